"""`runner.clip_grad_norm_` must equal `torch.nn.utils.clip_grad_norm_` on the
unpipelined model: the norm over every rank's gradients with each parameter
counted once (a tied weight, whose summed gradient every holder has, once),
every gradient scaled alike, the total norm returned on every rank."""

import pytest
import torch
from models import CASES

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("ranks", [2, 4])
def test_clip_grad_norm_equals_the_unpipelined_model(norm_type, ranks):
    case = CASES["gpt"]  # embedding tied to the output layer, across ranks
    model = case.model(torch.float64)
    ref = case.model(torch.float64)
    args, _ = case.inputs(2)
    pipe = mpmd.trace(model, args, **case.split)
    assert pipe.tied
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), ranks, loss_fn=case.loss, timeout=60)
    batch, _ = case.inputs(2 * M)
    target = case.target(2 * M)
    local.step(*batch, target=target)
    for xb, yb in zip(batch[0].chunk(M), target.chunk(M), strict=True):
        (case.loss(case.output(ref(xb)), yb) / M).backward()
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
