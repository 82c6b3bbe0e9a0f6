"""Schedules are data: every built-in must compile and, run by ranks as
threads, match unpipelined gradient accumulation; random valid schedules must
too; random corruptions must be rejected before anything runs with the right
message; the simulator must reproduce the textbook step times."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import CASES
from pipeline_check import ALL, check, data, microbatches_for, reference, stages_for, traced

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

S = mpmd.schedules
ONE_STAGE_PER_RANK = {S.Eager1F1B, S.ZeroBubbleH1}


def run_and_compare(name, schedule, ranks, num_stages):
    pipe = traced(name, num_stages)
    m = schedule.num_microbatches
    local = LocalPipeline(pipe, schedule, ranks, loss_fn=CASES[name].loss, timeout=60)
    batch, target = data(name, m)
    outs = local.step(batch, target=target)
    seen = set()
    for out, runner in zip(outs, local.runners, strict=True):
        seen |= check(name, out.loss, runner, m)
    _, ref_grads = reference(name, m)
    assert seen >= {n for n in ref_grads if not n.startswith("head.")}
    return local


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", ["gpt", "deep_unet"])
@pytest.mark.slow
def test_builtin_schedule_matches_gradient_accumulation(cls, ranks, name):
    m = microbatches_for(cls, ranks)
    local = run_and_compare(name, cls(m), ranks, stages_for(cls, ranks))
    # The stages whose split backward (I, W) ran.
    split = [sorted({e.stage for e in r.timeline.tasks if e.kind in "IW"}) for r in local.runners]
    uses_iw = cls in (S.ZeroBubbleH1, S.ZBV, S.DualPipeV)
    assert any(split) == uses_iw


# ---------------------------------------------------------------- random schedules


def dependencies(pipe_graph_edges, task, split):
    """Tasks that must finish before `task`, for a pipeline's stage edges."""
    kind, s, mb = task
    if kind == "F":
        return [("F", e.src, mb) for e in pipe_graph_edges if e.dst == s]
    if kind in ("B", "I"):
        deps = [("F", s, mb)]
        for e in pipe_graph_edges:
            if e.src == s and e.requires_grad:
                deps.append(("I" if split[(e.dst, mb)] else "B", e.dst, mb))
        return deps
    return [("I", s, mb)]


@st.composite
def valid_schedules(draw, num_stages, edges):
    """A random placement and a random legal order: a random linearisation of
    the task dependency graph, projected onto the ranks."""
    ranks = draw(st.integers(1, min(3, num_stages)))
    placement = draw(st.lists(st.integers(0, ranks - 1), min_size=num_stages, max_size=num_stages))
    # Every rank holds at least one stage: give each rank a distinct stage.
    for r, s in enumerate(draw(st.permutations(range(num_stages)))[:ranks]):
        placement[s] = r
    m = draw(st.integers(1, 3))
    split = {(s, mb): draw(st.booleans()) for s in range(num_stages) for mb in range(m)}
    pending = []
    for s in range(num_stages):
        for mb in range(m):
            pending.append(("F", s, mb))
            pending += [("I", s, mb), ("W", s, mb)] if split[(s, mb)] else [("B", s, mb)]
    done: set = set()
    lists = [[] for _ in range(ranks)]
    while pending:
        ready = [t for t in pending if all(d in done for d in dependencies(edges, t, split))]
        task = draw(st.sampled_from(ready))
        pending.remove(task)
        done.add(task)
        lists[placement[task[1]]].append(mpmd.Task(*task))
    return mpmd.Schedule.from_lists(lists, placement, m), ranks


def graph_edges(pipe):
    return pipe.plan.edges()


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
@pytest.mark.slow
def test_random_valid_schedules_match_gradient_accumulation(data_):
    name = data_.draw(st.sampled_from(["gpt", "deep_unet"]))
    pipe = traced(name, 4)
    schedule, ranks = data_.draw(valid_schedules(4, graph_edges(pipe)))
    run_and_compare(name, schedule, ranks, 4)


