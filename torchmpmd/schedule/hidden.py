"""How much of the communication inside fused tasks ran under compute
(`Timeline.hidden_communication`): a fused task whose two sides ran at once
(`RunnerOptions.overlap`) records each part's span and lane; an exchange
inside a part (expert parallelism's dispatch and combine) is hidden for the
time the other lane computed (its parts' spans less their own exchanges)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Span = tuple[float, float]


def _minus(span: Span, holes: Iterable[Span]) -> list[Span]:
    """`span` less the intervals `holes`, as disjoint intervals."""
    out: list[Span] = []
    start, end = span
    for a, b in sorted(holes):
        if b <= start or a >= end:
            continue
        if a > start:
            out.append((start, a))
        start = max(start, b)
    if start < end:
        out.append((start, end))
    return out


def _overlap(span: Span, regions: Iterable[Span]) -> float:
    return sum(max(0.0, min(span[1], b) - max(span[0], a)) for a, b in regions)


def hidden_communication(events: Sequence[Any], exchanges: Sequence[str]) -> tuple[float, float]:
    """`events`: TimelineEvents. (seconds of the exchanges inside fused tasks that ran while the task's
    other lane computed, all their seconds), summed over every rank."""
    by_lane = hidden_by_lane(events, exchanges)
    return sum(h for h, _, _ in by_lane.values()), sum(t for _, t, _ in by_lane.values())


def hidden_by_lane(
    events: Sequence[Any], exchanges: Sequence[str]
) -> dict[int, tuple[float, float, float]]:
    """`hidden_communication` per lane (side) of the exchanges: (seconds under
    the other lane's compute, all their seconds, seconds while the other
    lane exchanged too), summed over every rank."""
    out: dict[int, list[float]] = {}
    by_rank: dict[int, list[Any]] = {}
    for e in events:
        if e.kind in exchanges:
            by_rank.setdefault(e.rank, []).append(e)
    for task in events:
        if not task.part_spans:
            continue
        mine = by_rank.get(task.rank, [])
        inside: list[list[Span]] = []
        for part, (a, b, _lane) in zip(task.sub_tasks, task.part_spans, strict=True):
            inside.append(
                [
                    (x.start, x.end)
                    for x in mine
                    if (x.stage, x.microbatch) == (part.stage, part.microbatch)
                    and a <= x.start
                    and x.end <= b
                ]
            )
        for k, (_a, _b, lane) in enumerate(task.part_spans):
            others = [j for j, (_, _, other) in enumerate(task.part_spans) if other != lane]
            computing = [
                region for j in others for region in _minus(task.part_spans[j][:2], inside[j])
            ]
            exchanging = [region for j in others for region in inside[j]]
            sums = out.setdefault(lane, [0.0, 0.0, 0.0])
            for x in inside[k]:
                sums[0] += _overlap(x, computing)
                sums[1] += x[1] - x[0]
                sums[2] += _overlap(x, exchanging)
    return {lane: (h, t, both) for lane, (h, t, both) in sorted(out.items())}
