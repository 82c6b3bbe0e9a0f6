"""The tests' small model zoo, shared by the unit and distributed tests (and
through tests/conftest.py's fixtures).

Each `Case` builds a model, one microbatch of example inputs, the split that
cuts it into stages, and a loss. Tests compare the pipelined model with the
model itself run unpipelined in one process: `eager_step` is that reference
(gradient accumulation over the microbatches), `trace_case` a case traced for
a LocalPipeline with its batch. The losses (`lm_loss`, the one next-token
loss, from examples/gpt.py; `square_loss`) and token batches (`tokens`,
`token_pair`) live here too, so a test writes none of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from gpt import lm_loss  # examples/gpt.py (pytest's pythonpath)

import torchmpmd as mpmd


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT whose output projection shares the token embedding (tied weights)."""

    def __init__(
        self, vocab: int = 64, dim: int = 32, heads: int = 4, depth: int = 4, seq: int = 16
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        pos = torch.arange(seq, device=ids.device)
        mask = torch.triu(torch.full((seq, seq), float("-inf"), device=ids.device), diagonal=1)
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


class UNet(nn.Module):
    """Encoder-decoder whose outermost skip connection crosses every stage boundary."""

    def __init__(self, ch: int = 4) -> None:
        super().__init__()
        self.enc1 = nn.Conv2d(1, ch, 3, padding=1)
        self.enc2 = nn.Conv2d(ch, 2 * ch, 3, padding=1)
        self.bottleneck = nn.Conv2d(2 * ch, 2 * ch, 3, padding=1)
        self.up = nn.ConvTranspose2d(2 * ch, ch, 2, stride=2)
        self.dec2 = nn.Conv2d(2 * ch, ch, 3, padding=1)
        self.dec1 = nn.Conv2d(ch, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = F.relu(self.enc1(x))
        e2 = F.relu(self.enc2(F.max_pool2d(e1, 2)))
        b = F.relu(self.bottleneck(e2)) + e2
        u = self.up(b)
        d2 = F.relu(self.dec2(torch.cat([u, e1], dim=1)))
        return self.dec1(d2)


class DeepUNet(nn.Module):
    """Eight layers, each encoder layer's output skipping to its mirror in the
    decoder: split one layer per stage, the outermost skip crosses every
    boundary."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.enc = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.dec = nn.ModuleList(nn.Linear(2 * dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for layer in self.enc:
            x = torch.tanh(layer(x))
            skips.append(x)
        for layer, skip in zip(self.dec, reversed(skips), strict=True):
            x = torch.tanh(layer(torch.cat([x, skip], dim=-1)))
        return x


class KwargsModel(nn.Module):
    """Takes keyword arguments, an optional tensor and non-tensor flags."""

    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("offset", torch.linspace(-1, 1, dim))

    def forward(
        self,
        x: torch.Tensor,
        *,
        gate: torch.Tensor | None = None,
        scale: float = 1.0,
        residual: bool = True,
    ) -> dict[str, torch.Tensor]:
        h = self.inp(x) + self.offset
        h.mul_(scale)  # in place, on purpose
        if gate is not None:
            h = h * torch.sigmoid(gate)
        m = F.silu(self.mid(h))
        if residual:
            m = m + h
        y = self.out(m)
        return {"y": y, "aux": h.mean(dim=-1)}


class MarkedMLP(MLP):
    """An MLP whose stage boundaries are written in the model code."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i in (0, 2):
                x = mpmd.mark_stage_end(x)
        return x


# A tiny Hugging Face decoder's sizes, in its config's names: vocabulary 96,
# 4 layers of width 32, 4 heads over 2 key-value heads.
HF_DECODER: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def hf_llama(attention: str = "eager", **config: Any) -> nn.Module:
    """A tiny Hugging Face Llama (`HF_DECODER`, tied embeddings); `config`
    overrides."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {**HF_DECODER, "tie_word_embeddings": True, **config}
    cfg = LlamaConfig(**settings)
    cfg._attn_implementation = attention
    return LlamaForCausalLM(cfg)


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=96,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def _hf_logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out["logits"]


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[tuple, dict]]  # batch size -> (args, kwargs)
    split: dict[str, Any]  # keyword arguments of mpmd.trace
    output: Callable[[Any], torch.Tensor] = lambda out: out  # the tensor the loss reads
    target: Callable[[int], torch.Tensor] | None = None
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(
        default=lambda out, y: F.mse_loss(out, y)
    )
    num_stages: int = 0
    # False where the model itself takes another code path under tracing
    # (transformers' SDPA attention uses enable_gqa only in eager mode), so
    # gradients agree only up to rounding.
    exact_grads: bool = True

    def model(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.build().to(dtype)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _float(*shape: int) -> Callable[[int], tuple[tuple, dict]]:
    return lambda b: ((torch.randn(b, *shape, generator=_gen(b)),), {})


def _token_inputs(
    vocab: int, seq: int, as_kwarg: str | None = None
) -> Callable[[int], tuple[tuple, dict]]:
    def make(b: int) -> tuple[tuple, dict]:
        ids = torch.randint(0, vocab, (b, seq), generator=_gen(b))
        return ((), {as_kwarg: ids, "use_cache": False}) if as_kwarg else ((ids,), {})

    return make


def _token_targets(vocab: int, seq: int) -> Callable[[int], torch.Tensor]:
    return lambda b: torch.randint(0, vocab, (b, seq), generator=_gen(b + 1000))


def _kwargs_inputs(b: int) -> tuple[tuple, dict]:
    g = _gen(b)
    return (
        (torch.randn(b, 12, generator=g),),
        {"gate": torch.randn(b, 12, generator=g), "scale": 0.5, "residual": True},
    )


def split_gpt(num_stages: int) -> dict[str, list[str]]:
    """TinyGPT (4 blocks) cut into 2, 4 or 8 stages (8: attention and MLP apart)."""
    points = {
        2: ["blocks.2"],
        4: ["blocks.1", "blocks.2", "blocks.3"],
        8: [
            "blocks.0.mlp",
            "blocks.1",
            "blocks.1.mlp",
            "blocks.2",
            "blocks.2.mlp",
            "blocks.3",
            "blocks.3.mlp",
        ],
    }[num_stages]
    return {"split_before": points}


def split_deep_unet(num_stages: int) -> dict[str, list[str]]:
    """DeepUNet cut into 2, 4 or 8 stages of consecutive layers."""
    layers = [f"enc.{i}" for i in range(4)] + [f"dec.{i}" for i in range(4)]
    per = 8 // num_stages
    return {"split_before": layers[per::per]}


CASES = {
    c.name: c
    for c in [
        Case(
            "mlp",
            lambda: MLP(16, 4),
            _float(16),
            {"split_before": ["layers.1", "layers.2", "layers.3"]},
            target=lambda b: torch.randn(b, 16, generator=_gen(b + 1000)),
            num_stages=4,
        ),
        Case(
            "gpt",
            lambda: TinyGPT(),
            _token_inputs(64, 16),
            {"split_before": ["blocks.1", "blocks.2", "blocks.3"]},
            target=_token_targets(64, 16),
            loss=lm_loss,
            num_stages=4,
        ),
        Case(
            "unet",
            lambda: UNet(),
            lambda b: ((torch.randn(b, 1, 8, 8, generator=_gen(b)),), {}),
            {"split_before": ["enc2", "bottleneck", "up"]},
            target=lambda b: torch.randn(b, 1, 8, 8, generator=_gen(b + 1000)),
            num_stages=4,
        ),
        Case(
            "deep_unet",
            lambda: DeepUNet(),
            _float(8),
            split_deep_unet(8),
            target=lambda b: torch.randn(b, 8, generator=_gen(b + 1000)),
            num_stages=8,
        ),
        Case(
            "kwargs",
            lambda: KwargsModel(),
            _kwargs_inputs,
            {"split_after": ["inp"]},
            output=lambda out: out["y"] + out["aux"].unsqueeze(-1),
            target=lambda b: torch.randn(b, 12, generator=_gen(b + 1000)),
            num_stages=2,
        ),
        Case(
            "marked",
            lambda: MarkedMLP(16, 4),
            _float(16),
            {},
            target=lambda b: torch.randn(b, 16, generator=_gen(b + 1000)),
            num_stages=3,
        ),
        Case(
            "hf_llama",
            hf_llama,
            _token_inputs(96, 12, as_kwarg="input_ids"),
            {"split_before": ["model.layers.1", "model.layers.3"]},
            output=_hf_logits,
            target=_token_targets(96, 12),
            loss=lm_loss,
            num_stages=3,
        ),
        Case(
            "hf_llama_sdpa",
            lambda: hf_llama("sdpa"),
            _token_inputs(96, 12, as_kwarg="input_ids"),
            {"split_after": ["model.layers.1"]},
            output=_hf_logits,
            target=_token_targets(96, 12),
            loss=lm_loss,
            num_stages=2,
            exact_grads=False,
        ),
        Case(
            "hf_gpt2",
            _hf_gpt2,
            _token_inputs(96, 12, as_kwarg="input_ids"),
            {"split_before": ["transformer.h.2"]},
            output=_hf_logits,
            target=_token_targets(96, 12),
            loss=lm_loss,
            num_stages=2,
        ),
    ]
}


def square_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error (the regression models' loss)."""
    return (out - y).square().mean()


def tokens(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    """Token ids of `shape` below `vocab`, from a generator seeded `seed`."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def token_pair(
    vocab: int, batch: int, seq: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (batch, seq) below `vocab`, drawn in turn from one
    generator seeded `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(
        0, vocab, (batch, seq), generator=g
    )


def eager_step(
    loss_of: Callable[[Any, Any], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    split: Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]] = torch.chunk,
) -> torch.Tensor:
    """The unpipelined reference of one step: gradient accumulation over the
    `m` microbatches `split(x, m)` and `split(y, m)`, each adding the gradient
    of `loss_of(xb, yb) / m`. Returns the microbatches' losses (detached)."""
    losses = []
    for xb, yb in zip(split(x, m), split(y, m), strict=True):
        loss = loss_of(xb, yb)
        (loss / m).backward()
        losses.append(loss.detach())
    return torch.stack(losses)


@dataclass
class Traced:
    """A zoo case traced for a pipeline, and a batch of `m` microbatches."""

    case: Case
    pipe: mpmd.Pipe
    batch: tuple[Any, ...]  # positional inputs of the whole batch
    target: torch.Tensor

    def __iter__(self) -> Any:
        """`case, pipe, batch, target = traced`."""
        return iter((self.case, self.pipe, self.batch, self.target))


def trace_case(name: str, m: int = 4, dtype: torch.dtype = torch.float64) -> Traced:
    """`CASES[name]` in `dtype`, traced on a microbatch of 2 rows with its
    split, and a batch of `2 * m` rows with its target."""
    case = CASES[name]
    model = case.model(dtype)
    args, kwargs = case.inputs(2)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    pipe = mpmd.trace(model, args, kwargs, **case.split)
    batch, _ = case.inputs(2 * m)
    batch = tuple(a.to(dtype) if a.is_floating_point() else a for a in batch)
    target = case.target(2 * m)
    if target.is_floating_point():
        target = target.to(dtype)
    return Traced(case, pipe, batch, target)


def reference_step(
    case: Case, batch: tuple[Any, ...], target: torch.Tensor, m: int, dtype: torch.dtype
) -> tuple[nn.Module, torch.Tensor]:
    """A fresh `case` model in `dtype` after `eager_step` over the batch, and
    its mean loss (float64)."""
    ref = case.model(dtype)
    losses = eager_step(lambda a, y: case.loss(case.output(ref(a)), y), batch[0], target, m)
    return ref, losses.double().mean()


def skip_distance(pipe: mpmd.Pipe, value_stage: int = 0) -> int:
    """The largest stage distance any transfer from `value_stage` covers."""
    return max(
        (max(t.dst_stages) - t.src_stage for t in pipe.transfers if t.src_stage == value_stage),
        default=0,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, exact: bool) -> None:
    if exact:
        assert torch.equal(actual, expected), f"{what}: max diff {(actual - expected).abs().max()}"
    else:
        tol = 1e-10 if expected.dtype == torch.float64 else 2e-5
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=what)


__all__ = [
    "CASES",
    "Case",
    "Traced",
    "assert_close",
    "eager_step",
    "lm_loss",
    "reference_step",
    "skip_distance",
    "split_deep_unet",
    "split_gpt",
    "square_loss",
    "token_pair",
    "tokens",
    "trace_case",
]
