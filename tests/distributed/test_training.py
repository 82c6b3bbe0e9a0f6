"""Pipelined training over Gloo ranks must match the unpipelined model trained
in one process with gradient accumulation: the loss, every parameter's
gradient, and the parameters after each of several optimizer steps — for
GPipe and 1F1B, on 2 ranks (two stages per rank) and 4 ranks, with tied
weights and skip connections across boundaries."""

from __future__ import annotations

import torch
from harness import check_all, run_ranks
from models import CASES

import torchmpmd as mpmd

MICROBATCH = 2


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _batch(case, dtype, size):
    args, kwargs = case.inputs(size)
    args = tuple(_cast(a, dtype) for a in args)
    kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
    return args, kwargs, _cast(case.target(size), dtype)


def _microbatches(args, kwargs, target, m):
    """The batch cut like the runner cuts it: dim 0, non-tensors replicated."""

    def cut(v):
        return list(torch.chunk(v, m)) if isinstance(v, torch.Tensor) else [v] * m

    cols = [cut(a) for a in args]
    kcols = {k: cut(v) for k, v in kwargs.items()}
    ys = cut(target)
    return [
        (tuple(c[i] for c in cols), {k: c[i] for k, c in kcols.items()}, ys[i]) for i in range(m)
    ]


def _optimizer(params, dtype):
    # Adam divides by the gradient's magnitude, so float32 rounding in a
    # near-zero gradient can flip an update's sign: float32 runs use SGD.
    if dtype == torch.float64:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _tolerance(dtype):
    return (
        {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    )


def train_and_compare(rank, world, combos):
    report = []
    for name, schedule_name, dtype_name, m, steps in combos:
        case = CASES[name]
        dtype = getattr(torch, dtype_name)
        tol = _tolerance(dtype)

        reference = case.model(dtype, seed=0)
        ref_opt = _optimizer(reference.parameters(), dtype)
        model = case.model(dtype, seed=0)
        ex_args, ex_kwargs, _ = _batch(case, dtype, MICROBATCH)
        pipe = mpmd.trace(model, ex_args, ex_kwargs, **case.split)
        schedule = getattr(mpmd.schedules, schedule_name)(m)
        runner = mpmd.PipelineRunner(
            pipe,
            schedule,
            loss_fn=lambda out, y, case=case: case.loss(case.output(out), y),
            options=mpmd.RunnerOptions(timeout=60),
        )
        opt = _optimizer(runner.parameters(), dtype)
        local = dict(runner.named_parameters())
        assert local, f"rank {rank} holds no parameters"

        for step in range(steps):
            args, kwargs, target = _batch(case, dtype, MICROBATCH * m)
            args = tuple(a + step if a.is_floating_point() else a for a in args)
            # Reference: gradient accumulation in one process.
            ref_opt.zero_grad(set_to_none=True)
            ref_losses = []
            for a, k, y in _microbatches(args, kwargs, target, m):
                loss = case.loss(case.output(reference(*a, **k)), y)
                (loss / m).backward()
                ref_losses.append(loss.detach().double())
            ref_loss = torch.stack(ref_losses).mean()

            opt.zero_grad(set_to_none=True)
            out = runner.step(*args, target=target, **kwargs)
            what = f"{name}/{schedule_name}/{dtype_name} step {step} rank {rank}"
            torch.testing.assert_close(out.loss, ref_loss, msg=f"{what}: loss", **tol)
            for fqn, p in local.items():
                ref_grad = reference.get_parameter(fqn).grad
                assert p.grad is not None, f"{what}: {fqn} got no gradient"
                torch.testing.assert_close(p.grad, ref_grad, msg=f"{what}: grad of {fqn}", **tol)
            ref_opt.step()
            opt.step()
            for fqn, p in local.items():
                torch.testing.assert_close(
                    p.detach(), reference.get_parameter(fqn).detach(), msg=f"{what}: {fqn}", **tol
                )
        report.append((name, schedule_name, sorted(runner.local_stages), len(local)))
    return report


TWO_RANKS = [
    ("mlp", "GPipe", "float64", 4, 2),
    ("mlp", "OneFOneB", "float64", 4, 2),
    ("gpt", "GPipe", "float64", 4, 2),
    ("gpt", "OneFOneB", "float64", 4, 3),
    ("unet", "GPipe", "float64", 4, 2),
    ("unet", "OneFOneB", "float64", 4, 2),
    ("kwargs", "OneFOneB", "float64", 2, 2),
    ("gpt", "OneFOneB", "float32", 4, 2),
]

FOUR_RANKS = [
    ("mlp", "GPipe", "float64", 3, 2),
    ("mlp", "OneFOneB", "float64", 6, 2),
    ("gpt", "GPipe", "float64", 4, 2),
    ("gpt", "OneFOneB", "float64", 4, 3),
    ("unet", "GPipe", "float64", 4, 2),
    ("unet", "OneFOneB", "float64", 5, 2),
    ("gpt", "OneFOneB", "float32", 4, 2),
]


def test_two_ranks_two_stages_each():
    reports = check_all(run_ranks(train_and_compare, 2, TWO_RANKS))
    # Four-stage models put two stages on each rank, round-robin.
    assert reports[0][3][:3] == ("gpt", "OneFOneB", [0, 2])
    assert reports[1][3][:3] == ("gpt", "OneFOneB", [1, 3])


def test_four_ranks():
    reports = check_all(run_ranks(train_and_compare, 4, FOUR_RANKS))
    for rank, report in enumerate(reports):
        assert all(stages == [rank] for _, _, stages, _ in report)
