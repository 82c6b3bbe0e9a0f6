"""A mixture-of-experts transformer written the way torchtitan's MoE is
(torchtitan/models/moe.py before May 2026, the DeepSeek-V3 / Llama 4
pattern, tiny): a token-choice top-k router (`histc` tokens per expert, an
`expert_bias` buffer for DeepSeek's auxiliary-loss-free balancing, a
`tokens_per_expert` buffer the forward accumulates), tokens reordered by
expert (`argsort`), `GroupedExperts` with stacked `w1`/`w2`/`w3` run by the
for-loop path (`.tolist()` split sizes, `torch.split`), a shared expert, a
dense first layer, and DeepSeek's sequence-wise balance loss returned beside
the logits. Our own code, in their style, for the expert-parallel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEArgs:
    vocab_size: int = 64
    dim: int = 16
    n_layers: int = 4
    n_heads: int = 2
    hidden_dim: int = 32
    moe_hidden_dim: int = 16
    num_experts: int = 4
    top_k: int = 2
    n_dense_layers: int = 1
    shared_experts: int = 1
    score_func: str = "softmax"
    route_norm: bool = True
    load_balance_coeff: float | None = 1e-3
    aux_loss_coeff: float = 1e-2


def _run_experts_for_loop(
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    num_tokens_per_expert_list = num_tokens_per_expert.tolist()
    x_splits = torch.split(x, split_size_or_sections=num_tokens_per_expert_list, dim=0)
    out_experts_splits = []
    for expert_idx, x_expert in enumerate(x_splits):
        h = F.silu(torch.matmul(x_expert, w1[expert_idx].transpose(-2, -1)))
        h = h * torch.matmul(x_expert, w3[expert_idx].transpose(-2, -1))
        h = torch.matmul(h, w2[expert_idx].transpose(-2, -1))
        out_experts_splits.append(h)
    return torch.cat(out_experts_splits, dim=0)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return _run_experts_for_loop(self.w1, self.w2, self.w3, x, num_tokens_per_expert)

    def init_weights(self, init_std: float) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.gate(x)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(scores.to(torch.float32)).to(x.dtype)
        else:
            scores = F.softmax(scores, dim=1)
        scores_for_choice = scores if expert_bias is None else scores + expert_bias.to(x.dtype)
        _, selected_experts_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1)
        top_scores = scores.gather(dim=1, index=selected_experts_indices)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        num_tokens_per_expert = torch.histc(
            selected_experts_indices.view(-1).to(x.dtype),
            bins=self.num_experts,
            min=0,
            max=self.num_experts,
        )
        return top_scores, selected_experts_indices, num_tokens_per_expert, scores


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.experts = GroupedExperts(args.dim, args.moe_hidden_dim, args.num_experts)
        self.router = TokenChoiceTopKRouter(args)
        self.shared_experts = (
            FeedForward(args.dim, args.moe_hidden_dim * args.shared_experts)
            if args.shared_experts
            else None
        )
        self.top_k = args.top_k
        self.num_experts = args.num_experts
        self.aux_loss_coeff = args.aux_loss_coeff
        self.load_balance_coeff = args.load_balance_coeff
        if self.load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected, num_tokens_per_expert, scores = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert.to(self.tokens_per_expert.dtype))
        # Reorder the (token, slot) pairs by expert.
        token_indices_experts_sorted = torch.argsort(selected.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        routed_input = x[token_indices_experts_sorted // self.top_k]
        routed_output = self.experts(routed_input, num_tokens_per_expert.long())
        routed_output = routed_output * top_scores_experts_sorted.reshape(-1, 1)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        out = out.scatter_add(
            0,
            (token_indices_experts_sorted // self.top_k).reshape(-1, 1).expand(-1, dim),
            routed_output,
        )
        # DeepSeek-V3's sequence-wise balance loss: per sequence, the share of
        # routed slots each expert got times its mean score.
        seq_scores = (scores / (scores.sum(-1, keepdim=True) + 1e-20)).view(bs, slen, -1)
        chosen = F.one_hot(selected.view(bs, slen * self.top_k), self.num_experts).to(x.dtype)
        share = chosen.sum(1) * self.num_experts / (self.top_k * slen)
        aux = self.aux_loss_coeff * (share * seq_scores.mean(1)).sum(-1).mean()
        return out.view(bs, slen, dim), aux


class Attention(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, _ = x.shape
        q, k, v = (
            w(x).view(bs, slen, self.n_heads, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, slen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: MoEArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.attention(self.attention_norm(x))
        if self.moe_enabled:
            out, layer_aux = self.moe(self.ffn_norm(h))
            return h + out, aux + layer_aux
        return h + self.feed_forward(self.ffn_norm(h)), aux


class Transformer(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, GroupedExperts):
                module.init_weights(0.02)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()
            elif isinstance(module, MoE):  # torchtitan's _init_self_buffers
                with torch.no_grad():
                    module.tokens_per_expert.zero_()
                    if module.expert_bias is not None:
                        module.expert_bias.zero_()

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.tok_embeddings(tokens)
        aux = h.new_zeros(())
        for layer in self.layers.values():
            h, aux = layer(h, aux)
        return self.output(self.norm(h)), aux


def moe_loss(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    logits, aux = out
    return F.cross_entropy(logits.flatten(0, 1), target.flatten()) + aux


class FirstHalf(nn.Module):
    """A stage cut by hand: the embedding and the first half of the layers
    (a model's own modules, sharing its parameters)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        half = len(model.layers) // 2
        self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({k: v for k, v in model.layers.items() if int(k) < half})

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.tok_embeddings(tokens)
        aux = h.new_zeros(())
        for layer in self.layers.values():
            h, aux = layer(h, aux)
        return h, aux


class SecondHalf(nn.Module):
    """The other layers, the norm and the output."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        half = len(model.layers) // 2
        self.layers = nn.ModuleDict({k: v for k, v in model.layers.items() if int(k) >= half})
        self.norm = model.norm
        self.output = model.output

    def forward(self, h: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers.values():
            h, aux = layer(h, aux)
        return self.output(self.norm(h)), aux


def experts_over_ep(stage: nn.Module, stage_mesh) -> None:
    """A user's own parallelize for stages cut by hand: every GroupedExperts
    sharded over ep, its tokens dispatched there."""
    from torchmpmd.parallel import shard_experts

    for name, module in stage.named_modules():
        if isinstance(module, GroupedExperts):
            shard_experts(module, stage_mesh, "grouped_experts", path=name)


class ExpertParallel:
    """A stand-in for torchtitan's `ExpertParallel` ParallelStyle, as a
    torchtitan user's plan names it (`{"layers.*.moe.experts":
    ExpertParallel()}`): torchmpmd reads the style by its name (torchtitan
    itself is not installed here)."""
