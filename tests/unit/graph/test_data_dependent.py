"""Data-dependent operations (MoE top-k routing with nonzero and index_add)
must trace and train exactly; torchmpmd's own cost heuristic crashed on
their symbolic sizes after torch.export had succeeded. What cannot work gets
a clear error: a data-dependent tensor crossing stages. A zero-bubble
schedule runs such a stage's whole backward (B) in place of I/W, which
would fix one microbatch's routing, and says so."""

import re

import pytest
import torch
import torch.nn as nn
from models import square_loss
from pipeline_check import trains_like_eager

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4


class MoE(nn.Module):
    def __init__(self, dim: int = 8, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.gate(tokens), -1).topk(self.k, -1)
        out = torch.zeros_like(tokens)
        for i, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == i, as_tuple=True)
            out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.moe = MoE()
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.moe(self.a(x))))


def _case() -> tuple[Routed, Routed, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Routed().double()
    ref = Routed().double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4 * M, 3, 8, dtype=torch.float64)
    y = torch.randn(4 * M, 3, 8, dtype=torch.float64)
    return model, ref, x, y


@pytest.mark.slow
def test_moe_routing_trains_exactly():
    _, _, x, y = _case()
    local, ref = trains_like_eager(
        lambda: Routed().double(), x, y, square_loss, ["moe", "c"], mpmd.schedules.OneFOneB(M), 3
    )
    checked = {n for r in local.runners for n, _ in r.named_parameters()}
    assert checked == {n for n, _ in ref.named_parameters()}


@pytest.mark.slow
def test_zero_bubble_runs_a_routed_stage_with_full_backward():
    # ZB-H1 splits every stage's backward; the routed stage cannot be split
    # (its I/W graphs would fix one microbatch's routing), so it runs B in
    # I's place, without W, and says so; the others keep I/W. Exact.
    _, _, x, y = _case()
    with pytest.warns(UserWarning, match=r"stages \[1\].*in module 'moe'.*whole backward \(B\)"):
        local, _ = trains_like_eager(
            lambda: Routed().double(),
            x,
            y,
            square_loss,
            ["moe", "c"],
            mpmd.schedules.ZeroBubbleH1(M),
            3,
        )
    kinds = {(t.kind, t.stage) for r in local.runners for t in r.program.tasks(r.rank)}
    assert ("B", 1) in kinds and ("I", 1) not in kinds and ("W", 1) not in kinds
    assert {("I", 2), ("W", 2), ("W", 0)} <= kinds


class RoutedTail(Routed):
    """Four stages' worth of layers, for a V schedule on two ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.tanh(super().forward(x)))


@pytest.mark.slow
def test_zbv_runs_a_routed_stage_with_full_backward():
    # ZBV puts stages 0 and 3 on rank 0, 1 and 2 on rank 1: the routed stage
    # 1 runs B on the rank whose other stage keeps I/W. Two steps, so the
    # second step's routing differs from the first's. Exact.
    _, _, x, y = _case()
    with pytest.warns(UserWarning, match=r"ZBV splits the backward of stages \[1\].*'moe'"):
        local, _ = trains_like_eager(
            lambda: RoutedTail().double(),
            x,
            y,
            square_loss,
            ["moe", "c", "d"],
            mpmd.schedules.ZBV(M),
            2,
            steps=2,
        )
    kinds = {(t.kind, t.stage) for r in local.runners for t in r.program.tasks(r.rank)}
    assert ("B", 1) in kinds and ("I", 1) not in kinds and ("W", 1) not in kinds
    assert {("I", 0), ("W", 0), ("I", 2), ("W", 2), ("W", 3)} <= kinds


@pytest.mark.slow
def test_splitting_a_routed_stage_by_force_says_how_not_to():
    model, _, x, y = _case()
    pipe = mpmd.trace(model, (x[:4],), split_before=["moe", "c"])
    local = LocalPipeline(
        pipe,
        mpmd.schedules.ZeroBubbleH1(M),
        3,
        loss_fn=square_loss,
        timeout=30,
        split_backward=True,
    )
    with pytest.raises(
        ValueError, match=r"stage 1: .* in module 'moe' computes a tensor whose.*with_full_backward"
    ):
        local.step(x, target=y)


def test_full_backward_replaces_i_and_drops_w():
    zb = mpmd.schedules.ZeroBubbleH1(M)
    full = zb.with_full_backward([1])
    for before, after in zip(zb.tasks(2, 2, M), full.tasks(2, 2, M), strict=True):
        expect = [
            mpmd.Task("B", t.stage, t.microbatch) if (t.kind, t.stage) == ("I", 1) else t
            for t in before
            if (t.kind, t.stage) != ("W", 1)
        ]
        assert after == expect
    assert "with_full_backward([1])" in repr(full)
    with pytest.raises(TypeError, match="a stage is an int index"):
        zb.with_full_backward(["1"])


def test_data_dependent_tensor_crossing_stages_is_refused():
    class Crossing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            picked = h[torch.nonzero(h[:, 0] > 0, as_tuple=True)]
            h = mpmd.mark_stage_end(h)  # `picked` is made before, read after
            return self.b(picked).sum() + self.b(h).sum()

    with pytest.raises(
        ValueError, match=re.escape("not a single tensor with a shape known at trace time")
    ):
        mpmd.trace(Crossing(), (torch.randn(4, 8),))
