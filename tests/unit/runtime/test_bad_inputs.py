"""A catalogue of bad inputs, as a hostile or hurried user gives them: each
must fail before anything runs (or at the first step, for data), with the
right exception type and a message that names the problem and the fix;
never a raw pybind11 signature dump, an AttributeError from deep inside, or
a silent success."""

from __future__ import annotations

import datetime
import math
from typing import Any

import pytest
import torch
from catalogue import Case, cases, clear_error, tiny_model, tiny_pipe
from models import square_loss

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

S = mpmd.schedules
M = 2


def _local(**kwargs: Any) -> LocalPipeline:
    kwargs.setdefault("loss_fn", square_loss)
    kwargs.setdefault("timeout", 5)
    return LocalPipeline(tiny_pipe(), S.GPipe(M), 2, **kwargs)


def _simulated() -> mpmd.Timeline:
    return mpmd.compile_schedule(S.GPipe(M), 2, 2).simulate()


def _runner(**kwargs: Any) -> mpmd.PipelineRunner:
    return _local(**kwargs).runners[0]


x, y = torch.randn(4, 4), torch.randn(4, 4)

# (id, callable, exception type, message pattern)
CASES: list[Case] = [
    # ---- tracing
    (
        "trace a function",
        lambda: mpmd.trace(lambda v: v, (x,)),
        TypeError,
        "must be a torch.nn.Module",
    ),
    (
        "split point not a string",
        lambda: mpmd.trace(tiny_model(), (x,), split_before=[2]),
        TypeError,
        "module paths \\(strings\\)",
    ),
    (
        "split points as one string",
        lambda: mpmd.trace(tiny_model(), (x,), split_before="2"),
        TypeError,
        "write \\['2'\\]",
    ),
    (
        "both split lists",
        lambda: mpmd.trace(tiny_model(), (x,), split_before=["2"], split_after=["0"]),
        ValueError,
        "not both",
    ),
    ("example args as a list", lambda: mpmd.trace(tiny_model(), [x]), TypeError, "as a tuple"),
    (
        "unknown split module",
        lambda: mpmd.trace(tiny_model(), (x,), split_before=["nope"]),
        ValueError,
        "nope",
    ),
    # ---- tasks and schedules
    ("task kind", lambda: mpmd.Task("X", 0, 0), ValueError, "kind must be one of"),
    ("task stage as a string", lambda: mpmd.Task("F", "0", 0), TypeError, "stage must be an int"),
    ("task stage as a bool", lambda: mpmd.Task("F", True, 0), TypeError, "stage must be an int"),
    (
        "task negative microbatch",
        lambda: mpmd.compile_schedule(
            mpmd.Schedule.from_lists(
                [["0F0", "0B0", mpmd.Task("F", 0, -1)], ["1F0", "1B0"]], [0, 1], 1
            ),
            tiny_pipe(),
            2,
        ),
        ValueError,
        "-1",
    ),
    ("task huge microbatch", lambda: mpmd.Task("F", 0, 2**40), ValueError, "out of range"),
    ("zero microbatches", lambda: S.GPipe(0), ValueError, "positive int"),
    ("float microbatches", lambda: S.GPipe(2.0), ValueError, "positive int"),
    (
        "float placement",
        lambda: mpmd.Schedule.from_lists([["0F0", "0B0"], ["1F0", "1B0"]], [0.0, 1.9]),
        TypeError,
        "placement gives each stage's rank as an int",
    ),
    ("bad action text", lambda: mpmd.Task.parse("F0"), ValueError, "F0"),
    (
        "incomplete schedule",
        lambda: mpmd.compile_schedule(
            mpmd.Schedule.from_lists([["0F0"], ["1F0", "1B0"]], [0, 1]), tiny_pipe(), 2
        ),
        ValueError,
        "0B0|B\\(stage=0",
    ),
    (
        "schedule for other ranks",
        lambda: mpmd.compile_schedule(S.GPipe(M), tiny_pipe(), 0),
        ValueError,
        "num_ranks must be a positive int",
    ),
    (
        "not a schedule",
        lambda: mpmd.compile_schedule("gpipe", tiny_pipe(), 2),
        TypeError,
        "expected an mpmd.Schedule",
    ),
    (
        "recompute unknown stage",
        lambda: mpmd.compile_schedule(S.GPipe(M).with_recompute([9]), tiny_pipe(), 2),
        ValueError,
        "stages \\[9\\] do not exist",
    ),
    # ---- runner options
    (
        "runner given a model",
        lambda: mpmd.PipelineRunner(tiny_model(), S.GPipe(M)),
        TypeError,
        "needs an mpmd.Pipe",
    ),
    (
        "local pipeline given a model",
        lambda: LocalPipeline(tiny_model(), S.GPipe(M), 2),
        TypeError,
        "needs an mpmd.Pipe",
    ),
    (
        "negative timeout",
        lambda: _runner(timeout=-1),
        ValueError,
        "timeout must be a positive number",
    ),
    (
        "NaN timeout",
        lambda: _runner(timeout=math.nan),
        ValueError,
        "timeout must be a positive number",
    ),
    (
        "zero timedelta",
        lambda: _runner(timeout=datetime.timedelta(0)),
        ValueError,
        "timeout must be a positive number",
    ),
    (
        "compile as a string",
        lambda: _runner(compile="yes"),
        TypeError,
        "compile must be True, False or a dict",
    ),
    ("negative early receives", lambda: _runner(max_early_recvs=-1), ValueError, "max_early_recvs"),
    ("meta device", lambda: _runner(device="meta"), ValueError, "device='meta' cannot run a step"),
    (
        "unknown recompute mode",
        lambda: _runner(recompute="partial"),
        ValueError,
        "recompute='partial'",
    ),
    (
        "recompute mode of a stage",
        lambda: _runner(recompute={0: "some"}),
        ValueError,
        "'full' or 'selective'",
    ),
    (
        "recompute of a missing stage",
        lambda: _runner(recompute={5: "full"}),
        ValueError,
        "names stage 5",
    ),
    (
        "split_backward as a string",
        lambda: _runner(split_backward="yes"),
        ValueError,
        "split_backward must be True, False or 'auto'",
    ),
    (
        "split_backward off with I/W tasks",
        lambda: LocalPipeline(tiny_pipe(), S.ZeroBubbleH1(M), 2, split_backward=False),
        ValueError,
        "need split_backward|which need",
    ),
    (
        "unknown chunk_dims input",
        lambda: _runner(chunk_dims={"z": 0}),
        ValueError,
        "chunk_dims names unknown inputs",
    ),
    (
        "data parallel without a mesh",
        lambda: _runner(data_parallel="fsdp"),
        ValueError,
        "needs a mesh with a 'dp' dimension",
    ),
    (
        "parallelize without fsdp",
        lambda: _runner(parallelize=lambda m, mesh: None),
        ValueError,
        "parallelize= applies to data_parallel='fsdp'",
    ),
    (
        "group and transport",
        lambda: mpmd.PipelineRunner(tiny_pipe(), S.GPipe(M), group=object(), transport=object()),
        ValueError,
        "not both",
    ),
    (
        "transport of another kind",
        lambda: mpmd.PipelineRunner(tiny_pipe(), S.GPipe(M), transport=object()),
        TypeError,
        "must be a torchmpmd transport",
    ),
    # ---- step inputs
    (
        "target passed positionally",
        lambda: _runner().step(x, y),
        TypeError,
        "pass it as step\\(\\.\\.\\., target=y\\)",
    ),
    (
        "batch smaller than the microbatches",
        lambda: _runner().step(x[:1], target=y[:1]),
        ValueError,
        "at least one row",
    ),
    (
        "unknown keyword input",
        lambda: _runner().step(x, target=y, mask=x),
        TypeError,
        "got unexpected \\['mask'\\]",
    ),
    (
        "input of another dtype",
        lambda: _local().step(x.long(), target=y),
        TypeError,
        "input 'args\\[0\\]' has dtype torch.int64, but the pipeline was traced with torch.float32",
    ),
    (
        "missing target",
        lambda: _local().step(x),
        TypeError,
        "failed with no target.*pass the target to step as target=",
    ),
    (
        "loss that is not a scalar",
        lambda: _local(loss_fn=lambda o, t: o - t).step(x, target=y),
        ValueError,
        "must be a tensor with one element",
    ),
    (
        "loss raising KeyError",
        lambda: _local(loss_fn=lambda o, t: {}["k"]).step(x, target=y),
        KeyError,
        "KeyError",
    ),
    # ---- state
    (
        "state dict None",
        lambda: _runner().load_state_dict(None),
        TypeError,
        "takes a mapping of names to tensors",
    ),
    (
        "state dict list value",
        lambda: _runner().load_state_dict({"0.weight": [1.0]}),
        TypeError,
        "'0.weight' is a list, not a tensor",
    ),
    (
        "state dict unknown key",
        lambda: _runner().load_state_dict({**tiny_model().state_dict(), "bogus": torch.ones(1)}),
        KeyError,
        "\\['bogus'\\] are not parameters",
    ),
    (
        "state dict missing key",
        lambda: _runner().load_state_dict({}),
        KeyError,
        "found no entry for",
    ),
    (
        "state dict wrong shape",
        lambda: _runner().load_state_dict(
            {**tiny_model().state_dict(), "0.weight": torch.ones(2, 2)}
        ),
        ValueError,
        "has shape \\(2, 2\\)",
    ),
    (
        "timeline before a step",
        lambda: _runner().gather_timeline(),
        RuntimeError,
        "run a step first",
    ),
    # ---- plots
    ("plot nothing", lambda: mpmd.viz.plot([]), ValueError, "no timeline given"),
    (
        "plot an empty timeline",
        lambda: mpmd.viz.plot(mpmd.Timeline(2, [])),
        ValueError,
        "has no tasks",
    ),
    (
        "plot with too few titles",
        lambda: mpmd.viz.plot([_simulated(), _simulated()], titles=["one"]),
        ValueError,
        "1 titles for 2 timelines",
    ),
    (
        "plot into a directory",
        lambda: mpmd.viz.plot(_simulated(), "."),
        ValueError,
        "is not an image file",
    ),
    ("plot a program", lambda: mpmd.viz.plot([tiny_pipe()]), TypeError, "not an mpmd.Timeline"),
]


