"""`mark_stage_end`: stage boundaries written in model code."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

__all__ = ["mark_stage_end"]

T = TypeVar("T")

_state = threading.local()

# torch.export and make_fx patch process-wide state while they trace: ranks
# running as threads of one process (mpmd.testing) take turns.
TRACE_LOCK = threading.RLock()


def compiled(fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    """`torch.compile(fn, **options)`, called under TRACE_LOCK: while one
    thread FX-traces (make_fx sets a process-wide flag), dynamo refuses to
    run an optimized function in any other thread ("using FX to
    symbolically trace a dynamo-optimized function"). Uncontended (one rank
    per process) the lock costs nothing measurable."""
    optimized = torch.compile(fn, **options)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with TRACE_LOCK:
            return optimized(*args, **kwargs)

    return call


@torch.library.custom_op("torchmpmd::stage_end", mutates_args=())
def _stage_end(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    # Custom ops may not return their inputs; the copy only exists while
    # tracing, and the partitioner removes the op from every stage.
    return [x.clone() for x in xs]


@_stage_end.register_fake
def _stage_end_fake(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


def _stage_end_backward(ctx: object, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor]]:
    return (list(grads),)


_stage_end.register_autograd(_stage_end_backward)

STAGE_END_OP = torch.ops.torchmpmd.stage_end.default
# A boundary whose result the model ignores must still survive dead-code
# elimination in torch.export and fx.
torch.fx.node.has_side_effect(STAGE_END_OP)


@torch.library.custom_op("torchmpmd::recompute_region", mutates_args=())
def _recompute_region(begin: bool) -> None:
    # Where an activation-checkpointed region begins and ends in the traced
    # program; `mpmd.trace` removes both and recomputes the ops between.
    return None


@_recompute_region.register_fake
def _recompute_region_fake(begin: bool) -> None:
    return None


RECOMPUTE_REGION_OP = torch.ops.torchmpmd.recompute_region.default
torch.fx.node.has_side_effect(RECOMPUTE_REGION_OP)


@contextlib.contextmanager
def _tracing() -> Iterator[None]:
    """Makes `mark_stage_end` record a boundary (only `mpmd.trace` enters this)."""
    previous = getattr(_state, "tracing", False)
    _state.tracing = True
    try:
        yield
    finally:
        _state.tracing = previous


def mark_stage_end(x: T) -> T:
    """Ends the current pipeline stage after `x` (a tensor, or a tuple/list/dict of them).

    Returns `x` unchanged. Outside `mpmd.trace` it costs nothing; while tracing it
    records a boundary: operations after this call in program order belong to the
    next stage. Non-tensor leaves pass through untouched.
    """
    if not getattr(_state, "tracing", False):
        return x
    leaves, spec = pytree.tree_flatten(x)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    marked = STAGE_END_OP([leaves[i] for i in positions])
    for i, value in zip(positions, marked, strict=True):
        leaves[i] = value
    out: T = pytree.tree_unflatten(leaves, spec)
    return out
