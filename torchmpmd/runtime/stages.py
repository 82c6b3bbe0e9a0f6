"""One rank's stages, and the callables the executor runs for one step.

`LocalStages` holds what lasts across steps: the local stage modules (moved
to the device), what forward calls (the module, or its compiled form), the
F/I/W graphs of split stages and the loss. A `Step` holds what one step reads
and writes; `Training(stages, step)` and `Evaluation(stages, step)` are the
callables the executor runs for it, so two steps never share state through
the runner.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint

from ..graph.markers import compiled
from ..graph.pipe import Pipe
from ..graph.split import selective_recompute_context
from ..graph.stage import as_stage
from ..parallel.protocol import running_forward
from .materialize import allocate
from .microbatch import to_device
from .rank_rng import checkpoint_rng, own_generator
from .split_stages import Split, build_split_stage

__all__: list[str] = []

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(kw_only=True, slots=True)
class Step:
    """What one step reads (per microbatch: inputs, targets) and produces."""

    inputs: list[list[Any]]  # per microbatch, the model's flat inputs
    targets: list[Any]  # per microbatch (None without a target)
    # Per microbatch, filled by the last stage's forward:
    losses: list[torch.Tensor | None] = field(init=False)  # training
    outputs: list[list[Any] | None] = field(init=False)  # evaluation
    # Exceptions raised by this step's callables, as raised (the executor
    # passes on only their text).
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.losses = [None] * len(self.inputs)
        self.outputs = [None] * len(self.inputs)


class LocalStages:
    """The stages one rank holds and how each runs."""

    def __init__(
        self,
        pipe: Pipe,
        stages: list[int],
        device: torch.device,
        *,
        loss_fn: LossFn | None,
        num_microbatches: int,
        split: set[int],
        compile_options: Mapping[str, Any] | None,
        selective: set[int] | None = None,
        recomputed: set[int] | None = None,
        split_by_autograd: bool = False,
    ) -> None:
        self.pipe = pipe
        self.ids = stages
        self.device = device
        self.last = pipe.num_stages - 1
        self.num_microbatches = num_microbatches
        self.split = split
        # Split stages cut through autograd, not into graphs (a parallelism
        # rewrites the stages: their graphs are not the traced ones).
        self.split_by_autograd = split_by_autograd
        # Stages whose backward recomputes all but matmul and attention outputs.
        self.selective = set(selective or ())
        # Stages whose forward runs twice per microbatch (F, then R).
        self.recomputed = set(recomputed or ())
        self.compile_options = None if compile_options is None else dict(compile_options)
        self._loss_fn = loss_fn
        modules = {s: pipe.stage(s) for s in stages}
        # A model traced on the meta device: this rank's stages only, allocated here.
        self.allocation = allocate(modules, device)
        for m in modules.values():
            as_stage(m).retarget_devices(device)
        self.modules = {s: m.to(device) for s, m in modules.items()}
        # What forward calls: the stage's GraphModule, or its compiled form
        # (the module itself keeps the parameters under the model's names).
        self._calls: dict[int, Callable[..., Any]] = {
            s: compiled(m, self.compile_options)
            if self.compile_options is not None and s not in split
            else m
            for s, m in self.modules.items()
        }
        self._user_index = {
            s: [
                pipe.input_node_names.index(n)
                for n in pipe.stage_specs[s].input_names[: pipe.stage_specs[s].num_user_inputs]
            ]
            for s in stages
        }
        self.split_graphs: dict[int, Split] = {}

    def wrap_forwards(self, wrap: Callable[[int, Callable[..., Any]], Callable[..., Any]]) -> None:
        """Runs `wrap(stage, forward)` in place of each stage's forward
        (`RunnerOptions.wrap_stage`, for tests)."""
        self._calls = {s: wrap(s, call) for s, call in self._calls.items()}

    def prepare(self, step: Step, mb: int) -> None:
        """Traces the F/I/W graphs of split stages, at the first step that
        runs them (with the values of its microbatch `mb`)."""
        for stage in sorted(self.split - set(self.split_graphs)):
            with own_generator():  # tracing runs the forward: it draws
                self.split_graphs[stage] = build_split_stage(self, stage, step, mb)
        for graphs in self.split_graphs.values():
            graphs.reset()  # what a failed step left

    def user_inputs(self, step: Step, stage: int, mb: int) -> list[Any]:
        """The model inputs `stage` reads, for microbatch `mb`, on the device."""
        row = step.inputs[mb]
        out = []
        for i in self._user_index[stage]:
            v = row[i]
            out.append(v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
        return out

    def call(self, step: Step, stage: int, mb: int, received: list[torch.Tensor]) -> Any:
        """The stage's plain forward: its sent values, then (last stage) the model
        outputs; under selective recompute if the stage has it and grad is on."""
        args = (*self.user_inputs(step, stage, mb), *received)
        if stage in self.selective and torch.is_grad_enabled():
            context_fn, preserve_rng_state = checkpoint_rng(
                selective_recompute_context, self.device
            )
            try:
                return torch.utils.checkpoint.checkpoint(
                    self._calls[stage],
                    *args,
                    use_reentrant=False,
                    context_fn=context_fn,
                    preserve_rng_state=preserve_rng_state,
                )
            except BaseException as err:
                # torch < 2.13 leaves the checkpoint's contexts (saved-tensor
                # hooks, selective caching) entered when the forward raises,
                # until the traceback holding its frame goes: drop the
                # frames' locals so they exit now.
                traceback.clear_frames(err.__traceback__)
                raise
        return self._calls[stage](*args)

    def sends_and_loss(
        self, stage: int, outs: Any, target: Any, mb: int
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Splits a stage's outputs into its sends and, on the last stage, the loss."""
        spec = self.pipe.stage_specs[stage]
        sends = list(outs[: spec.num_sends])
        if stage != self.last:
            return sends, None
        env = dict(zip(spec.output_names, outs, strict=True))
        return sends, self._loss(self.pipe.unflatten_outputs(env), target, mb)

    def _loss(self, output: Any, target: Any, mb: int) -> torch.Tensor:
        if self._loss_fn is not None:
            try:
                loss = self._loss_fn(output, to_device(target, self.device))
            except Exception as err:
                if target is not None:
                    raise
                raise TypeError(
                    f"the loss of microbatch {mb} failed with no target ({type(err).__name__}: "
                    f"{err}); pass the target to step as target=..."
                ) from err
        else:
            loss = getattr(output, "loss", output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"the loss of microbatch {mb} must be a tensor with one element, got {shape}; "
                "pass loss_fn=... that reduces the model output to a scalar"
            )
        return loss.reshape(())


