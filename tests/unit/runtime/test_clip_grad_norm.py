"""`runner.clip_grad_norm_` must equal `torch.nn.utils.clip_grad_norm_` on the
unpipelined model: the norm over every rank's gradients with each parameter
counted once (a tied weight, whose summed gradient every holder has, once),
every gradient scaled alike, the total norm returned on every rank."""

import pytest
import torch

import torchmpmd as mpmd

# Every test here takes over ~2 s on 2 cores.
pytestmark = pytest.mark.slow

M = 4


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("ranks", [2, 4])
def test_clip_grad_norm_equals_the_unpipelined_model(
    norm_type, ranks, gpt, reference, local_pipeline
):
    _case, pipe, batch, target = gpt  # embedding tied to the output layer, across ranks
    assert pipe.tied
    local = local_pipeline(gpt, mpmd.schedules.OneFOneB(M), ranks)
    local.step(*batch, target=target)
    ref, _ = reference(gpt)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type)
    norms = local.clip_grad_norm_(0.1, norm_type)
    for norm in norms:
        torch.testing.assert_close(norm, expected, rtol=1e-12, atol=1e-12)
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            torch.testing.assert_close(
                p.grad, ref.get_parameter(fqn).grad, rtol=1e-12, atol=1e-12, msg=fqn
            )
    assert float(expected) > 0.1  # the clip did scale
