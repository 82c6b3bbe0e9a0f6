"""Weighing one candidate of `mpmd.plan`: a schedule class, its stage count
and microbatch count on a layout, split by `search` on the simulator, with
the recompute policies a memory limit calls for."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch

from ..graph.format import human_bytes
from ..schedule import builtins
from ..schedule.task import Schedule
from .candidates import Candidate
from .layouts import Layout, StageCharges
from .results import Balance, Profile
from .splits import search

__all__: list[str] = []


def schedule_classes(schedules: Any) -> list[type[Schedule]]:
    if schedules is None:
        return [getattr(builtins, name) for name in BUILTIN_ORDER]
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


BUILTIN_ORDER = (
    "OneFOneB",
    "GPipe",
    "Eager1F1B",
    "ZeroBubbleH1",
    "Interleaved1F1B",
    "ZBV",
    "DualPipeV",
    "Combined1F1B",
)


def may_split_backward(cls: type[Schedule]) -> bool:
    """Whether a schedule of class `cls` runs I and W tasks (on 2 ranks, 4
    microbatches; True where that cannot tell)."""
    try:
        return cls(4).splits_backward(stage_counts(cls, 2)[0], 2)
    except (TypeError, ValueError):
        return True  # cannot tell: measure


def stage_counts(cls: type[Schedule], num_ranks: int) -> list[int]:
    """The stage counts `cls` is weighed with: its own stages per rank."""
    per_rank = cls.stages_per_rank
    if not isinstance(per_rank, int) or isinstance(per_rank, bool) or per_rank < 1:
        raise TypeError(
            f"mpmd.plan: {cls.__name__}.stages_per_rank is {per_rank!r}; a schedule says how "
            "many stages it places on each rank as a positive int (1, or 2 for a V-shaped or "
            "interleaved schedule)"
        )
    return [per_rank * num_ranks]


def microbatch_counts(
    num_microbatches: int | None, batch_size: int | None, ranks: int, capped: bool, stages: int
) -> list[int]:
    """The microbatch counts to try for a replica's `batch_size` rows on
    `ranks` pipeline ranks: those that divide the batch, from one per rank
    up to 4 per stage, or, under a memory limit, up to one row per
    microbatch (smaller microbatches hold fewer activations)."""
    if num_microbatches is not None:
        return [num_microbatches]
    if batch_size is None:
        return [2 * stages]
    top = batch_size if capped else 4 * stages
    found = [m for m in range(ranks, top + 1) if batch_size % m == 0]
    return found or [batch_size]


def check_counts(num_microbatches: Any, batch_size: Any) -> None:
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
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"mpmd.plan: batch_size must be a positive int, got {batch_size!r}")


def batch_rows(args: Any, kwargs: dict[str, Any] | None = None) -> int:
    """Rows (dim 0) of the first tensor of a batch's arguments (0: none)."""
    leaves = [*(args if isinstance(args, tuple) else (args,)), *(kwargs or {}).values()]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 0


def policies(
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


def weigh(
    cls: type[Schedule],
    stages: int,
    m: int,
    layout: Layout,
    prof: Profile,
    policy: dict[int, str],
    limits: tuple[float | None, float, float],
    charges: StageCharges | None = None,
    sharing: tuple[float, float] | None = None,
) -> tuple[Candidate, Balance | None]:
    """The best split of `prof` for `cls(m)` on `stages` stages over
    `layout.pp` pipeline ranks, recomputing as `policy` says (stage ->
    "full": R tasks; "selective": its costs), each stage's data-parallel
    collectives and state as `charges` says, or why none runs. `sharing`:
    the cores the ranks compute on and the cores one pipeline rank takes
    (`splits.search`)."""
    memory_limit, bandwidth, latency = limits
    full = frozenset(s for s, mode in policy.items() if mode == "full")
    try:
        schedule = cls(m)
        simulated = schedule.with_recompute(full) if full else schedule
    except (TypeError, ValueError) as err:
        return failed(cls, stages, m, layout, f"{cls.__name__}({m}): {err}", policy), None
    if stages > len(prof.units):
        why = f"the model has {len(prof.units)} units"
        return failed(cls, stages, m, layout, why, policy), None
    try:
        found = search(
            prof,
            stages,
            schedule=simulated,
            num_ranks=layout.pp,
            memory_limit=memory_limit,
            bandwidth=bandwidth,
            latency=latency,
            selective=[s for s, mode in policy.items() if mode == "selective"],
            charges=charges,
            sharing=sharing,
        )
    except ValueError as err:
        text = str(err).removeprefix("mpmd.balance: ")
        peak = re.search(r"peak is [^(]*\((\d+) bytes, rank (\d+)", text)
        if peak is None:
            return failed(cls, stages, m, layout, text.split("; ")[0], policy), None
        why = f"its smallest peak is {human_bytes(int(peak[1]))} (rank {peak[2]})"
        out = failed(cls, stages, m, layout, why, policy)
        return dataclasses.replace(out, predicted_peak_bytes=[int(peak[1])]), None
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
            layout=layout,
            state_bytes=state_per_rank(prof, found.split_before, schedule, layout, charges),
        ),
        found,
    )


def state_per_rank(
    prof: Profile,
    split_before: list[str],
    schedule: Schedule,
    layout: Layout,
    charges: StageCharges | None,
) -> list[int]:
    """Per pipeline rank, the parameters, gradients and optimizer states its
    stages hold (`StageCharges.held`; [] where the profile has no sizes)."""
    if prof.parameter_bytes is None:
        return []
    held = charges or StageCharges(layout, None)
    starts = [0, *(prof.units.index(u) for u in split_before), len(prof.units)]
    placement = schedule.placement(len(starts) - 1, layout.pp)
    out = [0] * layout.pp
    for s in range(len(starts) - 1):
        out[placement[s]] += held.held(sum(prof.parameter_bytes[starts[s] : starts[s + 1]]))
    return out


def failed(
    cls: type[Schedule],
    stages: int,
    m: int,
    layout: Layout,
    why: str,
    recompute: dict[int, str],
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
        layout=layout,
    )
