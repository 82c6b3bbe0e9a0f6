"""What `mpmd.plan` returns: the plan (`Plan`) and every candidate it
weighed (`Candidate`), ranked, with why each lost."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..graph.format import human_bytes, table
from ..schedule.task import Schedule
from .layouts import Layout
from .results import Balance, _seconds

__all__ = ["Candidate", "Plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One layout, schedule, stage count and microbatch count the planner weighed."""

    name: str  # the schedule, as built: "OneFOneB(8)"
    schedule: Schedule | None  # None: it could not be built
    num_stages: int
    num_microbatches: int
    split_before: list[str]
    predicted_step_time: float  # seconds, simulated (inf: did not run)
    # Per pipeline rank, the simulated peak the limit was checked against:
    # activations (memory_limit), or activations and state (device_memory).
    predicted_peak_bytes: list[int]
    recompute: dict[int, str] = field(default_factory=dict)  # stage -> "full" / "selective"
    rejected: str = ""  # why it is not the plan ("" for the plan)
    measured_step_time: float | None = None  # seconds, median (`mpmd.refine`)
    layout: Layout | None = None  # None: pp = the plan's ranks, nothing else
    # Per pipeline rank, parameters, gradients and optimizer states (bytes).
    state_bytes: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What `mpmd.plan` chose. Pass the pieces on as they are:

    pipe = mpmd.trace(model, args, split_before=p.split_before)
    runner = mpmd.PipelineRunner(pipe, p.schedule, mesh=..., ...)

    or build it in one call: `runner = mpmd.build(p, model, *batch)`.
    """

    schedule: Schedule
    split_before: list[str]
    num_microbatches: int
    num_ranks: int
    predicted_step_time: float
    predicted_peak_bytes: list[int]
    # RunnerOptions(recompute=...): stage -> "full" or "selective" ({}: none).
    recompute: dict[int, str] = field(default_factory=dict)
    alternatives: tuple[Candidate, ...] = ()  # the others, fastest first
    seconds_planning: float = field(default=0.0, compare=False)
    # Its measured median step (`mpmd.refine`; None: not measured).
    measured_step_time: float | None = field(default=None, compare=False)
    balance: Balance | None = field(default=None, repr=False, compare=False)
    # The mesh: pp x dp x tp over the num_ranks devices (None: pp = num_ranks).
    layout: Layout | None = None
    batch_size: int | None = None  # rows of the global batch it was planned for
    state_bytes: list[int] = field(default_factory=list)
    # What the plan did not weigh, and why (e.g. no links to price collectives).
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def num_stages(self) -> int:
        return len(self.split_before) + 1

    @property
    def mesh_layout(self) -> Layout:
        """The layout, pp = num_ranks when the plan weighed the pipeline alone."""
        return self.layout if self.layout is not None else Layout(pp=self.num_ranks)

    def as_candidate(self, rejected: str = "") -> Candidate:
        """The plan's own choice as a `Candidate`, to rank beside its
        alternatives (its layout spelled out)."""
        return Candidate(
            name=repr(self.schedule),
            schedule=self.schedule,
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            split_before=self.split_before,
            predicted_step_time=self.predicted_step_time,
            predicted_peak_bytes=self.predicted_peak_bytes,
            recompute=self.recompute,
            rejected=rejected,
            measured_step_time=self.measured_step_time,
            layout=self.mesh_layout,
            state_bytes=self.state_bytes,
        )

    def taking(
        self,
        candidate: Candidate,
        alternatives: tuple[Candidate, ...],
        balance: Balance | None = None,
    ) -> Plan:
        """This plan with `candidate`'s pieces as its choice and
        `alternatives` as the others (`choose`, `mpmd.refine`)."""
        assert candidate.schedule is not None, "a candidate that ran has its schedule"
        return dataclasses.replace(
            self,
            schedule=candidate.schedule,
            split_before=candidate.split_before,
            num_microbatches=candidate.num_microbatches,
            predicted_step_time=candidate.predicted_step_time,
            predicted_peak_bytes=candidate.predicted_peak_bytes,
            recompute=candidate.recompute,
            measured_step_time=candidate.measured_step_time,
            layout=candidate.layout if candidate.layout is not None else self.layout,
            state_bytes=candidate.state_bytes,
            alternatives=alternatives,
            balance=balance,
        )

    def choose(self, candidate: Candidate) -> Plan:
        """This plan with `candidate` (one of `alternatives`) as its choice,
        the plan's own choice among the alternatives: to run the second
        best, or a layout the planner ranked lower, with `mpmd.build`."""
        if candidate not in self.alternatives or candidate.schedule is None:
            raise ValueError(
                f"Plan.choose: {candidate.name} on {candidate.layout} is not one of this plan's "
                "alternatives that ran; pass one of plan.alternatives whose schedule is not None"
            )
        mine = self.as_candidate(rejected="not chosen (Plan.choose)")
        others = tuple(c for c in self.alternatives if c is not candidate)
        return self.taking(candidate, (mine, *others))

    def __repr__(self) -> str:
        measured = self.measured_step_time is not None
        mine = self.mesh_layout
        rows = [_row("plan", repr(self.schedule), self, mine, measured, "")]
        rows += [
            _row("", c.name, c, c.layout or mine, measured, c.rejected) for c in self.alternatives
        ]
        head = (
            f"Plan: {mine}, {self.schedule!r}, {self.num_stages} stages on {self.num_ranks} "
            f"devices, split_before={self.split_before} (planned in "
            f"{self.seconds_planning:.1f} s)\n"
        )
        head += "".join(f"  note: {n}\n" for n in self.notes)
        columns = ["", "layout", "schedule", "stages", "microbatches", "step"]
        columns += ["measured"] if measured else []
        columns += ["peak per rank", "recompute", "rejected"]
        what = "candidates (simulated" + ("; measured by mpmd.refine):" if measured else "):")
        return head + table(what, columns, rows)


def _row(
    label: str, name: str, c: Plan | Candidate, layout: Layout, measured: bool, rejected: str
) -> tuple[Any, ...]:
    """One row of the table: the plan's or a candidate's."""
    step = c.predicted_step_time
    cells: list[Any] = [
        label,
        str(layout),
        name,
        c.num_stages,
        c.num_microbatches,
        _seconds(step) if step < float("inf") else "-",
    ]
    if measured:
        m = c.measured_step_time
        cells.append(_seconds(m) if m is not None else "")
    cells += [
        ", ".join(human_bytes(b) for b in c.predicted_peak_bytes),
        recompute_text(c.recompute),
        rejected,
    ]
    return tuple(cells)


def recompute_text(recompute: dict[int, str]) -> str:
    """'full 0, 1; selective 2' ('-': none)."""
    modes = sorted(set(recompute.values()))
    return (
        "; ".join(
            f"{mode} " + ", ".join(str(s) for s in sorted(recompute) if recompute[s] == mode)
            for mode in modes
        )
        or "-"
    )


def simplicity(c: Candidate) -> tuple[int, int, int, bool, bool, int, float, int]:
    """The order among candidates the simulator cannot tell apart: fewest
    stages, no tp, no ep, replicated over FSDP, no split backward, least
    recompute; then the fastest predicted (not the smallest peak: a memory
    limit already refused what does not fit, and more microbatches for a
    smaller peak measured slower), the smallest peak last."""
    assert c.schedule is not None
    ranks = max(c.num_stages // max(c.schedule.stages_per_rank, 1), 1)
    layout = c.layout or Layout(pp=ranks)
    try:
        split = c.schedule.splits_backward(c.num_stages, layout.pp)
    except (TypeError, ValueError):
        split = True
    return (
        c.num_stages,
        layout.tp,
        layout.ep,
        layout.data_parallel == "fsdp" and layout.replicas > 1,
        split,
        sum(2 if mode == "full" else 1 for mode in c.recompute.values()),
        c.predicted_step_time,
        max(c.predicted_peak_bytes, default=0),
    )


def per_batch(c: Candidate, batch_size: int | None) -> float:
    """A candidate's step time per global batch (the same batch for all when
    `batch_size` is given; else per microbatch, so that counts compare)."""
    if batch_size:
        return c.predicted_step_time
    return c.predicted_step_time / c.num_microbatches


def choose(
    ran: list[Candidate], batch_size: int | None, tolerance: float
) -> tuple[Candidate, list[Candidate]]:
    """The plan among candidates that ran (the simplest within `tolerance`
    of the fastest: the simulator cannot tell them apart) and the others,
    fastest first, each with why it lost."""
    ranked = sorted(ran, key=lambda c: per_batch(c, batch_size))
    fastest = per_batch(ranked[0], batch_size)
    close = [c for c in ranked if per_batch(c, batch_size) <= fastest * (1 + tolerance)]
    best = min(close, key=simplicity)
    others = [
        dataclasses.replace(c, rejected=why_not(c, best, batch_size, tolerance))
        for c in ranked
        if c is not best
    ]
    return best, others


def why_not(c: Candidate, best: Candidate, batch_size: int | None, tolerance: float) -> str:
    ratio = per_batch(c, batch_size) / max(per_batch(best, batch_size), 1e-30)
    if ratio > 1 + tolerance:
        return f"{ratio:.3f}x slower"
    return f"{ratio:.3f}x, within tolerance: the plan is simpler"


def nothing_fits(found: list[Candidate], limit: float | None, what: str) -> str:
    """Why no candidate runs: the smallest peak found, or each one's reason."""
    within = f" within {what}={human_bytes(limit)}" if limit is not None else ""
    peaks = [c for c in found if c.predicted_peak_bytes]
    if peaks:
        low = min(peaks, key=lambda c: max(c.predicted_peak_bytes))
        recompute = f", recomputing {recompute_text(low.recompute)}" if low.recompute else ""
        where = f" on {low.layout}" if low.layout is not None else ""
        return (
            f"mpmd.plan: no candidate runs{within}; the smallest simulated peak found is "
            f"{human_bytes(max(low.predicted_peak_bytes))} per rank ({low.name} on "
            f"{low.num_stages} stages{where}{recompute}); raise {what} to at least that, or "
            "plan for more ranks or smaller microbatches (batch_size with more microbatches)"
        )
    reasons = "; ".join(
        dict.fromkeys(f"{c.name} on {c.num_stages} stages: {c.rejected}" for c in found)
    )
    return f"mpmd.plan: no candidate runs{within}: {reasons}"
