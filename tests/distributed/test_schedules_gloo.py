"""Every built-in schedule on 2 and 4 Gloo processes, on the tied-embedding
GPT and the U-Net whose skips cross every stage boundary, must give the loss
and gradients of unpipelined gradient accumulation (float64)."""

from __future__ import annotations

import pytest
import torch
from harness import check_all, run_ranks
from models import CASES
from pipeline_check import ALL, check, data, microbatches_for, stages_for, traced

import torchmpmd as mpmd


def every_schedule(rank, world):
    done = []
    for name in ("gpt", "deep_unet"):
        for cls in ALL:
            m = microbatches_for(cls, world)
            pipe = traced(name, stages_for(cls, world))
            runner = mpmd.PipelineRunner(
                pipe, cls(m), loss_fn=CASES[name].loss, options=mpmd.RunnerOptions(timeout=60)
            )
            for p in runner.parameters():  # the traced pipe is shared between schedules
                p.grad = None
            batch, target = data(name, m)
            out = runner.step(batch, target=target)
            check(name, out.loss, runner, m)
            # The stages whose split backward (I, W) ran.
            split = sorted({e.stage for e in runner.timeline.tasks if e.kind in "IW"})
            done.append((name, cls.__name__, sorted(runner.local_stages), split))
    return done


@pytest.mark.parametrize("world", [2, 4])
def test_every_builtin_schedule_on_gloo(world):
    reports = check_all(run_ranks(every_schedule, world, deadline=400))
    for rank, report in enumerate(reports):
        assert len(report) == 2 * len(ALL)
        by_name = {(n, s): (local, split) for n, s, local, split in report}
        # V schedules hold stages r and 2p-1-r; zero-bubble ones split I/W.
        assert by_name[("gpt", "ZBV")][0] == [rank, 2 * world - 1 - rank]
        assert by_name[("gpt", "ZeroBubbleH1")][1] == [rank]
        assert by_name[("gpt", "OneFOneB")][1] == []


def compiled(rank, world):
    torch._dynamo.config.cache_size_limit = 64
    name, m = "gpt", 4
    pipe = traced(name, world)
    batch, target = data(name, m)
    kinds = []
    for schedule in (mpmd.schedules.ZeroBubbleH1(m), mpmd.schedules.OneFOneB(m)):
        runner = mpmd.PipelineRunner(
            pipe,
            schedule,
            loss_fn=CASES[name].loss,
            options=mpmd.RunnerOptions(timeout=300, compile=True),
        )
        for p in runner.parameters():
            p.grad = None
        # Dynamo's own count of the graphs it compiled (no runner internals).
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        out = runner.step(batch, target=target)
        check(name, out.loss, runner, m, compiled=True)
        assert not any("_orig_mod" in k for k in runner.state_dict()), "compiled names leak"
        kinds.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    return kinds


def test_torch_compile_with_zero_bubble_and_1f1b():
    # ZB-H1 compiles the split F/I/W graphs; 1F1B compiles each stage module:
    # each step compiled graphs of its own on every rank.
    for compiled_graphs in check_all(run_ranks(compiled, 2, deadline=600)):
        assert all(n > 0 for n in compiled_graphs), compiled_graphs
