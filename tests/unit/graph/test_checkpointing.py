"""Activation checkpointing in model code must survive tracing: the ops of a
`torch.utils.checkpoint` region (non-reentrant or reentrant) are recomputed
in the stage's backward, with full (B) and split (I/W) backward, so a stage
keeps what eager checkpointing keeps, not every intermediate (the traced
stage kept them all: 14,592 saved elements with or without checkpointing
on a small MLP block), and gradients equal eager mode's."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from models import square_loss
from pipeline_check import trains_like_eager

import torchmpmd as mpmd
from torchmpmd.graph.split import SplitStage

# Every test here takes over ~2 s on 2 cores.
pytestmark = pytest.mark.slow

M = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(F.layer_norm(x, (16,)))))


class Checkpointed(nn.Module):
    def __init__(self, mode: str | None) -> None:
        super().__init__()
        self.mode = mode
        self.first = Block()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for block in self.blocks:
            if self.mode is None:
                x = block(x)
            else:
                x = ckpt.checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x


def _model(mode: str | None, dtype: torch.dtype = torch.float32) -> Checkpointed:
    torch.manual_seed(0)
    return Checkpointed(mode).to(dtype)


def _activation_bytes(module: nn.Module, run) -> int:
    """Bytes autograd saves while `run()` executes, parameters not counted."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.untyped_storage().data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def _stage_saves(mode: str | None) -> tuple[int, int, int]:
    """Saved bytes of stage 1 (the checkpointed blocks): full backward, split
    backward (what F keeps for I and W), and eager mode on the same blocks."""
    x = torch.randn(8, 16)
    model = _model(mode)
    pipe = mpmd.trace(model, (x,), split_before=["blocks.0"])
    stage = pipe.stage(1)
    h = pipe.stage(0)(x)[0].detach().requires_grad_()
    full = _activation_bytes(stage, lambda: stage(h))

    names = [n for n, _ in stage.named_parameters()]

    def fn(params, buffers, xs):
        return list(
            torch.func.functional_call(stage, dict(zip(names, params, strict=True)), (xs[0],))
        )

    split = SplitStage(stage, fn, [h.detach()], [0], None)
    result = split.forward([h.detach()])
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    kept = sum(
        t.numel() * t.element_size()
        for t in result[split.joint.num_outputs :]
        if t.untyped_storage().data_ptr() not in params
    )

    def eager() -> None:
        y = h
        for block in model.blocks:
            y = block(y) if mode is None else ckpt.checkpoint(block, y, use_reentrant=False)

    return full, kept, _activation_bytes(model, eager)


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_checkpointed_stage_keeps_what_eager_checkpointing_keeps(mode):
    plain_full, plain_split, _ = _stage_saves(None)
    full, split, eager = _stage_saves(mode)
    assert full == eager
    assert full <= 0.5 * plain_full, (full, plain_full)
    assert split <= 0.5 * plain_split, (split, plain_split)


@pytest.mark.parametrize("cls", [mpmd.schedules.OneFOneB, mpmd.schedules.ZeroBubbleH1])
@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_checkpointed_model_trains_like_eager(mode, cls):
    x = torch.randn(2 * M, 8, 16, dtype=torch.float64)
    y = torch.randn(2 * M, 8, 16, dtype=torch.float64)
    trains_like_eager(
        lambda: Checkpointed(mode).double(),
        x,
        y,
        square_loss,
        ["blocks.1"],
        cls(M),
        2,
    )
