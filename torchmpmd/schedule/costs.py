"""`Costs`: what the simulator charges for tasks and messages."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import _C
from .timeline import COLLECTIVES, Timeline, TimelineEvent

__all__ = ["Costs"]

PerStage = float | Sequence[float]


def _per_stage(value: PerStage | None, n: int, name: str) -> list[float] | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"Costs.{name} gives {len(values)} values for {n} stages")
    return values


@dataclass(kw_only=True)
class Costs:
    """Per-stage task times and a link model, in any one time unit.

    Unset backward pieces are derived: B = 2 F, I = W = B / 2 (so I + W = B).
    `bandwidth` is bytes per time unit (0: free); `latency` per message.
    Activation bytes default to an estimate from the pipe's traced graph.

    Data parallelism, for programs compiled with `collectives`
    (`StageCollectives`): `unshard` is the time a stage's gather blocks its
    rank, `reduce_grads` the time its gradient reduction takes on the rank's
    collective channel (beside the compute, one at a time; blocking without
    `overlap_comm`), and `unsharded_bytes` what an unsharded stage holds from
    its gather to its reduction (counted in the timeline's `peak_bytes`, not
    in its activation peak). Unset: free.
    """

    forward: PerStage = 1.0
    backward: PerStage | None = None
    input_grad: PerStage | None = None
    weight_grad: PerStage | None = None
    activation_bytes: Sequence[int] | None = None
    weight_grad_bytes: Sequence[int] | None = None
    unshard: PerStage | None = None
    reduce_grads: PerStage | None = None
    unsharded_bytes: int | Sequence[int] | None = None
    latency: float = 0.0
    bandwidth: float = 0.0
    unit: str = "units"
    overlap_comm: bool = True

    def native(
        self, num_stages: int, activation_bytes: Sequence[int] | None = None
    ) -> _C.schedule.Costs:
        n = num_stages
        f = _per_stage(self.forward, n, "forward") or []
        b = _per_stage(self.backward, n, "backward") or [2 * x for x in f]
        i = _per_stage(self.input_grad, n, "input_grad")
        w = _per_stage(self.weight_grad, n, "weight_grad")
        if i is None and w is None:
            i = [x / 2 for x in b]
            w = [x / 2 for x in b]
        elif i is None:
            i = [bb - ww for bb, ww in zip(b, w or [], strict=True)]
        elif w is None:
            w = [bb - ii for bb, ii in zip(b, i, strict=True)]
        acts = list(self.activation_bytes or activation_bytes or [1] * n)
        wbytes = list(self.weight_grad_bytes or [a // 2 for a in acts])
        if len(acts) != n or len(wbytes) != n:
            raise ValueError(f"Costs: activation byte counts must give one value per stage ({n})")
        c = _C.schedule.Costs()
        c.forward, c.backward, c.input_grad, c.weight_grad = f, b, i, w or []
        c.activation_bytes = [int(a) for a in acts]
        c.weight_grad_bytes = [int(x) for x in wbytes]
        c.unshard = _per_stage(self.unshard, n, "unshard") or []
        c.reduce_grads = _per_stage(self.reduce_grads, n, "reduce_grads") or []
        held = _per_stage(self.unsharded_bytes, n, "unsharded_bytes") or []
        c.unsharded_bytes = [int(b) for b in held]
        c.latency = float(self.latency)
        c.bytes_per_unit = float(self.bandwidth)
        c.overlap_comm = self.overlap_comm
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
        """
        sums: dict[tuple[int, str], list[float]] = defaultdict(list)
        kept: dict[tuple[int, str], list[int]] = defaultdict(list)
        for e in timeline.events:
            if e.kind in COLLECTIVES:
                sums[(e.stage, e.kind)].append(e.duration)
        for e in timeline.tasks:
            sums[(e.stage, e.kind)].append(e.duration)
            if e.kept_bytes >= 0 and e.kind in ("B", "I", "W"):
                kept[(e.stage, "W" if e.kind == "W" else "BI")].append(e.kept_bytes)
        mean = {k: sum(v) / len(v) for k, v in sums.items()}
        memory = _kept_bytes(kept, num_stages)
        if memory is not None:
            link = {"activation_bytes": memory[0], "weight_grad_bytes": memory[1], **link}
        f, b, i, w = [], [], [], []
        for s in range(num_stages):
            if (s, "F") not in mean:
                raise ValueError(f"Costs.from_timeline: no forward of stage {s} was measured")
            bs, is_, ws = mean.get((s, "B")), mean.get((s, "I")), mean.get((s, "W"))
            if bs is None:
                bs = (is_ or 0.0) + (ws or 0.0)
            if is_ is None and ws is None:
                is_ = ws = bs / 2
            f.append(mean[(s, "F")])
            b.append(bs)
            i.append(is_ if is_ is not None else bs - (ws or 0.0))
            w.append(ws if ws is not None else bs - (is_ or 0.0))
        for kind in COLLECTIVES:
            if kind not in link and any(k == kind for _, k in mean):
                link[kind] = [mean.get((s, kind), 0.0) for s in range(num_stages)]
        return Costs(forward=f, backward=b, input_grad=i, weight_grad=w, unit=timeline.unit, **link)


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
            events.append(
                TimelineEvent(
                    e.rank, e.task.kind.name, e.task.stage, e.task.microbatch, e.start, e.end
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
