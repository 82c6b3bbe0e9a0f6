"""`mpmd.plan`: the schedule, stages per rank, split and number of
microbatches with the shortest simulated step for a model on N ranks.

The model is profiled once on one microbatch (`profile`, as `balance` does);
every candidate is then weighed on the simulator alone: each built-in
schedule (or the given ones), with one stage per rank or two where the
schedule needs or allows them, at each number of microbatches the batch
allows, is split by `search` (the best split for that schedule, within the
memory limit). The fastest candidate is the plan; the others are kept,
ranked, with why they lost.

With `batch_size` (rows of the global batch) and no `num_microbatches`,
each count `m` that divides the batch and keeps at least one microbatch in
flight per rank (`num_ranks <= m <= 4 * num_ranks * stages per rank`; under
a memory limit up to one row per microbatch) is tried, the profile's times, activations and transfers scaled by the
microbatch's rows over the example's (linear: a model whose cost per row
falls with the batch, as small matmuls do on a GPU, gets more microbatches
than it should). Under a memory limit each candidate is also weighed with
the stages of rank 0 and with every stage recomputed, selectively (matmul,
attention and convolution outputs kept, the rest recomputed in the backward:
the profile times every unit that way too) or in full (R before each
backward): `Plan.recompute`, for `RunnerOptions(recompute=...)`. When a
weighed schedule splits its backward, the profile times each unit's I and W
apart from its B (`split_profile`), so a zero-bubble schedule whose I + W
costs more than the bubble it fills loses on the simulator. Not searched:
a recompute set per rank beyond those two, or a mix of modes.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..graph.format import human_bytes, table
from ..schedule import builtins
from ..schedule.task import Schedule
from .balancer import on_rank_zero
from .profiler import LossFn, profile
from .results import Balance, Profile, _seconds
from .splits import check_limits, search

__all__ = ["Candidate", "Plan", "plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One schedule, stage count and microbatch count the planner weighed."""

    name: str  # the schedule, as built: "OneFOneB(8)"
    schedule: Schedule | None  # None: it could not be built
    num_stages: int
    num_microbatches: int
    split_before: list[str]
    predicted_step_time: float  # seconds, simulated (inf: did not run)
    predicted_peak_bytes: list[int]  # per rank, simulated activations
    recompute: dict[int, str] = field(default_factory=dict)  # stage -> "full" / "selective"
    rejected: str = ""  # why it is not the plan ("" for the plan)
    measured_step_time: float | None = None  # seconds, median (`mpmd.refine`)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What `mpmd.plan` chose. Pass the pieces on as they are:

    pipe = mpmd.trace(model, args, split_before=p.split_before)
    runner = mpmd.PipelineRunner(pipe, p.schedule, ...)
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

    @property
    def num_stages(self) -> int:
        return len(self.split_before) + 1

    def __repr__(self) -> str:
        measured = self.measured_step_time is not None
        rows = [_row("plan", repr(self.schedule), self, measured, "")]
        rows += [_row("", c.name, c, measured, c.rejected) for c in self.alternatives]
        head = (
            f"Plan: {self.schedule!r}, {self.num_stages} stages on {self.num_ranks} ranks, "
            f"split_before={self.split_before} (planned in {self.seconds_planning:.1f} s)\n"
        )
        columns = ["", "schedule", "stages", "microbatches", "step"]
        columns += ["measured"] if measured else []
        columns += ["peak per rank", "recompute", "rejected"]
        what = "candidates (simulated" + ("; measured by mpmd.refine):" if measured else "):")
        return head + table(what, columns, rows)


def _row(
    label: str, name: str, c: Plan | Candidate, measured: bool, rejected: str
) -> tuple[Any, ...]:
    """One row of the table: the plan's or a candidate's."""
    step = c.predicted_step_time
    cells: list[Any] = [
        label,
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
        _stages(c.recompute),
        rejected,
    ]
    return tuple(cells)


