"""The runtime in torch.profiler: a `torch.profiler.profile()` around a step
holds, on every rank's thread, exactly one range per task of the rank's
program, named as errors name tasks (`F(stage=0, mb=1)`, `I(...)`, `W(...)`,
`R(...)`), in program order and each holding the ops it ran, and a range
of its own for each wait on a receive (`wait recv(act 'h', mb=1, from rank
0)`) and tied-gradient sum (`REDUCE_tied(p0)`). Ranks as threads of one
process (LocalPipeline): a profiler started on the calling thread records
every rank's thread (tests/profiler_ranges.py has the checks;
tests/distributed/test_profiler_gloo.py runs them on Gloo processes)."""

from __future__ import annotations

import pytest
import torch
from models import CASES
from pipeline_check import data, traced
from profiler_ranges import check_step
from torch.profiler import ProfilerActivity, profile

import torchmpmd as mpmd
from torchmpmd import _C
from torchmpmd.testing import LocalPipeline

S = mpmd.schedules
M = 4


def _mlp() -> tuple[mpmd.Pipe, torch.Tensor, torch.Tensor]:
    """A 2-stage MLP, cheap to trace and split into I/W."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)
    ).double()
    pipe = mpmd.trace(model, (torch.randn(2, 8, dtype=torch.float64),), split_before=["2"])
    return (
        pipe,
        torch.randn(2 * M, 8, dtype=torch.float64),
        torch.randn(2 * M, 8, dtype=torch.float64),
    )


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _check_profiled_step(
    pipe: mpmd.Pipe, schedule: mpmd.Schedule, loss_fn, batch, target, kinds: set[str]
) -> list[dict[str, int]]:
    local = LocalPipeline(pipe, schedule, 2, loss_fn=loss_fn, timeout=60)
    local.step(batch, target=target)  # first-call work stays out of the trace
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        local.step(batch, target=target)
    program = local.runners[0].program
    counts = check_step(prof.events(), program, range(local.num_ranks))
    for rank, c in enumerate(counts):
        assert c["tasks"] == len(program.tasks(rank)) > 0
        assert c["waits"] > 0  # every rank receives something
    assert {t.kind for r in range(local.num_ranks) for t in program.tasks(r)} >= kinds
    # The measured timeline is still there, and agrees on the tasks.
    timeline = local.runners[0].timeline
    assert len([e for e in timeline.tasks if e.kind in "FBIWR"]) == len(program.tasks(0))
    return counts


@pytest.mark.parametrize(
    ("schedule", "kinds"),
    [(S.ZeroBubbleH1(M), {"F", "I", "W"}), (S.OneFOneB(M).with_recompute(), {"F", "R", "B"})],
    ids=["ZeroBubbleH1", "OneFOneB+recompute"],
)
def test_every_rank_has_one_range_per_task(schedule, kinds):
    pipe, x, y = _mlp()
    _check_profiled_step(pipe, schedule, _mse, x, y, kinds)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "num_stages", "kinds"),
    [
        (S.ZeroBubbleH1(M), 2, {"F", "I", "W"}),
        (S.OneFOneB(M).with_recompute(), 2, {"F", "R", "B"}),
        (S.ZBV(M), 4, {"F", "I", "W"}),
        (S.DualPipeV(M), 4, {"F", "B", "I", "W"}),
    ],
    ids=["ZeroBubbleH1", "OneFOneB+recompute", "ZBV", "DualPipeV"],
)
def test_gpt_ranges_with_tied_gradients(schedule, num_stages, kinds):
    """The tied-embedding GPT: tied-gradient receives and their sum have
    ranges too (ZBV and DualPipeV hold both ends of the tie on rank 0: no
    sum). DualPipeV's fused F+B tasks have one range each."""
    batch, target = data("gpt", M)
    counts = _check_profiled_step(
        traced("gpt", num_stages), schedule, CASES["gpt"].loss, batch, target, kinds
    )
    assert [c["reduces"] for c in counts] == ([1, 1] if num_stages == 2 else [0, 0])


def test_no_profiler_no_ranges_and_nothing_left_behind():
    """Without a profiler the ranks' threads record nothing, and a profiled
    call leaves no profiler behind on them or the caller."""
    pipe, batch, target = _mlp()
    local = LocalPipeline(pipe, S.OneFOneB(M), 2, loss_fn=_mse, timeout=60)
    assert not _C.runtime.ProfilerContext.current().active
    with profile(activities=[ProfilerActivity.CPU]):
        assert _C.runtime.ProfilerContext.current().active
        inside = local.on_all_ranks(lambda r: _C.runtime.ProfilerContext.current().active)
        assert inside == [True, True]
    assert not _C.runtime.ProfilerContext.current().active
    assert local.on_all_ranks(lambda r: _C.runtime.ProfilerContext.current().active) == [
        False,
        False,
    ]
    # A step run between profiles leaves nothing for the next one to find.
    local.step(batch, target=target)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(2).add(1)
    assert not any(e.name.startswith(("F(", "B(", "wait recv(")) for e in prof.events())


def test_a_failing_step_closes_its_ranges():
    """A task that raises ends its range: the failed step's trace holds it."""

    def wrap(rank, stage, forward):
        if stage != 1:
            return forward

        def crash(*inputs):
            raise RuntimeError("injected")

        return crash

    pipe, batch, target = _mlp()
    local = LocalPipeline(pipe, S.OneFOneB(M), 2, loss_fn=_mse, timeout=60, wrap_stage=wrap)
    with (
        profile(activities=[ProfilerActivity.CPU]) as prof,
        pytest.raises(Exception, match="injected"),
    ):
        local.step(batch, target=target)
    events = list(prof.events())
    failed = [e for e in events if e.name == "F(stage=1, mb=0)"]
    assert len(failed) == 1 and failed[0].time_range.end >= failed[0].time_range.start
    # Rank 0's ranges up to where it stopped (a wait for the gradient that
    # never came, or the send that failed first) are in the trace too.
    assert any(e.name == "F(stage=0, mb=0)" for e in events)
