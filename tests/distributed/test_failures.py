"""A rank that dies mid-step must make every other rank fail within the
timeout, with an error naming the rank, the peer, the stage, the microbatch
and the task — and no process may be left hanging."""

from __future__ import annotations

import os
import re
import time

import torch
from harness import run_ranks
from models import MLP

import torchmpmd as mpmd

TIMEOUT = 8.0


def dies_mid_step(rank, world, victim):
    torch.manual_seed(0)
    model = MLP(8, 4).double()
    pipe = mpmd.trace(
        model,
        (torch.randn(2, 8, dtype=torch.float64),),
        split_after=["layers.0", "layers.1", "layers.2"],
    )
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(4),
        loss_fn=lambda out, y: (out - y).pow(2).mean(),
        timeout=TIMEOUT,
    )
    batch = torch.randn(8, 8, dtype=torch.float64)
    runner.step(batch, target=torch.zeros(8, 8, dtype=torch.float64))  # a healthy step first
    if rank == victim:
        module = runner._stages._calls[victim]

        def crash(*args):
            crash.calls += 1
            if crash.calls == 2:  # second microbatch of the next step
                os._exit(17)
            return module(*args)

        crash.calls = 0
        runner._stages._calls[victim] = crash
    start = time.monotonic()
    try:
        runner.step(batch, target=torch.zeros(8, 8, dtype=torch.float64))
    except mpmd.PipelineError as err:
        return {"error": str(err), "after": time.monotonic() - start}
    return {"error": None, "after": time.monotonic() - start}


def test_rank_exits_mid_step():
    start = time.monotonic()
    results = run_ranks(dies_mid_step, 4, 2, deadline=120)
    assert time.monotonic() - start < 100
    assert results[2].exitcode == 17 and not results[2].ok
    for r in (0, 1, 3):
        res = results[r]
        assert res.ok, res.value
        assert res.exitcode == 0, f"rank {r} did not exit cleanly"
        err, after = res.value["error"], res.value["after"]
        assert err is not None, f"rank {r} finished a step its peer died in"
        assert after < TIMEOUT + 5, f"rank {r} took {after:.1f} s to fail"
        assert err.startswith(f"torchmpmd: rank {r} "), err
        # Each names the peer it waited for, the payload (stage, microbatch) and the task.
        assert re.search(
            r"waiting for the (activation|gradient of) '\w+' \(stage \d -> stage \d\) of microbatch "
            r"\d from rank \d, needed by [FB]\(stage=\d, mb=\d\) \(gloo\)",
            err,
        ), err
    # The direct neighbours of the dead rank name it.
    assert "from rank 2" in results[1].value["error"]
    assert "from rank 2" in results[3].value["error"]
