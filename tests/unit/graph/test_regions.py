"""Code that torch.export wraps into a region (an autocast block, a
`torch.no_grad()` block, a reentrant checkpoint) must split by module path
and train like eager mode, as must a model in bfloat16. The regions' nodes lost their module paths
("split module never ran"), and a reentrant checkpoint cut the gradient of
everything after it (1F1B failed, ZB-H1 gave zero gradients)."""

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt
from models import square_loss
from pipeline_check import trains_like_eager

import torchmpmd as mpmd

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
        if self.region == "plain":
            return self.c(self.b(self.a(x)))
        h = ckpt.checkpoint(self.b, self.a(x), use_reentrant=True)
        return self.c(h)


def _run(region: str, dtype: torch.dtype, cls: type, tol: float) -> None:
    x = torch.randn(2 * M, 8, dtype=dtype)
    y = torch.randn(2 * M, 8, dtype=dtype)
    local, ref = trains_like_eager(
        lambda: Regions(region).to(dtype), x, y, square_loss, ["b", "c"], cls(M), 3, tol=tol
    )
    torch.testing.assert_close(local.pipes[0](x[:2]), ref(x[:2]), rtol=0, atol=0)


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


@pytest.mark.parametrize("cls", [S.OneFOneB, S.ZeroBubbleH1])
def test_bfloat16_parameters_train_like_eager(cls):
    # The same ops in the same order per microbatch: bitwise equal, in bfloat16 too.
    x = torch.randn(2 * M, 8, dtype=torch.bfloat16)
    y = torch.randn(2 * M, 8, dtype=torch.bfloat16)
    local, _ = trains_like_eager(
        lambda: Regions("plain").to(torch.bfloat16),
        x,
        y,
        square_loss,
        ["b", "c"],
        cls(M),
        3,
        tol=0.0,
    )
    assert {t.spec.dtype for t in local.pipes[0].transfers} == {torch.bfloat16}


@pytest.mark.parametrize("cls", [S.OneFOneB, S.ZeroBubbleH1])
def test_float32_master_weights_with_bfloat16_compute(cls):
    # Traced under torch.autocast, the graph records the casts: parameters
    # stay float32 (master weights, float32 gradients), matmuls run in
    # bfloat16, and the transfers carry bfloat16, bitwise like eager autocast.
    from torchmpmd.testing import LocalPipeline

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 8)
        )

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out.float() - y).square().mean()

    model, ref = build(), build()
    x, y = torch.randn(4 * M, 8), torch.randn(4 * M, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe = mpmd.trace(model, (x[:4],), split_before=["3", "4"])
    assert [t.spec.dtype for t in pipe.transfers] == [torch.bfloat16, torch.bfloat16]
    local = LocalPipeline(pipe, cls(M), 3, loss_fn=loss, timeout=60)
    local.step(x, target=y)
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ref(xb)
        (loss(out, yb) / M).backward()
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            assert p.dtype == p.grad.dtype == torch.float32, fqn
            torch.testing.assert_close(p.grad, ref.get_parameter(fqn).grad, rtol=0, atol=0)
