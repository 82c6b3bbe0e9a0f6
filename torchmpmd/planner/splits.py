"""Searching the splits of a `Profile` on the project's simulator: each split
gets a `StageGraph` whose edges carry the bytes crossing its cuts, lowered by
one `Lowering` of the schedule (the path `compile_schedule` takes) and
predicted by `Program.predict`."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..graph.format import human_bytes
from ..schedule.builtins import OneFOneB
from ..schedule.costs import Costs
from ..schedule.kinds import part_of_backward
from ..schedule.program import Edge, Lowering, Prediction, StageCollectives, StageGraph
from ..schedule.task import Schedule
from ..schedule.timeline import Timeline
from .results import Balance, Profile, StageCost

if TYPE_CHECKING:
    from .layouts import StageCharges

__all__ = [
    "EXHAUSTIVE_LIMIT",
    "check_limits",
    "check_num_stages",
    "resolve_schedule",
    "search",
    "simulate",
]

# Splits tried one by one up to this many; beyond, a local search.
EXHAUSTIVE_LIMIT = 20_000


@dataclass(frozen=True, slots=True)
class _Eval:
    starts: tuple[int, ...]  # first unit of each stage
    step: float
    peak: tuple[int, ...]  # per rank
    crossing: int  # bytes sent per microbatch

    def key(self, limit: float | None) -> tuple[float, float, int, int, tuple[int, ...]]:
        over = max(0.0, max(self.peak, default=0) - limit) if limit is not None else 0.0
        return (over, self.step, max(self.peak, default=0), self.crossing, self.starts)


class _Sums:
    """Prefix sums of a profile's per-unit costs."""

    def __init__(self, profile: Profile) -> None:
        self.f = [0.0, *itertools.accumulate(profile.forward)]
        self.b = [0.0, *itertools.accumulate(profile.backward)]
        self.a = [0, *itertools.accumulate(profile.activation_bytes)]
        self.p = [0, *itertools.accumulate(profile.parameter_bytes or ())]
        self.e = [0, *itertools.accumulate(profile.expert_bytes or ())]
        self.i = [0.0, *itertools.accumulate(profile.input_grad or ())]
        self.w = [0.0, *itertools.accumulate(profile.weight_grad or ())]
        self.wb = [0, *itertools.accumulate(profile.weight_grad_bytes or ())]
        self.acc = [0.0, *itertools.accumulate(profile.accumulate or ())]


