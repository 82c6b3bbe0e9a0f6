"""The runtime in torch.profiler on Gloo processes: each rank profiles its own
`runner.step`, and its trace holds exactly one range per task of its program
(named as errors name tasks), a range per wait on a receive and per
tied-gradient sum (tests/profiler_ranges.py has the checks)."""

from __future__ import annotations

import torch
from harness import check_all, run_ranks
from models import CASES
from pipeline_check import data, traced
from profiler_ranges import check_step
from torch.profiler import ProfilerActivity, profile

import torchmpmd as mpmd

M = 4


def profiled(rank, world):
    counts = {}
    for name, schedule, num_stages in (
        ("ZeroBubbleH1", mpmd.schedules.ZeroBubbleH1(M), world),
        ("OneFOneB+recompute", mpmd.schedules.OneFOneB(M).with_recompute(), world),
    ):
        runner = mpmd.PipelineRunner(
            traced("gpt", num_stages),
            schedule,
            loss_fn=CASES["gpt"].loss,
            options=mpmd.RunnerOptions(timeout=60),
        )
        batch, target = data("gpt", M)
        runner.step(batch, target=target)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.step(batch, target=target)
        (counts[name],) = check_step(prof.events(), runner.program, [rank])
        kinds = {t.kind for t in runner.program.tasks(rank)}
        counts[name]["kinds"] = "".join(sorted(kinds))
        # Timelines are still gathered as before.
        timeline = runner.gather_timeline()
        assert len(timeline.tasks) > 0
        torch.distributed.barrier()
    return counts


def test_each_gloo_rank_profiles_its_program():
    reports = check_all(run_ranks(profiled, 2, deadline=300))
    for report in reports:
        assert report["ZeroBubbleH1"]["kinds"] == "FIW"
        assert report["OneFOneB+recompute"]["kinds"] == "BFR"
        for counts in report.values():
            assert counts["tasks"] > 0 and counts["waits"] > 0 and counts["reduces"] == 1