def plan(
    model: torch.nn.Module,
    example_args: Any,
    num_ranks: int,
    *,
    num_microbatches: int | None = None,
    batch_size: int | None = None,
    memory_limit: float | None = None,
    loss_fn: LossFn | None = None,
    example_target: Any = None,
    example_kwargs: dict[str, Any] | None = None,
    schedules: Sequence[type[Schedule]] | None = None,
    bandwidth: float = 0.0,
    latency: float = 0.0,
    repeats: int = 5,
    tolerance: float = 0.03,
) -> Plan:
    """The fastest schedule, stages per rank, split and number of
    microbatches for `model` on `num_ranks` ranks, on the simulator (see the
    module docstring). `example_args` is one microbatch. `schedules`: the
    schedule classes to weigh (default every built-in). `memory_limit`:
    bytes of activations per rank; a candidate whose every split exceeds it
    is rejected, and if every one does, the error gives the smallest peak.

    `tolerance`: candidates predicted within this fraction of the fastest
    are taken as equal (the simulator's prediction of a measured step is
    good to a few percent, and a schedule with more stages or a split
    backward pays per-task costs a profile does not see), and the simplest
    of them is the plan: the fewest stages, then no split backward, then the
    least recompute, then the smallest peak. 0: the fastest prediction wins.

    Under torch.distributed (initialised, several processes), call it on
    every rank: rank 0 profiles and searches, every rank gets its plan.
    """
    if not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ValueError(f"mpmd.plan: num_ranks must be a positive int, got {num_ranks!r}")
    check_limits(memory_limit, bandwidth, latency)
    if not isinstance(tolerance, int | float) or not 0 <= tolerance < 1:
        raise ValueError(f"mpmd.plan: tolerance must be in [0, 1), got {tolerance!r}")
    _check_loss(loss_fn, example_target)
    classes = _classes(schedules)
    counts = _counts(num_microbatches, batch_size, num_ranks, memory_limit is not None)

    def run() -> Plan:
        start = time.perf_counter()
        prof = profile(
            model,
            example_args,
            example_kwargs,
            min_units=2 * num_ranks,
            repeats=repeats,
            loss_fn=loss_fn,
            example_target=example_target,
            split_backward=any(_may_split_backward(cls) for cls in classes),
            selective=memory_limit is not None,
            traceable=True,
            caller="mpmd.plan",
        )
        rows = batch_rows(example_args, example_kwargs)
        found: list[tuple[Candidate, Balance | None]] = []
        for cls in classes:
            for stages in _stage_counts(cls, num_ranks):
                for m in counts(stages):
                    scaled = _scaled(prof, batch_size / m / rows if batch_size and rows else 1.0)
                    for recompute in _policies(cls, stages, m, num_ranks, memory_limit, scaled):
                        found.append(
                            _weigh(
                                cls,
                                stages,
                                m,
                                num_ranks,
                                scaled,
                                recompute,
                                (memory_limit, bandwidth, latency),
                            )
                        )
        ran = sorted(
            (c for c in found if c[1] is not None),
            key=lambda c: _per_row(c[0], batch_size),
        )
        if not ran:
            raise ValueError(_nothing_fits(found, memory_limit))
        fastest = _per_row(ran[0][0], batch_size)
        # Within `tolerance` of the fastest, the simulator cannot tell them
        # apart: the simplest wins (fewest stages, no split backward, least
        # recompute, smallest peak).
        close = [c for c in ran if _per_row(c[0], batch_size) <= fastest * (1 + tolerance)]
        best, balance = min(close, key=lambda c: _simplicity(c[0]))
        assert balance is not None and best.schedule is not None
        ranked = [c for c, _ in ran if c is not best]
        slower = [
            dataclasses.replace(c, rejected=_why_not(c, best, batch_size, tolerance))
            for c in ranked
        ]
        others = slower + [c for c, b in found if b is None]
        return Plan(
            schedule=best.schedule,
            split_before=best.split_before,
            num_microbatches=best.num_microbatches,
            num_ranks=num_ranks,
            recompute=best.recompute,
            predicted_step_time=best.predicted_step_time,
            predicted_peak_bytes=best.predicted_peak_bytes,
            alternatives=tuple(others),
            seconds_planning=time.perf_counter() - start,
            balance=balance,
        )

    return on_rank_zero(run)