class _Simulator:
    """Predicted step of splits of a profile, memoised: each split is a
    `StageGraph` whose edges carry the bytes of the values crossing its cuts
    (skip connections included), lowered by one `Lowering` of the schedule."""

    def __init__(
        self,
        profile: Profile,
        lowering: Lowering,
        bandwidth: float,
        latency: float,
        selective: frozenset[int] = frozenset(),
        charges: StageCharges | None = None,
        sharing: tuple[float, float] | None = None,
    ) -> None:
        self.profile = profile
        self.charges = charges
        self.sharing = sharing
        self.placement = lowering.schedule.placement(lowering.num_stages, lowering.num_ranks)
        self.n = lowering.num_stages
        self.lowering = lowering
        self.bandwidth = bandwidth
        self.latency = latency
        self.cache: dict[tuple[int, ...], _Eval] = {}
        # Per stage, the prefix sums of its own profile: the selective
        # recompute one for the stages in `selective`.
        plain = _Sums(profile)
        chosen = _Sums(profile.selective) if selective and profile.selective else plain
        self._sums = [chosen if k in selective else plain for k in range(self.n)]
        self._plain = plain
        self._split = profile.input_grad is not None
        # The stages the schedule gives I / W tasks: the runtime splits them,
        # and runs each of their B tasks as its I and W graphs.
        schedule = lowering.schedule
        tasks = schedule.tasks(self.n, lowering.num_ranks, schedule.num_microbatches)
        self._split_stages = frozenset(
            p.stage for rank in tasks for t in rank for p in t.parts if part_of_backward(p.kind)
        )

    def _spans(self, starts: tuple[int, ...]) -> list[tuple[_Sums, int, int]]:
        bounds = [*starts, len(self.profile.units)]
        return [(self._sums[k], s, e) for k, (s, e) in enumerate(itertools.pairwise(bounds))]

    def stages(self, starts: tuple[int, ...]) -> list[tuple[float, float, int]]:
        """Per stage: forward, backward, activation bytes."""
        return [
            (p.f[e] - p.f[s], p.b[e] - p.b[s], p.a[e] - p.a[s]) for p, s, e in self._spans(starts)
        ]

    def split_backward(self, starts: tuple[int, ...]) -> tuple[list[float], list[float]] | None:
        """Per stage, I and W as measured (None: not measured). The first
        stage reads no input gradient: its I is empty, its W the whole backward."""
        if not self._split:
            return None
        spans = self._spans(starts)
        i = [p.i[e] - p.i[s] for p, s, e in spans]
        w = [p.w[e] - p.w[s] for p, s, e in spans]
        w[0] += i[0]
        i[0] = 0.0
        return i, w

    def accumulated(self, starts: tuple[int, ...]) -> list[float]:
        """Per stage, the seconds to add one microbatch's weight gradients
        into those already there (0 where not measured)."""
        acc = self._plain.acc  # the same under selective recompute
        if len(acc) == 1:
            return [0.0] * self.n
        return [acc[e] - acc[s] for _, s, e in self._spans(starts)]

    def weight_grad_bytes(self, starts: tuple[int, ...]) -> list[int] | None:
        """Per stage, the bytes it holds from its I to its W as measured
        (None: not measured). The first stage's I computes nothing: it
        holds all its forward kept until its W."""
        spans = self._spans(starts)
        if any(len(p.wb) == 1 for p, _, _ in spans):
            return None
        held = [p.wb[e] - p.wb[s] for p, s, e in spans]
        held[0] = self.stages(starts)[0][2]
        return held

    def parameters(self, starts: tuple[int, ...]) -> list[tuple[int, int]]:
        """Per stage, the bytes of its parameters and, of those, its experts'."""
        bounds = [*starts, len(self.profile.units)]
        p, x = self._plain.p, self._plain.e

        def span(values: list[int], s: int, e: int) -> int:
            return values[e] - values[s] if len(values) > 1 else 0

        return [(span(p, s, e), span(x, s, e)) for s, e in itertools.pairwise(bounds)]

    def held(self, starts: tuple[int, ...]) -> list[int]:
        """Per rank, what its stages' state holds besides activations
        (parameters, gradients, optimizer states, as `charges` says)."""
        out = [0] * self.lowering.num_ranks
        if self.charges is not None and self.charges.counted:
            for s, (nbytes, experts) in enumerate(self.parameters(starts)):
                out[self.placement[s]] += self.charges.held(nbytes, experts)
        return out

    def sent(self, starts: tuple[int, ...]) -> list[int]:
        """Per stage, the bytes of the values it sends to another rank: the
        runtime holds them from its F until its backward (as the autograd
        graph's outputs, or until the peer's reply proves them delivered).
        A value read only on its own rank is not counted again: the reader's
        profile counts it where it saves it."""
        stage_of = [bisect.bisect_right(starts, u) - 1 for u in range(len(self.profile.units))]
        rank = self.placement
        out = [0] * self.n
        for t in self.profile.transfers:
            src = stage_of[t.src]
            if any(rank[stage_of[d]] != rank[src] for d in t.dst):
                out[src] += t.bytes
        return out

    def costs(self, starts: tuple[int, ...], shared: bool = False) -> Costs:
        """The split's costs; `shared`: with the cores the ranks share
        (`sharing`: the simulator then charges each task by the ranks
        computing beside it, a few simulations per prediction)."""
        stages = self.stages(starts)
        sent = self.sent(starts)
        split = self.split_backward(starts)
        data: dict[str, Any] = {}
        if self.charges is not None:
            params = self.parameters(starts)
            data["reduce_grads"] = [self.charges.reduce(p, x) for p, x in params]
            if self.charges.fsdp:
                data["unshard"] = [self.charges.gather(p, x) for p, x in params]
        # A step's microbatches after its first add their weight gradients
        # into those already there: on average (m - 1) / m of an addition
        # per backward (B, or W where it is split).
        m = self.lowering.schedule.num_microbatches
        acc = [(m - 1) / m * a for a in self.accumulated(starts)]
        backward = [b for _, b, _ in stages]
        if split:
            # A split stage's B is its I then its W (DualPipeV's B and
            # fused tasks): measured 1.00-1.16x I + W, where the autograd
            # backward profiled is 0.95x.
            backward = [
                split[0][k] + split[1][k] if k in self._split_stages else b
                for k, b in enumerate(backward)
            ]
        return Costs(
            **data,
            forward=[f for f, _, _ in stages],
            backward=[b + a for b, a in zip(backward, acc, strict=True)],
            input_grad=split[0] if split else None,
            weight_grad=[w + a for w, a in zip(split[1], acc, strict=True)] if split else None,
            activation_bytes=[a + out for (_, _, a), out in zip(stages, sent, strict=True)],
            weight_grad_bytes=self.weight_grad_bytes(starts),
            unit="s",
            bandwidth=self.bandwidth,
            latency=self.latency,
            shared_cores=self.sharing[0] if shared and self.sharing else 0.0,
            demand_per_rank=self.sharing[1] if shared and self.sharing else 1.0,
        )

    def graph(self, starts: tuple[int, ...]) -> tuple[StageGraph, int]:
        """The split's stage graph, and the bytes crossing its cuts per microbatch."""
        stage_of = [bisect.bisect_right(starts, u) - 1 for u in range(len(self.profile.units))]
        edges = []
        crossing = 0
        for value, t in enumerate(self.profile.transfers):
            src = stage_of[t.src]
            for dst in sorted({stage_of[d] for d in t.dst} - {src}):
                edges.append(Edge(value, src, dst, t.bytes, t.requires_grad))
                crossing += t.bytes
        tied = []
        for units, nbytes in self.profile.tied:
            stages = tuple(sorted({stage_of[u] for u in units}))
            if len(stages) > 1:
                tied.append((stages, nbytes))
        return StageGraph(self.n, tuple(edges), tuple(tied)), crossing

    def evaluate(self, starts: tuple[int, ...]) -> _Eval:
        """The split's prediction, without the shared cores: the search
        compares splits by it (`shared` predicts the chosen one)."""
        found = self.cache.get(starts)
        if found is None:
            graph, crossing = self.graph(starts)
            costs = self.costs(starts)
            predicted: Prediction = self.lowering.compile(graph, costs).predict(costs)
            found = self._eval(starts, predicted, crossing)
            self.cache[starts] = found
        return found

    def _eval(
        self, starts: tuple[int, ...], predicted: Prediction | Timeline, crossing: int
    ) -> _Eval:
        peak = tuple(
            a + h for a, h in zip(predicted.peak_activation_bytes, self.held(starts), strict=True)
        )
        return _Eval(starts, predicted.step_time, peak, crossing)

    def shared(self, starts: tuple[int, ...]) -> tuple[_Eval, Timeline]:
        """The split's prediction and timeline with the shared cores (one
        simulation: with them it takes several rounds)."""
        graph, crossing = self.graph(starts)
        timeline = self.timeline(starts, graph)
        return self._eval(starts, timeline, crossing), timeline

    def timeline(self, starts: tuple[int, ...], graph: StageGraph | None = None) -> Timeline:
        costs = self.costs(starts, shared=True)
        graph = graph if graph is not None else self.graph(starts)[0]
        return self.lowering.compile(graph, costs).simulate(costs)


