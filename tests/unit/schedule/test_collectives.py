"""A stage's data-parallel collectives (FSDP's unshard, the gradient
reduction of FSDP and replicate) are instructions of the compiled program,
as torch.distributed.pipelining's UNSHARD / REDUCE_GRAD actions: the
simulator charges their time and the memory an unsharded stage holds, and
the timeline, its costs and its plot carry them. Before, FSDP's gathers and
reductions were calls the runner made around the executor, which the
simulator never saw (its step and peak ignored them)."""

from __future__ import annotations

import pytest

import torchmpmd as mpmd
from torchmpmd.schedule.timeline import COLLECTIVES

SHARDED = mpmd.StageCollectives(unshard=True, reduce_grads=True)


def _program(schedule=None, stages=2, collectives=SHARDED, **kw) -> mpmd.Program:
    schedule = schedule or mpmd.schedules.OneFOneB(1)
    return mpmd.compile_schedule(schedule, stages, 2, collectives=collectives, **kw)


def _no_messages(program: mpmd.Program, rank: int) -> list[str]:
    return [i for i in program.instructions(rank) if not i.startswith(("SEND", "RECV"))]


def test_the_program_gathers_before_a_stages_first_task_and_reduces_after_its_last():
    program = _program(mpmd.schedules.ZeroBubbleH1(3))
    for rank in range(2):
        code = _no_messages(program, rank)
        assert code[0] == f"UNSHARD(s{rank})", code
        assert code[-1] == f"REDUCE_grads(s{rank})", code
        assert code[-2].startswith(f"{rank}W"), code  # the last weight gradient
    # The tasks are those of the program without collectives.
    assert program.tasks(0) == _program(mpmd.schedules.ZeroBubbleH1(3), collectives=None).tasks(0)


def test_replicated_stages_only_reduce_and_evaluation_has_neither():
    replicated = _program(collectives=mpmd.StageCollectives(reduce_grads=True))
    assert _no_messages(replicated, 0) == ["0F0", "0B0", "REDUCE_grads(s0)"]
    evaluation = _program(forward_only=True)
    assert _no_messages(evaluation, 0) == ["0F0"]


def test_collectives_per_stage():
    per_stage = [mpmd.StageCollectives(reduce_grads=True), SHARDED]
    program = _program(collectives=per_stage)
    assert _no_messages(program, 0) == ["0F0", "0B0", "REDUCE_grads(s0)"]
    assert _no_messages(program, 1) == ["UNSHARD(s1)", "1F0", "1B0", "REDUCE_grads(s1)"]
    with pytest.raises(ValueError, match=r"one per stage \(2\)"):
        _program(collectives=[SHARDED])
    with pytest.raises(ValueError, match=r"one mpmd\.StageCollectives"):
        _program(collectives=[SHARDED, "fsdp"])


def test_the_simulator_charges_the_collectives_and_the_gathered_bytes():
    costs = mpmd.Costs(
        forward=1,
        backward=2,
        unshard=5,
        reduce_grads=4,
        unsharded_bytes=100,
        activation_bytes=[10, 10],
    )
    plain = _program(collectives=None).simulate(costs)
    tl = _program().simulate(costs)
    # Gathers 0-5 on both ranks; F0 5-6, F1 6-7, B1 7-9 then its reduction
    # 9-13 beside the rank; B0 9-11, its reduction 11-15 ends the step.
    assert plain.step_time == 6
    assert tl.step_time == 15
    assert _program().predict(costs).step_time == 15
    reductions = {e.stage: (e.start, e.end) for e in tl.events if e.kind == "reduce_grads"}
    assert reductions == {0: (11, 15), 1: (9, 13)}
    assert sorted(e.stage for e in tl.events if e.kind == "unshard") == [0, 1]
    # Activations alone, and with what the stages gathered.
    assert tl.peak_activation_bytes == plain.peak_activation_bytes == [10, 10]
    assert tl.peak_bytes == [110, 110]
    # The reductions are not tasks: the bubble counts the ranks' compute only.
    assert tl.busy_time() == plain.busy_time()
    assert tl.bubble_fraction > plain.bubble_fraction


def test_unset_collective_costs_are_free():
    tl = _program().simulate(mpmd.Costs(forward=1, backward=2))
    assert tl.step_time == 6
    assert {e.kind for e in tl.events if not e.is_task} >= set(COLLECTIVES)


def test_costs_from_a_timeline_read_the_collectives():
    ev = mpmd.TimelineEvent
    events = [
        ev(0, "unshard", 0, -1, 0.0, 0.5),
        ev(0, "F", 0, 0, 0.5, 1.5),
        ev(0, "B", 0, 0, 1.5, 3.5),
        ev(0, "reduce_grads", 0, -1, 3.5, 3.75),
        ev(1, "unshard", 1, -1, 0.0, 0.25),
        ev(1, "F", 1, 0, 1.5, 2.5),
        ev(1, "B", 1, 0, 2.5, 4.5),
    ]
    costs = mpmd.Costs.from_timeline(mpmd.Timeline(2, events), 2)
    assert costs.unshard == [0.5, 0.25]
    assert costs.reduce_grads == [0.25, 0.0]
    # The step spans the collectives; the bubble counts tasks only.
    tl = mpmd.Timeline(2, events)
    assert tl.step_time == 4.5
    assert tl.busy_time() == [3.0, 3.0]


def test_a_timeline_with_collectives_plots_and_traces(tmp_path):
    tl = _program().simulate(mpmd.Costs(unshard=1, reduce_grads=1))
    mpmd.viz.plot(tl, tmp_path / "collectives.png")
    assert (tmp_path / "collectives.png").stat().st_size > 0
    names = {e["name"] for e in tl.to_chrome_trace()["traceEvents"]}
    assert {"unshard stage 0", "reduce_grads stage 1"} <= names


def test_negative_collective_costs_are_refused():
    with pytest.raises(ValueError, match="unshard cost of stage 1 must not be negative"):
        _program().simulate(mpmd.Costs(unshard=[1, -1]))
    with pytest.raises(ValueError, match=r"Costs.reduce_grads gives 3 values for 2 stages"):
        _program().simulate(mpmd.Costs(reduce_grads=[1, 1, 1]))
