"""`PipelineRunner`: pipelined training and evaluation across processes."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from . import _C
from ._pipe import Pipe, check_input, unique_named_parameters
from ._schedule import Program, Schedule, compile_schedule
from ._split import SplitStage
from ._timeline import Timeline, from_records

__all__ = ["PipelineRunner", "StepOutput"]

# Tag of the messages that share a step's result over an in-process
# transport; program messages use tags from 0 upwards.
_RESULT_TAG = 1 << 30


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What `PipelineRunner.step` returns on every rank."""

    loss: torch.Tensor  # mean over microbatches, as gradient accumulation weighs them
    losses: torch.Tensor  # per microbatch


class PipelineRunner:
    """Runs a `Pipe` under a `Schedule` on the ranks of a process group.

    Each rank keeps only the stages the schedule places on it (moved to
    `device`); a native executor runs the rank's program with receives posted
    ahead and waited on only when needed. Gradients accumulate into the local
    parameters like a gradient-accumulation loop over the microbatches, and
    the copies of tied parameters receive the same summed gradient, so any
    optimizer keeps them equal.

    Call `step` (and `eval_step`) on every rank with the same full batch.
    """

    def __init__(
        self,
        pipe: Pipe,
        schedule: Schedule,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        chunk_dims: Mapping[str, int | None] | None = None,
        timeout: float | datetime.timedelta = 300.0,
        max_early_recvs: int = 64,
        split_backward: bool | str = "auto",
        compile: bool | Mapping[str, Any] = False,
        _transport: Any = None,
        _rank: int | None = None,
    ) -> None:
        if not isinstance(pipe, Pipe):
            raise TypeError(f"PipelineRunner needs an mpmd.Pipe, got {type(pipe).__name__}")
        if _transport is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "PipelineRunner: torch.distributed is not initialized; call "
                    "dist.init_process_group() first (torchrun sets up the environment)"
                )
            self._group = group if group is not None else dist.group.WORLD
            self._rank = dist.get_rank(self._group)
            num_ranks = dist.get_world_size(self._group)
            self._transport = _C.runtime.C10dTransport(self._group)
        else:
            self._group = None
            self._rank = int(_rank)
            num_ranks = _transport.size
            self._transport = _transport
        self._pipe = pipe
        self._schedule = schedule
        self._loss_fn = loss_fn
        self._chunk_dims = dict(chunk_dims or {})
        unknown = set(self._chunk_dims) - set(pipe.input_names) - {"target"}
        if unknown:
            raise ValueError(
                f"chunk_dims names unknown inputs {sorted(unknown)}; inputs are {pipe.input_names} "
                "and 'target'"
            )
        self._timeout = (
            timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        )
        self._max_early_recvs = max_early_recvs
        self.program: Program = compile_schedule(schedule, pipe, num_ranks)
        self.num_microbatches = schedule.num_microbatches
        self._num_ranks = num_ranks
        self._last = pipe.num_stages - 1
        placement = self.program.placement
        self.local_stages = [s for s in range(pipe.num_stages) if placement[s] == self._rank]
        self._loss_rank = placement[self._last]
        self.device = self._pick_device(device)
        self._modules = {s: pipe.stage(s).to(self.device) for s in self.local_stages}
        self._user_index = {
            s: [
                pipe.input_node_names.index(n)
                for n in pipe.stage_specs[s].input_names[: pipe.stage_specs[s].num_user_inputs]
            ]
            for s in self.local_stages
        }
        self._values = [
            _C.runtime.ValueInfo(
                t.value,
                pipe.transfers[i].name,
                list(pipe.transfers[i].spec.shape),
                pipe.transfers[i].spec.dtype,
                t.requires_grad,
            )
            for i, t in enumerate(pipe.plan.transfers)
        ]
        self._compile = None if compile is False else ({} if compile is True else dict(compile))
        self._split_stages = self._choose_split(split_backward)
        self._split_graphs: dict[int, SplitStage] = {}
        # What forward calls: the stage's GraphModule, or its compiled form
        # (the module itself keeps the parameters under the model's names).
        self._stage_fns: dict[int, Callable] = {
            s: torch.compile(m, **self._compile)
            if self._compile is not None and s not in self._split_stages
            else m
            for s, m in self._modules.items()
        }
        self._stage_infos = [
            _C.runtime.StageInfo(
                s,
                list(pipe.plan.recvs[s]),
                list(pipe.plan.sends[s]),
                s == self._last,
                s in self._split_stages,
            )
            for s in range(pipe.num_stages)
        ]
        self._tied = {
            node: param
            for node, param in pipe.tied_parameters.items()
            if any(placement[s] == self._rank for s in pipe.plan_tied_stages(node))
        }
        self._executor = self._make_executor(self.program, training=True)
        self._eval_executor = None
        # Per step: inputs and targets of each microbatch, and what it produced.
        self._mb_inputs: list[list[Any]] = []
        self._mb_targets: list[Any] = []
        self._losses: list[torch.Tensor | None] = []
        self._eval_outputs: list[list[Any] | None] = []
        self.timeline: Timeline | None = None

    # ---- set-up

    def _pick_device(self, device: torch.device | str | None) -> torch.device:
        if device is not None:
            return torch.device(device)
        if self._group is not None and dist.get_backend(self._group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _choose_split(self, split_backward: bool | str) -> set[int]:
        with_iw = {t.stage for t in self.program.tasks(self._rank) if t.kind in ("I", "W")}
        if split_backward == "auto":
            return with_iw
        if split_backward is True:
            return set(self.local_stages)
        if split_backward is False:
            if with_iw:
                raise ValueError(
                    f"{type(self._schedule).__name__} has input/weight-gradient tasks (I/W) for "
                    f"stages {sorted(with_iw)} on rank {self._rank}, which need split_backward"
                )
            return set()
        raise ValueError(f"split_backward must be True, False or 'auto', got {split_backward!r}")

    def _make_executor(self, program: Program, training: bool) -> Any:
        split = training and bool(self._split_stages)
        stages = self._stage_infos
        if not training:  # evaluation runs every stage's plain forward
            stages = [
                _C.runtime.StageInfo(i.id, i.inputs, i.outputs, i.has_loss, False) for i in stages
            ]
        return _C.runtime.Executor(
            rank=self._rank,
            program=program._native,
            stages=stages,
            values=self._values,
            transport=self._transport,
            forward=self._forward if training else self._eval_forward,
            input_grad=self._input_grad if split else None,
            weight_grad=self._weight_grad if split else None,
            tied=self._tied if training else {},
            timeout_s=self._timeout,
            max_early_recvs=self._max_early_recvs,
            training=training,
            device=self.device,
        )

    # ---- microbatches

    def _split_batch(self, args: tuple, kwargs: dict[str, Any]) -> list[list[Any]]:
        flat = self._pipe.flatten_structure(args, kwargs)
        m = self.num_microbatches
        columns = []
        for name, expected, value in zip(
            self._pipe.input_names, self._pipe.input_specs, flat, strict=True
        ):
            if isinstance(value, torch.Tensor):
                dim = self._chunk_dims.get(name, 0)
                pieces = [value.contiguous()] * m if dim is None else _chunk(value, m, dim, name)
                for i, piece in enumerate(pieces):
                    _check_microbatch(name, expected, piece, i)
                columns.append(pieces)
            else:
                check_input(name, expected, value)
                columns.append([value] * m)
        return [list(row) for row in zip(*columns, strict=True)]

    def _split_target(self, target: Any) -> list[Any]:
        m = self.num_microbatches
        dim = self._chunk_dims.get("target", 0)
        leaves, spec = pytree.tree_flatten(target)
        split = [
            _chunk(leaf, m, dim, "target")
            if isinstance(leaf, torch.Tensor) and dim is not None
            else [leaf] * m
            for leaf in leaves
        ]
        return [pytree.tree_unflatten([col[i] for col in split], spec) for i in range(m)]

    def _stage_inputs(self, stage: int, mb: int) -> list[Any]:
        row = self._mb_inputs[mb]
        out = []
        for i in self._user_index[stage]:
            v = row[i]
            out.append(v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
        return out

    # ---- callables the executor runs

    def _forward(self, stage: int, mb: int, received: list[torch.Tensor]) -> list[torch.Tensor]:
        if stage in self._split_graphs:
            return self._split_forward(stage, mb, received)
        outs = self._stage_fns[stage](*self._stage_inputs(stage, mb), *received)
        spec = self._pipe.stage_specs[stage]
        sends = list(outs[: spec.num_sends])
        if stage != self._last:
            return sends
        model_out = self._pipe.unflatten_outputs(dict(zip(spec.output_names, outs, strict=True)))
        loss = self._compute_loss(model_out, self._mb_targets[mb], mb)
        self._losses[mb] = loss.detach()
        return [*sends, loss / self.num_microbatches]

    # ---- split stages (I/W): forward, input-grad and weight-grad graphs

    def _split_inputs(
        self, stage: int, mb: int, received: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        user = [v for v in self._stage_inputs(stage, mb) if isinstance(v, torch.Tensor)]
        xs = [*user, *received]
        if stage == self._last:
            target = _to(self._mb_targets[mb], self.device)
            xs += [v for v in pytree.tree_leaves(target) if isinstance(v, torch.Tensor)]
        return xs

    def _split_forward(
        self, stage: int, mb: int, received: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        result = self._split_graphs[stage].forward(self._split_inputs(stage, mb, received))
        if stage != self._last:
            return result
        # Outputs: sends, loss / m (differentiated), loss (reported); then saved.
        sends = self._pipe.stage_specs[stage].num_sends
        self._losses[mb] = result[sends + 1]
        return [*result[: sends + 1], *result[sends + 2 :]]

    def _input_grad(
        self, stage: int, mb: int, saved: list[torch.Tensor], grads: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        input_grads, for_w = self._split_graphs[stage].input_grad(saved, grads)
        return [*input_grads, *for_w]

    def _weight_grad(self, stage: int, mb: int, saved: list[torch.Tensor]) -> None:
        self._split_graphs[stage].weight_grad(saved)

    def _build_split_stages(self) -> None:
        """Traces the F/I/W graphs of split stages with the first microbatch's values."""
        grad_values = {t.value for t in self._pipe.plan.transfers if t.requires_grad}
        for stage in sorted(self._split_stages - set(self._split_graphs)):
            spec = self._pipe.stage_specs[stage]
            received = [
                torch.zeros(
                    spec.input_specs[i].shape, dtype=spec.input_specs[i].dtype, device=self.device
                )
                for i in range(spec.num_user_inputs, len(spec.input_names))
            ]
            user_all = self._stage_inputs(stage, 0)
            n_user = sum(isinstance(v, torch.Tensor) for v in user_all)
            recv_values = self._pipe.plan.recvs[stage]
            self._split_graphs[stage] = SplitStage(
                self._modules[stage],
                self._stage_function(stage, user_all, len(received)),
                self._split_inputs(stage, 0, received),
                [n_user + i for i, v in enumerate(recv_values) if v in grad_values],
                self._compile,
                loss_output=spec.num_sends if stage == self._last else None,
            )

    def _stage_function(self, stage: int, user_all: list[Any], n_received: int) -> Callable:
        """fn(params, buffers, tensors) -> outputs of one stage, loss included, for tracing."""
        module = self._modules[stage]
        spec = self._pipe.stage_specs[stage]
        param_names = [n for n, _ in module.named_parameters()]
        buffer_names = [n for n, _ in module.named_buffers()]
        tensor_slots = [i for i, v in enumerate(user_all) if isinstance(v, torch.Tensor)]
        last = stage == self._last
        target_leaves, target_spec = (
            pytree.tree_flatten(self._mb_targets[0]) if last else ([], None)
        )
        target_consts = [None if isinstance(v, torch.Tensor) else v for v in target_leaves]

        def fn(params: list[torch.Tensor], buffers: list[torch.Tensor], xs: list[torch.Tensor]):
            state = dict(zip(param_names, params, strict=True))
            state.update(zip(buffer_names, buffers, strict=True))
            user = list(user_all)
            for slot, x in zip(tensor_slots, xs, strict=False):
                user[slot] = x
            received = xs[len(tensor_slots) : len(tensor_slots) + n_received]
            outs = torch.func.functional_call(module, state, (*user, *received))
            sends = list(outs[: spec.num_sends])
            if not last:
                return sends
            rest = iter(xs[len(tensor_slots) + n_received :])
            target = pytree.tree_unflatten(
                [next(rest) if c is None else c for c in target_consts], target_spec
            )
            env = dict(zip(spec.output_names, outs, strict=True))
            loss = self._compute_loss(self._pipe.unflatten_outputs(env), target, 0)
            return [*sends, loss / self.num_microbatches, loss.detach()]

        return fn

    def _compute_loss(self, output: Any, target: Any, mb: int) -> torch.Tensor:
        if self._loss_fn is not None:
            loss = self._loss_fn(output, _to(target, self.device))
        else:
            loss = getattr(output, "loss", output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"the loss of microbatch {mb} must be a tensor with one element, got {shape}; "
                "pass loss_fn=... that reduces the model output to a scalar"
            )
        return loss.reshape(())

    def _eval_forward(
        self, stage: int, mb: int, received: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        outs = self._stage_fns[stage](*self._stage_inputs(stage, mb), *received)
        spec = self._pipe.stage_specs[stage]
        if stage == self._last:
            self._eval_outputs[mb] = list(outs[spec.num_sends :])
        return list(outs[: spec.num_sends])

    # ---- public API

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> StepOutput:
        """One training step over the full batch (split into microbatches).

        Gradients accumulate into the local parameters (`.grad`), as a loop of
        `(loss_fn(model(mb), target_mb) / num_microbatches).backward()` would.
        Returns the mean loss on every rank.
        """
        m = self.num_microbatches
        self._mb_inputs = self._split_batch(args, kwargs)
        self._mb_targets = self._split_target(target) if target is not None else [None] * m
        if self._split_stages - set(self._split_graphs):
            self._build_split_stages()
        self._losses = [None] * m
        try:
            self._executor.run()
        finally:
            self._mb_inputs, self._mb_targets = [], []
        self.timeline = self._measured(self._executor)
        # float64 holds a float32 or float64 loss exactly.
        if self._rank == self._loss_rank:
            losses = torch.stack([loss.double() for loss in self._losses]).to(self.device)
        else:
            losses = torch.empty(m, dtype=torch.float64, device=self.device)
        self._losses = []
        self._share_from_loss_rank(losses)
        return StepOutput(loss=losses.mean(), losses=losses)

    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, keeping no autograd state; the model's output for the
        whole batch (microbatch outputs concatenated) on every rank."""
        if self._eval_executor is None:
            program = compile_schedule(
                self._schedule, self._pipe, self._num_ranks, forward_only=True
            )
            self._eval_executor = self._make_executor(program, training=False)
        m = self.num_microbatches
        self._mb_inputs = self._split_batch(args, kwargs)
        self._eval_outputs = [None] * m
        try:
            self._eval_executor.run()
        finally:
            self._mb_inputs = []
        merged = None
        if self._rank == self._loss_rank:
            merged = [
                _merge([o[i] for o in self._eval_outputs])
                for i in range(len(self._eval_outputs[0]))
            ]
        self._eval_outputs = []
        flat = self._broadcast_outputs(merged)
        env = {}
        names = [n for n in self._pipe.output_names if n is not None]
        env.update(zip(names, flat, strict=True))
        return self._pipe.unflatten_outputs(env)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters, once each, under their names in the model."""
        return unique_named_parameters(self._modules[s] for s in self.local_stages)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers under the model's names.

        A tied parameter appears on every rank that holds it, each under the
        name its stage uses; merged over ranks the keys are the model's.
        """
        out: dict[str, torch.Tensor] = {}
        for s in self.local_stages:
            for name, t in self._modules[s].state_dict(keep_vars=False).items():
                out.setdefault(name, t)
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Loads this rank's entries from a (full or per-rank) state dict.

        Keys of other ranks' stages are ignored. With `strict`, every local
        entry must be present under one of its names.
        """
        missing = []
        for s in self.local_stages:
            for name, t in self._modules[s].state_dict(keep_vars=True).items():
                aliases = self._pipe.parameter_aliases.get(name, [name])
                key = next((a for a in [name, *aliases] if a in state_dict), None)
                if key is None:
                    missing.append(name)
                    continue
                value = state_dict[key]
                if tuple(value.shape) != tuple(t.shape):
                    raise ValueError(
                        f"load_state_dict: '{key}' has shape {tuple(value.shape)}, but stage {s} on "
                        f"rank {self._rank} holds it with shape {tuple(t.shape)}"
                    )
                t.copy_(value)
        if strict and missing:
            raise KeyError(f"load_state_dict: rank {self._rank} found no entry for {missing}")

    def gather_timeline(self) -> Timeline:
        """The last step's measured timeline of every rank (collective: call on all ranks)."""
        if self.timeline is None:
            raise RuntimeError("gather_timeline: run a step first")
        if self._group is None:
            return self.timeline
        parts: list[Timeline | None] = [None] * self._num_ranks
        dist.all_gather_object(parts, self.timeline, group=self._group)
        return Timeline.merge(p for p in parts if p is not None)

    # ---- collectives on the result

    def _measured(self, executor: Any) -> Timeline:
        return from_records(
            self._rank, self._num_ranks, executor.records(), executor.step_start_unix_ns
        )

    def _share_from_loss_rank(self, tensor: torch.Tensor) -> None:
        if self._group is not None:
            src = dist.get_global_rank(self._group, self._loss_rank)
            dist.broadcast(tensor, src=src, group=self._group)
        elif self._rank == self._loss_rank:
            for r in range(self._num_ranks):
                if r != self._rank:
                    self._transport.send(tensor, r, _RESULT_TAG, self._timeout)
        else:
            self._transport.recv(tensor, self._loss_rank, _RESULT_TAG, self._timeout)

    def _broadcast_outputs(self, merged: list[Any] | None) -> list[Any]:
        """The loss rank's merged outputs, on every rank (shapes come from the plan)."""
        spec = self._pipe.stage_specs[self._last]
        out = []
        for i, one in enumerate(spec.output_specs[spec.num_sends :]):
            if one is None:
                raise TypeError(
                    f"eval_step: model output '{spec.output_names[spec.num_sends + i]}' is not a "
                    "tensor; pipelines return tensors (and constants) only"
                )
            if self._rank == self._loss_rank:
                t = merged[i].contiguous()
            else:
                shape = (
                    (one.shape[0] * self.num_microbatches, *one.shape[1:])
                    if one.shape
                    else (self.num_microbatches,)
                )
                t = torch.empty(shape, dtype=one.dtype, device=self.device)
            self._share_from_loss_rank(t)
            out.append(t)
        return out


def _chunk(value: torch.Tensor, m: int, dim: int, name: str) -> list[torch.Tensor]:
    size = value.shape[dim] if value.dim() > dim else None
    if size is None or size % m:
        raise ValueError(
            f"input '{name}' has shape {tuple(value.shape)}: dimension {dim} must split into "
            f"{m} equal microbatches; pass a batch that is a multiple of num_microbatches, or "
            f"chunk_dims={{'{name}': ...}} to split along another dimension (None: replicate)"
        )
    # Contiguous, like the traced example: graphs may view their inputs.
    return [piece.contiguous() for piece in torch.chunk(value, m, dim)]


def _check_microbatch(name: str, expected: Any, piece: torch.Tensor, i: int) -> None:
    try:
        check_input(name, expected, piece)
    except ValueError as err:
        raise ValueError(f"microbatch {i}: {err}") from None


def _merge(pieces: list[Any]) -> Any:
    first = pieces[0]
    if not isinstance(first, torch.Tensor):
        return first
    if first.dim() == 0:
        return torch.stack(pieces)
    return torch.cat(pieces, dim=0)


def _to(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(
        lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v, value
    )