def _check_loss(loss_fn: Any, example_target: Any) -> None:
    """A loss that reads no target (`lambda out, _: out.loss`) needs no
    example_target, as the runner's step needs none; one that does is told
    so at the profile's first forward."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"mpmd.plan: loss_fn must be callable as loss_fn(output, target), got "
            f"{type(loss_fn).__name__}"
        )
    if loss_fn is None and example_target is not None:
        raise ValueError(
            "mpmd.plan: example_target is given but no loss_fn reads it; pass the "
            "PipelineRunner's loss_fn too (e.g. loss_fn=F.cross_entropy), or leave "
            "example_target out"
        )


def _classes(schedules: Any) -> list[type[Schedule]]:
    if schedules is None:
        return [getattr(builtins, name) for name in _BUILTIN_ORDER]
    if isinstance(schedules, type | str | Schedule) or not isinstance(schedules, Iterable):
        given = f"{schedules!r}"
        if isinstance(schedules, type):
            given = f"the class {schedules.__name__}; write schedules=[{schedules.__name__}]"
        elif isinstance(schedules, Schedule):
            given += f"; write schedules=[{type(schedules).__name__}]"
        raise TypeError(
            "mpmd.plan: schedules must be a list of Schedule classes (the planner chooses the "
            f"number of microbatches), e.g. [mpmd.schedules.OneFOneB]; got {given}"
        )
    out = []
    for i, s in enumerate(schedules):
        if not (isinstance(s, type) and issubclass(s, Schedule)):
            hint = f"; pass its class {type(s).__name__}" if isinstance(s, Schedule) else ""
            raise TypeError(
                f"mpmd.plan: schedules must be Schedule classes (the planner chooses the number "
                f"of microbatches), e.g. [mpmd.schedules.OneFOneB]; schedules[{i}] is "
                f"{s!r}{hint}"
            )
        out.append(s)
    if not out:
        raise ValueError("mpmd.plan: schedules is empty; leave it out to weigh every built-in")
    return out


_BUILTIN_ORDER = (
    "OneFOneB",
    "GPipe",
    "Eager1F1B",
    "ZeroBubbleH1",
    "Interleaved1F1B",
    "ZBV",
    "DualPipeV",
)


def _may_split_backward(cls: type[Schedule]) -> bool:
    """Whether a schedule of class `cls` runs I and W tasks (on 2 ranks, 4
    microbatches; True where that cannot tell)."""
    try:
        return cls(4).splits_backward(_stage_counts(cls, 2)[0], 2)
    except (TypeError, ValueError):
        return True  # cannot tell: measure


def _stage_counts(cls: type[Schedule], num_ranks: int) -> list[int]:
    """The stage counts `cls` is weighed with: its own stages per rank."""
    per_rank = cls.stages_per_rank
    if not isinstance(per_rank, int) or isinstance(per_rank, bool) or per_rank < 1:
        raise TypeError(
            f"mpmd.plan: {cls.__name__}.stages_per_rank is {per_rank!r}; a schedule says how "
            "many stages it places on each rank as a positive int (1, or 2 for a V-shaped or "
            "interleaved schedule)"
        )
    return [per_rank * num_ranks]


def _counts(
    num_microbatches: int | None, batch_size: int | None, num_ranks: int, capped: bool
) -> Any:
    """stages -> the microbatch counts to try: those that divide the batch,
    from one per rank up to 4 per stage, or, under a memory limit, up to
    one row per microbatch (smaller microbatches hold fewer activations)."""
    if num_microbatches is not None:
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(
                f"mpmd.plan: num_microbatches must be a positive int, got {num_microbatches!r}"
            )
        if batch_size is not None and batch_size % num_microbatches:
            raise ValueError(
                f"mpmd.plan: batch_size={batch_size} does not divide into "
                f"num_microbatches={num_microbatches}"
            )
        return lambda stages: [num_microbatches]
    if batch_size is None:
        return lambda stages: [2 * stages]
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"mpmd.plan: batch_size must be a positive int, got {batch_size!r}")

    def counts(stages: int) -> list[int]:
        top = batch_size if capped else 4 * stages
        found = [m for m in range(num_ranks, top + 1) if batch_size % m == 0]
        return found or [batch_size]

    return counts


def batch_rows(args: Any, kwargs: dict[str, Any] | None = None) -> int:
    """Rows (dim 0) of the first tensor of a batch's arguments (0: none)."""
    leaves = [*(args if isinstance(args, tuple) else (args,)), *(kwargs or {}).values()]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 0


