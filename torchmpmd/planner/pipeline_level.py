"""The level of the predictions, with a pipeline and without one, measured
on the job for `mpmd.plan` where its ranks compute on one host's CPU.

The simulator charges a rank that shares its cores with others by how many
compute beside it (`Costs.shared_cores`), and the profile's times by the
contention measured when every rank computes. What it does not see is the
kernel's scheduler: a rank woken by a receive waits for a core held by
another, and the rank on the critical path gets no more than its fair share
while the others fill their bubbles. On 4 ranks sharing 2 cores,
pipelines measured 6-32% over their prediction (`benchmarks/
mpmd_vs_spmd.py --nproc 4`) while layouts without a pipeline, priced from
a run on the job (`job_runs`), came within a few percent: the plan chose a
pipeline 1.20x slower than DDP. With a core per rank the ranks still share
the host's caches, memory bus and the backend's threads, and the profile,
taken on rank 0 alone seconds before, moves with the machine: on 2 ranks
of 2 cores the same ZBV(2) was predicted 177-218 ms by consecutive plans
and stepped in 193-196 ms, DualPipeV(4) 210-291 ms against 230-239, its
tasks 0.65-1.19x their simulated times. And the dp probe (`job_runs`)
steps one microbatch of the example while the layouts it prices step the
replica's share: with pipelines leveled at their own rows and dp anchored
at the example's, the plan took dp 2 predicted 0.925x its step over a
pipeline 1.11x faster. So where the ranks compute on one host's CPU and
both kinds of layout ran, the fastest candidate with a pipeline and the
fastest without one are built and stepped on the job, in turns, each at
its replica's share of the batch (`set_measure`:
`job_probe.step_candidates`), and every candidate is predicted at the
level the measured one of its kind measured; the plan is then chosen again
as `mpmd.plan` chooses (the fastest, the simplest within the tolerance).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..graph.inputs import example_inputs
from .candidates import Candidate, Plan, choose, per_batch
from .layouts import Layout

__all__ = ["leveled", "on_the_job", "set_measure", "to_measure"]

# fn(candidates, replica_rows, model, args, kwargs, loss_fn, target, tp_plan):
# each candidate's step in seconds measured on the job, stepped in turns,
# the same on every rank; a collective (every rank calls it alike).
_measure: list[Callable[..., list[float]]] = []


def set_measure(fn: Callable[..., list[float]]) -> None:
    """How candidates are stepped on the job (the runtime's runner)."""
    _measure[:] = [fn]


def on_the_job(
    plan: Plan,
    model: torch.nn.Module,
    example: tuple[Any, dict[str, Any] | None],
    loss: tuple[Any, Any],
    tp_plan: dict[str, Any] | None,
    tolerance: float,
) -> Plan:
    """`plan` leveled by its fastest candidates with and without a pipeline
    stepped on the job in turns (as it was without a measure registered, a
    model with meta parameters, or no choice between pipelines and layouts
    without one). A collective: every rank calls it with rank 0's plan."""
    cs = to_measure(plan)
    if not cs or not _measure or plan.batch_size is None:
        return plan
    if any(p.is_meta for p in model.parameters()):
        return plan
    start = time.perf_counter()
    args, kwargs = example_inputs("mpmd.plan", *example)
    rows = [plan.batch_size // (c.layout or Layout(pp=plan.num_ranks)).replicas for c in cs]
    seconds = _measure[0](cs, rows, model, args, kwargs, loss[0], loss[1], tp_plan)
    out = leveled(plan, list(zip(cs, seconds, strict=True)), tolerance)
    # Rank 0's time, as the rest of the plan is rank 0's: each rank's own
    # differs by when it entered, and a plan must be the same on every rank
    # (its repr printed 0.1 s apart on one rank of 4 in a CI run).
    box = [plan.seconds_planning + time.perf_counter() - start]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return dataclasses.replace(out, seconds_planning=box[0])


def _pipelined(c: Candidate, num_ranks: int) -> bool:
    return (c.layout or Layout(pp=num_ranks)).pp > 1


def to_measure(plan: Plan) -> list[Candidate]:
    """The fastest predicted candidate with a pipeline and the fastest
    without one, where both kinds ran (else none: the level cannot change
    the choice)."""
    ran = [c for c in (plan.as_candidate(), *plan.alternatives) if c.schedule is not None]
    pipes = [c for c in ran if _pipelined(c, plan.num_ranks)]
    flat = [c for c in ran if not _pipelined(c, plan.num_ranks)]
    if not pipes or not flat:
        return []
    return [min(kind, key=lambda c: per_batch(c, plan.batch_size)) for kind in (pipes, flat)]


def leveled(plan: Plan, measured: Sequence[tuple[Candidate, float]], tolerance: float) -> Plan:
    """`plan` with every candidate scaled by what the measured one of its
    kind (with a pipeline, or without one) measured over its prediction,
    and chosen again; a kind not measured keeps its predictions.
    Deterministic: every rank, given the same plan and seconds, returns the
    same plan."""
    levels = {
        _pipelined(c, plan.num_ranks): (
            c,
            seconds,
            seconds / c.predicted_step_time if c.predicted_step_time > 0 else 1.0,
        )
        for c, seconds in measured
    }
    mine = plan.as_candidate()

    def scaled(c: Candidate) -> Candidate:
        level = levels.get(_pipelined(c, plan.num_ranks))
        if c.schedule is None or level is None:
            return c
        who, seconds, ratio = level
        kept = seconds if _same(c, who) else c.measured_step_time
        return dataclasses.replace(
            c, predicted_step_time=c.predicted_step_time * ratio, measured_step_time=kept
        )

    everyone = [scaled(c) for c in (mine, *plan.alternatives)]
    ran = [c for c in everyone if c.schedule is not None]
    best, others = choose(ran, plan.batch_size, tolerance)
    refused = [c for c in everyone if c.schedule is None]
    kept = plan.balance if _same(best, mine) else None
    out = plan.taking(best, tuple(others + refused), kept)
    parts = [
        f"{who.name} on {who.layout} stepped in {seconds * 1e3:.1f} ms against "
        f"{who.predicted_step_time * 1e3:.1f} ms predicted: every candidate "
        f"{'with' if pipelined else 'without'} a pipeline is predicted {ratio:.2f}x its simulation"
        for pipelined, (who, seconds, ratio) in sorted(levels.items(), reverse=True)
    ]
    text = (
        "levels measured on the job, in turns (its ranks compute on one host's CPU): "
        + "; ".join(parts)
    )
    if not _same(best, mine):
        text += f" (the simulation alone chose {mine.name} on {mine.layout})"
    return dataclasses.replace(out, notes=(*plan.notes, text))


def _same(a: Candidate, b: Candidate) -> bool:
    return (
        a.name == b.name
        and a.layout == b.layout
        and a.num_stages == b.num_stages
        and a.split_before == b.split_before
        and a.recompute == b.recompute
    )
