"""What the example inputs of `mpmd.trace` may be: one tensor passed as two
arguments (nanoGPT's `model(idx, targets=idx)`) or views of one tensor in a
nested argument are traced as separate inputs, so a later call with different
tensors there reads each (traced as one value, the first step silently used
`idx` as the targets); a model built on the meta device traces with a real
batch (its forward builds a mask with `device=idx.device`). Each is compared
with the unpipelined model in float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from models import eager_step, lm_loss, square_loss, tokens
from public_models import GPT, GPTConfig

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 2


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)).double()


def _own_loss(out: tuple[torch.Tensor, torch.Tensor], _target: object) -> torch.Tensor:
    return out[1]


def _accumulated(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The plain model's loss over `M` microbatches, gradients accumulated."""
    return eager_step(lambda xb, yb: model(xb, yb)[1], x, y, M).mean()


def _assert_matches(local: LocalPipeline, ref: nn.Module, loss: torch.Tensor, out: list) -> None:
    for o in out:
        torch.testing.assert_close(o.loss, loss, rtol=1e-12, atol=1e-12)
    for runner in local.runners:
        for name, p in runner.named_parameters():
            torch.testing.assert_close(
                p.grad, ref.get_parameter(name).grad, rtol=1e-10, atol=1e-12, msg=name
            )
            p.grad = None
    for p in ref.parameters():
        p.grad = None


@pytest.mark.slow
def test_nanogpt_given_its_batch_as_targets_keeps_them_separate():
    model = _gpt()
    ref = copy.deepcopy(model)
    idx = tokens(64, 2, 8, seed=1)
    pipe = mpmd.trace(model, (idx,), {"targets": idx}, split_before=["transformer.h.1"])
    assert pipe.input_names == ["args[0]", "targets"]

    # Called in this process, with other targets than the trace's.
    y = tokens(64, 2, 8, seed=2)
    logits, loss = pipe(idx, targets=y)
    ref_logits, ref_loss = ref(idx, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-12, atol=1e-12)

    # The first step has the traced shapes: the traced program itself runs.
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=_own_loss, timeout=60)
    x, y = tokens(64, 2 * M, 8, seed=3), tokens(64, 2 * M, 8, seed=4)
    out = local.step(x, targets=y)
    assert [r.num_traces for r in local.runners] == [0, 0]
    _assert_matches(local, ref, _accumulated(ref, x, y), out)

    # A new shape given as its own targets is traced again from aliased
    # microbatches; the next step of that shape must still read its targets.
    x6 = tokens(64, 2 * M, 6, seed=5)
    local.step(x6, targets=x6)
    _accumulated(ref, x6, x6)
    x6, y6 = tokens(64, 2 * M, 6, seed=6), tokens(64, 2 * M, 6, seed=7)
    for runner in local.runners:
        for p in runner.parameters():
            p.grad = None
    for p in ref.parameters():
        p.grad = None
    out = local.step(x6, targets=y6)
    assert [r.num_traces for r in local.runners] == [1, 1]
    _assert_matches(local, ref, _accumulated(ref, x6, y6), out)