def _scaled(prof: Profile, factor: float) -> Profile:
    if factor == 1.0:
        return prof
    return dataclasses.replace(
        prof,
        forward=tuple(f * factor for f in prof.forward),
        backward=tuple(b * factor for b in prof.backward),
        activation_bytes=tuple(round(a * factor) for a in prof.activation_bytes),
        input_grad=None if prof.input_grad is None else tuple(i * factor for i in prof.input_grad),
        weight_grad=None
        if prof.weight_grad is None
        else tuple(w * factor for w in prof.weight_grad),
        transfers=tuple(
            dataclasses.replace(t, bytes=round(t.bytes * factor)) for t in prof.transfers
        ),
        selective=None if prof.selective is None else _scaled(prof.selective, factor),
    )


def _policies(
    cls: type[Schedule],
    stages: int,
    m: int,
    num_ranks: int,
    memory_limit: float | None,
    prof: Profile,
) -> list[dict[int, str]]:
    """The recompute policies weighed (stage -> "selective" | "full"): none;
    under a memory limit also the stages of rank 0 (which holds the most
    microbatches in flight in 1F1B-like schedules) and every stage, each
    recomputed selectively (when the profile has its costs) or in full."""
    if memory_limit is None:
        return [{}]
    try:
        placement = cls(m).placement(stages, num_ranks)
    except (TypeError, ValueError):
        return [{}]
    first = [s for s in range(stages) if placement[s] == 0]
    every = list(range(stages))
    modes = ["selective", "full"] if prof.selective is not None else ["full"]
    found: list[dict[int, str]] = [{}]
    for mode in modes:
        for chosen in (first, every):
            policy = dict.fromkeys(chosen, mode)
            if policy not in found:
                found.append(policy)
    return found


