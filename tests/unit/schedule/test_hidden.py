"""`Timeline.hidden_communication`: of the exchanges inside fused tasks, the
time that ran while the task's other side computed (its parts' spans less
their own exchanges)."""

from __future__ import annotations

import pytest

import torchmpmd as mpmd
from torchmpmd import Task, TimelineEvent
from torchmpmd.schedule.hidden import hidden_by_lane


def _fused(rank: int, spans: list[tuple[float, float, int]]) -> TimelineEvent:
    f, b = Task("F", 0, 3), Task("B", 3, 1)
    return TimelineEvent(rank, "F", 0, 3, 0.0, 20.0, sub_tasks=(f, b), part_spans=tuple(spans))


def _exchange(rank: int, kind: str, stage: int, mb: int, start: float, end: float):
    return TimelineEvent(rank, kind, stage, mb, start, end, f"ep {kind} layers.0.experts")


def test_exchanges_count_only_while_the_other_side_computes():
    # F (side 1) ran 0-10 with its own exchange 5-6; B (side 0) 0-20 with
    # exchanges 2-4 (under F's compute), 12-14 (F done: not hidden).
    events = [
        _fused(0, [(0.0, 10.0, 1), (0.0, 20.0, 0)]),
        _exchange(0, "dispatch", 0, 3, 5.0, 6.0),
        _exchange(0, "combine", 3, 1, 2.0, 4.0),
        _exchange(0, "dispatch", 3, 1, 12.0, 14.0),
    ]
    hidden, total = mpmd.Timeline(1, events).hidden_communication()
    assert total == pytest.approx(5.0)
    # B's 2-4 under F's compute (2); F's 5-6 under B's compute (1).
    assert hidden == pytest.approx(3.0)


def test_parts_run_one_after_the_other_hide_nothing():
    events = [
        _fused(0, [(0.0, 8.0, 1), (8.0, 20.0, 0)]),
        _exchange(0, "dispatch", 0, 3, 2.0, 3.0),
        _exchange(0, "combine", 3, 1, 10.0, 12.0),
    ]
    assert mpmd.Timeline(1, events).hidden_communication() == pytest.approx((0.0, 3.0))


def test_exchanges_outside_fused_tasks_and_other_ranks_do_not_count():
    events = [
        _fused(0, [(0.0, 10.0, 1), (0.0, 10.0, 0)]),
        _exchange(1, "dispatch", 3, 1, 2.0, 4.0),  # another rank's
        _exchange(0, "dispatch", 2, 0, 2.0, 4.0),  # another task's
        TimelineEvent(0, "F", 2, 0, 30.0, 40.0),
        _exchange(0, "dispatch", 2, 0, 32.0, 34.0),
    ]
    assert mpmd.Timeline(2, events).hidden_communication() == (0.0, 0.0)


def test_per_side_the_time_both_sides_exchanged_is_not_hidden():
    # F (side 1) 0-10, its exchange 4-8; B (side 0) 0-20, its exchange 6-9:
    # F's is under B's compute 4-6 and beside B's exchange 6-8; B's is beside
    # F's exchange 6-8 and under F's compute 8-9.
    events = [
        _fused(0, [(0.0, 10.0, 1), (0.0, 20.0, 0)]),
        _exchange(0, "dispatch", 0, 3, 4.0, 8.0),
        _exchange(0, "combine", 3, 1, 6.0, 9.0),
    ]
    by_lane = hidden_by_lane(events, ("dispatch", "combine"))
    assert by_lane[1] == pytest.approx((2.0, 4.0, 2.0))
    assert by_lane[0] == pytest.approx((1.0, 3.0, 2.0))
    hidden, total = mpmd.Timeline(1, events).hidden_communication()
    assert (hidden, total) == pytest.approx((3.0, 7.0))
