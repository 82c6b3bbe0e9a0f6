"""Bad schedules, recompute options, placements and timelines, as a hurried
user gives them: each must be refused before anything runs with the exception
type a Python user expects and a message that says what was given and how to
write it (never an AttributeError from deep inside, an `int()` error or a
silently truncated placement); and recompute asked twice for the same stages
must be one recompute, not a schedule refused for a task it never wrote."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
from catalogue import Case, cases, clear_error
from models import square_loss

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

S = mpmd.schedules
M = 2


def _pipe() -> mpmd.Pipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    return mpmd.trace(model, (torch.randn(2, 4),), split_before=["2"])


def _local(schedule: Any = None, **kwargs: Any) -> LocalPipeline:
    kwargs.setdefault("loss_fn", square_loss)
    kwargs.setdefault("timeout", 5)
    return LocalPipeline(_pipe(), S.GPipe(M) if schedule is None else schedule, 2, **kwargs)


def _placed(placement: list[Any]) -> mpmd.Schedule:
    """GPipe whose placement() returns `placement` as given."""

    class Placed(S.GPipe):
        def placement(self, num_stages: int, num_ranks: int) -> list[int]:
            return placement

    return Placed(M)


class _NoInit(mpmd.Schedule):
    def __init__(self) -> None:  # forgets super().__init__(num_microbatches)
        pass


def _event(**changes: Any) -> mpmd.TimelineEvent:
    fields: dict[str, Any] = dict(rank=0, kind="F", stage=0, microbatch=0, start=0.0, end=1.0)
    return mpmd.TimelineEvent(**{**fields, **changes})


def _plot_with_added_event() -> Any:
    timeline = mpmd.compile_schedule(S.GPipe(M), 2, 2).simulate()
    timeline.events.append(_event(rank=5))  # a list: events can be added after construction
    return mpmd.viz.plot(timeline)


# (id, callable, exception type, message pattern)
CASES: list[Case] = [
    # ---- the schedule argument
    (
        "runner given a schedule class",
        lambda: mpmd.PipelineRunner(_pipe(), S.GPipe),
        TypeError,
        r"PipelineRunner: expected an mpmd.Schedule, got the class GPipe.*instantiate it.*"
        r"mpmd\.schedules\.GPipe\(num_microbatches\)",
    ),
    (
        "local pipeline given a schedule class",
        lambda: LocalPipeline(_pipe(), S.OneFOneB, 2),
        TypeError,
        r"LocalPipeline: .*the class OneFOneB.*mpmd\.schedules\.OneFOneB\(num_microbatches\)",
    ),
    (
        "compile a schedule class",
        lambda: mpmd.compile_schedule(S.ZeroBubbleH1, 2, 2),
        TypeError,
        r"compile_schedule: .*the class ZeroBubbleH1.*instantiate it",
    ),
    (
        "runner given a number of microbatches",
        lambda: mpmd.PipelineRunner(_pipe(), 4),
        TypeError,
        r"got 4 \(int\).*mpmd\.schedules\.OneFOneB\(4\)",
    ),
    (
        "compile a number",
        lambda: mpmd.compile_schedule(8, 2, 2),
        TypeError,
        r"compile_schedule: expected an mpmd.Schedule, got 8 \(int\)",
    ),
    (
        "runner given a schedule's name",
        lambda: mpmd.PipelineRunner(_pipe(), "gpipe"),
        TypeError,
        r"got 'gpipe' \(str\); a schedule is an object, not a name: write "
        r"mpmd\.schedules\.GPipe\(num_microbatches\)",
    ),
    (
        "compile a schedule's nickname",
        lambda: mpmd.compile_schedule("1f1b", 2, 2),
        TypeError,
        r"got '1f1b' \(str\).*mpmd\.schedules\.OneFOneB\(num_microbatches\)",
    ),
    (
        "local pipeline given None",
        lambda: LocalPipeline(_pipe(), None, 2),
        TypeError,
        r"LocalPipeline: expected an mpmd.Schedule, got None; pass one, e.g. "
        r"mpmd\.schedules\.OneFOneB\(num_microbatches\)",
    ),
    (
        "compile None",
        lambda: mpmd.compile_schedule(None, 2, 2),
        TypeError,
        r"got None; pass one",
    ),
    (
        "schedule subclass without super().__init__",
        lambda: mpmd.PipelineRunner(_pipe(), _NoInit()),
        TypeError,
        r"_NoInit has no num_microbatches; its __init__ must call "
        r"super\(\).__init__\(num_microbatches\)",
    ),
    # ---- recompute=
    (
        "recompute None",
        lambda: _local(recompute=None),
        TypeError,
        r"recompute=None .*use False \(the default: none\)",
    ),
    (
        "recompute 0",
        lambda: _local(recompute=0),
        TypeError,
        r"recompute=0: an int is not a collection of stages; pass \[0\] .* or False for none",
    ),
    (
        "recompute 1",
        lambda: _local(recompute=1),
        TypeError,
        r"recompute=1: an int is not a collection of stages; pass \[1\] to recompute stage 1 "
        r"in full, or True for every stage",
    ),
    (
        "recompute a float",
        lambda: _local(recompute=0.5),
        TypeError,
        r"recompute=0.5 \(float\): use False",
    ),
    (
        "recompute a stage given as a string",
        lambda: _local(recompute=["0"]),
        TypeError,
        r"recompute names stage '0' \(str\); a stage is an int index, 0..1",
    ),
    (
        "recompute a stage given as a bool",
        lambda: _local(recompute=[True]),
        TypeError,
        r"recompute names stage True \(bool\)",
    ),
    (
        "selective recompute of a stage the schedule recomputes in full",
        lambda: _local(S.GPipe(M).with_recompute([0]), recompute="selective"),
        ValueError,
        r"the schedule recomputes stages \[0\] in full .* and recompute='selective' asks for "
        r"them selectively; choose one per stage",
    ),
    (
        "selective stage of a listed schedule with R tasks",
        lambda: _local(
            mpmd.Schedule.from_lists([["0F0", "0R0", "0B0"], ["1F0", "1B0"]], [0, 1]),
            recompute={0: "selective"},
        ),
        ValueError,
        r"recomputes stages \[0\] in full",
    ),
    (
        "with_recompute of one int",
        lambda: S.GPipe(M).with_recompute(1),
        TypeError,
        r"with_recompute takes stage indices, got 1 \(int\); write \[1\] for that one stage",
    ),
    (
        "with_recompute of True",
        lambda: S.GPipe(M).with_recompute(True),
        TypeError,
        r"got True \(bool\); e\.g\. \[0, 1\], or none for every stage",
    ),
    (
        "with_recompute of a string stage",
        lambda: S.GPipe(M).with_recompute(["0"]),
        TypeError,
        r"with_recompute: a stage is an int index, got '0' \(str\)",
    ),
    # ---- placements
    (
        "float placement from a subclass",
        lambda: mpmd.compile_schedule(_placed([0.0, 1.9]), _pipe(), 2),
        TypeError,
        r"Placed.placement\(\): placement gives each stage's rank as an int; stage 0 has 0.0 "
        r"\(float\), in \[0.0, 1.9\]",
    ),
    (
        "string placement from a subclass, in a runner",
        lambda: _local(_placed(["0", "1"])),
        TypeError,
        r"stage 0 has '0' \(str\)",
    ),
    (
        "None in a subclass's placement",
        lambda: mpmd.compile_schedule(_placed([0, None]), 2, 2),
        TypeError,
        r"stage 1 has None \(NoneType\)",
    ),
    (
        "bool placement",
        lambda: mpmd.Schedule.from_lists([["0F0", "0B0"], ["1F0", "1B0"]], [False, True]),
        TypeError,
        r"Schedule.from_lists: placement gives each stage's rank as an int; stage 0 has False",
    ),
    (
        "None in a listed placement",
        lambda: mpmd.Schedule.from_lists([["0F0", "0B0"], ["1F0", "1B0"]], [None, 1]),
        TypeError,
        r"stage 0 has None \(NoneType\)",
    ),
    (
        "placement not a list",
        lambda: mpmd.Schedule.from_csv("0F0,0B0\n1F0,1B0\n", None),
        TypeError,
        r"placement is a list with each stage's rank, e\.g\. \[0, 1, 0, 1\], got None",
    ),
    (
        "placement as a string",
        lambda: mpmd.compile_schedule(_placed("01"), 2, 2),
        TypeError,
        r"placement is a list with each stage's rank.*got '01' \(str\)",
    ),
    # ---- timelines
    (
        "timeline event of an unknown kind",
        lambda: _event(kind="X"),
        ValueError,
        r"TimelineEvent\(rank=0, kind='X'.*kind must be a task kind \(F, B, I, W, R\) or "
        r"one of 'transfer', 'wait', 'unshard', 'reduce_grads', 'dispatch', 'combine', got 'X'",
    ),
    (
        "timeline event of a lower-case kind",
        lambda: _event(kind="f"),
        ValueError,
        r"got 'f'",
    ),
    (
        "timeline event rank as a string",
        lambda: _event(rank="1"),
        TypeError,
        r"TimelineEvent\(rank='1'.*rank must be an int, got '1' \(str\)",
    ),
    ("timeline event of a negative rank", lambda: _event(rank=-1), ValueError, r"rank must be 0"),
    (
        "timeline event start as a string",
        lambda: _event(start="0"),
        TypeError,
        r"start must be a number .*got '0' \(str\)",
    ),
    (
        "timeline with an event of a rank it does not have",
        lambda: mpmd.Timeline(2, [_event(), _event(rank=3)]),
        ValueError,
        r"Timeline: event 1 TimelineEvent\(rank=3.* is on rank 3, but the timeline has 2 ranks "
        r"\(0..1\); give Timeline\(num_ranks=4, ...\)",
    ),
    (
        "timeline of something else than events",
        lambda: mpmd.Timeline(2, ["0F0"]),
        TypeError,
        r"Timeline: event 0 is a str, not an mpmd.TimelineEvent",
    ),
    (
        "timeline with a float number of ranks",
        lambda: mpmd.Timeline(2.0, []),
        TypeError,
        r"num_ranks must be an int, got 2.0",
    ),
    (
        "plot an event added on a rank the timeline does not have",
        _plot_with_added_event,
        ValueError,
        r"plot: timeline 0: event \d+ TimelineEvent\(rank=5.*is on rank 5, but the timeline has "
        r"2 ranks",
    ),
]


@cases(CASES)
def test_bad_input_gets_a_clear_error(call, kind, pattern):
    clear_error(call, kind, pattern)


def _counts(program: mpmd.Program) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for rank in range(program.num_ranks):
        for t in program.tasks(rank):
            kinds[t.kind] = kinds.get(t.kind, 0) + 1
    return kinds


@pytest.mark.parametrize("recompute", [True, "full", [0, 1], {0: "full", 1: "full"}])
def test_recompute_asked_twice_is_one_recompute(recompute):
    # The schedule already recomputes every stage: recompute= asks for the
    # same, so each backward keeps its one R (it was "task R(stage=0, mb=0)
    # appears twice"), and the step is the one recompute=True alone gives.
    x, y = torch.randn(2 * M, 4), torch.randn(2 * M, 4)
    both = _local(S.GPipe(M).with_recompute(), recompute=recompute)
    alone = _local(recompute=True)
    for local in (both, alone):
        program = local.runners[0].program
        assert _counts(program) == {"F": 2 * M, "R": 2 * M, "B": 2 * M}
    out = [local.step(x, target=y)[0].loss for local in (both, alone)]
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


def test_recompute_adds_to_what_the_schedule_recomputes():
    # recompute=False leaves the schedule's own R tasks; recompute=[1] adds
    # stage 1's to stage 0's.
    program = _local(S.GPipe(M).with_recompute([0]), recompute=[1]).runners[0].program
    recomputed = {t.stage for r in range(2) for t in program.tasks(r) if t.kind == "R"}
    assert recomputed == {0, 1}
    assert _counts(program)["R"] == 2 * M
    twice = mpmd.compile_schedule(S.GPipe(M).with_recompute([0]).with_recompute(), 2, 2)
    assert _counts(twice) == {"F": 2 * M, "R": 2 * M, "B": 2 * M}


def test_integer_placements_of_other_types_are_taken():
    # numpy's integers and arrays are ints for a placement (np.argsort gives them).
    program = mpmd.compile_schedule(_placed([np.int64(0), np.int64(1)]), 2, 2)
    assert program.placement == [0, 1]
    listed = mpmd.Schedule.from_lists([["0F0", "0B0"], ["1F0", "1B0"]], (np.int32(0), 1))
    assert listed.placement(2, 2) == [0, 1]
    from_array = mpmd.Schedule.from_lists([["0F0", "0B0"], ["1F0", "1B0"]], np.arange(2))
    assert mpmd.compile_schedule(from_array, 2, 2).placement == [0, 1]
