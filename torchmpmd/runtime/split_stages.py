"""Split stages on a rank: tracing each stage (with its loss) into F/I/W graphs.

The cut itself is `graph.split`; this module gives it the function to trace:
the stage's forward over (parameters, buffers, tensor inputs), followed on
the last stage by the loss, with non-tensor inputs and target leaves baked in
from the first microbatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ..graph.split import SplitStage
from .microbatch import to_device

if TYPE_CHECKING:
    from .stages import LocalStages, Step

__all__: list[str] = []


def split_inputs(
    stages: LocalStages, step: Step, stage: int, mb: int, received: list[torch.Tensor]
) -> list[torch.Tensor]:
    """A split stage's tensor inputs: user tensors, received values, then
    (last stage) the target's tensor leaves."""
    user = [v for v in stages.user_inputs(step, stage, mb) if isinstance(v, torch.Tensor)]
    xs = [*user, *received]
    if stage == stages.last:
        target = to_device(step.targets[mb], stages.device)
        xs += [v for v in pytree.tree_leaves(target) if isinstance(v, torch.Tensor)]
    return xs


def build_split_stage(stages: LocalStages, stage: int, step: Step) -> SplitStage:
    """Traces `stage` on the step's first microbatch and cuts it into F/I/W."""
    pipe = stages.pipe
    spec = pipe.stage_specs[stage]
    received = [
        torch.zeros(s.shape, dtype=s.dtype, device=stages.device)
        for s in spec.input_specs[spec.num_user_inputs :]
        if s is not None
    ]
    user_all = stages.user_inputs(step, stage, 0)
    n_user = sum(isinstance(v, torch.Tensor) for v in user_all)
    grad_values = {t.value for t in pipe.transfers if t.requires_grad}
    try:
        return SplitStage(
            stages.modules[stage],
            _stage_function(stages, stage, user_all, len(received), step.targets[0]),
            split_inputs(stages, step, stage, 0, received),
            [n_user + i for i, v in enumerate(spec.recv_values) if v in grad_values],
            stages.compile_options,
            loss_output=spec.num_sends if stage == stages.last else None,
        )
    except ValueError as err:  # what the stage holds that cannot be split
        raise ValueError(f"stage {stage}: {err}") from None


def _stage_function(
    stages: LocalStages, stage: int, user_all: list[Any], n_received: int, target: Any
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

    def fn(
        params: list[torch.Tensor], buffers: list[torch.Tensor], xs: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        state = dict(zip(param_names, params, strict=True))
        state.update(zip(buffer_names, buffers, strict=True))
        user = list(user_all)
        for slot, x in zip(tensor_slots, xs, strict=False):
            user[slot] = x
        received = xs[len(tensor_slots) : len(tensor_slots) + n_received]
        outs = torch.func.functional_call(module, state, (*user, *received))
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
