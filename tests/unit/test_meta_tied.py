"""Meta-device models whose weights are tied across ranks: the ranks agree
on the job whichever copies they allocated (a rank holding one copy of a
tied weight describes the same job as one holding none), the copies of a
tied weight are equal on every rank after `init_weights` and
`load_state_dict`, and from the first call for copies built apart (the rank
of the tie's first stage gives its value), and
`init_weights()` runs a torchtitan model's own root `init_weights()`. Each
step equals the unpipelined model holding the same weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.nn import functional as F

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4


# ---- karpathy's nanoGPT model.py (the parts a training step uses), as written there


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # flash attention make GPU go brrrrr but support is only in PyTorch >= 2.0
        self.flash = hasattr(torch.nn.functional, "scaled_dot_product_attention")
        if not self.flash:
            print("WARNING: using slow attention. Flash Attention requires PyTorch >= 2.0")
            # causal mask to ensure that attention is only applied to the left in the input sequence
            self.register_buffer(
                "bias",
                torch.tril(torch.ones(config.block_size, config.block_size)).view(
                    1, 1, config.block_size, config.block_size
                ),
            )

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        if self.flash:
            # efficient attention using Flash Attention CUDA kernels
            y = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None,
                dropout_p=self.dropout if self.training else 0,
                is_causal=True,
            )
        else:
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = (
            y.transpose(1, 2).contiguous().view(B, T, C)
        )  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 1024
    # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64 for efficiency
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    # True: bias in Linears and LayerNorms, like GPT-2. False: a bit better and faster
    bias: bool = True


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # with weight tying when using torch.compile() some warnings get generated:
        # "UserWarning: functional_call was passed multiple values for tied weights.
        # This behavior is deprecated and will be an error in future versions"
        # not 100% sure what this is, so far seems to be harmless. TODO investigate
        self.transformer.wte.weight = (
            self.lm_head.weight
        )  # https://paperswithcode.com/method/weight-tying

        # init all weights
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()  # noqa: RUF059 (as nanoGPT writes it)
        assert t <= self.config.block_size, (
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)

        if targets is not None:
            # if we are given some desired targets also calculate the loss
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim
            loss = None

        return logits, loss


# ---- a torchtitan-style Llama (torchtitan/models/llama3/model.py's pattern, tiny)


@dataclass
class TransformerModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 202048
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000
    max_seq_len: int = 131072
    depth_init: bool = True


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
    return freqs_cis


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    assert ndim > 1
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    assert freqs_cis.shape == (seqlen, x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        torch.unsqueeze(x, dim=3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, model_args: TransformerModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = (
            model_args.n_heads if model_args.n_kv_heads is None else model_args.n_kv_heads
        )
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.dim // model_args.n_heads
        self.wq = nn.Linear(model_args.dim, model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq = xq.transpose(1, 2)
        xk = keys.transpose(1, 2)
        xv = values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous()
        output = output.view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(
        self, dim: int, hidden_dim: int, multiple_of: int, ffn_dim_multiplier: float | None
    ):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, model_args: TransformerModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.dim = model_args.dim
        self.attention = Attention(model_args)
        self.feed_forward = FeedForward(
            dim=model_args.dim,
            hidden_dim=4 * model_args.dim,
            multiple_of=model_args.multiple_of,
            ffn_dim_multiplier=model_args.ffn_dim_multiplier,
        )
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        if model_args.depth_init:
            self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        else:
            self.weight_init_std = 0.02 / (2 * model_args.n_layers) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, model_args: TransformerModelArgs):
        super().__init__()
        self.model_args = model_args
        self.vocab_size = model_args.vocab_size
        self.n_layers = model_args.n_layers
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = torch.nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = TransformerBlock(layer_id, model_args)
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self, buffer_device: torch.device | None = None):
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        final_out_std = self.model_args.dim**-0.5
        cutoff_factor = 3
        if self.output is not None:
            nn.init.trunc_normal_(
                self.output.weight,
                mean=0.0,
                std=final_out_std,
                a=-cutoff_factor * final_out_std,
                b=cutoff_factor * final_out_std,
            )

    def _precompute_freqs_cis(self) -> torch.Tensor:
        return precompute_freqs_cis(
            self.model_args.dim // self.model_args.n_heads,
            self.model_args.max_seq_len,
            self.model_args.rope_theta,
        )

    def forward(self, tokens: torch.Tensor):
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm else h
        output = self.output(h) if self.output else h
        return output


# ---- a pre-norm transformer LM with its output tied to its embedding


class PreNormBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.ff(self.norm(h)))


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(PreNormBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h))


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _tokens(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _merged_state(local: LocalPipeline) -> dict[str, torch.Tensor]:
    """Every rank's weights under the model's names, lower ranks first."""
    out: dict[str, torch.Tensor] = {}
    for runner in local.runners:
        for name, t in runner.state_dict().items():
            out.setdefault(name, t.detach().clone())
    return out


def _tied_copies(local: LocalPipeline, names: set[str]) -> list[tuple[int, torch.Tensor]]:
    """Each rank's copy of the tied weight known by `names`."""
    return [
        (r, p.detach())
        for r, runner in enumerate(local.runners)
        for name, p in runner.named_parameters()
        if name in names
    ]