def _recorded(method: Any) -> Any:
    """Keeps an exception the callable raises on the step (see `Step.errors`)."""

    def call(self: Any, *args: Any) -> Any:
        try:
            return method(self, *args)
        except BaseException as err:
            self._step.errors.append(err)
            raise

    call.__name__ = method.__name__
    call.__doc__ = method.__doc__
    return call


class Training:
    """The executor's callables for one training step.

    `stages[mb]` runs microbatch `mb`: the local stages traced for its
    shapes (the same parameters whatever the shapes)."""

    def __init__(self, stages: list[LocalStages], step: Step) -> None:
        self._stages = stages
        self._step = step
        # Ranks as threads: the generator state each forward started from,
        # which its recompute (R, the second call) replays.
        self._rng_at: dict[tuple[int, int], torch.Tensor] = {}
        # The (stage, microbatch) forwards run: a second is a recompute (R).
        self._forwarded: set[tuple[int, int]] = set()

    @_recorded
    def forward(self, stage: int, mb: int, received: list[torch.Tensor]) -> list[torch.Tensor]:
        key = (stage, mb)
        replay = self._rng_at.pop(key, None)  # R: the second call
        again = key in self._forwarded
        self._forwarded.add(key)
        with own_generator(replay=replay) as start, running_forward(stage, mb, again):
            if start is not None and replay is None and stage in self._stages[mb].recomputed:
                self._rng_at[key] = start.clone()
            return self._forward(stage, mb, received)

    def _forward(self, stage: int, mb: int, received: list[torch.Tensor]) -> list[torch.Tensor]:
        st, step = self._stages[mb], self._step
        split = st.split_graphs.get(stage)
        if split is not None:
            result = split.forward(st, step, stage, mb, received)
            if stage != st.last:
                return result
            # Outputs: sends, loss / m (differentiated), loss (reported); then saved.
            n = st.pipe.stage_specs[stage].num_sends
            step.losses[mb] = result[n + 1]
            return [*result[: n + 1], *result[n + 2 :]]
        outs = st.call(step, stage, mb, received)
        sends, loss = st.sends_and_loss(stage, outs, step.targets[mb], mb)
        if loss is None:
            return sends
        step.losses[mb] = loss.detach()
        return [*sends, loss / st.num_microbatches]

    @_recorded
    def input_grad(
        self, stage: int, mb: int, saved: list[torch.Tensor], grads: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        st = self._stages[mb]
        return st.split_graphs[stage].input_grad(st, stage, mb, saved, grads)

    @_recorded
    def weight_grad(self, stage: int, mb: int, saved: list[torch.Tensor]) -> None:
        self._stages[mb].split_graphs[stage].weight_grad(mb, saved)


class Evaluation:
    """The executor's callables for one forward-only step (`stages` as in `Training`)."""

    def __init__(self, stages: list[LocalStages], step: Step) -> None:
        self._stages = stages
        self._step = step

    @_recorded
    def forward(self, stage: int, mb: int, received: list[torch.Tensor]) -> list[torch.Tensor]:
        st = self._stages[mb]
        with own_generator(), running_forward(stage, mb):
            outs = st.call(self._step, stage, mb, received)
        n = st.pipe.stage_specs[stage].num_sends
        if stage == st.last:
            self._step.outputs[mb] = list(outs[n:])
        return list(outs[:n])