@cases(CASES)
def test_bad_input_gets_a_clear_error(call, kind, pattern):
    clear_error(call, kind, pattern)


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 40


def test_a_stage_exception_keeps_its_type_and_is_chained():
    with pytest.raises(KeyError) as err:
        _local(loss_fn=lambda o, t: {}["missing"]).step(x, target=y)
    assert isinstance(err.value, mpmd.PipelineError)
    assert isinstance(err.value.__cause__, KeyError)
    # What the failed step left behind is said, with what to do.
    assert "zero them (optimizer.zero_grad()) before the next step" in str(err.value)


def test_runners_given_different_jobs_fail_naming_the_difference():
    # Rank 1 was started with 4 microbatches, rank 0 with 2: without the
    # check they would pair messages that do not belong together.
    local = _local()
    local.runners[1] = mpmd.PipelineRunner(
        local.pipes[1],
        S.GPipe(4),
        transport=local.world.transport(1),
        loss_fn=square_loss,
        options=mpmd.RunnerOptions(timeout=5),
    )
    with pytest.raises(
        RuntimeError,
        match=r"the runners were not given the same job: the "
        r"schedule and its program of rank\(s\) \[1\] differs from rank 0's",
    ):
        local.step(x, target=y)


def test_local_pipeline_stays_usable_after_a_bad_call():
    # Every rank refuses the same bad batch before any message: the world is
    # untouched, and the next good step runs.
    local = _local()
    with pytest.raises(ValueError, match="at least one row"):
        local.step(x[:1], target=y[:1])
    out = local.step(x, target=y)
    assert torch.isfinite(out[0].loss)


