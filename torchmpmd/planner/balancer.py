"""`mpmd.balance`: profile on rank 0, search, and every rank gets the result;
`trace(..., num_stages=N)`: trace at the split `balance` chose."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..graph.frontend import trace as trace_at
from ..graph.pipe import Pipe
from ..schedule.task import Schedule
from .profiler import LossFn, profile
from .results import Balance
from .splits import check_limits, check_num_stages, resolve_schedule, search

__all__ = ["balance", "on_rank_zero", "trace"]


def balance(
    model: torch.nn.Module,
    example_args: Any,
    num_stages: int,
    *,
    schedule: Schedule | None = None,
    num_ranks: int | None = None,
    memory_limit: float | None = None,
    example_kwargs: dict[str, Any] | None = None,
    bandwidth: float = 0.0,
    latency: float = 0.0,
    loss_fn: LossFn | None = None,
    example_target: Any = None,
    repeats: int = 5,
) -> Balance:
    """Chooses where to cut `model` into `num_stages` stages for `schedule`.

    Profiles the model once on one microbatch (`profile`: per unit forward,
    backward, saved activations, what crosses each cut) and searches the
    splits on the simulator (`search`). `schedule` defaults to
    `OneFOneB(2 * num_stages)`; `num_ranks` to `num_stages` (or half of it for
    a schedule that needs two stages per rank). `memory_limit` caps each
    rank's simulated peak activation bytes; `bandwidth` (bytes/s) and
    `latency` (s) price transfers, which are free by default. `loss_fn` and
    `example_target` (one microbatch's) add the loss to the last stage's cost,
    as the runner computes it there.

    Under torch.distributed (initialised, several processes), call it on
    every rank: rank 0 profiles and searches, and every rank returns its
    result, since timings differ between processes and all ranks must cut
    the model the same way.

        found = mpmd.balance(model, (x,), 4)
        pipe = mpmd.trace(model, (x,), split_before=found.split_before)
    """
    num_stages = check_num_stages(num_stages)
    resolved, lowering = resolve_schedule(schedule, num_stages, num_ranks)  # fail first
    check_limits(memory_limit, bandwidth, latency)
    # A schedule with a split backward gets I and W timed apart from B.
    split = resolved.splits_backward(num_stages, lowering.num_ranks)

    def run() -> Balance:
        prof = profile(
            model,
            example_args,
            example_kwargs,
            min_units=num_stages,
            repeats=repeats,
            loss_fn=loss_fn,
            example_target=example_target,
            split_backward=split,
        )
        return search(
            prof,
            num_stages,
            schedule=schedule,
            num_ranks=num_ranks,
            memory_limit=memory_limit,
            bandwidth=bandwidth,
            latency=latency,
        )

    return on_rank_zero(run)


_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "RuntimeError": RuntimeError,
}


_R = TypeVar("_R")


def on_rank_zero(run: Callable[[], _R]) -> _R:
    """`run()` on rank 0 of the default process group, its result (or error) on every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return run()
    box: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", run())
        except Exception as err:  # every rank must hear of it, or they wait forever
            error = err
            box[0] = ("error", type(err).__name__, str(err))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    outcome = box[0]
    if outcome[0] == "error":
        raise _ERRORS.get(outcome[1], RuntimeError)(f"{outcome[2]} (on rank 0)")
    result: _R = outcome[1]
    return result


def trace(
    model: torch.nn.Module,
    example_args: Any = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    split_before: list[str] | None = None,
    split_after: list[str] | None = None,
    num_stages: int | None = None,
    schedule: Schedule | None = None,
    num_ranks: int | None = None,
    experts: list[str] | None = None,
) -> Pipe:
    """Traces `model` on one microbatch and splits it into pipeline stages.

    Stages come from `mpmd.mark_stage_end` calls in the model, or from module
    paths: `split_before=["layers.4"]` starts a stage at that module,
    `split_after=[...]` ends one there, or from `num_stages=N` alone:
    `mpmd.balance` profiles the model and picks the split with the shortest
    simulated step for `schedule` on `num_ranks` ranks (defaults: 1F1B over
    2N microbatches on N ranks). The returned `Pipe` holds one
    `torch.fx.GraphModule` per stage, sharing the model's parameters.
    A mixture of experts' experts modules (found by themselves, or named by
    `experts=["layers.*.moe.experts"]`) run as modules, each one call in the
    graph (`graph.experts`).
    """
    if num_stages is None:
        if schedule is not None or num_ranks is not None:
            raise ValueError(
                "mpmd.trace: schedule and num_ranks only tell num_stages which split to choose; "
                "pass num_stages=N with them, or give the schedule to the PipelineRunner"
            )
        return trace_at(
            model,
            example_args,
            example_kwargs,
            split_before=split_before,
            split_after=split_after,
            experts=experts,
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"mpmd.trace: model must be a torch.nn.Module, got {type(model).__name__}")
    if split_before is not None or split_after is not None:
        raise ValueError(
            "mpmd.trace: num_stages chooses the split points itself; pass num_stages or "
            "split_before/split_after, not both"
        )
    found = balance(
        model,
        example_args,
        num_stages,
        schedule=schedule,
        num_ranks=num_ranks,
        example_kwargs=example_kwargs,
    )
    return trace_at(
        model, example_args, example_kwargs, split_before=found.split_before, experts=experts
    )