def _check_step(
    local: LocalPipeline,
    ref: nn.Module,
    outs: list[mpmd.StepOutput],
    losses: list[torch.Tensor],
    tol: float,
) -> None:
    for out in outs:
        torch.testing.assert_close(out.losses, torch.stack(losses), rtol=tol, atol=tol)
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            expected = ref.get_parameter(fqn).grad
            torch.testing.assert_close(p.grad, expected, rtol=tol, atol=tol, msg=fqn)


def test_a_tie_held_by_some_ranks_only_describes_the_same_job():
    # 4 stages on 4 ranks: ranks 0 and 3 hold the tied pair, 1 and 2 do not.
    with torch.device("meta"):
        model = TiedLM().double()
    ids = _tokens(32, 2, 6)
    pipe = mpmd.trace(model, (ids.to("meta"),), split_before=["blocks.1", "blocks.2", "blocks.3"])
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 4, loss_fn=_lm_loss, timeout=60)
    assert [r.local_stages for r in local.runners] == [[0], [1], [2], [3]]
    torch.manual_seed(0)
    ref = TiedLM().double()
    local.load_state_dict(ref.state_dict())
    x, y = _tokens(32, 4 * M, 6, seed=1), _tokens(32, 4 * M, 6, seed=2)
    outs = local.step(x, target=y)
    losses = []
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        loss = _lm_loss(ref(xb), yb)
        (loss / M).backward()
        losses.append(loss.detach())
    _check_step(local, ref, outs, losses, 1e-10)


def _nanogpt_meta_pipe(config: GPTConfig) -> tuple[GPT, mpmd.Pipe]:
    with torch.device("meta"):
        model = GPT(config).double()
    idx = _tokens(config.vocab_size, 2, 8).to("meta")
    targets = _tokens(config.vocab_size, 2, 8, seed=1).to("meta")
    return model, mpmd.trace(model, (idx,), {"targets": targets}, split_before=["transformer.h.1"])


def test_nanogpt_tied_weights_are_initialised_equal_on_every_rank():
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    model, pipe = _nanogpt_meta_pipe(config)

    def init(m: nn.Module) -> None:
        model._init_weights(m)
        if isinstance(m, LayerNorm):  # nanoGPT's own LayerNorm starts at ones and zeros
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    local = LocalPipeline(
        pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lambda out, _: out[1], timeout=60
    )
    assert list(pipe.tied.values()) == [(0, 1)]
    local.init_weights(init)
    tie = {"transformer.wte.weight", "lm_head.weight"}
    copies = _tied_copies(local, tie)
    assert [r for r, _ in copies] == [0, 1]
    # Rank 1's copy is rank 0's (the tie's first stage), bit for bit, and it
    # follows the model's init (std 0.02), not some other.
    assert torch.equal(copies[0][1], copies[1][1])
    assert 0.015 < float(copies[0][1].std()) < 0.025

    # The step equals the plain nanoGPT holding the owner's values.
    ref = GPT(config).double()
    state = _merged_state(local)
    ref.load_state_dict({**state, "lm_head.weight": state["transformer.wte.weight"]}, strict=True)
    x = _tokens(config.vocab_size, 4 * M, 8, seed=3)
    y = _tokens(config.vocab_size, 4 * M, 8, seed=4)
    outs = local.step(x, targets=y)
    losses = []
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        _, loss = ref(xb, targets=yb)
        (loss / M).backward()
        losses.append(loss.detach())
    _check_step(local, ref, outs, losses, 1e-10)

    # load_state_dict too: a per-rank state dict whose copies differ ends equal.
    other = GPT(config).double().state_dict()
    local._on_all(lambda r: r.load_state_dict({k: v + r.rank for k, v in other.items()}))
    copies = _tied_copies(local, tie)
    assert torch.equal(copies[1][1], other["transformer.wte.weight"])
    assert torch.equal(copies[0][1], copies[1][1])


