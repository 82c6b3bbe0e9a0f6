"""`Costs` keeps a time per task kind as the native task-kind table lists
the kinds: which kinds have a time of their own, which one a kind is charged
as (R as F), and how a time not given is derived (B = 2 F, I = W = B / 2,
or from the given parts) all come from the table, so a new kind needs
nothing in `Costs`."""

from __future__ import annotations

import pytest

import torchmpmd as mpmd
from torchmpmd.schedule.kinds import TABLE


def _rows(costs: mpmd.Costs, stages: int = 2) -> dict[str, list[float]]:
    native = costs.native(stages)
    return dict(zip(TABLE, native.time, strict=True))


def test_a_row_per_kind_of_its_own_and_none_for_kinds_charged_as_another():
    rows = _rows(mpmd.Costs(forward=[1, 2]))
    for letter, kind in TABLE.items():
        if kind.charged_as == letter:
            assert len(rows[letter]) == 2, letter
        else:
            assert rows[letter] == [], letter
    assert TABLE["R"].charged_as == "F"


def test_times_not_given_are_derived_as_the_table_says():
    rows = _rows(mpmd.Costs(forward=[1, 2]))
    assert rows["B"] == [2, 4] and rows["I"] == [1, 2] and rows["W"] == [1, 2]
    # From the parts, and a part from the whole and the other part.
    rows = _rows(mpmd.Costs(forward=1, input_grad=1, weight_grad=2))
    assert rows["B"] == [3, 3]
    rows = _rows(mpmd.Costs(forward=1, backward=4, input_grad=1))
    assert rows["W"] == [3, 3]


def test_times_by_letter_are_the_same_as_the_named_fields():
    by_name = mpmd.Costs(forward=[1, 2], backward=[3, 5], weight_grad=1)
    by_letter = mpmd.Costs(forward=[1, 2], times={"B": [3, 5], "W": 1})
    assert _rows(by_name) == _rows(by_letter)
    program = mpmd.compile_schedule(mpmd.schedules.ZeroBubbleH1(4), 2, 2)
    assert program.simulate(by_name).step_time == program.simulate(by_letter).step_time


@pytest.mark.parametrize(
    ("costs", "message"),
    [
        (mpmd.Costs(times={"X": 1}), r"'X' is not a task kind; use one of F, B, I, W, R"),
        (mpmd.Costs(times={"R": 1}), r"recompute \(R\) takes the time of F; give that one"),
        (
            mpmd.Costs(backward=2, times={"B": 2}),
            r"the backward time is given twice, as backward and as times\['B'\]",
        ),
        (mpmd.Costs(times={"I": [1, 2, 3]}), r"Costs.times\['I'\] gives 3 values for 2 stages"),
    ],
)
def test_bad_times_are_named(costs, message):
    with pytest.raises(ValueError, match=message):
        costs.native(2)


def test_a_negative_time_names_the_kind_and_stage():
    program = mpmd.compile_schedule(mpmd.schedules.OneFOneB(2), 2, 2)
    with pytest.raises(ValueError, match=r"costs of stage 1 must not be negative \(weight grad"):
        program.simulate(mpmd.Costs(backward=[2, 2], input_grad=[1, 3]))


def test_costs_from_a_timeline_derive_what_was_not_measured():
    ev = mpmd.TimelineEvent
    events = [
        ev(0, "F", 0, 0, 0.0, 1.0),
        ev(0, "B", 0, 0, 2.0, 5.0),
        ev(1, "F", 1, 0, 1.0, 2.0),
        ev(1, "I", 1, 0, 2.0, 3.0),
        ev(1, "W", 1, 0, 3.0, 5.0),
        ev(1, "R", 1, 0, 5.0, 6.0),  # charged as F: not a time of its own
    ]
    costs = mpmd.Costs.from_timeline(mpmd.Timeline(2, events), 2)
    assert costs.forward == [1, 1]
    assert costs.backward == [3, 3]  # stage 1: I + W
    assert costs.input_grad == [1.5, 1] and costs.weight_grad == [1.5, 2]
    assert costs.times is None


def _with_exchanges() -> mpmd.Timeline:
    """A measured 2-stage step whose stage 0 runs expert-parallel all-to-alls:
    each F of it 3 s with 1 s of dispatch + combine inside, each B 6 s with
    1.5 s inside; stage 1 none."""
    E = mpmd.TimelineEvent
    events = []
    for mb in range(2):
        t = 3.0 * mb
        events += [
            E(0, "F", 0, mb, t, t + 3),
            E(0, "dispatch", 0, mb, t + 1, t + 1.5),
            E(0, "combine", 0, mb, t + 2.5, t + 3),
            E(1, "F", 1, mb, 10 + 2 * mb, 11 + 2 * mb),
            E(1, "B", 1, mb, 11 + 2 * mb, 12 + 2 * mb),
        ]
        t = 20 + 6.0 * mb
        events += [
            E(0, "B", 0, mb, t, t + 6),
            E(0, "combine", 0, mb, t + 0.5, t + 1),
            E(0, "dispatch", 0, mb, t + 5, t + 6),
        ]
    return mpmd.Timeline(2, events, "measured", "s")


def test_expert_parallel_exchanges_are_costs_of_their_own():
    # from_timeline keeps the all-to-alls out of the tasks' own times and
    # charges them as `exchange`; the simulator puts them back inside the
    # tasks (the same step as tasks timed with them) and shows them.
    costs = mpmd.Costs.from_timeline(_with_exchanges(), 2)
    assert costs.forward == [2.0, 1.0] and costs.backward == [4.5, 1.0]
    assert costs.exchange == [1.0, 0.0] and costs.exchange_backward == [1.5, 0.0]
    program = mpmd.compile_schedule(mpmd.schedules.OneFOneB(2), 2, 2)
    timeline = program.simulate(costs)
    whole = mpmd.Costs(forward=[3.0, 1.0], backward=[6.0, 1.0])
    assert timeline.step_time == pytest.approx(program.simulate(whole).step_time)
    shown = [e for e in timeline.events if e.kind in ("dispatch", "combine")]
    assert len(shown) == 2 * 2 * 2  # stage 0: 2 microbatches x (F, B) x 2
    for e in shown:
        task = next(
            t
            for t in timeline.tasks
            if (t.stage, t.microbatch) == (e.stage, e.microbatch)
            and t.start <= e.start
            and e.end <= t.end
        )
        assert task.kind in ("F", "B"), (e, task)
    # From the routed tokens' bytes over a link model instead.
    assert mpmd.Costs.exchange_time(2e6, 4, latency=1e-4, bandwidth=1e9) == pytest.approx(
        4e-4 + 2e-3
    )
