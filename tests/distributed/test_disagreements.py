"""Ranks that disagree must fail, every one of them, with a message naming
both sides, within the timeout: never a SIGABRT (Gloo aborts the process on
a receive of the wrong size), never a hang, never wrong results reported as
success. Before, different batch sizes on two ranks, or clip_grad_norm_ on
one rank while the other gathered its timeline, killed a rank with SIGABRT;
clip_grad_norm_ on one data-parallel replica hung (FSDP) or clipped one
replica only (replicate); a rank that skipped a batch returned wrong losses;
a peer killed between steps was not named; Ctrl-C became a RuntimeError."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.nn as nn
from harness import check_all, run_ranks
from models import square_loss

import torchmpmd as mpmd

TIMEOUT = 4.0


def _runner(timeout: float = TIMEOUT) -> mpmd.PipelineRunner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    pipe = mpmd.trace(model, (torch.randn(2, 4),), split_before=["2", "4"])
    return mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(4),
        loss_fn=square_loss,
        options=mpmd.RunnerOptions(timeout=timeout),
    )


def _outcome(fn) -> dict:
    start = time.monotonic()
    try:
        value = fn()
    except BaseException as err:
        return {"error": f"{type(err).__name__}: {err}", "after": time.monotonic() - start}
    return {"error": None, "value": value, "after": time.monotonic() - start}


def disagree(rank: int, world: int, case: str) -> dict:
    runner = _runner(timeout=60)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 4, generator=g) for _ in range(4)]
    runner.step(batches[0], target=batches[0])
    if case == "batch sizes":
        x = torch.randn(8 if rank == 0 else 12, 4)
        return _outcome(lambda: runner.step(x, target=x))
    if case == "clip and timeline":
        return _outcome(
            lambda: runner.clip_grad_norm_(1.0) if rank == 0 else runner.gather_timeline()
        )
    if case == "clip arguments":
        return _outcome(lambda: runner.clip_grad_norm_(1.0 if rank == 0 else 0.5))
    assert case == "skipped batch"  # rank 1's loop caught a loader error
    mine = batches[2:] if rank == 1 else batches[1:]
    return _outcome(lambda: [float(runner.step(b, target=b).loss) for b in mine])


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        (
            "batch sizes",
            r"were given different batches for call 2 \(step\).*\((8|12), 4\).*\((12|8), 4\)",
        ),
        (
            "clip and timeline",
            r"is at call 2 \((clip_grad_norm_|gather_timeline)\) but rank \d at call 2 "
            r"\((gather_timeline|clip_grad_norm_)\)",
        ),
        ("clip arguments", r"made call 2 \(clip_grad_norm_\) with other arguments"),
        ("skipped batch", r"were given different batches for call 2 \(step\): the same shapes"),
    ],
)
def test_ranks_that_disagree_fail_every_rank_naming_both_sides(case, pattern):
    results = check_all(run_ranks(disagree, 3, case, deadline=120))
    errors = [r["error"] for r in results]
    assert all(e is not None for e in errors), errors  # nobody reports success
    # Found by the check-in, not by a timeout (60 s).
    assert all(r["after"] < 30 and "did not answer" not in r["error"] for r in results), errors
    # The two ranks that compared name both sides; the third is told why.
    direct = [e for e in errors if re.search(pattern, e, re.S)]
    assert len(direct) >= 2, errors
    assert all("rank 0" in e and "rank 1" in e for e in direct), errors


def killed_between_steps(rank: int, world: int) -> dict:
    runner = _runner()
    x = torch.randn(8, 4)
    runner.step(x, target=x)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    return _outcome(lambda: runner.step(x, target=x))


def test_a_peer_killed_between_steps_is_named():
    # Before: "Connection closed by peer [127.0.0.1]:6551 ... A peer may have
    # died", leaving which one to guess.
    results = run_ranks(killed_between_steps, 3, deadline=60)
    assert results[1].exitcode == -signal.SIGKILL
    for r in (0, 2):
        assert results[r].ok, results[r].value
        err, after = results[r].value["error"], results[r].value["after"]
        assert after < TIMEOUT + 2, after
        assert "Rank 1 may have died" in err and "lost rank 1 while exchanging" in err, err


def busy_between_steps(rank: int, world: int, who: str) -> dict:
    runner = _runner()
    x = torch.randn(8, 4)
    runner.step(x, target=x)
    if who == "busy" and rank == 1:
        time.sleep(TIMEOUT + 2)  # an evaluation, a checkpoint: past the timeout
        return _outcome(lambda: runner.step(x, target=x))
    if who == "clip" and rank != 0:
        time.sleep(TIMEOUT + 2)
        return _outcome(lambda: runner.step(x, target=x))
    call = runner.clip_grad_norm_ if who == "clip" else (lambda: runner.step(x, target=x))
    return _outcome(call if who != "clip" else (lambda: call(1.0)))


def test_a_rank_busy_past_the_timeout_is_told_that_its_peers_gave_up_on_it():
    results = check_all(run_ranks(busy_between_steps, 3, "busy", deadline=60))
    # Ranks 0 and 2 both give up on rank 1; either may be first to say so.
    waited = [results[r]["error"] for r in (0, 2)]
    assert all(w is not None for w in waited), waited
    gave_up = "rank 1 did not answer within 4 s while exchanging the check-in of call 2"
    assert any(gave_up in w for w in waited), waited
    late = results[1]["error"]
    # Before: a raw Gloo "Connection closed by peer" for the late rank.
    assert re.search(r"rank 1 stopped step, because rank [02] failed", late), late
    assert "after a peer had stopped waiting for it" in late and "raise the timeout" in late, late


def test_clip_grad_norm_on_one_rank_says_it_is_a_collective():
    results = check_all(run_ranks(busy_between_steps, 3, "clip", deadline=60))
    err = results[0]["error"]
    assert "call 2 (clip_grad_norm_)" in err, err
    assert "not making this call (every rank must make the runner's collective calls" in err, err
    assert results[0]["after"] < TIMEOUT + 2


def one_replica_clips(rank: int, world: int, mode: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    pipe = mpmd.trace(model, (torch.randn(2, 4),), split_before=["2"])
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(2),
        loss_fn=square_loss,
        mesh=mesh,
        options=mpmd.RunnerOptions(timeout=TIMEOUT, data_parallel=mode),
    )
    x = torch.randn(4, 4)
    runner.step(x, target=x)
    if mesh.get_local_rank("dp") == 0:
        return _outcome(lambda: runner.clip_grad_norm_(1.0))
    return _outcome(lambda: runner.step(x, target=x))  # replica 1 goes on without clipping


@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_clip_grad_norm_on_one_data_parallel_replica_fails_every_rank(mode):
    # Before: FSDP hung every rank past 120 s; replicate clipped one replica.
    results = check_all(run_ranks(one_replica_clips, 4, mode, deadline=90))
    for r in results:
        assert r["error"] is not None, results
        assert r["after"] < TIMEOUT + 3, results
    text = "\n".join(r["error"] for r in results)
    assert "is at call 2 (clip_grad_norm_) but global rank" in text, text
    assert "at call 2 (step)" in text, text


def interrupted(rank: int, world: int) -> dict:
    runner = _runner(timeout=20)
    x = torch.randn(8, 4)
    runner.step(x, target=x)
    if rank == 0:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()

    def steps() -> None:
        for _ in range(100_000):
            runner.step(x, target=x)

    # Whether Ctrl-C landed inside a step (which then told the peers why) or
    # between two (in the loop, or splitting the next batch), where no runner
    # call is running to tell them.
    return {**_outcome(steps), "in_step": runner.failed_first}


def test_ctrl_c_in_a_step_stays_a_keyboard_interrupt_and_stops_the_peers():
    results = check_all(run_ranks(interrupted, 3, deadline=60))
    assert results[0]["error"].startswith("KeyboardInterrupt"), results[0]
    for r in results[1:]:
        assert r["error"].startswith("PipelineError"), r
        if results[0]["in_step"]:
            assert "KeyboardInterrupt" in r["error"], r
        else:  # rank 0 left between two steps: its peers lose it
            assert "lost rank 0" in r["error"] and "may have died" in r["error"], r
        assert r["after"] < 5, r


def leaves_between_steps(rank: int, world: int) -> dict:
    runner = _runner(timeout=20)
    x = torch.randn(8, 4)

    def steps() -> None:
        for i in range(3):
            if rank == 0 and i == 2:
                raise KeyboardInterrupt
            runner.step(x, target=x)

    return {**_outcome(steps), "in_step": runner.failed_first}


def test_ctrl_c_between_steps_loses_the_rank_within_the_timeout():
    # No runner call is running on rank 0 to tell the peers why it left:
    # they lose it at their next step's check-in, at once, naming it.
    results = check_all(run_ranks(leaves_between_steps, 3, deadline=60))
    assert results[0]["error"] == "KeyboardInterrupt: " and not results[0]["in_step"], results[0]
    for r in results[1:]:
        assert "lost rank 0" in r["error"] and "may have died" in r["error"], r
        assert r["after"] < 5, r
