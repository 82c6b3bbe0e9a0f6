"""A transport plugs into PipelineRunner through its public `transport=`
argument (the path the in-process harness takes too), results such as the
gathered timeline travel over it, and a wrong transport argument is refused
with what to pass instead."""

import pytest
import torch

import torchmpmd as mpmd
from torchmpmd.runtime import LocalWorld, Transport
from torchmpmd.testing import LocalPipeline

M = 4


@pytest.mark.slow
def test_runners_on_a_local_world_match_gradient_accumulation_and_gather_timelines(gpt, reference):
    case, pipe, batch, target = gpt
    world = LocalWorld(2)
    assert isinstance(world.transport(0), Transport)
    # The same public argument a user's own transport would take.
    local = LocalPipeline(
        pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=case.loss, timeout=30, measure_memory=True
    )
    outs = local.step(*batch, target=target)
    _ref, ref_loss = reference(gpt)
    for out in outs:
        torch.testing.assert_close(out.loss, ref_loss)

    gathered = local.on_all_ranks(lambda r: r.gather_timeline())

    def fields(e: mpmd.TimelineEvent) -> tuple:
        return (e.rank, e.kind, e.stage, e.microbatch, e.start, e.end, e.held_bytes, e.kept_bytes)

    expected = sorted(fields(e) for r in local.runners for e in r.timeline.events)
    assert len(expected) == 2 * pipe.num_stages * M  # an F and a B per stage and microbatch
    assert min(e[-1] for e in expected) > 0  # every task measured what it kept
    peaks = [r.timeline.peak_activation_bytes[r.rank] for r in local.runners]
    assert min(peaks) > 0
    for tl in gathered:
        assert tl.num_ranks == 2 and tl.source == "measured"
        assert sorted(fields(e) for e in tl.events) == expected
        assert tl.peak_activation_bytes == peaks


def test_bad_transport_arguments_say_what_to_pass(gpt):
    pipe = gpt.pipe
    schedule = mpmd.schedules.GPipe(M)
    with pytest.raises(TypeError, match="transport must be a torchmpmd transport, got str"):
        mpmd.PipelineRunner(pipe, schedule, transport="gloo")
    world = LocalWorld(2)
    with pytest.raises(ValueError, match="pass group or transport, not both"):
        mpmd.PipelineRunner(pipe, schedule, transport=world.transport(0), group=object())
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        mpmd.PipelineRunner(pipe, schedule)