def _weigh(
    cls: type[Schedule],
    stages: int,
    m: int,
    num_ranks: int,
    prof: Profile,
    policy: dict[int, str],
    limits: tuple[float | None, float, float],
) -> tuple[Candidate, Balance | None]:
    """The best split of `prof` for `cls(m)` on `stages` stages, recomputing
    as `policy` says (stage -> "full": R tasks; "selective": its costs), or
    why none runs."""
    memory_limit, bandwidth, latency = limits
    full = frozenset(s for s, mode in policy.items() if mode == "full")
    try:
        schedule = cls(m)
        simulated = schedule.with_recompute(full) if full else schedule
    except (TypeError, ValueError) as err:
        return _failed(cls, stages, m, f"{cls.__name__}({m}): {err}", policy), None
    if stages > len(prof.units):
        return _failed(cls, stages, m, f"the model has {len(prof.units)} units", policy), None
    try:
        found = search(
            prof,
            stages,
            schedule=simulated,
            num_ranks=num_ranks,
            memory_limit=memory_limit,
            bandwidth=bandwidth,
            latency=latency,
            selective=[s for s, mode in policy.items() if mode == "selective"],
        )
    except ValueError as err:
        text = str(err).removeprefix("mpmd.balance: ")
        peak = re.search(r"peak is [^(]*\((\d+) bytes, rank (\d+)", text)
        if peak is None:
            return _failed(cls, stages, m, text.split("; ")[0], policy), None
        failed = _failed(
            cls,
            stages,
            m,
            f"its smallest peak is {human_bytes(int(peak[1]))} (rank {peak[2]})",
            policy,
        )
        return dataclasses.replace(failed, predicted_peak_bytes=[int(peak[1])]), None
    return (
        Candidate(
            name=repr(schedule),
            schedule=schedule,
            num_stages=stages,
            num_microbatches=m,
            split_before=found.split_before,
            predicted_step_time=found.predicted_step,
            predicted_peak_bytes=list(found.peak_activation_bytes),
            recompute=policy,
        ),
        found,
    )


def _failed(
    cls: type[Schedule], stages: int, m: int, why: str, recompute: dict[int, str]
) -> Candidate:
    return Candidate(
        name=f"{cls.__name__}({m})",
        schedule=None,
        num_stages=stages,
        num_microbatches=m,
        split_before=[],
        predicted_step_time=float("inf"),
        predicted_peak_bytes=[],
        recompute=recompute,
        rejected=why,
    )


def _simplicity(c: Candidate) -> tuple[int, bool, int, int, float]:
    assert c.schedule is not None
    split = _may_split_backward(type(c.schedule))
    return (
        c.num_stages,
        split,
        sum(2 if mode == "full" else 1 for mode in c.recompute.values()),
        max(c.predicted_peak_bytes),
        c.predicted_step_time,
    )


def _why_not(c: Candidate, best: Candidate, batch_size: int | None, tolerance: float) -> str:
    ratio = _per_row(c, batch_size) / max(_per_row(best, batch_size), 1e-30)
    if ratio > 1 + tolerance:
        return f"{ratio:.3f}x slower"
    return f"{ratio:.3f}x, within tolerance: the plan is simpler"


def _stages(recompute: dict[int, str]) -> str:
    """'full 0, 1; selective 2' ('-': none)."""
    modes = sorted(set(recompute.values()))
    return (
        "; ".join(
            f"{mode} " + ", ".join(str(s) for s in sorted(recompute) if recompute[s] == mode)
            for mode in modes
        )
        or "-"
    )


def _per_row(c: Candidate, batch_size: int | None) -> float:
    """A candidate's step time per global batch (the same batch for all when
    `batch_size` is given; else per microbatch, so that counts compare)."""
    if batch_size:
        return c.predicted_step_time
    return c.predicted_step_time / c.num_microbatches


def _nothing_fits(found: list[tuple[Candidate, Balance | None]], limit: float | None) -> str:
    what = f" within memory_limit={human_bytes(limit)}" if limit is not None else ""
    peaks = [c for c, _ in found if c.predicted_peak_bytes]
    if peaks:
        low = min(peaks, key=lambda c: max(c.predicted_peak_bytes))
        recompute = f", recomputing {_stages(low.recompute)}" if low.recompute else ""
        return (
            f"mpmd.plan: no candidate runs{what}; the smallest simulated peak found is "
            f"{human_bytes(max(low.predicted_peak_bytes))} per rank ({low.name} on "
            f"{low.num_stages} stages{recompute}); raise memory_limit to at least that, or "
            "plan for more ranks or smaller microbatches (batch_size with more microbatches)"
        )
    reasons = "; ".join(
        dict.fromkeys(f"{c.name} on {c.num_stages} stages: {c.rejected}" for c, _ in found)
    )
    return f"mpmd.plan: no candidate runs{what}: {reasons}"
