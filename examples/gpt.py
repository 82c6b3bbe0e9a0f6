"""A small GPT (nanoGPT-style) with tied input/output embeddings, and
`lm_loss`, the next-token loss it trains with (also the loss of the
benchmarks, the GPU checks and the tests' language models). With
`GPTConfig(experts=N)` each block's MLP is a mixture of N experts (top-k
token-choice routing, the experts stacked as Hugging Face's and
torchtitan's are), which expert parallelism shards over an "ep" mesh
dimension."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True, slots=True, frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 128
    dim: int = 128
    heads: int = 4
    layers: int = 8
    dropout: float = 0.0
    tie_embeddings: bool = True
    experts: int = 0  # 0: dense MLPs; N: a mixture of N experts per block
    top_k: int = 2  # experts per token


def residual_std(cfg: GPTConfig) -> float:
    return 0.02 / math.sqrt(2 * cfg.layers)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.proj.init_std = residual_std(cfg)  # type: ignore[assignment]
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Experts(nn.Module):
    """Every expert's MLP, stacked (`[experts, ...]` parameters), called as
    Hugging Face's experts modules are: with the tokens, the experts each
    chose and their weights. Each expert runs the rows routed to it."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_experts = cfg.experts
        hidden = 4 * cfg.dim // cfg.top_k  # top-k experts: a dense MLP's compute
        self.up = nn.Parameter(torch.empty(cfg.experts, hidden, cfg.dim))
        self.down = nn.Parameter(torch.empty(cfg.experts, cfg.dim, hidden))
        self.init_std = residual_std(cfg)

    def forward(
        self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        for e in range(self.num_experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            h = F.gelu(tokens[rows] @ self.up[e].t()) @ self.down[e].t()
            out = out.index_add(0, rows, h * weights[rows, slot, None])
        return out


class MoE(nn.Module):
    """Token-choice top-k routing over `Experts` (weights renormalised over
    the chosen experts)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        weights, chosen = torch.softmax(self.router(tokens), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(tokens, chosen, weights).reshape(b, t, d)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp: nn.Module
        if cfg.experts:
            self.mlp = MoE(cfg)
        else:
            self.mlp = nn.Sequential(
                nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim)
            )
            self.mlp[2].init_std = residual_std(cfg)  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    # Tensor parallelism (a mesh with a "tp" dimension), in Hugging Face's
    # plan format, which torchmpmd reads from a model's `_tp_plan`: each
    # block's MLP as Megatron splits it (the first layer by output features,
    # the second by input features: one all-reduce), the attention's packed
    # q/k/v projection by output features and its output projection by
    # input features. Embeddings, norms and the tied head stay whole.
    _tp_plan: ClassVar[dict[str, str]] = {
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
    }

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        self.apply(self.init_weights)

    @staticmethod
    @torch.no_grad()
    def init_weights(m: nn.Module) -> None:
        """Initialises one module's own parameters (GPT-2's scheme; the
        projections into the residual stream scaled down by depth). Works on
        a model built on the meta device too: `runner.init_weights(GPT.init_weights)`."""
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=getattr(m, "init_std", 0.02))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, Experts):
            nn.init.normal_(m.up, std=0.02)
            nn.init.normal_(m.down, std=m.init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tok(ids) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def split_points(cfg: GPTConfig, num_stages: int) -> list[str]:
    """Even split of the blocks: the first block of every stage after the first."""
    if not 1 <= num_stages <= cfg.layers:
        raise ValueError(f"need 1 to {cfg.layers} stages for {cfg.layers} blocks, got {num_stages}")
    return [f"blocks.{cfg.layers * s // num_stages}" for s in range(1, num_stages)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of `logits` (..., vocab) against token ids `targets` (...),
    averaged over every position. Half-precision logits (bf16, fp16) are
    upcast to float32 first; float32 and float64 stay as they are."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
