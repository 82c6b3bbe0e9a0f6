"""Code that torch.export wraps into a region (an autocast block, a
`torch.no_grad()` block, a reentrant checkpoint) must split by module path
and train like eager mode. The regions' nodes lost their module paths
("split module never ran"), and a reentrant checkpoint cut the gradient of
everything after it (1F1B failed, ZB-H1 gave zero gradients)."""

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

S = mpmd.schedules
M = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l(x))


class Regions(nn.Module):
    def __init__(self, region: str) -> None:
        super().__init__()
        self.region = region
        self.a, self.b, self.c = Block(), Block(), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.region == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.b(self.a(x))
            return self.c(h.float())
        if self.region == "no_grad":  # a frozen encoder, split inside
            with torch.no_grad():
                h = self.b(self.a(x))
            return self.c(h)
        h = ckpt.checkpoint(self.b, self.a(x), use_reentrant=True)
        return self.c(h)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def _run(region: str, dtype: torch.dtype, cls: type, tol: float) -> None:
    torch.manual_seed(0)
    model = Regions(region).to(dtype)
    ref = Regions(region).to(dtype)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2 * M, 8, dtype=dtype)
    y = torch.randn(2 * M, 8, dtype=dtype)
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        (_loss(ref(xb), yb) / M).backward()

    pipe = mpmd.trace(model, (x[:2],), split_before=["b", "c"])
    torch.testing.assert_close(pipe(x[:2]), model(x[:2]), rtol=0, atol=0)
    local = LocalPipeline(pipe, cls(M), 3, loss_fn=_loss, timeout=30)
    local.step(x, target=y)
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            expected = ref.get_parameter(fqn).grad
            if expected is None:  # frozen by the no_grad region, as in eager mode
                assert p.grad is None or not p.grad.any(), fqn
                continue
            torch.testing.assert_close(p.grad, expected, rtol=tol, atol=tol, msg=fqn)


@pytest.mark.parametrize("cls", [S.OneFOneB, S.ZeroBubbleH1])
def test_autocast_region_splits_and_transfers_its_dtype(cls):
    torch.manual_seed(0)
    model = Regions("autocast")
    pipe = mpmd.trace(model, (torch.randn(2, 8),), split_before=["b", "c"])
    assert [t.spec.dtype for t in pipe.transfers] == [torch.bfloat16, torch.float32]
    _run("autocast", torch.float32, cls, 1e-5)


@pytest.mark.parametrize("cls", [S.OneFOneB, S.ZeroBubbleH1])
def test_split_inside_a_no_grad_region(cls):
    _run("no_grad", torch.float64, cls, 1e-10)


@pytest.mark.parametrize("cls", [S.OneFOneB, S.ZeroBubbleH1])
def test_reentrant_checkpoint_keeps_the_gradient(cls):
    _run("reentrant", torch.float64, cls, 1e-10)
