"""Fused (composite) tasks: `Task.fused` must build them and refuse what
cannot be one; their torch action format must round-trip through
`Task.parse` and CSV (and read as torch's own OVERLAP_F_B); a list schedule
with fused tasks, run by ranks as threads in float64, must give the
unpipelined model's gradients, with one timeline record and one profiler
range per fused task; DualPipeV must pair its F and B as fused tasks
without changing its simulated step time."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import CASES
from pipeline_check import ALL, check, data, reference, stages_for, traced
from torch.distributed.pipelining.schedules import OVERLAP_F_B, _Action
from torch.profiler import ProfilerActivity, profile

import torchmpmd as mpmd
from torchmpmd.schedule.costs import fused_key
from torchmpmd.testing import LocalPipeline

Task = mpmd.Task
S = mpmd.schedules

# 2 stages on 2 ranks, 3 microbatches: rank 0 fuses a forward with an input
# gradient (its stage is split into I and W), rank 1 forwards with full
# backwards.
FUSED_LISTS = [
    ["0F0", "0F1", "(0F2;0I0)OVERLAP_F_B", "0W0", "0I1", "0W1", "0I2", "0W2"],
    ["1F0", "(1F1;1B0)OVERLAP_F_B", "(1F2;1B1)OVERLAP_F_B", "1B2"],
]


def _flat(lists: list[list[Task]]) -> list[list[Task]]:
    return [[p for t in rank for p in t.parts] for rank in lists]


def test_fused_task_holds_its_parts_and_answers_the_first_ones_fields():
    t = Task.fused(Task("F", 0, 3), "3B1")
    assert t.is_fused and t.parts == (Task("F", 0, 3), Task("B", 3, 1))
    assert (t.kind, t.stage, t.microbatch) == ("F", 0, 3)
    assert t != Task("F", 0, 3) and hash(t) == hash(Task.fused("0F3", "3B1"))
    assert str(t) == "(0F3;3B1)OVERLAP_F_B"
    # A simple task is its one part, built as before.
    simple = Task("B", 1, 2)
    assert not simple.is_fused and simple.parts == (simple,) and simple.sub_tasks == ()
    assert repr(simple) == "Task(kind='B', stage=1, microbatch=2)"
    assert repr(t) == (
        "Task.fused(Task(kind='F', stage=0, microbatch=3), Task(kind='B', stage=3, microbatch=1))"
    )
    assert eval(repr(t), {"Task": Task}) == t


@pytest.mark.parametrize(
    ("parts", "error", "match"),
    [
        ((Task("F", 0, 0),), ValueError, "needs two or more parts, got 1"),
        ((), ValueError, "needs two or more parts, got 0"),
        (
            (Task("F", 0, 0), Task.fused("0F1", "0B0")),
            ValueError,
            r"part 2 \(\(0F1;0B0\)OVERLAP_F_B\) is fused itself; fused tasks do not nest",
        ),
        ((Task("F", 0, 0), 3), TypeError, r"part 2 is 3 \(int\), not an mpmd.Task"),
    ],
)
def test_fused_refuses_what_cannot_be_one(parts, error, match):
    with pytest.raises(error, match=match):
        Task.fused(*parts)


def test_fused_task_built_by_hand_must_answer_its_first_part():
    with pytest.raises(ValueError, match=r"build fused tasks with Task\.fused"):
        Task("B", 3, 1, (Task("F", 0, 3), Task("B", 3, 1)))
    with pytest.raises(TypeError, match="sub_tasks must be a tuple"):
        Task("F", 0, 3, [Task("F", 0, 3), Task("B", 3, 1)])  # type: ignore[arg-type]


def test_action_format_round_trips_and_is_torchs():
    t = Task.parse(" (0F3; 3B1)OVERLAP_F_B ")
    assert t == Task.fused("0F3", "3B1")
    assert Task.parse(str(t)) == t
    # torch.distributed.pipelining reads and writes the same text.
    action = _Action.from_str(str(t))
    assert action.computation_type == OVERLAP_F_B
    assert [str(a) for a in action.sub_actions] == ["0F3", "3B1"]
    assert str(action) == str(t)
    for bad, match in [
        ("(0F3)OVERLAP_F_B", "two or more parts"),
        ("(0F3;3B1)OVERLAP", "expected OVERLAP_F_B after the parts"),
        ("(0F3;(1F0;2B0)OVERLAP_F_B)OVERLAP_F_B", "cannot read action"),
    ]:
        with pytest.raises(ValueError, match=match):
            Task.parse(bad)


def test_csv_round_trips_fused_tasks():
    schedule = S.DualPipeV(8)
    placement = schedule.placement(8, 4)
    text = schedule.to_csv(8, 4)
    assert "OVERLAP_F_B" in text
    back = mpmd.Schedule.from_csv(text, placement)
    assert back.tasks(8, 4, 8) == schedule.tasks(8, 4, 8)
    assert back.to_csv(8, 4) == text


def test_dual_pipe_v_pairs_its_forward_and_backward_as_fused_tasks():
    p, m = 4, 8
    schedule = S.DualPipeV(m)
    lists = schedule.tasks(2 * p, p, m)
    for r, rank in enumerate(lists):
        fused = [t for t in rank if t.is_fused]
        assert fused, f"rank {r} has no fused task"
        for t in fused:
            # The forward of one of the rank's stages with the backward of
            # the other, as torch's DualPipeV overlaps them.
            (f, b) = t.parts
            assert (f.kind, b.kind) == ("F", "B") and {f.stage, b.stage} == {r, 2 * p - 1 - r}
    # Run apart, the same tasks take the same simulated time and memory: by
    # default a fused task costs the sum of its parts.
    apart = mpmd.Schedule.from_lists(_flat(lists), schedule.placement(2 * p, p), m)
    for costs in (mpmd.Costs(), mpmd.Costs(forward=[1, 2, 1, 3, 1, 2, 2, 1], latency=0.3)):
        fused_tl = mpmd.compile_schedule(schedule, 2 * p, p, costs=costs).simulate(costs)
        apart_tl = mpmd.compile_schedule(apart, 2 * p, p, costs=costs).simulate(costs)
        assert fused_tl.step_time == pytest.approx(apart_tl.step_time, abs=1e-9)
        assert fused_tl.peak_activation_bytes == apart_tl.peak_activation_bytes
        # One event per fused task, with its parts.
        events = [e for e in fused_tl.tasks if e.is_fused]
        assert len(events) == sum(t.is_fused for rank in lists for t in rank)
        assert {e.task for e in events} == {t for rank in lists for t in rank if t.is_fused}


def test_a_measured_fused_time_is_taken_by_the_simulator():
    p, m = 2, 4
    program = mpmd.compile_schedule(S.DualPipeV(m), 2 * p, p)
    base = program.simulate(mpmd.Costs())
    keys = {fused_key(e.sub_tasks) for e in base.tasks if e.is_fused}
    assert keys == {"0F;3B", "3F;0B", "2F;1B", "1F;2B"}
    # Overlapped, F (1) and B (2) take 2.
    overlapped = program.simulate(mpmd.Costs(fused=dict.fromkeys(keys, 2.0)))
    assert overlapped.step_time < base.step_time
    assert {e.duration for e in overlapped.tasks if e.is_fused} == {2.0}
    with pytest.raises(ValueError, match="names stage 7"):
        program.simulate(mpmd.Costs(fused={"0F;7B": 1.0}))


def test_validation_names_rank_task_and_part():
    dependent = mpmd.Schedule.from_lists([["(0F0;0B0)OVERLAP_F_B"], ["1F0", "1B0"]], [0, 1])
    with pytest.raises(ValueError) as err:
        mpmd.compile_schedule(dependent, 2, 2)
    assert str(err.value).startswith(
        "schedule: rank 0 position 0: fused task (0F0;0B0)OVERLAP_F_B has part "
        "B(stage=0, mb=0) depending on its part F(stage=0, mb=0)"
    )
    elsewhere = mpmd.Schedule.from_lists(
        [["0F0", "0B0"], ["(1F0;0F1)OVERLAP_F_B", "1B0", "1F1", "1B1"]], [0, 1], 2
    )
    with pytest.raises(ValueError, match=r"rank 1 position 0: part F\(stage=0, mb=1\) of fused"):
        mpmd.compile_schedule(elsewhere, 2, 2)


def test_schedule_rewrites_see_each_part():
    schedule = mpmd.Schedule.from_lists(FUSED_LISTS, [0, 1])
    assert schedule.splits_backward(2, 2)  # 0I0 only inside a fused task
    # Recompute: an R right before each fused task's backward part, inside
    # it (on the backward's side, beside the forward).
    rows = schedule.with_recompute([1]).tasks(2, 2, 3)
    assert [str(t) for t in rows[1][:3]] == [
        "1F0",
        "(1F1;1R0;1B0)OVERLAP_F_B",
        "(1F2;1R1;1B1)OVERLAP_F_B",
    ]
    # ... and the program runs it: R and B on one side, after one another.
    program = mpmd.compile_schedule(schedule.with_recompute([1]), 2, 2)
    assert "(1F1;1R0;1B0)OVERLAP_F_B" in [str(t) for t in program.tasks(1)]
    # Full backward on stage 0: the fused I becomes B, its W goes.
    rows = schedule.with_full_backward([0]).tasks(2, 2, 3)
    assert [str(t) for t in rows[0]] == ["0F0", "0F1", "(0F2;0B0)OVERLAP_F_B", "0B1", "0B2"]
    # Evaluation runs the forward parts alone.
    program = mpmd.compile_schedule(schedule, 2, 2, forward_only=True)
    assert [str(t) for t in program.tasks(1)] == ["1F0", "1F1", "1F2"]


def test_fused_list_schedule_matches_the_unpipelined_model():
    """Gradients equal the plain model's accumulation over the microbatches
    (float64); one timeline record and one profiler range per fused task."""
    name, m = "gpt", 3
    pipe = traced(name, 2)
    schedule = mpmd.Schedule.from_lists(FUSED_LISTS, [0, 1])
    local = LocalPipeline(pipe, schedule, 2, loss_fn=CASES[name].loss, timeout=60)
    batch, target = data(name, m)
    local.step(batch, target=target)  # first-call work stays out of the trace
    for runner in local.runners:
        for _, param in runner.named_parameters():
            param.grad = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = local.step(batch, target=target)
    seen = set()
    for out, runner in zip(outs, local.runners, strict=True):
        seen |= check(name, out.loss, runner, m)
    _, ref_grads = reference(name, m)
    assert seen >= {n for n in ref_grads if not n.startswith("head.")}

    names = [e.name for e in prof.events()]
    for rank, runner in enumerate(local.runners):
        tasks = runner.program.tasks(rank)
        assert [t for t in tasks if t.is_fused] == [
            t for t in schedule.tasks(2, 2, m)[rank] if t.is_fused
        ]
        timeline = runner.timeline
        assert [e.task for e in timeline.tasks] == tasks
        for t in tasks:
            if t.is_fused:
                # torch.profiler: one range, named by all its parts.
                ranged = "+".join(f"{p.kind}(stage={p.stage}, mb={p.microbatch})" for p in t.parts)
                assert names.count(ranged) == 1, ranged
    # Gathered over the ranks, the fused events keep their parts, and they
    # feed the measured costs.
    merged = mpmd.Timeline.merge(r.timeline for r in local.runners)
    gathered = local.on_all_ranks(lambda r: r.gather_timeline())[0]
    assert [(e.rank, e.name) for e in gathered.tasks] == [(e.rank, e.name) for e in merged.tasks]
    assert sum(e.is_fused for e in gathered.tasks) == 3
    costs = mpmd.Costs.from_timeline(gathered, 2)
    assert set(costs.fused or {}) == {"0F;0I", "1F;1B"}
    assert all(v > 0 for v in (costs.fused or {}).values())
    # The chrome trace and the plot name them by their parts.
    trace = merged.to_chrome_trace()
    assert "(0F2;0I0)OVERLAP_F_B" in {e["name"] for e in trace["traceEvents"]}


def test_a_failing_part_is_named():
    name, m = "gpt", 3
    pipe = traced(name, 2)
    schedule = mpmd.Schedule.from_lists(FUSED_LISTS, [0, 1])
    batch, target = data(name, m)
    calls = {"n": 0}

    def bad_loss(out, y):
        calls["n"] += 1
        if calls["n"] == 2:  # the loss of 1F1, inside (1F1;1B0)
            raise RuntimeError("boom")
        return CASES[name].loss(out, y)

    local = LocalPipeline(pipe, schedule, 2, loss_fn=bad_loss, timeout=30)
    with pytest.raises(Exception, match=r"F\(stage=1, mb=1\) \(part of fused \(1F1;1B0\)"):
        local.step(batch, target=target)


def test_plot_draws_fused_tasks(tmp_path):
    pytest.importorskip("matplotlib")
    tl = mpmd.compile_schedule(S.DualPipeV(4), 4, 2).simulate()
    fig = mpmd.viz.plot(tl, tmp_path / "dual.png")
    assert (tmp_path / "dual.png").stat().st_size > 0
    del fig


def test_timeline_event_keeps_its_parts():
    parts = (Task("F", 0, 3), Task("B", 3, 1))
    e = mpmd.TimelineEvent(0, "F", 0, 3, 0.0, 1.0, sub_tasks=parts)
    assert e.is_fused and e.task == Task.fused(*parts) and e.name == "(0F3;3B1)OVERLAP_F_B"
    with pytest.raises(ValueError, match="first part's kind, stage and microbatch"):
        mpmd.TimelineEvent(0, "B", 3, 1, 0.0, 1.0, sub_tasks=parts)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fusing_tasks_keeps_the_simulated_step_by_default(data_):
    """Any built-in schedule with random neighbouring tasks of a rank fused
    (where that still lowers) predicts the step time and memory of its parts
    run apart: a fused task costs the sum of its parts by default."""
    cls = data_.draw(st.sampled_from(ALL))
    ranks = data_.draw(st.integers(2, 3))
    num_stages = stages_for(cls, ranks)
    m = 2 * num_stages if cls is S.DualPipeV else ranks * data_.draw(st.integers(1, 2))
    schedule = cls(m)
    placement = schedule.placement(num_stages, ranks)
    flat = _flat(schedule.tasks(num_stages, ranks, m))
    lists = []
    for rank in flat:
        row: list[Task] = []
        i = 0
        while i < len(rank):
            if i + 1 < len(rank) and data_.draw(st.booleans()):
                row.append(Task.fused(rank[i], rank[i + 1]))
                i += 2
            else:
                row.append(rank[i])
                i += 1
        lists.append(row)
    costs = mpmd.Costs(
        forward=[1.0 + (s % 3) / 2 for s in range(num_stages)],
        latency=data_.draw(st.sampled_from([0.0, 0.3])),
        bandwidth=data_.draw(st.sampled_from([0.0, 4.0])),
    )
    fused = mpmd.Schedule.from_lists(lists, placement, m)
    try:
        program = mpmd.compile_schedule(fused, num_stages, ranks, costs=costs)
    except ValueError as e:
        # Parts that depend on one another, or wait for each other through
        # another rank: refused, and said so.
        assert "only on an earlier part of its own side" in str(e) or "deadlock" in str(e), str(e)
        return
    apart = mpmd.Schedule.from_lists(flat, placement, m)
    a = program.simulate(costs)
    b = mpmd.compile_schedule(apart, num_stages, ranks, costs=costs).simulate(costs)
    assert a.step_time == pytest.approx(b.step_time, abs=1e-9)
    assert a.peak_activation_bytes == b.peak_activation_bytes
    assert len(a.tasks) == sum(len(r) for r in lists)


def test_from_timeline_says_when_a_forward_ran_only_fused():
    fused = Task.fused("0F1", "1B0")
    events = [
        mpmd.TimelineEvent(0, "F", 1, 0, 0.0, 1.0),
        mpmd.TimelineEvent(0, "F", 0, 1, 1.0, 4.0, sub_tasks=fused.sub_tasks),
    ]
    with pytest.raises(ValueError, match="no forward of stage 0 was measured on its own"):
        mpmd.Costs.from_timeline(mpmd.Timeline(1, events), 2)


def test_simulator_runs_the_two_sides_of_a_fused_task_at_once():
    """With expert parallelism's exchanges inside the tasks, a fused F&B
    takes the longer of its parts' compute and each side's time (one side's
    exchanges under the other's compute), as `RunnerOptions.overlap` runs it;
    without `overlap_sides`, the sum of its parts."""
    schedule = mpmd.schedules.DualPipeV(4)
    program = mpmd.compile_schedule(schedule, 4, 2)
    costs = dict(forward=1.0, backward=2.0, exchange=0.5, exchange_backward=0.8)
    apart = program.simulate(mpmd.Costs(**costs, overlap_sides=False))
    together = program.simulate(mpmd.Costs(**costs))

    # F: 1 + 0.5 exchange; B: 2 + 0.8. Compute 1 + 2 = 3 against the sides'
    # 1.5 and 2.8: 3. In order: 4.3.
    def durations(timeline: mpmd.Timeline) -> set[float]:
        return {round(e.duration, 9) for e in timeline.tasks if e.is_fused}

    assert min(durations(apart)) == 4.3  # part by part (and any wait between)
    assert durations(together) == {3.0}
    assert together.step_time < apart.step_time
    # A backward side longer than the forward's whole time: the side.
    long_b = program.simulate(
        mpmd.Costs(forward=1.0, backward=2.0, exchange=0.1, exchange_backward=3.0)
    )
    assert durations(long_b) == {5.0}
    # No exchanges: nothing to hide, the sum of the parts.
    plain = program.simulate(mpmd.Costs(forward=1.0, backward=2.0))
    assert min(durations(plain)) == 3.0


def test_ranks_sharing_cores_run_the_two_sides_one_after_the_other():
    """Where the ranks share cores (2 ranks on 1 here) every core is busy
    while as many compute, so a rank's wait on an exchange is another's
    compute: the simulator charges a fused task's sides one after the other,
    as `overlap_sides=False` does under the same sharing. With a core per
    rank they run at once again."""
    program = mpmd.compile_schedule(mpmd.schedules.DualPipeV(4), 4, 2)
    costs = dict(forward=1.0, backward=2.0, exchange=0.5, exchange_backward=0.8)
    for cores in (1.0, 2.0):
        shared = program.simulate(mpmd.Costs(**costs, shared_cores=cores))
        apart = program.simulate(mpmd.Costs(**costs, shared_cores=cores, overlap_sides=False))
        if cores == 1.0:
            assert shared.step_time == pytest.approx(apart.step_time, abs=1e-9)
        else:  # nothing shared: as on a device per rank, the sides at once
            overlapped = program.simulate(mpmd.Costs(**costs))
            assert shared.step_time == pytest.approx(overlapped.step_time, abs=1e-9)
            assert shared.step_time < apart.step_time - 0.5


def test_combined_1f1b_pairs_each_steady_forward_with_an_earlier_backward():
    rows = mpmd.schedules.Combined1F1B(6).tasks(3, 3, 6)
    assert [str(t) for t in rows[2]] == [
        "2F0",
        "(2F1;2B0)OVERLAP_F_B",
        "(2F2;2B1)OVERLAP_F_B",
        "(2F3;2B2)OVERLAP_F_B",
        "(2F4;2B3)OVERLAP_F_B",
        "(2F5;2B4)OVERLAP_F_B",
        "2B5",
    ]
    # Warm-up 2 (p - r) - 1 forwards: 5 on rank 0 (of 6 microbatches).
    assert [str(t) for t in rows[0]][:6] == [
        "0F0",
        "0F1",
        "0F2",
        "0F3",
        "0F4",
        "(0F5;0B0)OVERLAP_F_B",
    ]
    # Its fused pairs overlap their exchanges: faster than 1F1B on the
    # simulator, for more activations held; with nothing to hide, slower.
    costs = mpmd.Costs(forward=1.0, exchange=0.5)
    for p, m in ((2, 8), (4, 16)):
        combined = mpmd.compile_schedule(mpmd.schedules.Combined1F1B(m), p, p).simulate(costs)
        plain = mpmd.compile_schedule(mpmd.schedules.OneFOneB(m), p, p).simulate(costs)
        assert combined.step_time < 0.85 * plain.step_time, (p, m)
        # 2 p - 1 warm-up microbatches, one more inside the first pair.
        assert max(combined.peak_activation_bytes) == 2 * p
    with pytest.raises(ValueError, match="one stage per rank: 2 stages for 2 ranks, got 4"):
        mpmd.schedules.Combined1F1B(8).tasks(4, 2, 8)
