"""`mpmd.refine`: a plan's close candidates run for a few steps, in turns,
and the measured fastest (the simplest within a tolerance) is the plan.

`mpmd.plan` weighs every candidate on the simulator from a profile taken on
one rank alone. The simulator predicts a step from the task costs a run
measures to within a few percent, but a profile does not see what the
runtime adds per task and per transfer when ranks share cores, caches and
links (on 2 CPU cores with Gloo, 4-stage schedules measured 10-20% over
their prediction where 2-stage ones measured 4-13%). `refine` takes, from
each family of candidates (stages per rank, split backward or not), the one
predicted fastest within `slack` of the plan, runs each on the real job for
`rounds` steps in turns (one step of each per round, each round starting
one later) and keeps the measured medians. Collective: every rank of the
pipeline's group calls it with its part of the same batch, and rank 0's
choice is every rank's. The ranks check in (through the process group's
store) before any work, so a rank that does not call it fails every rank
within the runners' timeout instead of leaving them in a collective. The
model's parameters, gradients, buffers and the random state are as they
were before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh

from .build import layout_mesh, runner_of
from .planner.candidates import Candidate, Plan, per_batch, simplicity
from .planner.check_in import check_in
from .planner.layouts import Layout
from .planner.profiler import _buffers_restored
from .planner.weigh import batch_rows
from .runtime import PipelineRunner, RunnerOptions

__all__ = ["refine"]


def refine(
    plan: Plan,
    model: torch.nn.Module,
    *batch_args: Any,
    target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    rounds: int = 5,
    warmup: int = 1,
    slack: float = 1.25,
    tolerance: float = 0.03,
    options: RunnerOptions | None = None,
    group: dist.ProcessGroup | None = None,
) -> Plan:
    """`plan` with its pieces replaced by those of the candidate that measured
    fastest on this job's `batch_args` (a whole global batch, as
    `runner.step` takes it; `target` and `loss_fn` as the runner's). Within
    `tolerance` of the fastest measured, the simplest wins (fewest stages,
    no split backward, least recompute), as in `mpmd.plan`. The candidates
    are the plan and, per family (stage count, split backward), the fastest
    predicted within `slack` x the plan's prediction. `options` are the
    runners' (their `recompute` is each candidate's own); a rank that does
    not call refine within their `timeout` fails every rank. Every
    candidate's median is in `.measured`; a candidate other than the plan
    comes back without `.balance`."""
    if not isinstance(plan, Plan):
        raise TypeError(f"mpmd.refine: plan must be what mpmd.plan returned, got {plan!r}")
    if not isinstance(rounds, int) or rounds < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(
            f"mpmd.refine: rounds must be a positive int and warmup a non-negative int, got "
            f"rounds={rounds!r}, warmup={warmup!r}"
        )
    if not isinstance(slack, int | float) or slack < 1:
        raise ValueError(f"mpmd.refine: slack must be a number >= 1, got {slack!r}")
    if options is not None and not isinstance(options, RunnerOptions):
        raise TypeError(
            f"mpmd.refine: options must be an mpmd.RunnerOptions, got {type(options).__name__}"
        )
    base = options or RunnerOptions()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "mpmd.refine runs the candidates on the job's ranks: call it on every rank under "
            f"torchrun (torch.distributed initialised, {plan.num_ranks} ranks in the pipeline's "
            "group); without them, use the plan as mpmd.plan gave it"
        )
    size = dist.get_world_size(group)
    if size != plan.num_ranks:
        raise ValueError(
            f"mpmd.refine: the plan is for {plan.num_ranks} ranks but the group has {size}; "
            "pass the pipeline's group (group=...)"
        )
    problem: Exception | None = None
    try:
        rows = _rows(batch_args)
        chosen = _candidates(plan, slack, rows, other_layouts=group is None)
    except ValueError as err:  # the other ranks hear of it at the check-in
        problem, rows = err, 0
    call = {"plan": f"{plan.schedule!r} split_before={plan.split_before}", "rows": rows}
    call |= {"rounds": rounds, "warmup": warmup, "problem": str(problem) if problem else None}
    _check_in(group, base.timeout, call)
    if problem is not None:
        raise problem
    with _model_kept(model):
        meshes: dict[Layout, DeviceMesh | None] = {}
        runners, batches = [], []
        for c in chosen:
            layout = c.layout or plan.mesh_layout
            if layout not in meshes:  # every rank makes the meshes in the same order
                meshes[layout] = layout_mesh(layout) if layout.num_devices > layout.pp else None
            mine = _share((batch_args, target), rows, layout)
            runners.append(
                runner_of(
                    c, model, mine[0], rows // layout.replicas, loss_fn, base, meshes[layout], group
                )
            )
            batches.append(mine)
        times = _measure(runners, batches, rounds, warmup, group)
    medians: list[Any] = [[statistics.median(t) for t in times]]
    dist.broadcast_object_list(medians, src=dist.get_global_rank(group, 0) if group else 0)
    measured = [
        dataclasses.replace(c, measured_step_time=m)
        for c, m in zip(chosen, medians[0], strict=True)
    ]
    fastest = min(c.measured_step_time or 0.0 for c in measured)
    close = [c for c in measured if (c.measured_step_time or 0.0) <= fastest * (1 + tolerance)]
    best = min(close, key=simplicity)
    assert best.schedule is not None
    kept = plan.balance if best is measured[0] else None
    others = [
        dataclasses.replace(c, rejected=_measured_why(c, best, tolerance))
        for c in measured
        if c is not best
    ]

    def key(c: Candidate) -> tuple[str, str, int, tuple[str, ...]]:
        return (str(c.layout or plan.mesh_layout), c.name, c.num_stages, tuple(c.split_before))

    named = {key(c) for c in measured}
    rest = [c for c in (plan.as_candidate(), *plan.alternatives) if key(c) not in named]
    return plan.taking(best, tuple(others + rest), kept)


def _check_in(
    group: dist.ProcessGroup | None, timeout: float | datetime.timedelta, entry: dict[str, Any]
) -> None:
    """Every rank of the pipeline's group calls it within `timeout`
    (`check_in`), with the same plan, batch rows, rounds and warmup."""
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    me = dist.get_rank()
    advice = (
        "Call it on every rank with the same plan and batch, or raise "
        "RunnerOptions(timeout=...) if a rank is only slow"
    )
    entries = check_in("mpmd.refine", group, seconds, entry, advice)
    if entry["problem"] is not None:
        return  # the caller raises its own
    for r, other in entries.items():
        if other["problem"] is not None:
            raise ValueError(f"mpmd.refine: rank {r} could not run it: {other['problem']}")
        differ = [k for k in ("plan", "rows", "rounds", "warmup") if other[k] != entry[k]]
        if differ:
            raise ValueError(
                f"mpmd.refine: rank {me} and rank {r} were given different {differ[0]} "
                f"({entry[differ[0]]!r} and {other[differ[0]]!r}); pass the same plan (mpmd.plan "
                "gives every rank rank 0's), batch, rounds and warmup on every rank"
            )


def _rows(batch_args: tuple[Any, ...]) -> int:
    rows = batch_rows(batch_args)
    if rows == 0:
        raise ValueError(
            "mpmd.refine: batch_args must hold the global batch as tensors (rows in dim 0), as "
            "runner.step takes it"
        )
    return rows


def _candidates(plan: Plan, slack: float, rows: int, other_layouts: bool = True) -> list[Candidate]:
    """The plan, then per family (layout, stage count, split backward) the
    fastest predicted within `slack` of the plan's prediction (per global
    batch when the plan was given one, else per microbatch), whose
    microbatch count divides its replica's rows; other layouts than the
    plan's only with `other_layouts` (the job's whole world)."""
    first = plan.as_candidate()
    if rows % plan.num_microbatches:
        raise ValueError(
            f"mpmd.refine: the batch has {rows} rows, which do not divide into the plan's "
            f"{plan.num_microbatches} microbatches"
        )
    out = [first]
    families = {_family(first, plan.num_ranks)}
    mine = per_batch(first, plan.batch_size)
    for c in sorted(
        (
            c
            for c in plan.alternatives
            if c.schedule is not None
            and c.predicted_step_time > 0
            and (other_layouts or (c.layout or plan.mesh_layout) == plan.mesh_layout)
        ),
        key=lambda c: per_batch(c, plan.batch_size),
    ):
        replicas = (c.layout or plan.mesh_layout).replicas
        if rows % (c.num_microbatches * replicas) or per_batch(c, plan.batch_size) > slack * mine:
            continue
        family = _family(c, plan.num_ranks)
        if family not in families:
            families.add(family)
            out.append(c)
    return out


def _family(c: Candidate, num_ranks: int) -> tuple[str, int, bool]:
    """Layout, stage count, and whether the schedule splits its backward."""
    assert c.schedule is not None
    layout = c.layout or Layout(pp=num_ranks)
    return str(layout), c.num_stages, c.schedule.splits_backward(c.num_stages, layout.pp)


def _share(batch: tuple[tuple[Any, ...], Any], rows: int, layout: Layout) -> Any:
    """This rank's replica's rows of the global batch (and target) under
    `layout` (the mesh is pp x dp x ep x tp in rank order: a replica is the
    ranks' index over dp x ep, the same on every pipeline rank)."""
    if layout.replicas == 1:
        return batch
    share = rows // layout.replicas
    index = (dist.get_rank() // layout.tp) % layout.replicas
    return pytree.tree_map(
        lambda t: (
            t[index * share : (index + 1) * share]
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows
            else t
        ),
        batch,
    )


def _measure(
    runners: list[PipelineRunner],
    batches: list[tuple[tuple[Any, ...], Any]],
    rounds: int,
    warmup: int,
    group: dist.ProcessGroup | None,
) -> list[list[float]]:
    times: list[list[float]] = [[] for _ in runners]
    order = list(range(len(runners)))
    for r in range(warmup + rounds):
        shift = r % len(order)
        for k in order[shift:] + order[:shift]:
            dist.barrier(group)
            start = time.perf_counter()
            args, target = batches[k]
            runners[k].step(*args, target=target)
            elapsed = time.perf_counter() - start
            for p in runners[k].parameters():
                p.grad = None
            if r >= warmup:
                times[k].append(elapsed)
    return times


@contextlib.contextmanager
def _model_kept(model: torch.nn.Module) -> Iterator[None]:
    """Parameters, gradients, buffers (`_buffers_restored`, as the profile
    keeps them) and the CPU random state as they were."""
    params = [(p, p.detach().clone(), p.grad) for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    try:
        with torch.random.fork_rng(devices=[]), _buffers_restored(model):
            yield
    finally:
        with torch.no_grad():
            for p, value, _ in params:
                p.copy_(value)
        for p, _, grad in params:
            p.grad = grad


def _measured_why(c: Candidate, best: Candidate, tolerance: float) -> str:
    ratio = (c.measured_step_time or 0.0) / max(best.measured_step_time or 0.0, 1e-30)
    if ratio > 1 + tolerance:
        return f"measured {ratio:.3f}x slower"
    return f"measured {ratio:.3f}x, within tolerance: the plan is simpler"
