"""`Costs`: what the simulator charges for tasks and messages.

Task times are kept per task kind, as the native task-kind table lists the
kinds (csrc/schedule/task_kinds.cpp): a kind the table charges as another
(R as F) takes that kind's time, and a time not given is derived as the
table says, so a new kind needs nothing here."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _C
from .kinds import TABLE, WHOLE_BACKWARD
from .task import Task, task_from_native
from .timeline import COLLECTIVES, EXCHANGES, Timeline, TimelineEvent

__all__ = ["Costs", "fused_key"]

PerStage = float | Sequence[float]

# The kinds with a time of their own, in the table's order; the named fields
# of `Costs` and the kinds they give.
_OWN = [letter for letter, k in TABLE.items() if k.charged_as == letter]
_FIELDS = {"F": "forward", "B": "backward", "I": "input_grad", "W": "weight_grad"}
# The kinds computing a part of the backward (I, W) by their part, and the
# one computing the whole (B).
_PARTS = {TABLE[x].backward_parts: x for x in _OWN if 0 < TABLE[x].backward_parts < WHOLE_BACKWARD}
_WHOLE = next((x for x in _OWN if TABLE[x].backward_parts == WHOLE_BACKWARD), None)


def _per_stage(value: PerStage | None, n: int, name: str) -> list[float] | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"Costs.{name} gives {len(values)} values for {n} stages")
    return values


def _derive(given: Mapping[str, float | None], stage: int) -> dict[str, float]:
    """One stage's time for each kind of its own: as given, else as the
    table derives it. A kind computing the whole backward (B) is the sum of
    given kinds that make it up (I + W); one computing a part is the whole
    minus the given other part; otherwise the kind's table default (B = 2 F,
    I = W = B / 2)."""
    out: dict[str, float] = {}
    for letter in _OWN:
        kind = TABLE[letter]
        value = given.get(letter)
        if value is None and letter == _WHOLE and _PARTS:
            pieces = [given.get(p) for p in _PARTS.values()]
            if None not in pieces:
                value = sum(p for p in pieces if p is not None)
        other = _PARTS.get(WHOLE_BACKWARD ^ kind.backward_parts)
        other_time = given.get(other) if other is not None else None
        if value is None and _WHOLE in out and other_time is not None:
            value = out[_WHOLE] - other_time
        if value is None:
            if not kind.default_cost:
                raise ValueError(
                    f"Costs: no {kind.name} ({letter}) time for stage {stage}; give one"
                )
            value = sum(factor * out[term] for term, factor in kind.default_cost)
        out[letter] = value
    return out


@dataclass(kw_only=True)
class Costs:
    """Per-stage task times and a link model, in any one time unit.

    `forward`, `backward`, `input_grad` and `weight_grad` give the times of
    F, B, I and W; `times` those of any task kind by its letter (a kind
    added to the task-kind table: `times={"A": [...]}`). Unset times are
    derived: B = 2 F (or I + W when both are given), I = W = B / 2 (or B
    minus the other), a new kind as its table row says.
    `fused` gives measured times of fused tasks (`Task.fused`) by their
    parts' stages and kinds, e.g. `{"0F;3B": 2.5}` for a forward of stage 0
    fused with a backward of stage 3, whatever their microbatches; a fused
    task without one takes the sum of its parts' times.
    `bandwidth` is bytes per time unit (0: free); `latency` per message.
    Activation bytes default to an estimate from the pipe's traced graph.

    Data parallelism, for programs compiled with `collectives`
    (`StageCollectives`): `unshard` is the time a stage's gather blocks its
    rank, `reduce_grads` the time its gradient reduction takes on the rank's
    collective channel (beside the compute, one at a time; blocking without
    `overlap_comm`), and `unsharded_bytes` what an unsharded stage holds from
    its gather to its reduction (counted in the timeline's `peak_bytes`, not
    in its activation peak). Unset: free.

    Expert parallelism: `exchange` is the time a stage's all-to-alls
    (dispatch and combine) take per microbatch inside its forward, and
    `exchange_backward` inside its backward (B, or I; default: the same).
    The task times above exclude them; the simulator charges them inside
    the tasks (the task waits for them) and shows them in the simulated
    timeline ("dispatch", "combine"). From a measured step, `from_timeline`
    separates them; from bytes, `exchange_time`. With `overlap_sides` (as
    `RunnerOptions.overlap` runs them), a fused task of a forward beside a
    backward (DualPipeV's F&B) runs its two sides at once: it takes the
    longer of its parts' compute (exchanges left out) and each side's time,
    so that one side's exchanges hide under the other's compute; where the
    ranks share cores (below) its sides are charged one after the other
    instead: every core is busy while as many ranks compute, so what a rank
    waits on an exchange is another's compute and hiding it gains nothing.

    Ranks sharing CPU cores (more CPU ranks than cores on a host):
    `shared_cores` is the cores the ranks compute on (0: each rank has a
    device of its own) and `demand_per_rank` the cores one rank's compute
    takes (its threads times the ranks it stands for, e.g. its data-parallel
    replicas). The task times are then taken as measured with every rank at
    work, and the simulator charges each task by the ranks computing beside
    it: where fewer compute (a pipeline's bubbles) the cores are shared
    among fewer and each runs faster, by max(1, computing x demand / cores)
    relative to that of every rank.
    """

    forward: PerStage = 1.0
    backward: PerStage | None = None
    input_grad: PerStage | None = None
    weight_grad: PerStage | None = None
    times: Mapping[str, PerStage] | None = None
    fused: Mapping[str, float] | None = None
    activation_bytes: Sequence[int] | None = None
    weight_grad_bytes: Sequence[int] | None = None
    unshard: PerStage | None = None
    reduce_grads: PerStage | None = None
    unsharded_bytes: int | Sequence[int] | None = None
    exchange: PerStage | None = None
    exchange_backward: PerStage | None = None
    latency: float = 0.0
    bandwidth: float = 0.0
    unit: str = "units"
    overlap_comm: bool = True
    overlap_sides: bool = True
    shared_cores: float = 0.0
    demand_per_rank: float = 1.0

    @staticmethod
    def exchange_time(sent_bytes: float, calls: int, latency: float, bandwidth: float) -> float:
        """The time of `calls` all-to-alls sending `sent_bytes` in all over a
        link of `latency` per message and `bandwidth` bytes per time unit
        (the routed tokens' bytes: `StepOutput.metrics["all_to_all_sent_bytes"]`)."""
        return calls * latency + (sent_bytes / bandwidth if bandwidth > 0 else 0.0)

    def exchanges(self, n: int) -> tuple[list[float], list[float]] | None:
        """Per stage, the forward and the backward exchange times (None: none)."""
        forward = _per_stage(self.exchange, n, "exchange")
        if forward is None:
            return None
        backward = _per_stage(self.exchange_backward, n, "exchange_backward") or forward
        return forward, backward

    def _given(self, n: int) -> dict[str, list[float] | None]:
        """Per kind of its own, the per-stage times given (None: derive)."""
        given: dict[str, list[float] | None] = {
            letter: _per_stage(getattr(self, name), n, name) for letter, name in _FIELDS.items()
        }
        for letter, value in (self.times or {}).items():
            if letter not in TABLE:
                raise ValueError(
                    f"Costs.times: {letter!r} is not a task kind; use one of {', '.join(TABLE)}"
                )
            if TABLE[letter].charged_as != letter:
                raise ValueError(
                    f"Costs.times: {TABLE[letter].name} ({letter}) takes the time of "
                    f"{TABLE[letter].charged_as}; give that one"
                )
            if given.get(letter) is not None:
                raise ValueError(
                    f"Costs: the {TABLE[letter].name} time is given twice, as "
                    f"{_FIELDS[letter]} and as times[{letter!r}]"
                )
            given[letter] = _per_stage(value, n, f"times[{letter!r}]")
        return given

    def native(
        self, num_stages: int, activation_bytes: Sequence[int] | None = None
    ) -> _C.schedule.Costs:
        n = num_stages
        given = self._given(n)
        per_stage = [
            _derive({k: (v[s] if v is not None else None) for k, v in given.items()}, s)
            for s in range(n)
        ]
        acts = list(self.activation_bytes or activation_bytes or [1] * n)
        wbytes = list(self.weight_grad_bytes or [a // 2 for a in acts])
        if len(acts) != n or len(wbytes) != n:
            raise ValueError(f"Costs: activation byte counts must give one value per stage ({n})")
        exchanges = self.exchanges(n)
        # Per kind, the exchanges inside its tasks: F its forward's, B and I
        # (whose backward goes through the all-to-alls) the backward's.
        comm: dict[str, list[float]] = {}
        if exchanges is not None:
            comm["F"] = exchanges[0]
            for letter in _OWN:
                if TABLE[letter].emits_input_grads or letter == _WHOLE:
                    comm[letter] = exchanges[1]
            for s, stage in enumerate(per_stage):
                for letter, spent in comm.items():
                    stage[letter] += spent[s]
        c = _C.schedule.Costs()
        c.time = [
            [stage[letter] for stage in per_stage] if letter in _OWN else [] for letter in TABLE
        ]
        c.fused_time = {str(k): float(v) for k, v in (self.fused or {}).items()}
        c.activation_bytes = [int(a) for a in acts]
        c.weight_grad_bytes = [int(x) for x in wbytes]
        c.unshard = _per_stage(self.unshard, n, "unshard") or []
        c.reduce_grads = _per_stage(self.reduce_grads, n, "reduce_grads") or []
        held = _per_stage(self.unsharded_bytes, n, "unsharded_bytes") or []
        c.unsharded_bytes = [int(b) for b in held]
        c.latency = float(self.latency)
        c.bytes_per_unit = float(self.bandwidth)
        c.overlap_comm = self.overlap_comm
        c.comm = [list(comm[letter]) if letter in comm else [] for letter in TABLE] if comm else []
        c.overlap_sides = self.overlap_sides
        c.shared_cores = float(self.shared_cores)
        c.demand_per_rank = float(self.demand_per_rank)
        return c

    @staticmethod
    def from_timeline(timeline: Timeline, num_stages: int, **link: Any) -> Costs:
        """Mean measured time of each task kind per stage (a profile of real steps).

        Kinds a schedule did not run are derived from the others (B = I + W,
        I = W = B / 2); a stage with no measurement at all is an error.
        A timeline measured with `measure_memory=True` also gives the bytes a
        microbatch keeps per stage: what its forward held when its backward
        (B or I) started, and what I left for W. A data-parallel runner's
        unshard and reduce_grads events give those costs (their time on the
        rank: a reduction launched beside the compute counts its launch).
        Fused tasks give `fused`, the mean time of each shape of them (their
        parts' stages and kinds), not the times of their parts' kinds.
        Expert parallelism's exchanges inside the tasks ("dispatch",
        "combine" events) give `exchange` and `exchange_backward`, and are
        left out of the tasks' own times.
        """
        sums: dict[tuple[int, str], list[float]] = defaultdict(list)
        kept: dict[tuple[int, str], list[int]] = defaultdict(list)
        fused: dict[str, list[float]] = defaultdict(list)
        for e in timeline.events:
            if e.kind in COLLECTIVES:
                sums[(e.stage, e.kind)].append(e.duration)
        exchanged = _exchanges_inside(timeline)
        for e in timeline.tasks:
            if e.sub_tasks:
                fused[fused_key(e.sub_tasks)].append(e.duration)
                continue
            # Exchanges come out of the kinds `native` charges them in (F, B,
            # I); a first stage's whole backward in W keeps its own in W.
            charged = e.kind == "F" or TABLE[e.kind].emits_input_grads
            sums[(e.stage, e.kind)].append(
                e.duration - (exchanged.get(id(e), 0.0) if charged else 0.0)
            )
            info = TABLE[e.kind]
            if e.kept_bytes >= 0 and info.backward:
                whole = info.backward_parts == WHOLE_BACKWARD
                # B and I start from what the forward kept; W from what I left.
                reads_forward = whole or info.emits_input_grads
                kept[(e.stage, "BI" if reads_forward else "W")].append(e.kept_bytes)
        mean = {k: sum(v) / len(v) for k, v in sums.items()}
        memory = _kept_bytes(kept, num_stages)
        if memory is not None:
            link = {"activation_bytes": memory[0], "weight_grad_bytes": memory[1], **link}
        rows: dict[str, list[float]] = {letter: [] for letter in _OWN}
        for s in range(num_stages):
            if (s, "F") not in mean:
                inside = any(f"{s}F" in key.split(";") for key in fused)
                raise ValueError(
                    f"Costs.from_timeline: no forward of stage {s} was measured"
                    + (
                        " on its own (only inside fused tasks, timed as a whole): run a step "
                        "of a schedule without fused tasks to measure it"
                        if inside
                        else ""
                    )
                )
            for letter, value in _derive({x: mean.get((s, x)) for x in _OWN}, s).items():
                rows[letter].append(value)
        for kind in COLLECTIVES:
            if kind not in link and any(k == kind for _, k in mean):
                link[kind] = [mean.get((s, kind), 0.0) for s in range(num_stages)]
        if fused and "fused" not in link:
            link["fused"] = {k: sum(v) / len(v) for k, v in fused.items()}
        if exchanged and "exchange" not in link:
            link.update(_exchange_means(timeline, exchanged, num_stages))
        return Costs(
            forward=rows.pop("F"),
            backward=rows.pop("B"),
            input_grad=rows.pop("I"),
            weight_grad=rows.pop("W"),
            times=rows or None,
            unit=timeline.unit,
            **link,
        )


def _exchanges_inside(timeline: Timeline) -> dict[int, float]:
    """Per task event (by id), the time of the exchanges ("dispatch",
    "combine") of its stage and microbatch that ran inside it on its rank."""
    tasks = [t for t in timeline.tasks if not t.sub_tasks]
    out: dict[int, float] = {}
    for e in timeline.events:
        if e.kind not in EXCHANGES:
            continue
        for t in tasks:
            if (
                t.rank == e.rank
                and (t.stage, t.microbatch) == (e.stage, e.microbatch)
                and t.start <= e.start
                and e.end <= t.end
            ):
                out[id(t)] = out.get(id(t), 0.0) + e.duration
                break
    return out


def _exchange_means(timeline: Timeline, inside: dict[int, float], n: int) -> dict[str, list[float]]:
    """`exchange` and `exchange_backward` per stage: the mean time the
    forwards (F) and the backwards (B, I) spent in exchanges."""
    forward: dict[int, list[float]] = defaultdict(list)
    backward: dict[int, list[float]] = defaultdict(list)
    for t in timeline.tasks:
        if t.sub_tasks:
            continue
        info = TABLE[t.kind]
        spent = inside.get(id(t), 0.0)
        if not info.backward:
            if t.kind == "F":
                forward[t.stage].append(spent)
        elif info.emits_input_grads or info.backward_parts == WHOLE_BACKWARD:
            backward[t.stage].append(spent)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    return {
        "exchange": [mean(forward[s]) for s in range(n)],
        "exchange_backward": [mean(backward[s]) for s in range(n)],
    }


def fused_key(parts: Sequence[Task]) -> str:
    """The key of a fused task's time in `Costs.fused`: its parts' stages
    and kinds, '0F;3B'."""
    return ";".join(f"{p.stage}{p.kind}" for p in parts)


def _kept_bytes(
    kept: dict[tuple[int, str], list[int]], num_stages: int
) -> tuple[list[int], list[int]] | None:
    """Per stage, the mean bytes a microbatch's forward kept for B / I, and
    I for W (0 without split stages); None unless every stage was measured."""
    acts, wbytes = [], []
    for s in range(num_stages):
        a, w = kept.get((s, "BI")), kept.get((s, "W"))
        if not a:
            return None
        acts.append(round(sum(a) / len(a)))
        wbytes.append(round(sum(w) / len(w)) if w else 0)
    return acts, wbytes


def timeline_from_native(native: _C.schedule.Timeline, unit: str) -> Timeline:
    EK = _C.schedule.EventKind
    events = []
    for e in native.events:
        if e.kind == EK.compute:
            task = task_from_native(e.task)
            events.append(
                TimelineEvent(
                    e.rank,
                    task.kind,
                    task.stage,
                    task.microbatch,
                    e.start,
                    e.end,
                    sub_tasks=task.sub_tasks,
                )
            )
        elif e.kind == EK.transfer:
            events.append(TimelineEvent(e.rank, "transfer", -1, -1, e.start, e.end, e.label))
        elif e.kind == EK.collective:
            events.append(TimelineEvent(e.rank, e.label, e.task.stage, -1, e.start, e.end))
        else:
            events.append(
                TimelineEvent(e.rank, "wait", e.task.stage, e.task.microbatch, e.start, e.end)
            )
    return Timeline(
        native.num_ranks,
        events,
        "simulated",
        unit,
        list(native.peak_activation_bytes),
        list(native.peak_bytes),
    )
