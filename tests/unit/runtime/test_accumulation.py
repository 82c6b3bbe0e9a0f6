"""Gradient accumulation across steps: two `step` calls without `zero_grad`
must leave every gradient, tied weights included, equal to two passes of
unpipelined gradient accumulation (the tied reduction must sum only this
step's part, not the whole `.grad` again)."""

import pytest
import torch
from models import CASES
from pipeline_check import data, traced

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

# Every test here takes over ~2 s on 2 cores.
pytestmark = pytest.mark.slow

S = mpmd.schedules
M = 4


def _two_passes(name: str) -> dict[str, torch.Tensor]:
    case = CASES[name]
    model = case.model(torch.float64)
    batch, target = data(name, M)
    for _ in range(2):
        for x, y in zip(batch.chunk(M), target.chunk(M), strict=True):
            (case.loss(model(x), y) / M).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("cls", [S.OneFOneB, S.ZeroBubbleH1])
def test_two_steps_without_zero_grad_accumulate_like_eager(cls):
    pipe = traced("gpt", 2)
    assert pipe.tied, "the fixture must tie a weight across stages"
    local = LocalPipeline(pipe, cls(M), 2, loss_fn=CASES["gpt"].loss, timeout=60)
    batch, target = data("gpt", M)
    local.step(batch, target=target)
    local.step(batch, target=target)
    expected = _two_passes("gpt")
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            torch.testing.assert_close(p.grad, expected[fqn], rtol=1e-10, atol=1e-10, msg=fqn)
    # Each rank holds the tied weight under the name its stage uses.
    names = set(pipe.parameter_aliases[next(iter(pipe.tied))])
    tied = [p for r in local.runners for n, p in r.named_parameters() if n in names]
    assert len(tied) == 2
    for p in tied[1:]:
        assert torch.equal(p.grad, tied[0].grad), "tied copies must stay bitwise equal"