class Attend(nn.Module):
    """Attention over a nested argument: `{"query": q, "memory": (k, v)}`."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 4)

    def forward(self, batch: dict) -> torch.Tensor:
        key, value = batch["memory"]
        h, _ = self.attn(batch["query"], key, value, need_weights=False)
        return self.out(torch.tanh(h))


def test_aliased_tensors_inside_a_nested_argument_are_separate_inputs():
    torch.manual_seed(0)
    model = Attend().double()
    ref = copy.deepcopy(model)
    h = torch.randn(2, 5, 8, dtype=torch.float64)
    # Self-attention as the example: query, key and value are one tensor
    # (the same object twice, and a view of it).
    example = {"query": h, "memory": (h, h.view(2, 5, 8))}
    pipe = mpmd.trace(model, (example,), split_before=["out"])

    q, k, v = (torch.randn(2 * M, 5, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(
        pipe({"query": q[:2], "memory": (k[:2], v[:2])}),
        ref({"query": q[:2], "memory": (k[:2], v[:2])}),
        rtol=1e-12,
        atol=1e-12,
    )

    y = torch.randn(2 * M, 5, 4, dtype=torch.float64)
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(M), 2, loss_fn=square_loss, timeout=60)
    out = local.step({"query": q, "memory": (k, v)}, target=y)
    assert [r.num_traces for r in local.runners] == [0, 0]
    losses = []
    for qb, kb, vb, yb in zip(q.chunk(M), k.chunk(M), v.chunk(M), y.chunk(M), strict=True):
        loss = square_loss(ref({"query": qb, "memory": (kb, vb)}), yb)
        (loss / M).backward()
        losses.append(loss.detach())
    for o in out:
        torch.testing.assert_close(o.loss, torch.stack(losses).mean(), rtol=1e-12, atol=1e-12)
    for runner in local.runners:
        for name, p in runner.named_parameters():
            torch.testing.assert_close(
                p.grad, ref.get_parameter(name).grad, rtol=1e-10, atol=1e-12, msg=name
            )


# ------------------------------------------------------ meta model, real batch

V, D = 32, 16


class TransformerLM(nn.Module):
    """A pre-norm transformer LM whose causal mask is built on the input's device."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(
            torch.full((t, t), float("-inf"), device=idx.device, dtype=self.out.weight.dtype),
            diagonal=1,
        )
        h = self.tok(idx)
        for layer in self.layers:
            h = layer(h, src_mask=mask)
        return self.out(self.norm(h))


@torch.no_grad()
def _init(module: nn.Module) -> None:
    """Deterministic values, so each rank's part equals the reference's."""
    for name, p in module.named_parameters(recurse=False):
        n = p.numel()
        values = torch.sin(torch.arange(n, dtype=torch.float64) * (1 + n % 7) + len(name))
        p.copy_((values / math.sqrt(n)).reshape(p.shape))


@pytest.mark.slow
def test_meta_model_traced_with_a_real_batch_trains_like_the_real_model():
    with torch.device("meta"):
        model = TransformerLM().double()
    idx = tokens(64, 2, 6, seed=1) % V  # a real CPU batch
    pipe = mpmd.trace(model, (idx,), split_before=["layers.1"])
    assert all(p.is_meta for p in pipe.parameters())
    assert [str(s) for s in pipe.input_specs] == ["(2, 6) int64"]

    ref = TransformerLM().double()
    ref.apply(_init)
    real = TransformerLM().double()
    real.load_state_dict(ref.state_dict())
    for fill in ("init_weights", "load_state_dict"):
        local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lm_loss, timeout=60)
        for runner in local.runners:
            if fill == "init_weights":
                runner.init_weights(_init)
            else:
                runner.load_state_dict(real.state_dict())
        x, y = tokens(64, 2 * M, 6, seed=2) % V, tokens(64, 2 * M, 6, seed=3) % V
        out = local.step(x, target=y)
        losses = eager_step(lambda xb, yb: lm_loss(ref(xb), yb), x, y, M)
        for o in out:
            torch.testing.assert_close(o.loss, losses.mean(), rtol=1e-12, atol=1e-12)
        for runner in local.runners:
            for name, p in runner.named_parameters():
                torch.testing.assert_close(
                    p.grad, ref.get_parameter(name).grad, rtol=1e-10, atol=1e-12, msg=name
                )
        ref.zero_grad(set_to_none=True)

        # Another sequence length: traced again (from real microbatches) on
        # the meta model, then run with this rank's real weights.
        x, y = tokens(64, 2 * M, 4, seed=4) % V, tokens(64, 2 * M, 4, seed=5) % V
        out = local.step(x, target=y)
        assert [r.num_traces for r in local.runners] == [1, 1]
        expected = torch.stack(
            [lm_loss(ref(xb), yb) for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True)]
        ).mean()
        for o in out:
            torch.testing.assert_close(o.loss, expected.detach(), rtol=1e-12, atol=1e-12)