CORRUPTIONS = {
    "drop": r"is missing|has no backward|has I but no W|has W but no I",
    "duplicate": r"appears twice",
    "misplace": r"is on rank \d+, but stage \d+ is placed on rank \d+",
    "reorder": r"runs [FBIW]\(stage=\d+, mb=\d+\) \(position \d+\) before [FBIW]\(stage=\d+, mb=\d+\) "
    r"\(position \d+\), which it depends on",
    "out_of_range": r"names a (stage|microbatch) outside",
}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_corruptions_are_rejected_with_the_right_message(data_):
    cls = data_.draw(st.sampled_from(ALL))
    ranks = data_.draw(st.integers(2, 4))
    num_stages = stages_for(cls, ranks)
    m = 2 * num_stages if cls is S.DualPipeV else ranks * data_.draw(st.integers(1, 2))
    schedule = cls(m)
    placement = schedule.placement(num_stages, ranks)
    lists = schedule.tasks(num_stages, ranks, m)
    kind = data_.draw(st.sampled_from(sorted(CORRUPTIONS)))
    r = data_.draw(st.integers(0, ranks - 1))
    i = data_.draw(st.integers(0, len(lists[r]) - 1))
    task = lists[r][i]
    if kind == "drop":
        del lists[r][i]
    elif kind == "duplicate":
        lists[r].insert(data_.draw(st.integers(0, len(lists[r]))), task)
    elif kind == "misplace":
        other = (r + data_.draw(st.integers(1, ranks - 1))) % ranks
        del lists[r][i]
        lists[other].insert(data_.draw(st.integers(0, len(lists[other]))), task)
    elif kind == "reorder":
        # Move a task before a task of its own rank that it depends on.
        deps = {
            "F": [mpmd.Task("F", task.stage - 1, task.microbatch)],  # a chain of stages
            "B": [mpmd.Task("F", task.stage, task.microbatch)],
            "I": [mpmd.Task("F", task.stage, task.microbatch)],
            "W": [mpmd.Task("I", task.stage, task.microbatch)],
        }[task.kind]
        earlier = [j for j, t in enumerate(lists[r][:i]) if t in deps]
        if not earlier:
            return  # nothing on this rank to put it before
        del lists[r][i]
        lists[r].insert(data_.draw(st.sampled_from(earlier)), task)
    else:
        bad = (
            mpmd.Task(task.kind, task.stage, m + 3)
            if data_.draw(st.booleans())
            else mpmd.Task(task.kind, num_stages + 2, task.microbatch)
        )
        lists[r][i] = bad
    corrupted = mpmd.Schedule.from_lists(lists, placement, m)
    with pytest.raises(ValueError) as err:
        mpmd.compile_schedule(corrupted, num_stages, ranks)
    msg = str(err.value)
    assert re.search(CORRUPTIONS[kind], msg), f"{kind}: {msg}"
    assert msg.startswith("schedule: ")
    # Every error but a missing task draws the grid with the spot marked.
    if kind != "drop":
        assert "  rank 0:" in msg and "[" in msg


def test_deadlock_is_rejected_with_where_each_rank_stopped():
    lists = [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]]
    with pytest.raises(ValueError) as err:
        mpmd.compile_schedule(mpmd.Schedule.from_lists(lists, [0, 1]), 2, 2)
    assert str(err.value) == (
        "schedule: deadlock: no rank can run its next task, each waits for a task that runs "
        "later on another rank:\n"
        "  rank 0 waits at 0B0 for 1B0 (rank 1 position 2)\n"
        "  rank 1 waits at 1F1 for 0F1 (rank 0 position 2)\n"
        "  rank 0: 0F0 [0B0] 0F1 0B1\n"
        "  rank 1: [1F1] 1F0 1B0 1B1\n"
    )


# ----------------------------------------------------------------- simulation


@settings(max_examples=80, deadline=None)
@given(
    p=st.integers(2, 6),
    m=st.integers(1, 12),
    f=st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]),
    b=st.sampled_from([0.5, 1.0, 2.0, 3.0, 4.0]),
)
def test_gpipe_and_1f1b_step_time_is_textbook(p, m, f, b):
    for cls in (S.GPipe, S.OneFOneB):
        tl = mpmd.compile_schedule(cls(m), p, p).simulate(mpmd.Costs(forward=f, backward=b))
        assert tl.step_time == pytest.approx((m + p - 1) * (f + b)), cls.__name__
        assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@settings(max_examples=80, deadline=None)
@given(
    p=st.integers(2, 6),
    extra=st.integers(0, 8),
    f=st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]),
    i=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
    w=st.sampled_from([0.25, 0.5, 1.0, 2.0]),
)
def test_zero_bubble_h1_step_time_is_textbook(p, extra, f, i, w):
    # The formula's regime (Qi et al.): at least p microbatches, W no longer
    # than F or I, so weight passes fit in the bubbles they fill.
    m = p + extra
    w = min(w, f, i)
    costs = mpmd.Costs(forward=f, input_grad=i, weight_grad=w, backward=i + w)
    tl = mpmd.compile_schedule(S.ZeroBubbleH1(m), p, p).simulate(costs)
    assert tl.step_time == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))


