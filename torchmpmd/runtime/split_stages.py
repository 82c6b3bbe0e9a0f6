"""Split stages on a rank: each stage whose backward runs as input- and
weight-gradient tasks (I/W) is a `Split`, one interface whatever the stage:
a stage with a graph is traced (with its loss) into F/I/W graphs
(`GraphSplit`, over `graph.split.SplitStage`); a stage without one (cut by
hand), one a parallelism rewrites (its stage runs on DTensors), or one
calling experts modules (routed tokens' shapes change with the data), splits
through autograd (`AutogradStageSplit`, over `autograd_split.AutogradSplit`).

The graph cut itself is `graph.split`; this module gives it the function to
trace: the stage's forward over (parameters, buffers, tensor inputs),
followed on the last stage by the loss, with non-tensor inputs and target
leaves baked in from the microbatch it is traced with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from ..graph.experts import experts_calls
from ..graph.pipe import Pipe
from ..graph.split import SplitStage
from ..graph.stage import as_stage
from .autograd_split import AutogradSplit
from .microbatch import to_device

__all__: list[str] = []


class StepTargets(Protocol):
    """What split stages read of one step (`stages.Step`)."""

    targets: list[Any]  # per microbatch


class StageHost(Protocol):
    """What split stages read of a rank's stages (`stages.LocalStages`, which
    imports this module: the protocol keeps the dependency one way)."""

    pipe: Pipe
    device: torch.device
    last: int  # the last stage's index
    num_microbatches: int
    modules: dict[int, torch.nn.Module]
    selective: set[int]  # stages under selective recompute
    compile_options: dict[str, Any] | None
    # Every split stage splits through autograd (a parallelism rewrites them).
    split_by_autograd: bool

    def user_inputs(self, step: Any, stage: int, mb: int) -> list[Any]: ...

    def call(self, step: Any, stage: int, mb: int, received: list[torch.Tensor]) -> Any: ...

    def sends_and_loss(
        self, stage: int, outs: Any, target: Any, mb: int
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]: ...


class Split(Protocol):
    """One split stage's F / I / W, as the executor's callables run them."""

    def reset(self) -> None:
        """Forgets what a failed step left."""

    def forward(
        self,
        stages: StageHost,
        step: StepTargets,
        stage: int,
        mb: int,
        received: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """F: sends (on the last stage loss / m, then the loss), then what I
        and W need."""
        ...

    def input_grad(
        self,
        stages: StageHost,
        stage: int,
        mb: int,
        saved: list[torch.Tensor],
        grads: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """I: the inputs' gradients, then what W needs."""
        ...

    def weight_grad(self, mb: int, saved: list[torch.Tensor]) -> None:
        """W: accumulates the parameters' gradients."""


