"""A model that writes into slices of a fresh tensor (DeepSeek-V3's attention:
`t = x.new_empty(...); t[..., :k].copy_(a); t[..., k:].copy_(b)`) must train:
functionalisation turns the writes into `aten.copy`, which autograd cannot
differentiate ("derivative for aten::copy is not implemented")."""

import pytest
import torch
import torch.nn as nn

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

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


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.mix = HalfAndHalf()
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.mix(self.first(x))))


@pytest.mark.parametrize("cls", [mpmd.schedules.OneFOneB, mpmd.schedules.ZeroBubbleH1])
def test_copy_into_a_fresh_tensor_trains_like_eager(cls):
    def loss(out, y):
        return (out - y).square().mean()

    torch.manual_seed(0)
    model = Model().double()
    ref = Model().double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2 * M, 8, dtype=torch.float64)
    y = torch.randn(2 * M, 8, dtype=torch.float64)
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        (loss(ref(xb), yb) / M).backward()
    pipe = mpmd.trace(model, (x[:2],), split_before=["mix", "last"])
    torch.testing.assert_close(pipe(x[:2]), model(x[:2]), rtol=0, atol=0)
    local = LocalPipeline(pipe, cls(M), 3, loss_fn=loss, timeout=30)
    local.step(x, target=y)
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            expected = ref.get_parameter(fqn).grad
            torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-10, msg=fqn)