def test_simulated_memory_gpipe_keeps_all_1f1b_keeps_p():
    p, m = 4, 8
    gp = mpmd.compile_schedule(S.GPipe(m), p, p).simulate(mpmd.Costs(activation_bytes=[10] * p))
    ofob = mpmd.compile_schedule(S.OneFOneB(m), p, p).simulate(
        mpmd.Costs(activation_bytes=[10] * p)
    )
    assert gp.peak_activation_bytes == [10 * m] * p
    assert ofob.peak_activation_bytes == [10 * (p - r) for r in range(p)]


def test_zero_bubble_schedules_beat_1f1b_in_simulation():
    p, m = 4, 8
    costs = mpmd.Costs(forward=1, backward=2)
    half = mpmd.Costs(forward=0.5, backward=1)  # V schedules: two half-size stages per rank
    base = mpmd.compile_schedule(S.OneFOneB(m), p, p).simulate(costs).bubble_fraction
    zbh1 = mpmd.compile_schedule(S.ZeroBubbleH1(m), p, p).simulate(costs).bubble_fraction
    zbv = mpmd.compile_schedule(S.ZBV(m), 2 * p, p).simulate(half).bubble_fraction
    dual = mpmd.compile_schedule(S.DualPipeV(m), 2 * p, p).simulate(half).bubble_fraction
    inter = mpmd.compile_schedule(S.Interleaved1F1B(m), 2 * p, p).simulate(half).bubble_fraction
    assert zbh1 < base and zbv < zbh1 and dual < base and inter < base


# ----------------------------------------------------------------- the API


def test_action_format_and_csv_round_trip():
    schedule = S.ZeroBubbleH1(4)
    text = schedule.to_csv(3, 3)
    assert text.splitlines()[2].startswith("2F0,2I0,2F1,2I1,")  # rank 2 defers two W
    back = mpmd.Schedule.from_csv(text, schedule.placement(3, 3))
    assert back.tasks(3, 3, 4) == schedule.tasks(3, 3, 4)
    assert str(mpmd.Task("W", 12, 3)) == "12W3"
    assert mpmd.Task.parse("12W3") == mpmd.Task("W", 12, 3)
    with pytest.raises(ValueError, match=re.escape("cannot read action '1X2'")):
        mpmd.Task.parse("1X2")
    with pytest.raises(ValueError, match="Task kind must be one of F, B, I, W"):
        mpmd.Task("Q", 0, 0)


def test_user_schedule_mistakes_are_named():
    class WrongLength(mpmd.Schedule):
        def tasks(self, num_stages, num_ranks, num_microbatches):
            return [[]]

    with pytest.raises(ValueError, match="returned 1 task lists for 2 ranks"):
        mpmd.compile_schedule(WrongLength(2), 2, 2)

    class NotTasks(mpmd.Schedule):
        def tasks(self, num_stages, num_ranks, num_microbatches):
            return [["0F0"], ["1F0"]]

    with pytest.raises(TypeError, match=re.escape("rank 0 position 0 is str, not mpmd.Task")):
        mpmd.compile_schedule(NotTasks(1), 2, 2)
    with pytest.raises(ValueError, match="ZBV places two stages per rank"):
        mpmd.compile_schedule(S.ZBV(4), 3, 2)
    with pytest.raises(ValueError, match="needs at least as many microbatches as stages"):
        mpmd.compile_schedule(S.DualPipeV(3), 4, 2)


@pytest.mark.slow
def test_costs_from_a_measured_timeline():
    local = run_and_compare("gpt", S.ZeroBubbleH1(4), 2, 2)
    measured = mpmd.Timeline.merge(r.timeline for r in local.runners)
    assert {e.kind for e in measured.tasks} == {"F", "I", "W"}
    costs = mpmd.Costs.from_timeline(measured, 2)
    assert all(x > 0 for x in costs.forward + costs.input_grad + costs.weight_grad)
    assert costs.backward == pytest.approx(
        [i + w for i, w in zip(costs.input_grad, costs.weight_grad, strict=True)]
    )
    predicted = local.runners[0].program.simulate(costs)
    assert predicted.source == "simulated" and predicted.unit == "s"
    assert predicted.step_time > 0


@pytest.mark.slow
def test_timeline_exports(tmp_path):
    tl = mpmd.compile_schedule(S.ZBV(4), 4, 2).simulate()
    trace = tl.to_chrome_trace()
    tasks = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"] in "FBIW"]
    assert len(tasks) == 4 * 4 * 3  # F, I, W of 4 stages x 4 microbatches
    assert {e["name"] for e in tasks} >= {"0F0", "3W3"}
    path = tmp_path / "zbv.png"
    mpmd.viz.plot([tl, tl], path, titles=["predicted", "again"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
