"""`mpmd.plan` under torch.distributed: rank 0 profiles and searches, and
every rank gets its plan (timings differ between processes; all ranks must
cut and schedule the model alike)."""

from __future__ import annotations

import torch
from harness import check_all, run_ranks

import torchmpmd as mpmd


def plan_on_each_rank(rank: int, world: int) -> tuple[str, list[str], int, float]:
    torch.manual_seed(rank)  # each rank's model differs: the plan must not
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(6)))
    found = mpmd.plan(model, (torch.randn(2, 16),), 2, batch_size=8, repeats=2)
    return (
        repr(found.schedule),
        found.split_before,
        found.num_microbatches,
        found.predicted_step_time,
    )


def test_every_rank_gets_the_same_plan():
    results = check_all(run_ranks(plan_on_each_rank, 2, deadline=120))
    assert results[0] == results[1], results
