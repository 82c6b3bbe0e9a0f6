"""A rank that dies mid-step must make every other rank fail within the
timeout, with an error naming the rank, the peer, the stage, the microbatch
and the task — and no process may be left hanging."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
from harness import run_ranks
from models import MLP, square_loss

import torchmpmd as mpmd

TIMEOUT = 8.0


def _mlp_pipe():
    torch.manual_seed(0)
    model = MLP(8, 4).double()
    pipe = mpmd.trace(
        model,
        (torch.randn(2, 8, dtype=torch.float64),),
        split_after=["layers.0", "layers.1", "layers.2"],
    )
    return model, pipe


def dies_mid_step(rank, world, victim):
    _, pipe = _mlp_pipe()
    calls = None  # counted from the second step on

    def wrap(at_rank, stage, module):
        if (at_rank, stage) != (victim, victim):
            return module

        def crash(*args):
            nonlocal calls
            if calls is not None:
                calls += 1
                if calls == 2:  # second microbatch of the next step
                    os._exit(17)
            return module(*args)

        return crash

    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(4),
        loss_fn=square_loss,
        options=mpmd.RunnerOptions(timeout=TIMEOUT, wrap_stage=wrap),
    )
    batch = torch.randn(8, 8, dtype=torch.float64)
    runner.step(batch, target=torch.zeros(8, 8, dtype=torch.float64))  # a healthy step first
    calls = 0
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


# ---- an exception on one rank (not a dead process) ----------------------------------------------


def raises_on_one_rank(rank, world, victim, where):
    import torch.distributed as dist

    model, pipe = _mlp_pipe()
    reference = MLP(8, 4).double()
    reference.load_state_dict(model.state_dict())
    calls = {"loss": 0, "forward": 0}

    def loss_fn(out, y):
        calls["loss"] += 1
        if where == "loss" and calls["loss"] == 6:  # microbatch 1 of the second step
            raise KeyError("label 'cat' is not in the vocabulary")
        return square_loss(out, y)

    def wrap(at_rank, stage, module):
        if where != "forward" or (at_rank, stage) != (victim, victim):
            return module

        def bad(*args):
            calls["forward"] += 1
            if calls["forward"] == 6:
                raise ValueError("stage input has NaNs")
            return module(*args)

        return bad

    # The default timeout (300 s): peers must not wait it out.
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(4),
        loss_fn=loss_fn,
        options=mpmd.RunnerOptions(wrap_stage=wrap),
    )
    gen = torch.Generator().manual_seed(1)
    batch = torch.randn(8, 8, dtype=torch.float64, generator=gen)
    target = torch.randn(8, 8, dtype=torch.float64, generator=gen)
    runner.step(batch, target=target)
    out = {}
    start = time.monotonic()
    try:
        runner.step(batch, target=target)
        out["error"] = None
    except Exception as err:
        out["error"] = str(err)
        out["types"] = [c.__name__ for c in type(err).__mro__]
    out["after"] = time.monotonic() - start
    # Every later call fails at once, saying what to do.
    start = time.monotonic()
    try:
        runner.step(batch, target=target)
        out["again"] = None
    except mpmd.PipelineError as err:
        out["again"] = str(err)
    out["again_after"] = time.monotonic() - start
    # The recipe it gives works: a new group and runner, the same parameters.
    group = dist.new_group(list(range(world)))
    fresh = mpmd.PipelineRunner(pipe, mpmd.schedules.OneFOneB(4), loss_fn=square_loss, group=group)
    for p in fresh.parameters():
        p.grad = None
    loss = fresh.step(batch, target=target).loss
    (square_loss(reference(batch[:2]), target[:2]) / 4).backward()  # microbatch 0 ...
    for i in range(1, 4):
        (square_loss(reference(batch[2 * i : 2 * i + 2]), target[2 * i : 2 * i + 2]) / 4).backward()
    want = dict(reference.named_parameters())
    out["grad_error"] = max(
        (p.grad - want[n].grad).abs().max().item() for n, p in fresh.named_parameters()
    )
    out["loss"] = loss.item()
    return out


@pytest.mark.parametrize(
    "victim, where, cause",
    [(3, "loss", "KeyError"), (1, "forward", "ValueError")],
    ids=["loss-on-last-rank", "forward-on-rank-1"],
)
def test_exception_on_one_rank_fails_every_rank_within_seconds(victim, where, cause):
    results = run_ranks(raises_on_one_rank, 4, victim, where, deadline=150)
    for res in results:
        assert res.ok, res.value
    for r, res in enumerate(results):
        v = res.value
        assert v["error"] is not None, f"rank {r} finished a step rank {victim} failed"
        # Every rank fails within seconds, not after its 300 s timeout.
        assert v["after"] < 5, f"rank {r} took {v['after']:.1f} s to fail"
        assert v["error"].startswith(f"torchmpmd: rank {r}"), v["error"]
        assert cause in v["error"], v["error"]
        if r == victim:
            assert cause in v["types"] and "PipelineError" in v["types"]
        else:
            assert f"because rank {victim} failed in step: " in v["error"], v["error"]
        assert v["again_after"] < 1
        assert f"torchmpmd: rank {r}: this runner cannot run another step" in v["again"]
        assert f"rank {victim} failed in step" in v["again"]
        assert "torch.distributed.new_group" in v["again"] and "--max-restarts" in v["again"]
        assert v["grad_error"] < 1e-12
