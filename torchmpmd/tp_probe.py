"""Tensor parallelism measured on the job, for `mpmd.plan`.

The planner prices tp from the profile (rank 0 alone, the model whole):
the planned modules' share of the FLOPs divided by tp, the collectives from
the calibrated links. On the job tp costs more than that: DTensor's
dispatch of every sharded op and the waits of each collective on ranks that
drift apart come per call, and on CPU they made tp layouts measure 1.5-2.4x
their prediction. So, before it plans, `mpmd.plan` runs the model here as
one stage on every rank: once without tp (dp over every rank) and once per
tp size it weighs (dp x tp), a few steps each, and takes each rank's
forward and backward task times from the runner's timeline (the slowest
rank's median). What the tp run exceeds its prediction by, beyond what the
run without tp exceeds its own by, is charged per call to the units'
planned modules (`tensor_costs.per_call`).

It lives beside `build` and `refine` because it runs the runtime, which the
planner does not import; `mpmd.plan` finds it through `set_tp_probe`.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .planner.layouts import Layout
from .planner.tp_measured import set_tp_probe
from .runtime import PipelineRunner, RunnerOptions
from .schedules import OneFOneB

__all__ = ["measure_tp"]

_STEPS = 3  # timed, after one warm-up step


def measure_tp(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    target: Any,
    tp_plan: dict[str, Any] | None,
    tp: int,
) -> tuple[float, float]:
    """The forward and backward seconds of `model` as one stage on a
    (pp 1, dp world / tp, tp) mesh of every rank, one microbatch of the
    example per replica: the slowest rank's median. A collective."""
    from .planner import trace

    world = dist.get_world_size()
    layout = Layout(pp=1, dp=world // tp, tp=tp)
    backend = dist.get_backend()
    mesh = init_device_mesh(
        "cuda" if backend == "nccl" else "cpu",
        layout.mesh_shape,
        mesh_dim_names=layout.mesh_dim_names,
    )
    pipe = trace(copy.deepcopy(model), args, kwargs or None)
    runner = PipelineRunner(
        pipe,
        OneFOneB(1),
        loss_fn=loss_fn,
        mesh=mesh,
        options=RunnerOptions(tp_plan=tp_plan if tp > 1 else None),
    )
    forward: list[float] = []
    backward: list[float] = []
    for step in range(_STEPS + 1):
        runner.step(*args, target=target, **kwargs)
        for p in runner.parameters():
            p.grad = None
        timeline = runner.timeline
        if step == 0 or timeline is None:
            continue
        for task in timeline.tasks:
            if task.rank != runner.rank:
                continue
            if task.kind == "F":
                forward.append(task.end - task.start)
            elif task.kind == "B":
                backward.append(task.end - task.start)
    mine = torch.tensor(
        [statistics.median(forward), statistics.median(backward)], dtype=torch.float64
    )
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine[0]), float(mine[1])


set_tp_probe(measure_tp)