@pytest.mark.slow
def test_a_stuck_rank_is_not_waited_for_past_the_timeout():
    import time

    def slow_loss(out, t):
        time.sleep(12)  # user code that hangs far past the 1 s timeout
        return square_loss(out, t)

    local = _local(loss_fn=slow_loss, timeout=1)
    start = time.monotonic()
    with pytest.raises(Exception, match=r"timed out|still running"):
        local.step(x, target=y)
    assert time.monotonic() - start < 9.0


@pytest.mark.slow
def test_a_rank_that_skipped_a_step_fails_every_rank_naming_both_calls():
    # Rank 1's loop caught an exception and skipped its second step: without
    # the check, its third step would pair with rank 0's second and report
    # success with wrong gradients.
    local = _local()
    local.step(x, target=y)
    local.runners[1]._calls += 1  # as if it had gone through a step rank 0 never made
    with pytest.raises(
        RuntimeError,
        match=r"rank 0 is at call 2 \(step\) but rank 1 at call 3 \(step\)"
        r"|rank 1 is at call 3 \(step\) but rank 0 at call 2 \(step\)",
    ):
        local.step(x, target=y)


def test_tune_cpu_refuses_a_policy_that_is_not_a_bool_before_changing_anything(monkeypatch):
    # "no" is truthy: it used to fix malloc's thresholds for the life of the process.
    import torchmpmd.runtime.tune as tune

    changed: list[str] = []
    monkeypatch.setattr(tune.heap, "keep_freed_memory", lambda: changed.append("malloc") or True)
    monkeypatch.setattr(tune, "BatchHold", lambda: changed.append("gloo threads"))
    for name, value, shown in (
        ("keep_freed_memory", "no", "'no' \\(str\\)"),
        ("gloo_sched_batch", 0, "0 \\(int\\)"),
    ):
        with pytest.raises(
            TypeError,
            match=f"^mpmd\\.tune_cpu: {name} must be True or False, got {shown}; nothing was "
            f"changed. Pass {name}=False to leave that policy alone$",
        ):
            mpmd.tune_cpu(**{name: value})
    assert changed == []


def test_a_step_inside_autocast_is_refused_before_any_message():
    # Ranks as threads ignored the caller's autocast (thread-local state) and
    # trained in float32; processes cast the traced graph's ops and failed
    # mid-step on the plan's dtypes. Mixed precision is traced in.
    local = _local()
    calls = [
        ("step", lambda: local.step(x, target=y)),
        ("eval_step", lambda: local.eval_step(x)),
        ("step", lambda: local.on_all_ranks(lambda r: r.step(x, target=y))),
    ]
    for call, run in calls:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            clear_error(
                run,
                RuntimeError,
                f"^PipelineRunner\\.{call} \\(rank \\d\\): called inside torch\\.autocast\\('cpu', "
                "dtype=torch\\.bfloat16\\), which a pipeline does not apply: it runs the graph "
                "mpmd\\.trace recorded.*trace inside torch\\.autocast instead.*call "
                f"{call} outside it",
            )
    # Refused on every rank before any message: the pipeline stays usable.
    assert torch.isfinite(local.step(x, target=y)[0].loss)
    assert local.eval_step(x)[0].dtype == torch.float32
