"""Sharding strategies for ops a traced stage holds that DTensor has none
for: on the CPU, torch.export lowers `scaled_dot_product_attention` to
`_scaled_dot_product_flash_attention_for_cpu` (DTensor knows only the CUDA
kernels). Attention is independent per head, so the heads dimension (1 of
(batch, heads, sequence, head_dim)) may be sharded, or nothing; a mask is
replicated. Registered once, at import (DTensor's own extension point)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

__all__: list[str] = []

aten = torch.ops.aten
_Strategy = tuple[list[Placement], list[Placement | None]]


def _strategies(outputs: int, tensors: int, scalars: int, attn_mask: Any) -> list[_Strategy]:
    mask: list[Placement | None] = [] if attn_mask is None else [Replicate()]
    every: list[_Strategy] = []
    placements: tuple[Placement, ...] = (Replicate(), Shard(1))
    for p in placements:
        ins: list[Placement | None] = [p] * tensors + [None] * scalars + mask
        every.append(([p] * outputs, ins))
    return every


if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)  # type: ignore[untyped-decorator]
    def _flash_cpu(
        query: Any,
        key: Any,
        value: Any,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        attn_mask: Any = None,
        scale: float | None = None,
    ) -> list[_Strategy]:
        # -> (output, logsumexp), both (batch, heads, ...).
        return _strategies(2, 3, 2, attn_mask)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)  # type: ignore[untyped-decorator]
    def _flash_cpu_backward(
        grad_out: Any,
        query: Any,
        key: Any,
        value: Any,
        out: Any,
        logsumexp: Any,
        dropout_p: float,
        is_causal: bool,
        attn_mask: Any = None,
        scale: float | None = None,
    ) -> list[_Strategy]:
        # -> (grad_query, grad_key, grad_value).
        return _strategies(3, 6, 2, attn_mask)