def _even_starts(num_units: int, num_stages: int) -> tuple[int, ...]:
    """Equal numbers of units per stage; the first `num_units % num_stages` get one more."""
    q, r = divmod(num_units, num_stages)
    return tuple(s * q + min(s, r) for s in range(num_stages))


def _min_max_starts(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """The contiguous partition whose largest stage sum is smallest (the bottleneck)."""
    n = len(weights)
    prefix = [0.0, *itertools.accumulate(weights)]
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, num_stages + 1):
        for i in range(j, n - (num_stages - j) + 1):
            for k in range(j - 1, i):
                v = max(best[j - 1][k], prefix[i] - prefix[k])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, k
    starts = []
    i = n
    for j in range(num_stages, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return tuple(reversed(starts))


def _local_search(
    sim: _Simulator, seeds: Sequence[tuple[int, ...]], num_units: int, limit: float | None
) -> None:
    """Steepest descent from each seed, moving one cut by 1, 2, 4, ... units."""
    n = sim.n
    reach = max(1, num_units // n)
    for seed in seeds:
        current = sim.evaluate(seed)
        while True:
            moves = []
            for i in range(1, n):
                lo = current.starts[i - 1] + 1
                hi = (current.starts[i + 1] if i + 1 < n else num_units) - 1
                d = 1
                while d <= reach:
                    for v in (current.starts[i] - d, current.starts[i] + d):
                        if lo <= v <= hi:
                            moves.append((*current.starts[:i], v, *current.starts[i + 1 :]))
                    d *= 2
            if not moves:
                break
            candidate = min((sim.evaluate(m) for m in moves), key=lambda e: e.key(limit))
            if candidate.key(limit) >= current.key(limit):
                break
            current = candidate


def check_num_stages(num_stages: Any) -> int:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool):
        raise TypeError(
            f"mpmd.balance: num_stages must be an int, got {num_stages!r} "
            f"({type(num_stages).__name__})"
        )
    if num_stages < 1:
        raise ValueError(f"mpmd.balance: num_stages must be at least 1, got {num_stages}")
    return num_stages


def resolve_schedule(
    schedule: Any,
    num_stages: int,
    num_ranks: Any,
    collectives: StageCollectives | None = None,
) -> tuple[Schedule, Lowering]:
    """The schedule (default 1F1B over 2 x num_stages microbatches) and number of
    ranks (default num_stages over the schedule's own stages per rank),
    checked by lowering it once for a chain of stages."""
    if schedule is None:
        schedule = OneFOneB(2 * num_stages)
    elif isinstance(schedule, type) and issubclass(schedule, Schedule):
        raise TypeError(
            f"mpmd.balance: schedule is the class {schedule.__name__}; pass an instance with "
            f"its number of microbatches, e.g. schedule={schedule.__name__}({2 * num_stages})"
        )
    elif not isinstance(schedule, Schedule):
        raise TypeError(
            f"mpmd.balance: schedule must be an mpmd.Schedule such as "
            f"mpmd.schedules.OneFOneB(8), got {type(schedule).__name__}"
        )
    if num_ranks is not None and (
        not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1
    ):
        raise ValueError(f"mpmd.balance: num_ranks must be a positive int, got {num_ranks!r}")
    per_rank = schedule.stages_per_rank
    if num_ranks is not None:
        tries = [num_ranks]
    elif num_stages % per_rank == 0:
        tries = [num_stages // per_rank]
    else:
        tries = [num_stages]
    errors: list[ValueError] = []
    for ranks in tries:
        try:
            lowering = Lowering(schedule, num_stages, ranks, collectives=collectives)
            lowering.compile(num_stages)
            return schedule, lowering
        except ValueError as err:
            errors.append(err)
    which = " or ".join(str(r) for r in tries)
    raise ValueError(
        f"mpmd.balance: {schedule!r} cannot run {num_stages} stages on {which} ranks: "
        f"{errors[0]}; pass num_ranks=... or a num_stages and schedule that fit "
        "(OneFOneB: a multiple of num_ranks stages; ZBV and DualPipeV: 2 x num_ranks)"
    ) from errors[0]


def check_limits(memory_limit: Any, bandwidth: Any, latency: Any) -> None:
    if memory_limit is not None and (
        not isinstance(memory_limit, (int, float))
        or isinstance(memory_limit, bool)
        or not memory_limit > 0
    ):
        raise ValueError(
            f"mpmd.balance: memory_limit is bytes per rank and must be positive, got "
            f"{memory_limit!r}"
        )
    for name, value in (("bandwidth", bandwidth), ("latency", latency)):
        if not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"mpmd.balance: {name} must be a non-negative number, got {value!r}")


def search(
    profile: Profile,
    num_stages: int,
    *,
    schedule: Schedule | None = None,
    num_ranks: int | None = None,
    memory_limit: float | None = None,
    bandwidth: float = 0.0,
    latency: float = 0.0,
    selective: Collection[int] = (),
    charges: StageCharges | None = None,
    sharing: tuple[float, float] | None = None,
) -> Balance:
    """The split of `profile`'s units into `num_stages` stages with the shortest
    simulated step under `schedule` on `num_ranks` ranks.

    Every split when there are at most `EXHAUSTIVE_LIMIT`; otherwise a local
    search from the even split and the min-max partition of forward +
    backward time, which never returns a split slower than the even one. With
    `memory_limit` (bytes per rank), only splits whose simulated peak
    activation bytes stay within it on every rank. `bandwidth` (bytes per
    second, 0: free) and `latency` (seconds per message) price transfers.
    The stages in `selective` are priced under selective recompute
    (`profile.selective`'s costs). With `charges` (a data- or
    tensor-parallel layout's, `layouts.StageCharges`), each stage's gradient
    reduction (and FSDP gather) is simulated beside the schedule, and the
    peaks (and `memory_limit`) count each rank's parameters, gradients and
    optimizer states on top of its activations. With `sharing` (the cores
    the ranks compute on, the cores one pipeline rank's compute takes: CPU
    ranks outnumbering cores), the chosen split (and the even one) is
    predicted with each task charged by the ranks computing beside it
    (`Costs.shared_cores`).
    """
    num_stages = check_num_stages(num_stages)
    collectives = (
        StageCollectives(unshard=charges.fsdp, reduce_grads=True) if charges is not None else None
    )
    schedule, lowering = resolve_schedule(schedule, num_stages, num_ranks, collectives)
    check_limits(memory_limit, bandwidth, latency)
    units = len(profile.units)
    if num_stages > units:
        raise ValueError(
            f"mpmd.balance: num_stages={num_stages} but the model has {units} unit(s) a stage "
            f"can start at ({', '.join(repr(u) for u in profile.units)}); a stage holds at least "
            f"one: use num_stages <= {units}, or cut inside a unit by hand with "
            "mpmd.trace(..., split_before=[...]) or mpmd.mark_stage_end"
        )
    chosen = _selective(profile, selective, num_stages)
    sim = _Simulator(profile, lowering, float(bandwidth), float(latency), chosen, charges, sharing)
    limit = float(memory_limit) if memory_limit is not None else None
    even = _even_starts(units, num_stages)
    if math.comb(units - 1, num_stages - 1) <= EXHAUSTIVE_LIMIT:
        method = "exhaustive"
        for cuts in itertools.combinations(range(1, units), num_stages - 1):
            sim.evaluate((0, *cuts))
    else:
        method = "local search"
        work = [f + b for f, b in zip(profile.forward, profile.backward, strict=True)]
        seeds = [even, _min_max_starts(work, num_stages)]
        if limit is not None:
            seeds.append(_min_max_starts([float(a) for a in profile.activation_bytes], num_stages))
        _local_search(sim, seeds, units, limit)
    best = min(sim.cache.values(), key=lambda e: e.key(limit))
    if limit is not None and max(best.peak) > limit:
        rank = best.peak.index(max(best.peak))
        smallest = "smallest" if method == "exhaustive" else "smallest found"
        what = "activation memory" if charges is None else "memory (activations and state)"
        raise ValueError(
            f"mpmd.balance: no split into {num_stages} stages keeps the simulated peak "
            f"{what} of every rank within memory_limit={human_bytes(limit)}; the "
            f"{smallest} peak is {human_bytes(max(best.peak))} ({max(best.peak)} bytes, rank "
            f"{rank}, split_before={_names(profile, best.starts)}); raise memory_limit, use "
            "more stages or ranks, fewer microbatches in flight (OneFOneB rather than GPipe), "
            "or recompute (PipelineRunner(recompute=...))"
        )
    if sharing is not None:
        best, timeline = sim.shared(best.starts)
        even_eval = sim.shared(even)[0]
    else:
        timeline = sim.timeline(best.starts)
        even_eval = sim.evaluate(even)
    bounds = itertools.pairwise([*best.starts, units])
    stage_costs = tuple(
        StageCost(units=profile.units[s:e], forward=f, backward=b, activation_bytes=a)
        for (s, e), (f, b, a) in zip(bounds, sim.stages(best.starts), strict=True)
    )
    return Balance(
        split_before=_names(profile, best.starts),
        predicted_step=best.step,
        stage_costs=stage_costs,
        peak_activation_bytes=list(best.peak),
        even_split_before=_names(profile, even),
        even_step=even_eval.step,
        schedule=schedule,
        num_ranks=lowering.num_ranks,
        method=method,
        splits_simulated=len(sim.cache),
        profile=profile,
        timeline=timeline,
    )


def _names(profile: Profile, starts: tuple[int, ...]) -> list[str]:
    return [profile.units[s] for s in starts[1:]]


def simulate(
    profile: Profile,
    split_before: Sequence[str],
    *,
    schedule: Schedule | None = None,
    num_ranks: int | None = None,
    bandwidth: float = 0.0,
    latency: float = 0.0,
    selective: Collection[int] = (),
    charges: StageCharges | None = None,
    sharing: tuple[float, float] | None = None,
) -> Timeline:
    """The simulated step of one split of `profile` (units named as in
    `split_before`), priced as `search` prices its chosen split (the stages
    in `selective` under selective recompute)."""
    if isinstance(split_before, str):
        raise TypeError(f"mpmd.balance: split_before must be a list, write [{split_before!r}]")
    unknown = [u for u in split_before if u not in profile.units[1:]]
    if unknown:
        raise ValueError(
            f"mpmd.balance: {unknown[0]!r} is not a unit a stage can start at; the profile's "
            f"units are {', '.join(profile.units[1:])}"
        )
    starts = (0, *(profile.units.index(u) for u in split_before))
    if list(starts) != sorted(set(starts)):
        raise ValueError(
            f"mpmd.balance: split_before={list(split_before)} must name units once each, "
            "in the model's order"
        )
    num_stages = len(starts)
    collectives = (
        StageCollectives(unshard=charges.fsdp, reduce_grads=True) if charges is not None else None
    )
    _, lowering = resolve_schedule(schedule, num_stages, num_ranks, collectives)
    chosen = _selective(profile, selective, num_stages)
    sim = _Simulator(profile, lowering, float(bandwidth), float(latency), chosen, charges, sharing)
    return sim.timeline(starts)


def _selective(profile: Profile, selective: Collection[int], num_stages: int) -> frozenset[int]:
    chosen = frozenset(selective)
    if chosen and profile.selective is None:
        raise ValueError(
            f"mpmd.balance: selective={sorted(chosen)} but the profile has no selective "
            "recompute costs; profile with selective=True"
        )
    if any(not 0 <= k < num_stages for k in chosen):
        raise ValueError(
            f"mpmd.balance: selective={sorted(chosen)} names stages outside 0..{num_stages - 1}"
        )
    return chosen
