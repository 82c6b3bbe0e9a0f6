"""Batch size and sequence length may change between steps: each new
microbatch signature is traced once (every rank alike, no extra messages)
and runs like eager gradient accumulation; a signature seen before costs no
tracing. Before, any shape other than the traced one was refused."""

import torch
from models import CASES

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4


def _tokens(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 100 + seq)
    return torch.randint(0, 64, (batch, seq), generator=g), torch.randint(
        0, 64, (batch, seq), generator=g
    )


def test_shapes_change_between_steps_and_each_is_traced_once():
    case = CASES["gpt"]  # tied embeddings across ranks, positions up to 16
    model = case.model(torch.float64)
    ref = case.model(torch.float64)
    ids, _ = _tokens(2, 16)
    pipe = mpmd.trace(model, (ids,), **case.split)
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=case.loss, timeout=60)
    for batch, seq in [(8, 16), (4, 12), (8, 16), (12, 8), (4, 12)]:
        x, y = _tokens(batch, seq)
        ref.zero_grad()
        losses = []
        for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
            loss = case.loss(ref(xb), yb)
            (loss / M).backward()
            losses.append(loss.detach())
        for runner in local.runners:
            for p in runner.parameters():
                p.grad = None
        outs = local.step(x, target=y)
        for out in outs:
            torch.testing.assert_close(out.loss, torch.stack(losses).double().mean())
        for runner in local.runners:
            for fqn, p in runner.named_parameters():
                expected = ref.get_parameter(fqn).grad
                torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-10, msg=fqn)
        logits = local.eval_step(x)
        torch.testing.assert_close(logits[0], ref(x), rtol=1e-12, atol=1e-12)
    # (2 x 16) was traced by mpmd.trace; (1 x 12) and (3 x 8) once each.
    assert [r.num_traces for r in local.runners] == [2, 2]