class GraphSplit:
    """A stage's F / I / W graphs (`graph.split.SplitStage`)."""

    def __init__(self, graphs: SplitStage) -> None:
        self.graphs = graphs

    def reset(self) -> None:
        """Nothing: the graphs keep no state between tasks."""

    def forward(
        self,
        stages: StageHost,
        step: StepTargets,
        stage: int,
        mb: int,
        received: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        return self.graphs.forward(split_inputs(stages, step, stage, mb, received))

    def input_grad(
        self,
        stages: StageHost,
        stage: int,
        mb: int,
        saved: list[torch.Tensor],
        grads: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        input_grads, for_w = self.graphs.input_grad(saved, grads)
        return [*input_grads, *for_w]

    def weight_grad(self, mb: int, saved: list[torch.Tensor]) -> None:
        self.graphs.weight_grad(saved)


class AutogradStageSplit:
    """A stage split through autograd (`autograd_split.AutogradSplit`): F
    keeps the autograd graph per microbatch, I and W walk its two parts."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.graphs = AutogradSplit(params)

    def reset(self) -> None:
        self.graphs.reset()

    def forward(
        self,
        stages: StageHost,
        step: StepTargets,
        stage: int,
        mb: int,
        received: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        return _autograd_forward(self.graphs, stages, step, stage, mb, received)

    def input_grad(
        self,
        stages: StageHost,
        stage: int,
        mb: int,
        saved: list[torch.Tensor],
        grads: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        if stage == stages.last:  # the loss / m's own gradient
            grads = [*grads, torch.ones((), device=stages.device)]
        return self.graphs.input_grad(mb, list(grads))

    def weight_grad(self, mb: int, saved: list[torch.Tensor]) -> None:
        self.graphs.weight_grad(mb)


def _autograd_forward(
    split: AutogradSplit,
    stages: StageHost,
    step: StepTargets,
    stage: int,
    mb: int,
    received: list[torch.Tensor],
) -> list[torch.Tensor]:
    """F of a stage split through autograd: sends (and on the last stage
    loss / m, then the loss), with the autograd graph kept for I and W."""
    spec = stages.pipe.stage_specs[stage]
    grad_values = {t.value for t in stages.pipe.transfers if t.requires_grad}
    leaves = [
        r.detach().requires_grad_(v in grad_values)
        for r, v in zip(received, spec.recv_values, strict=True)
    ]
    with torch.enable_grad():
        outs = stages.call(step, stage, mb, leaves)
        sends, loss = stages.sends_and_loss(stage, outs, step.targets[mb], mb)
        scaled = None if loss is None else loss / stages.num_microbatches
    split.keep(
        mb, sends if scaled is None else [*sends, scaled], [x for x in leaves if x.requires_grad]
    )
    result = [s.detach() for s in sends]
    if scaled is None or loss is None:
        return result
    return [*result, scaled.detach(), loss.detach()]


def split_inputs(
    stages: StageHost, step: StepTargets, stage: int, mb: int, received: list[torch.Tensor]
) -> list[torch.Tensor]:
    """A split stage's tensor inputs: user tensors, received values, then
    (last stage) the target's tensor leaves."""
    user = [v for v in stages.user_inputs(step, stage, mb) if isinstance(v, torch.Tensor)]
    xs = [*user, *received]
    if stage == stages.last:
        target = to_device(step.targets[mb], stages.device)
        xs += [v for v in pytree.tree_leaves(target) if isinstance(v, torch.Tensor)]
    return xs


def build_split_stage(stages: StageHost, stage: int, step: StepTargets, mb: int) -> Split:
    """Traces `stage` on the step's microbatch `mb` and cuts it into F/I/W
    graphs; a stage without a graph, or one a parallelism rewrites, splits
    through autograd instead."""
    pipe = stages.pipe
    module = as_stage(stages.modules[stage]).graph_module
    params = list(stages.modules[stage].parameters())
    # Parameters that are DTensors (a user's own sharding) split through
    # autograd too: the graphs are traced on plain tensors; so does a stage
    # calling experts modules (their routed tokens' shapes change with the
    # data: graph.experts).
    if (
        module is None
        or stages.split_by_autograd
        or any(isinstance(p, DTensor) for p in params)
        or experts_calls(module.graph)
    ):
        if stage in stages.selective:
            # Its I and W are two backward passes over the checkpointed
            # forward; torch's selective checkpoint allows one.
            raise ValueError(
                f"stage {stage} splits its backward (I, W) through autograd (it calls "
                "experts modules, or a parallelism rewrites it) and is recomputed "
                "selectively: torch's selective checkpoint runs one backward per forward, "
                f"and I and W are two. Run its whole backward (schedule.with_full_backward"
                f"([{stage}])), or recompute it in full (recompute={{{stage}: 'full'}})"
            )
        return AutogradStageSplit(params)
    spec = pipe.stage_specs[stage]
    received = [
        torch.zeros(s.shape, dtype=s.dtype, device=stages.device)
        for s in spec.input_specs[spec.num_user_inputs :]
        if s is not None
    ]
    user_all = stages.user_inputs(step, stage, mb)
    n_user = sum(isinstance(v, torch.Tensor) for v in user_all)
    grad_values = {t.value for t in pipe.transfers if t.requires_grad}
    try:
        split = SplitStage(
            module,
            _stage_function(stages, stage, user_all, len(received), step.targets[mb]),
            split_inputs(stages, step, stage, mb, received),
            [n_user + i for i, v in enumerate(spec.recv_values) if v in grad_values],
            stages.compile_options,
            loss_output=spec.num_sends if stage == stages.last else None,
            selective=stage in stages.selective,
        )
    except ValueError as err:  # what the stage holds that cannot be split
        raise ValueError(f"stage {stage}: {err}") from None
    differentiated = [i for i, v in enumerate(spec.send_values) if v in grad_values]
    if stage == stages.last:
        differentiated.append(spec.num_sends)
    for i in differentiated:
        if i not in split.joint.tangent_outputs:
            what = f"'{spec.output_names[i]}'" if i < spec.num_sends else "its loss"
            raise ValueError(
                f"stage {stage} (split into I/W) computes {what} without a gradient path, but "
                "the stage plan says gradients flow back through it: the parameters and inputs "
                "before it would silently get none. The stage ran without autograd "
                "(torch.no_grad, .detach() or a non-differentiable call) where the traced "
                f"model had it; make that part of stage {stage} differentiable, or detach it "
                "in the model itself"
            )
    return GraphSplit(split)


class _Unhooked(torch.nn.Module):
    """Calls `inner.forward` directly: no forward hooks of `inner` run."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return self.inner.forward(*args)


def _stage_function(
    stages: StageHost, stage: int, user_all: list[Any], n_received: int, target: Any
) -> Callable[[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]:
    """fn(params, buffers, tensors) -> outputs of one stage, loss included, for tracing."""
    module = stages.modules[stage]
    param_names = [n for n, _ in module.named_parameters()]
    buffer_names = [n for n, _ in module.named_buffers()]
    tensor_slots = [i for i, v in enumerate(user_all) if isinstance(v, torch.Tensor)]
    last = stage == stages.last
    target_leaves, target_spec = pytree.tree_flatten(target)
    # A tensor leaf is fed in at run time; any other leaf (None too) is baked in.
    is_tensor = [isinstance(v, torch.Tensor) for v in target_leaves]

    unhooked = _Unhooked(module)

    def prefixed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"inner.{name}": t for name, t in state.items()}

    def fn(
        params: list[torch.Tensor], buffers: list[torch.Tensor], xs: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        state = dict(zip(param_names, params, strict=True))
        state.update(zip(buffer_names, buffers, strict=True))
        user = list(user_all)
        for slot, x in zip(tensor_slots, xs, strict=False):
            user[slot] = x
        received = xs[len(tensor_slots) : len(tensor_slots) + n_received]
        # Selective recompute of a split stage is a rewrite of its joint
        # graph (SplitStage), not a checkpoint call, which make_fx would undo.
        # The stage's own forward hooks (FSDP's gather and reshard) stay out
        # of the trace: the runner gathers split stages around the step.
        outs = torch.func.functional_call(unhooked, prefixed(state), (*user, *received))
        if not last:
            return stages.sends_and_loss(stage, outs, None, 0)[0]
        rest = iter(xs[len(tensor_slots) + n_received :])
        target = pytree.tree_unflatten(
            [next(rest) if t else v for v, t in zip(target_leaves, is_tensor, strict=True)],
            target_spec,
        )
        sends, loss = stages.sends_and_loss(stage, outs, target, 0)
        if loss is None:
            raise AssertionError(f"stage {stage} is the last stage but computed no loss")
        return [*sends, loss / stages.num_microbatches, loss.detach()]

    return fn
