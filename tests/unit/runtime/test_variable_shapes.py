"""Batch size and sequence length may change between steps: each new
microbatch signature is traced once (every rank alike, no extra messages)
and runs like eager gradient accumulation; a signature seen before costs no
tracing. Before, any shape other than the traced one was refused."""

import pytest
import torch
from models import CASES, eager_step, token_pair

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4


def _batch(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_pair(64, batch, seq, seed=batch * 100 + seq)


@pytest.mark.slow
def test_shapes_change_between_steps_and_each_is_traced_once():
    case = CASES["gpt"]  # tied embeddings across ranks, positions up to 16
    model = case.model(torch.float64)
    ref = case.model(torch.float64)
    ids, _ = _batch(2, 16)
    pipe = mpmd.trace(model, (ids,), **case.split)
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=case.loss, timeout=60)
    for batch, seq in [(8, 16), (4, 12), (8, 16), (12, 8), (4, 12)]:
        x, y = _batch(batch, seq)
        ref.zero_grad()
        losses = eager_step(lambda xb, yb: case.loss(ref(xb), yb), x, y, M)
        for runner in local.runners:
            for p in runner.parameters():
                p.grad = None
        outs = local.step(x, target=y)
        for out in outs:
            torch.testing.assert_close(out.loss, losses.double().mean())
        for runner in local.runners:
            for fqn, p in runner.named_parameters():
                expected = ref.get_parameter(fqn).grad
                torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-10, msg=fqn)
        logits = local.eval_step(x)
        torch.testing.assert_close(logits[0], ref(x), rtol=1e-12, atol=1e-12)
    # (2 x 16) was traced by mpmd.trace; (1 x 12) and (3 x 8) once each.
    assert [r.num_traces for r in local.runners] == [2, 2]


def _eager_losses(case, ref, x, y):
    """Eager gradient accumulation over the same pieces (tensor_split)."""
    ref.zero_grad()
    return eager_step(lambda xb, yb: case.loss(ref(xb), yb), x, y, M, torch.tensor_split).double()


@pytest.mark.parametrize("schedule", [mpmd.schedules.OneFOneB(M), mpmd.schedules.ZBV(M)])
@pytest.mark.slow
def test_partial_last_batch_and_uneven_microbatches(schedule):
    # 10 rows into 4 microbatches: 3, 3, 2, 2 rows, one step holding two
    # microbatch shapes; the receiving rank allocates each microbatch's own.
    case = CASES["gpt"]
    model = case.model(torch.float64)
    ref = case.model(torch.float64)
    ids, _ = _batch(2, 16)
    pipe = mpmd.trace(model, (ids,), **case.split)
    local = LocalPipeline(pipe, schedule, 2, loss_fn=case.loss, timeout=60)
    traces = []
    for batch, seq in [(8, 16), (10, 16), (10, 12), (10, 16), (5, 12)]:
        x, y = _batch(batch, seq)
        expected = _eager_losses(case, ref, x, y)
        for runner in local.runners:
            for p in runner.parameters():
                p.grad = None
        outs = local.step(x, target=y)
        for out in outs:
            torch.testing.assert_close(out.losses, expected, rtol=1e-12, atol=1e-12)
        for runner in local.runners:
            for fqn, p in runner.named_parameters():
                torch.testing.assert_close(
                    p.grad, ref.get_parameter(fqn).grad, rtol=1e-10, atol=1e-10, msg=fqn
                )
        logits = local.eval_step(x)
        torch.testing.assert_close(logits[0], ref(x), rtol=1e-12, atol=1e-12)
        traces.append(local.runners[0].num_traces)
    # (2 x 16) traced by mpmd.trace; then (3 x 16), (3 x 12), (2 x 12) once
    # each; the second (10, 16) batch and (5, 12) = 2, 1, 1, 1 rows: (1 x 12).
    assert traces == [0, 1, 3, 3, 4]


def test_batch_smaller_than_the_number_of_microbatches():
    case = CASES["gpt"]
    ids, _ = _batch(2, 16)
    pipe = mpmd.trace(case.model(torch.float64), (ids,), **case.split)
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(M), 2, loss_fn=case.loss)
    x, y = _batch(3, 16)
    with pytest.raises(ValueError, match="must split into 4 microbatches of at least one row"):
        local.runners[0].step(x, target=y)


def test_a_pipe_traced_under_autocast_traces_new_shapes_under_it_too():
    # Mixed precision by tracing inside torch.autocast held only for the
    # traced shape: a new batch size was traced again in float32.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe = mpmd.trace(model, (torch.randn(2, 8),), split_before=["2"])
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(2), 2, loss_fn=lambda o, t: o.sum())
    for rows in (4, 6):  # the traced microbatch shape, then a new one
        x = torch.randn(rows, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x)
        out = local.eval_step(x)[0]
        assert out.dtype == torch.bfloat16, (rows, out.dtype)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert local.runners[0].num_traces == 1
