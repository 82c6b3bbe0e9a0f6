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
            runner = mpmd.PipelineRunner(pipe, cls(m), loss_fn=CASES[name].loss, timeout=60)
            for p in runner.parameters():  # the traced pipe is shared between schedules
                p.grad = None
            batch, target = data(name, m)
            out = runner.step(batch, target=target)
            check(name, out.loss, runner, m)
            done.append(
                (name, cls.__name__, sorted(runner.local_stages), sorted(runner._split_stages))
            )
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


def compiled_zero_bubble(rank, world):
    torch._dynamo.config.cache_size_limit = 64
    name, m = "gpt", 4
    pipe = traced(name, world)
    runner = mpmd.PipelineRunner(
        pipe, mpmd.schedules.ZeroBubbleH1(m), loss_fn=CASES[name].loss, timeout=300, compile=True
    )
    batch, target = data(name, m)
    out = runner.step(batch, target=target)
    check(name, out.loss, runner, m, compiled=True)
    graphs = runner._split_graphs[rank]
    return type(graphs._forward).__name__, type(graphs._weight_grad).__name__


def test_zero_bubble_with_torch_compile():
    reports = check_all(run_ranks(compiled_zero_bubble, 2, deadline=600))
    for fwd, _wgrad in reports:
        assert "Optimized" in fwd or "Compiled" in fwd or fwd != "GraphModule", fwd
