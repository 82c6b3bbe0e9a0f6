"""PipelineRunner's arguments: the tuning knobs in one frozen RunnerOptions;
the former keyword arguments still work, each with a DeprecationWarning
saying what to write instead; a runner changes nothing process-wide."""

import dataclasses
import inspect
import warnings

import pytest
from models import CASES

import torchmpmd as mpmd
from torchmpmd.runtime import LocalWorld, heap


def _pipe():
    case = CASES["mlp"]
    args, kwargs = case.inputs(2)
    return mpmd.trace(case.model(), args, kwargs, **case.split)


def _runner(**kwargs):
    # One rank holding both stages: no peer to wait for.
    return mpmd.PipelineRunner(
        _pipe(), mpmd.schedules.GPipe(2), transport=LocalWorld(1).transport(0), **kwargs
    )


def test_options_are_frozen_and_every_field_is_documented():
    options = mpmd.RunnerOptions(timeout=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.timeout = 6  # type: ignore[misc]
    source = inspect.getsource(mpmd.RunnerOptions)
    for f in dataclasses.fields(mpmd.RunnerOptions):
        at = source.index(f"    {f.name}:")
        after = source[at:].split("\n", 2)[1:]
        assert '"""' in after[0], f"RunnerOptions.{f.name} has no docstring"


def test_runner_takes_options():
    runner = _runner(options=mpmd.RunnerOptions(timeout=7.5, max_early_recvs=3))
    assert runner.timeout == 7.5
    assert runner.options.max_early_recvs == 3


def test_former_keywords_still_work_with_a_deprecation_message():
    # The one test of the former spelling: pyproject.toml's filterwarnings
    # makes its DeprecationWarning an error everywhere else.
    with pytest.warns(DeprecationWarning, match=r"options=mpmd\.RunnerOptions\(timeout=\.\.\.\)"):
        runner = _runner(timeout=7.5)
    assert runner.timeout == 7.5
    assert runner.options == mpmd.RunnerOptions(timeout=7.5)
    # The process-wide CPU knobs point at mpmd.tune_cpu() (False changes nothing).
    with pytest.warns(DeprecationWarning, match=r"call mpmd\.tune_cpu\(\) once at start-up"):
        runner = _runner(keep_freed_memory=False, gloo_sched_batch=False)
    assert runner.options == mpmd.RunnerOptions()


def test_keywords_and_options_together_are_refused():
    with pytest.raises(TypeError, match="not both"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        _runner(options=mpmd.RunnerOptions(), timeout=5)


def test_an_unknown_keyword_names_the_arguments():
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['timeuot'\].*timeout"):
        _runner(timeuot=5)


def test_options_of_another_type_are_refused():
    with pytest.raises(TypeError, match=r"options must be an mpmd\.RunnerOptions, got dict"):
        _runner(options={"timeout": 5})


def test_a_runner_changes_no_process_wide_policy(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append("malloc") or True)
    _runner()
    _runner(options=mpmd.RunnerOptions(timeout=5))
    assert calls == []


def test_tune_cpu_says_what_it_changed(monkeypatch):
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: True)
    tuning = mpmd.tune_cpu(gloo_sched_batch=False)
    assert "thresholds fixed" in tuning.malloc
    assert tuning.gloo_threads == "left alone (gloo_sched_batch=False)"
    tuning.release()
    untouched = mpmd.tune_cpu(keep_freed_memory=False, gloo_sched_batch=False)
    assert untouched.malloc == "left alone (keep_freed_memory=False)"
