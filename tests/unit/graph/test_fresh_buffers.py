"""A model that writes into slices of a fresh tensor (DeepSeek-V3's attention:
`t = x.new_empty(...); t[..., :k].copy_(a); t[..., k:].copy_(b)`) must train:
functionalisation turns the writes into `aten.copy`, which autograd cannot
differentiate ("derivative for aten::copy is not implemented")."""

import pytest
import torch
import torch.nn as nn
from models import square_loss
from pipeline_check import trains_like_eager

import torchmpmd as mpmd

# Every test here takes over ~2 s on 2 cores.
pytestmark = pytest.mark.slow

M = 4


class HalfAndHalf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.new_empty(*x.shape[:-1], 8)
        t[..., :4].copy_(self.a(x))
        t[..., 4:].copy_(self.b(x).float().double())  # a cast on the way in
        return t


class FreshSlices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.mix = HalfAndHalf()
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.mix(self.first(x))))


@pytest.mark.parametrize("cls", [mpmd.schedules.OneFOneB, mpmd.schedules.ZeroBubbleH1])
def test_copy_into_a_fresh_tensor_trains_like_eager(cls):
    x = torch.randn(2 * M, 8, dtype=torch.float64)
    y = torch.randn(2 * M, 8, dtype=torch.float64)
    local, ref = trains_like_eager(
        lambda: FreshSlices().double(),
        x,
        y,
        square_loss,
        ["mix", "last"],
        cls(M),
        3,
    )
    torch.testing.assert_close(local.pipes[0](x[:2]), ref(x[:2]), rtol=0, atol=0)
