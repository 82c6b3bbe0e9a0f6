"""Shared by the unit and distributed tests: trace a fixture model, run it
pipelined, and compare the loss and every gradient with the unpipelined
model's gradient accumulation over the same microbatches (float64)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from models import CASES, split_deep_unet, split_gpt

import torchmpmd as mpmd

SPLITS = {"gpt": split_gpt, "deep_unet": split_deep_unet}
S = mpmd.schedules
ALL = [S.GPipe, S.OneFOneB, S.Eager1F1B, S.Interleaved1F1B, S.ZeroBubbleH1, S.ZBV, S.DualPipeV]
TWO_STAGES_PER_RANK = {S.Interleaved1F1B, S.ZBV, S.DualPipeV}


def stages_for(cls: type, ranks: int) -> int:
    return 2 * ranks if cls in TWO_STAGES_PER_RANK else ranks


def microbatches_for(cls: type, ranks: int) -> int:
    return 2 * stages_for(cls, ranks) if cls is S.DualPipeV else 4


@functools.cache
def traced(name: str, num_stages: int) -> mpmd.Pipe:
    case = CASES[name]
    model = case.model(torch.float64)
    args, kwargs = case.inputs(2)
    args = tuple(a.double() if a.is_floating_point() else a for a in args)
    return mpmd.trace(model, args, kwargs, **SPLITS[name](num_stages))


def data(name: str, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    case = CASES[name]
    (x,), _ = case.inputs(2 * m)
    y = case.target(2 * m)
    return (x.double() if x.is_floating_point() else x), (
        y.double() if y.is_floating_point() else y
    )


@functools.cache
def reference(name: str, m: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean loss and gradients of the unpipelined model over m microbatches."""
    case = CASES[name]
    model = case.model(torch.float64)
    batch, target = data(name, m)
    losses = []
    for x, y in zip(batch.chunk(m), target.chunk(m), strict=True):
        loss = case.loss(model(x), y)
        (loss / m).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return torch.stack(losses).double().mean(), grads


def check(
    name: str, loss: torch.Tensor, runner: mpmd.PipelineRunner, m: int, compiled: bool = False
) -> set[str]:
    """Asserts one rank's loss and gradients; returns the parameters it checked.

    Compiled stages fuse kernels and so round differently: the GPT's float32
    loss then agrees to float32 rounding, not exactly.
    """
    ref_loss, ref_grads = reference(name, m)
    tol = 1e-6 if compiled else 1e-12
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    grad_tol = 1e-6 if compiled else 1e-10
    seen = set()
    for fqn, p in runner.named_parameters():
        assert p.grad is not None, f"{fqn} got no gradient"
        torch.testing.assert_close(p.grad, ref_grads[fqn], rtol=grad_tol, atol=grad_tol, msg=fqn)
        seen.add(fqn)
    return seen


def trains_like_eager(
    build: Callable[[], torch.nn.Module],
    x: torch.Tensor,
    y: torch.Tensor | None,
    loss: Callable[[Any, Any], torch.Tensor],
    split_before: list[str],
    schedule: mpmd.Schedule,
    num_ranks: int,
    *,
    tol: float = 1e-10,
    steps: int = 1,
) -> tuple[Any, torch.nn.Module]:
    """Runs `steps` pipelined steps of a model built by `build()` (seeded) on
    in-process ranks and asserts every gradient equals eager gradient
    accumulation over the same microbatches (a parameter eager leaves without
    gradient must get none, or zeros). Returns the LocalPipeline and the
    eager reference, for further checks."""
    from torchmpmd.testing import LocalPipeline

    m = schedule.num_microbatches
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(0)
    ref = build()
    ref.load_state_dict(model.state_dict())
    targets = y.chunk(m) if y is not None else [None] * m
    pipe = mpmd.trace(model, (x.chunk(m)[0],), split_before=split_before)
    local = LocalPipeline(pipe, schedule, num_ranks, loss_fn=loss, timeout=60)
    for _ in range(steps):
        for xb, yb in zip(x.chunk(m), targets, strict=True):
            (loss(ref(xb), yb) / m).backward()
        local.step(x, target=y)
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            expected = ref.get_parameter(fqn).grad
            if expected is None:
                assert p.grad is None or not p.grad.any(), fqn
                continue
            torch.testing.assert_close(p.grad, expected, rtol=tol, atol=tol, msg=fqn)
    return local, ref
