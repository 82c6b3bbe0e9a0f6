"""Shared by the unit and distributed tests: trace a fixture model, run it
pipelined, and compare the loss and every gradient with the unpipelined
model's gradient accumulation over the same microbatches (float64)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from models import CASES, MLP, eager_step, split_deep_unet, split_gpt, square_loss

import torchmpmd as mpmd

SPLITS = {"gpt": split_gpt, "deep_unet": split_deep_unet}
S = mpmd.schedules
ALL = [
    S.GPipe,
    S.OneFOneB,
    S.Eager1F1B,
    S.Interleaved1F1B,
    S.ZeroBubbleH1,
    S.ZBV,
    S.DualPipeV,
    S.Combined1F1B,
]


def stages_for(cls: type[mpmd.Schedule], ranks: int) -> int:
    return cls.stages_per_rank * ranks


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
    losses = eager_step(lambda x, y: case.loss(model(x), y), batch, target, m)
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return losses.double().mean(), grads


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


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def plain_kept_bytes(model: MLP, x: torch.Tensor, y: torch.Tensor, split: int) -> list[int]:
    """Per stage, the bytes one microbatch of the plain model keeps for its
    backward when cut before layer `split`: every tensor autograd saves in
    the stage's layers (and, on the last, in the loss), and the stage's
    input and output, which the pipeline holds until the stage's backward.
    Parameters and the caller's inputs are not activations."""
    not_activations = {_storage(p)[0] for p in model.parameters()} | {
        _storage(x)[0],
        _storage(y)[0],
    }
    kept: list[dict[int, int]] = [{}, {}]
    stage = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(t)
        if ptr not in not_activations:
            kept[stage][ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for i, layer in enumerate(model.layers):
            if i == split:
                kept[0].setdefault(*_storage(h))  # stage 0's output
                h = h.clone()  # stage 1's own copy of it, as received
                stage = 1
                kept[1].setdefault(*_storage(h))
            h = torch.tanh(layer(h))
        square_loss(h, y)
    return [sum(k.values()) for k in kept]


def mlp_memory_case(
    width: int, depth: int, batch: int, m: int
) -> tuple[mpmd.Pipe, torch.Tensor, torch.Tensor, list[int]]:
    """An MLP cut in two halves (float64), a batch of `m` microbatches and
    its target, and per stage what one microbatch of the plain model keeps
    for its backward (`plain_kept_bytes`)."""
    torch.manual_seed(0)
    model = MLP(width, depth).double()
    x = torch.randn(batch, width, dtype=torch.float64)
    y = torch.randn(batch, width, dtype=torch.float64)
    mb = batch // m
    expected = plain_kept_bytes(model, x[:mb].clone(), y[:mb].clone(), depth // 2)
    pipe = mpmd.trace(model, (x[:mb],), split_before=[f"layers.{depth // 2}"])
    return pipe, x, y, expected
