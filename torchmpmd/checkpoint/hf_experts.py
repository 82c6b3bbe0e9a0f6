"""Stacked experts in Hugging Face checkpoints.

A Hugging Face MoE model (transformers 5) holds each layer's experts stacked
(`mlp.experts.gate_up_proj`, `[experts, 2 x intermediate, hidden]`), while its
checkpoints (the Hub's, and `save_pretrained`'s) keep one tensor per expert
and projection (`mlp.experts.3.gate_proj.weight`); transformers converts on
load and back on save, as its conversion mapping for the model type says
(`MergeModulelist(dim=0)`, then `Concatenate(dim=1)` of the projections).
`load_hf` and `save_hf` follow the same mapping, and keep to a rank's own
experts: a stacked parameter is read as the per-expert tensors of the
experts this rank holds (expert parallelism's shard of the experts
dimension), and written as the per-expert tensors of those experts, by the
rank holding them, without gathering the layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = [
    "Converter",
    "Stacked",
    "converters",
    "expert_pieces",
    "keys_written",
    "stacked_keys",
    "write_experts",
]


@dataclass(frozen=True, slots=True)
class Converter:
    """One of transformers' conversions: the per-expert `sources` (patterns
    with `*` for the expert number, one per projection) stacked and, with
    `concat_dim`, concatenated into the parameter named by `target`."""

    sources: tuple[str, ...]
    target: str
    concat_dim: int | None  # in the stacked tensor's dimensions (>= 1)

    def prefix_of(self, name: str) -> str | None:
        """The part of parameter `name` before `target` (None: not this one's)."""
        if name == self.target:
            return ""
        if name.endswith("." + self.target):
            return name[: -len(self.target)]
        return None

    def keys(self, prefix: str, expert: int) -> list[str]:
        return [prefix + s.replace("*", str(expert)) for s in self.sources]


def converters(source: Any) -> list[Converter]:
    """The stacked-experts conversions transformers applies to the model
    `source` (none for a model that is not Hugging Face's, or an older
    transformers without them)."""
    model_type = getattr(getattr(source, "config", None), "model_type", None)
    if not model_type:
        return []
    try:
        from transformers import conversion_mapping
    except ImportError:
        return []
    mapping: Any = getattr(conversion_mapping, "get_checkpoint_conversion_mapping", None)
    out = []
    for c in (mapping(model_type) if mapping is not None else None) or []:
        ops = list(getattr(c, "operations", None) or [])
        kinds = [type(o).__name__ for o in ops]
        if kinds not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
            continue
        if getattr(ops[0], "dim", 0) != 0:
            continue
        sources = c.source_patterns
        targets = c.target_patterns
        sources = [sources] if isinstance(sources, str) else list(sources)
        targets = [targets] if isinstance(targets, str) else list(targets)
        if len(targets) != 1 or not all("*" in s for s in sources):
            continue
        concat = int(ops[1].dim) if len(ops) == 2 else None
        if concat is None and len(sources) != 1:
            continue
        out.append(Converter(tuple(sources), targets[0], concat))
    return out


@dataclass(frozen=True, slots=True)
class Stacked:
    """A stacked parameter as the checkpoint holds it: per expert, the keys
    of its projections (concatenated along `concat_dim - 1` of each)."""

    keys: tuple[tuple[str, ...], ...]  # [expert][projection]
    concat_dim: int | None

    def shape(self, shape_of: Callable[[str], list[int]]) -> list[int]:
        parts = [shape_of(k) for k in self.keys[0]]
        one = list(parts[0])
        if self.concat_dim is not None:
            one[self.concat_dim - 1] = sum(p[self.concat_dim - 1] for p in parts)
        return [len(self.keys), *one]

    def read(
        self, read: Callable[[str], torch.Tensor], index: tuple[slice, ...] | None
    ) -> torch.Tensor:
        """The experts `index[0]` selects (only their tensors are read), then
        the rest of `index`."""
        experts = range(len(self.keys))[index[0]] if index is not None else range(len(self.keys))
        rows = []
        for e in experts:
            parts = [read(k) for k in self.keys[e]]
            one = parts[0] if self.concat_dim is None else torch.cat(parts, self.concat_dim - 1)
            rows.append(one)
        value = torch.stack(rows)
        if index is not None:
            value = value[(slice(None), *index[1:])]
        return value


def stacked_keys(keys: Iterable[str], found: list[Converter]) -> dict[str, Stacked]:
    """The stacked parameters a checkpoint's per-expert `keys` make up, by the
    parameter's name (each with experts 0..E-1 and every projection)."""
    present = set(keys)
    out: dict[str, Stacked] = {}
    for c in found:
        first = re.compile(
            "^(?P<prefix>.*?)" + re.escape(c.sources[0]).replace(r"\*", r"(?P<e>\d+)") + "$"
        )
        experts: dict[str, set[int]] = {}
        for k in present:
            m = first.match(k)
            if m is not None:
                experts.setdefault(m["prefix"], set()).add(int(m["e"]))
        for prefix, numbers in experts.items():
            count = len(numbers)
            if numbers != set(range(count)):
                continue
            keys_of = tuple(tuple(c.keys(prefix, e)) for e in range(count))
            if all(k in present for row in keys_of for k in row):
                out[prefix + c.target] = Stacked(keys_of, c.concat_dim)
    return out


def expert_pieces(
    name: str, t: torch.Tensor, found: list[Converter]
) -> tuple[Converter, str, range, bool] | None:
    """How stacked parameter `name` is written: its converter, the key
    prefix, the experts this rank writes from its own tensor, and whether
    its tensor must be gathered first (a DTensor whose shard is not a
    plain slice of whole experts); None for a parameter that is not stacked."""
    for c in found:
        prefix = c.prefix_of(name)
        if prefix is None:
            continue
        if not isinstance(t, DTensor):
            return c, prefix, range(t.shape[0]), False
        if all(type(p) in (Shard, Replicate) for p in t.placements):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(
                t.shape, t.device_mesh, t.placements
            )
            if list(shape[1:]) == list(t.shape[1:]):
                return c, prefix, range(offset[0], offset[0] + shape[0]), False
        return c, prefix, range(t.shape[0]), True
    return None


def split_expert(c: Converter, rows: torch.Tensor) -> list[torch.Tensor]:
    """One expert's stacked slice as its projections' tensors (the inverse
    of the concatenation; equal parts)."""
    if c.concat_dim is None:
        return [rows]
    return list(torch.chunk(rows, len(c.sources), dim=c.concat_dim - 1))


def keys_written(name: str, pieces: Any) -> list[str]:
    """The keys a local tensor goes out under: its name, or a stacked
    parameter's per-expert keys of the experts this rank writes
    (`pieces`: `expert_pieces`'s)."""
    if pieces is None:
        return [name]
    c, prefix, experts, _gather = pieces
    return [k for e in experts for k in c.keys(prefix, e)]


def write_experts(
    pieces: Any,
    t: torch.Tensor,
    writer: dict[str, int],
    me: int,
    mine: dict[str, torch.Tensor],
    whole: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """A stacked parameter's per-expert tensors this rank writes (into
    `mine`), from its own experts; gathered first (`whole`: a collective,
    every rank in the same order) only where its shard is no slice of whole
    experts."""
    c, prefix, experts, gather = pieces
    if gather:
        rows, first = whole(t), 0
    else:
        value = t.detach()
        rows = value.to_local() if isinstance(value, DTensor) else value
        first = experts.start
    for e in experts:
        for key, part in zip(c.keys(prefix, e), split_expert(c, rows[e - first]), strict=True):
            if writer.get(key) == me and key not in mine:
                mine[key] = part.to("cpu", copy=True, memory_format=torch.contiguous_format)
