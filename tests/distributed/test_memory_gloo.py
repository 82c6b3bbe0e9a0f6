"""Activation memory on 2 Gloo processes, measured from the allocator, against
what the unpipelined model keeps for its backward: a sent activation is freed
once the peer's reply proves it arrived, not held to the end of the step
(Gloo's send reports completion only to a wait)."""

from __future__ import annotations

from harness import check_all, run_ranks
from models import square_loss
from pipeline_check import mlp_memory_case

import torchmpmd as mpmd

M, WIDTH, DEPTH, BATCH = 8, 64, 4, 64


def one_f_one_b(rank, world):
    pipe, x, y, expected = mlp_memory_case(WIDTH, DEPTH, BATCH, M)
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(M),
        loss_fn=square_loss,
        options=mpmd.RunnerOptions(timeout=60, measure_memory=True),
    )
    for _ in range(2):
        runner.step(x, target=y)
    tl = runner.gather_timeline()
    held_after_backward = [e.held_bytes for e in tl.tasks if e.rank == rank and e.kind == "B"]
    return expected, tl.peak_activation_bytes, held_after_backward


def test_sent_activations_are_freed_when_the_reply_arrives():
    reports = check_all(run_ranks(one_f_one_b, 2, deadline=120))
    for rank, (expected, peaks, held_after_backward) in enumerate(reports):
        # 1F1B keeps 2 - rank microbatches in flight: exactly that many
        # forwards' worth, no sent tensor of the earlier ones besides.
        assert abs(peaks[rank] / ((2 - rank) * expected[rank]) - 1) < 0.01, (rank, peaks)
        # Between backwards at most one microbatch stays, and its output
        # (which may still be on its way) is all that may linger past it.
        limit = (1 - rank) * expected[rank] + 0.01 * expected[rank] + WIDTH * 8 * BATCH // M
        assert max(held_after_backward) <= limit, (rank, held_after_backward, expected)
