"""Layouts stepped on the job, for `mpmd.plan` (`planner/job_runs.py`).

The planner prices data and tensor parallelism from the profile (rank 0
alone, the model whole) and the calibrated links. On the job both cost
more: DTensor's dispatch of every sharded op and the waits of each
collective on ranks that drift apart come per call (on CPU tp layouts
measured 1.5-2.4x their prediction), and Gloo's threads averaging the
gradients take the cores the backward runs on. So, before it plans,
`mpmd.plan` steps the model here as one stage on every rank: once without
tp (dp over every rank) and once per tp size it weighs (dp x tp), one
microbatch of the example per replica, a warm-up and four timed steps
each, and takes each rank's forward and backward task times from the
runner's timeline and its whole step (the slowest rank's fastest).

It lives beside `build` and `refine` because it runs the runtime, which the
planner does not import; `mpmd.plan` finds it through `set_probe`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh

from .planner import trace
from .planner.job_runs import Run, set_probe
from .planner.layouts import Layout
from .runtime import PipelineRunner, RunnerOptions
from .schedules import OneFOneB

__all__ = ["step_layout"]

_STEPS = 4  # timed, after one warm-up step


def step_layout(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    target: Any,
    tp_plan: dict[str, Any] | None,
    tp: int,
) -> Run:
    """The forward, backward and step seconds of `model` as one stage on a
    (pp 1, dp world / tp, tp) mesh of every rank, one microbatch of the
    example per replica: the slowest rank's fastest of four steps (as
    `calibrate` takes the collectives': the least disturbed). A collective."""
    world = dist.get_world_size()
    layout = Layout(pp=1, dp=world // tp, tp=tp)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=layout.mesh_dim_names)
    pipe = trace(copy.deepcopy(model), args, kwargs or None)
    runner = PipelineRunner(
        pipe,
        OneFOneB(1),
        # Without one, the profile's backward starts from ones: the outputs' sum.
        loss_fn=loss_fn or _sum_of_outputs,
        mesh=mesh,
        options=RunnerOptions(tp_plan=tp_plan if tp > 1 else None),
    )
    forward: list[float] = []
    backward: list[float] = []
    steps: list[float] = []
    for step in range(_STEPS + 1):
        dist.barrier()
        start = time.perf_counter()
        runner.step(*args, target=target, **kwargs)
        steps.append(time.perf_counter() - start)
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
        [min(forward), min(backward), min(steps[1:])],
        dtype=torch.float64,
        device=torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else None,
    )
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return Run(*(float(v) for v in mine))


def _sum_of_outputs(output: Any, _target: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    return sum((t.sum() for t in leaves if t.is_floating_point()), torch.zeros(()))


set_probe(step_layout)
