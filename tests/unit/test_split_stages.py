"""Split (I/W) stages must train what full backward trains: keep backward
formulas that write in place (adaptive average pooling of a non-contiguous
input writes its gradient with `copy_` into a view of a fresh buffer, a node
nothing reads; cut by dataflow it was dropped and ZB-H1 gave zero gradients
on Swin while 1F1B was exact), and take a step without a target."""

import pytest
import torch
import torch.nn as nn

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4


class PooledMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.pool = nn.AdaptiveAvgPool1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c(self.b(self.a(x)))
        return self.pool(h.transpose(1, 2)).flatten(1)  # as Swin pools its tokens


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


@pytest.mark.parametrize("cls", [mpmd.schedules.OneFOneB, mpmd.schedules.ZeroBubbleH1])
def test_in_place_backward_formulas_survive_the_split(cls):
    torch.manual_seed(0)
    model = PooledMLP().double()
    x = torch.randn(2 * M, 5, 8, dtype=torch.float64)
    y = torch.randn(2 * M, 8, dtype=torch.float64)
    ref = PooledMLP().double()
    ref.load_state_dict(model.state_dict())
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        (_loss(ref(xb), yb) / M).backward()

    pipe = mpmd.trace(model, (x[:2],), split_before=["b", "c"])
    local = LocalPipeline(pipe, cls(M), 3, loss_fn=_loss, timeout=30)
    local.step(x, target=y)
    seen = set()
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            expected = ref.get_parameter(fqn).grad
            torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-10, msg=fqn)
            seen.add(fqn)
    assert seen == {n for n, _ in ref.named_parameters()}


def test_split_stages_step_without_a_target():
    torch.manual_seed(0)
    model = PooledMLP().double()
    x = torch.randn(2 * M, 5, 8, dtype=torch.float64)
    ref = PooledMLP().double()
    ref.load_state_dict(model.state_dict())
    for xb in x.chunk(M):
        (ref(xb).square().mean() / M).backward()

    pipe = mpmd.trace(model, (x[:2],), split_before=["b", "c"])
    schedule = mpmd.schedules.ZeroBubbleH1(M)
    local = LocalPipeline(pipe, schedule, 3, loss_fn=lambda out, _: out.square().mean())
    local.step(x)  # no target: the loss function gets None
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            expected = ref.get_parameter(fqn).grad
            torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-10, msg=fqn)
