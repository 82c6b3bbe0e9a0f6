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
from ._pipe import Pipe, check_input
from ._schedule import Program, Schedule, compile_schedule
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
        self._stage_infos = [
            _C.runtime.StageInfo(
                s, list(pipe.plan.recvs[s]), list(pipe.plan.sends[s]), s == self._last
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

    def _make_executor(self, program: Program, training: bool) -> Any:
        return _C.runtime.Executor(
            rank=self._rank,
            program=program._native,
            stages=self._stage_infos,
            values=self._values,
            transport=self._transport,
            forward=self._forward if training else self._eval_forward,
            tied=self._tied if training else {},
            timeout_s=self._timeout,
            max_early_recvs=self._max_early_recvs,
            training=training,
            device=self.device,
        )

    # ---- microbatches

    def _split(self, args: tuple, kwargs: dict[str, Any]) -> list[list[Any]]:
        flat = self._pipe.flatten_structure(args, kwargs)
        m = self.num_microbatches
        columns = []
        for name, expected, value in zip(
            self._pipe.input_names, self._pipe.input_specs, flat, strict=True
        ):
            if isinstance(value, torch.Tensor):
                dim = self._chunk_dims.get(name, 0)
                pieces = [value] * m if dim is None else _chunk(value, m, dim, name)
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
        outs = self._modules[stage](*self._stage_inputs(stage, mb), *received)
        spec = self._pipe.stage_specs[stage]
        sends = list(outs[: spec.num_sends])
        if stage != self._last:
            return sends
        model_out = self._pipe.unflatten_outputs(dict(zip(spec.output_names, outs, strict=True)))
        loss = self._compute_loss(model_out, self._mb_targets[mb], mb)
        self._losses[mb] = loss.detach()
        return [*sends, loss / self.num_microbatches]

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
        outs = self._modules[stage](*self._stage_inputs(stage, mb), *received)
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
        self._mb_inputs = self._split(args, kwargs)
        self._mb_targets = self._split_target(target) if target is not None else [None] * m
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
        self._mb_inputs = self._split(args, kwargs)
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
        seen: set[int] = set()
        for s in self.local_stages:
            for name, p in self._modules[s].named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

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
        tl = from_records(self._rank, self._num_ranks, executor.records())
        shift = executor.step_start_unix_ns / 1e9
        tl.events = [
            type(e)(e.rank, e.kind, e.stage, e.microbatch, e.start + shift, e.end + shift)
            for e in tl.events
        ]
        return tl

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
    return list(torch.chunk(value, m, dim))


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