def test_real_tied_copies_built_apart_are_equal_from_the_first_call():
    # A real model built on each rank from its own seed gives each rank its
    # own copy of the tied weight: they must not train apart. At the first
    # call the tie's first stage's rank gives its copy, as DDP's replicas
    # take rank 0's weights at construction.
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT(config).double()
    x = _tokens(config.vocab_size, 4 * M, 8, seed=3)
    y = _tokens(config.vocab_size, 4 * M, 8, seed=4)
    pipe = mpmd.trace(model, (x[:4],), {"targets": y[:4]}, split_before=["transformer.h.1"])
    local = LocalPipeline(
        pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lambda out, _: out[1], timeout=60
    )
    tie = {"transformer.wte.weight", "lm_head.weight"}
    with torch.no_grad():  # rank 1's copy as another seed would have made it
        _tied_copies(local, tie)[1][1].add_(torch.randn(config.vocab_size, config.n_embd))
    outs = local.step(x, targets=y)
    copies = _tied_copies(local, tie)
    assert torch.equal(copies[0][1], copies[1][1])
    assert torch.equal(copies[0][1], model.transformer.wte.weight)
    losses = []
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        _, loss = model(xb, targets=yb)
        (loss / M).backward()
        losses.append(loss.detach())
    _check_step(local, model, outs, losses, 1e-10)


def test_an_init_that_assigns_new_parameters_keeps_the_tie():
    # An init function may assign a new parameter rather than write the one
    # it finds: its values must reach the tensor the tie map, the executor
    # and data parallelism hold, so the copies still end equal and tied.
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    _, pipe = _nanogpt_meta_pipe(config)
    local = LocalPipeline(
        pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lambda out, _: out[1], timeout=60
    )
    counter = iter(range(1, 10_000))

    def init(m: nn.Module) -> None:
        for name, p in list(m._parameters.items()):
            if p is not None:
                value = float(next(counter)) / 100
                setattr(m, name, nn.Parameter(torch.full_like(p, value)))

    local.init_weights(init)
    tie = {"transformer.wte.weight", "lm_head.weight"}
    copies = _tied_copies(local, tie)
    assert torch.equal(copies[0][1], copies[1][1])
    for runner in local.runners:  # the tie map holds the stage's own tensor
        held = {id(p) for _, p in runner.named_parameters()}
        assert all(id(p) in held for p in runner._first.tied_parameters.values())
    ref = GPT(config).double()
    state = _merged_state(local)
    ref.load_state_dict({**state, "lm_head.weight": state["transformer.wte.weight"]}, strict=True)
    x = _tokens(config.vocab_size, 4 * M, 8, seed=3)
    y = _tokens(config.vocab_size, 4 * M, 8, seed=4)
    outs = local.step(x, targets=y)
    losses = []
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        _, loss = ref(xb, targets=yb)
        (loss / M).backward()
        losses.append(loss.detach())
    _check_step(local, ref, outs, losses, 1e-10)


def test_a_rank_whose_stages_hold_no_tensor_takes_part_in_init_weights():
    # Stage 1 is parameter-free: its rank has nothing to initialise, but the
    # call is collective (the tie of stages 0 and 2 spans ranks 0 and 2), so
    # it must not refuse alone and leave the others waiting.
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(16, 8)
            self.act = nn.Tanh()
            self.out = nn.Linear(8, 16, bias=False)
            self.out.weight = self.tok.weight

        def forward(self, ids):
            return self.out(self.act(self.tok(ids)))

    with torch.device("meta"):
        model = Tied()
    ids = _tokens(16, 2, 4).to("meta")
    pipe = mpmd.trace(model, (ids,), split_before=["act", "out"])
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(M), 3, timeout=30)
    local.init_weights(lambda m: nn.init.normal_(m.weight) if isinstance(m, nn.Embedding) else None)
    copies = _tied_copies(local, {"tok.weight", "out.weight"})
    assert [r for r, _ in copies] == [0, 2]
    assert torch.equal(copies[0][1], copies[1][1])


