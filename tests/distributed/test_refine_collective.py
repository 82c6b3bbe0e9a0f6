"""`mpmd.refine` is a collective: called by one rank of two (its peer never
joins), it fails within the runners' timeout on the rank that called,
naming the rank that did not and what it waited for, instead of a Gloo
error or a hang; ranks given different arguments fail naming them."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from harness import check_all, run_ranks

import torchmpmd as mpmd


def refine_alone(rank: int, world: int) -> list[str]:
    # Rank 0 calls refine on the world group, rank 1 on another group of
    # both: in each group one rank calls and the other never does.
    other, both = dist.new_group([0, 1]), dist.new_group([0, 1])
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    plan = mpmd.Plan(
        schedule=mpmd.schedules.OneFOneB(4),
        split_before=["2"],
        num_microbatches=4,
        num_ranks=2,
        predicted_step_time=1.0,
        predicted_peak_bytes=[0, 0],
    )
    x = torch.randn(8, 8)
    options = mpmd.RunnerOptions(timeout=1)
    seen = []
    start = time.monotonic()
    try:
        mpmd.refine(plan, model, x, rounds=1, options=options, group=other if rank else None)
    except Exception as err:
        seen.append(f"{type(err).__name__}: {err}")
    seen.append(f"{time.monotonic() - start:.1f}")
    # Both call, with other arguments: both are told which. (On a group of
    # its own: on the world group rank 0 is a call ahead.) The ranks leave
    # the first call up to the verdict's grace apart: a timeout of 10 s lets
    # the later one arrive, however loaded the machine.
    patient = mpmd.RunnerOptions(timeout=10)
    try:
        mpmd.refine(plan, model, x, rounds=1 + rank, options=patient, group=both)
    except Exception as err:
        seen.append(f"{type(err).__name__}: {err}")
    return seen


@pytest.mark.slow
def test_refine_on_one_rank_fails_naming_the_rank_that_did_not_call():
    results = check_all(run_ranks(refine_alone, 2, deadline=60))
    for rank, (alone, seconds, differ) in enumerate(results):
        assert alone.startswith("TimeoutError: mpmd.refine is a collective: every rank"), alone
        assert f"Rank(s) [{1 - rank}] did not call it within 1 s (rank {rank} waited" in alone
        assert "raise RunnerOptions(timeout=...)" in alone
        assert float(seconds) < 10, seconds
        assert differ.startswith("ValueError: mpmd.refine: rank "), differ
        assert "were given different rounds (" in differ
