"""Activation memory: what the executor measures (from the allocator) against
what the unpipelined model keeps for its backward, run in one process, and
the simulator's prediction against the measurement."""

from __future__ import annotations

import pytest
import torch
from models import CASES, square_loss
from pipeline_check import ALL, microbatches_for, mlp_memory_case, stages_for, traced

import torchmpmd as mpmd
from torchmpmd.runtime.local import LocalWorld
from torchmpmd.testing import LocalPipeline

M = 4
WIDTH, DEPTH, BATCH = 64, 4, 32  # microbatches of 8 rows: tensors of 4 KiB


@pytest.mark.parametrize(
    "schedule, in_flight",
    # Microbatches a rank keeps at once: GPipe all of them, 1F1B as many
    # as stages from its own to the last.
    [("GPipe", lambda r: M), ("OneFOneB", lambda r: 2 - r)],
)
def test_measured_memory_is_what_the_plain_model_keeps(schedule, in_flight):
    pipe, x, y, expected = mlp_memory_case(WIDTH, DEPTH, BATCH, M)
    local = LocalPipeline(
        pipe, getattr(mpmd.schedules, schedule)(M), 2, loss_fn=square_loss, measure_memory=True
    )
    for _ in range(2):  # the second step: nothing of the first one's set-up
        local.step(x, target=y)
    for r, runner in enumerate(local.runners):
        tl = runner.timeline
        assert tl is not None
        # Each backward finds exactly what its forward kept (the pipeline's
        # own scalars, the loss and its share, are the only extra bytes).
        for e in tl.tasks:
            if e.kind == "B":
                assert e.kept_bytes == pytest.approx(expected[e.stage], rel=0.01), e
        peak = tl.peak_activation_bytes[r]
        assert peak == pytest.approx(in_flight(r) * expected[r], rel=0.01), f"rank {r}"
        # Nothing is held after the last backward but the losses reported.
        assert tl.tasks[-1].held_bytes < 0.01 * expected[r]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
@pytest.mark.slow
def test_simulated_peak_is_within_10_percent_of_the_measured(cls):
    """The simulator, given the per-stage bytes measured in a run
    (`Costs.from_timeline`), predicts each rank's peak within 10%."""
    ranks = 2
    m = microbatches_for(cls, ranks)
    pipe = traced("gpt", stages_for(cls, ranks))
    case = CASES["gpt"]
    (x,), _ = case.inputs(2 * m)
    y = case.target(2 * m)
    local = LocalPipeline(pipe, cls(m), ranks, loss_fn=case.loss, measure_memory=True)
    for _ in range(2):
        local.step(x, target=y)
    measured = mpmd.Timeline.merge(r.timeline for r in local.runners if r.timeline)
    costs = mpmd.Costs.from_timeline(measured, pipe.num_stages)
    assert costs.activation_bytes is not None and min(costs.activation_bytes) > 0
    predicted = local.runners[0].program.simulate(costs)
    for r in range(ranks):
        ratio = measured.peak_activation_bytes[r] / predicted.peak_activation_bytes[r]
        assert 0.9 <= ratio <= 1.1, f"rank {r}: measured / predicted = {ratio:.3f}"


def test_memory_is_not_measured_unless_asked():
    pipe = traced("gpt", 2)
    case = CASES["gpt"]
    (x,), _ = case.inputs(2 * M)
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=case.loss)
    local.step(x, target=case.target(2 * M))
    tl = local.runners[0].timeline
    assert tl is not None
    assert tl.peak_activation_bytes == [-1, -1]
    assert {(e.held_bytes, e.kept_bytes) for e in tl.tasks} == {(-1, -1)}
    # Costs then keep their default activation sizes (the traced estimate).
    assert mpmd.Costs.from_timeline(tl, 1).activation_bytes is None


def _one_rank_runner(loss_fn) -> tuple[mpmd.PipelineRunner, torch.Tensor, torch.Tensor]:
    """Both halves of the MLP on one rank, measuring memory; its batch and target."""
    pipe, x, y, _ = mlp_memory_case(WIDTH, DEPTH, BATCH, M)
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.GPipe(M),
        transport=LocalWorld(1).transport(0),
        loss_fn=loss_fn,
        options=mpmd.RunnerOptions(measure_memory=True),
    )
    return runner, x, y


def test_code_in_a_measured_step_sees_no_profiler():
    """The measuring hook sits where torch keeps its profiler's state: torch
    code asking whether a profiler runs must read "no", not misread it."""
    seen = []

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append((torch.autograd._profiler_enabled(), torch._C._autograd._profiler_type()))
        return square_loss(out, target)

    runner, x, y = _one_rank_runner(loss)
    runner.step(x, target=y)
    assert runner.timeline is not None and runner.timeline.peak_activation_bytes[0] > 0
    assert seen == [(False, torch._C._profiler.ActiveProfilerType.NONE)] * M


def test_a_running_profiler_keeps_the_allocator_hook():
    """Under torch.profiler the step is not measured (-1) rather than the
    profiler's memory events taken from it."""
    runner, x, y = _one_rank_runner(square_loss)
    runner.step(x, target=y)
    assert runner.timeline is not None and runner.timeline.peak_activation_bytes[0] > 0
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        runner.step(x, target=y)
    assert runner.timeline.peak_activation_bytes == [-1]
    assert any(e.cpu_memory_usage > 0 for e in prof.events())