def _titan_args() -> TransformerModelArgs:
    return TransformerModelArgs(
        dim=16,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=64,
        multiple_of=16,
        max_seq_len=16,
    )


def _deterministic_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.nn.init's random fills made a function of (shape, mean, std),
    so that an init that ran on a few tensors of a meta model equals the one
    run on the whole model, exactly; a wrong std (a layer's depth rule not
    followed) shows as a wrong value."""

    def pattern(t: torch.Tensor) -> torch.Tensor:
        n = torch.arange(t.numel(), dtype=torch.float64, device=t.device)
        return torch.sin(n * 0.7 + 0.3 * t.shape[0]).reshape(t.shape)

    def normal_(t, mean=0.0, std=1.0, generator=None):
        with torch.no_grad():
            return t.copy_(mean + std * pattern(t))

    def trunc_normal_(t, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        with torch.no_grad():
            return t.copy_((mean + std * 1.5 * pattern(t)).clamp(a, b))

    monkeypatch.setattr(nn.init, "normal_", normal_)
    monkeypatch.setattr(nn.init, "trunc_normal_", trunc_normal_)


def test_torchtitan_model_initialises_from_its_root(monkeypatch):
    _deterministic_init(monkeypatch)
    args = _titan_args()
    with torch.device("meta"):
        model = Transformer(args).double()
    tokens = _tokens(args.vocab_size, 2, 8).to("meta")
    pipe = mpmd.trace(model, (tokens,), split_before=["layers.2"])
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=_lm_loss, timeout=60)
    local.init_weights()

    ref = Transformer(args).double()
    ref.init_weights()  # again, in float64
    expected = ref.state_dict()
    for runner in local.runners:
        for name, t in runner.state_dict().items():
            torch.testing.assert_close(t, expected[name], rtol=0, atol=0, msg=name)
        for s in runner.local_stages:
            # The RoPE table, which no state dict holds, was recomputed.
            table = runner.local_modules()[runner.local_stages.index(s)].get_buffer("freqs_cis")
            assert torch.equal(table, ref.freqs_cis)
    # Each layer's output projection took its own depth's std.
    stds = [float(ref.layers[str(i)].attention.wo.weight.detach().abs().max()) for i in range(4)]
    assert stds == sorted(stds, reverse=True) and len(set(stds)) == 4
    # The model keeps its meta tensors.
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])

    x = _tokens(args.vocab_size, 4 * M, 8, seed=3)
    y = _tokens(args.vocab_size, 4 * M, 8, seed=4)
    outs = local.step(x, target=y)
    losses = []
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        loss = _lm_loss(ref(xb), yb)
        (loss / M).backward()
        losses.append(loss.detach())
    _check_step(local, ref, outs, losses, 1e-10)


def test_torchtitan_root_init_with_torch_random_numbers():
    # Unpatched: the values are random, so the check is that the step equals
    # the plain model holding the runners' weights, the RoPE table is right,
    # and each rank ran the init of its own layers (depth-dependent std).
    args = _titan_args()
    with torch.device("meta"):
        model = Transformer(args).double()
    pipe = mpmd.trace(
        model, (_tokens(args.vocab_size, 2, 8).to("meta"),), split_before=["layers.2"]
    )
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=_lm_loss, timeout=60)
    local.init_weights()
    ref = Transformer(args).double()
    state = _merged_state(local)
    ref.load_state_dict(state)
    for runner in local.runners:
        modules = runner.local_modules()
        assert all(torch.equal(m.get_buffer("freqs_cis"), ref.freqs_cis) for m in modules)
    std_0 = float(state["layers.0.feed_forward.w2.weight"].std())
    std_3 = float(state["layers.3.feed_forward.w2.weight"].std())
    # 0.02 / sqrt(2) and 0.02 / sqrt(8): 2x apart, well beyond sampling noise.
    assert 1.6 < std_0 / std_3 < 2.5, (std_0, std_3)
    x = _tokens(args.vocab_size, 4 * M, 8, seed=3)
    y = _tokens(args.vocab_size, 4 * M, 8, seed=4)
    outs = local.step(x, target=y)
    losses = []
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        loss = _lm_loss(ref(xb), yb)
        (loss / M).backward()
        losses.append(loss.detach())
    _check_step(local, ref, outs, losses, 1e-10)
