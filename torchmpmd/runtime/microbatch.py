"""Splitting a batch into microbatches and merging microbatch outputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..graph.pipe import Pipe, check_input

__all__: list[str] = []


class Microbatcher:
    """Cuts call arguments and targets into `num_microbatches` pieces.

    Tensors split along dim 0 unless `chunk_dims` names another dimension
    (None: every microbatch gets the whole tensor); other values are
    replicated. A batch that does not divide evenly splits like
    `torch.tensor_split`: the first `size % m` microbatches hold one row
    more than the rest (so a partial last batch works). Each microbatch is
    checked against the example its pipe was traced with.
    """

    def __init__(
        self, pipe: Pipe, num_microbatches: int, chunk_dims: Mapping[str, int | None] | None
    ) -> None:
        self._pipe = pipe
        self.num_microbatches = num_microbatches
        self._chunk_dims = dict(chunk_dims or {})
        unknown = set(self._chunk_dims) - set(pipe.input_names) - {"target"}
        if unknown:
            raise ValueError(
                f"chunk_dims names unknown inputs {sorted(unknown)}; inputs are {pipe.input_names} "
                "and 'target'"
            )

    def split(self, flat: list[Any]) -> list[list[Any]]:
        """Per microbatch, its piece of the flat inputs (`Pipe.flatten_structure`)."""
        m = self.num_microbatches
        columns = []
        for name, value in zip(self._pipe.input_names, flat, strict=True):
            if isinstance(value, torch.Tensor):
                dim = self._chunk_dims.get(name, 0)
                columns.append(
                    [value.contiguous()] * m if dim is None else _chunk(value, m, dim, name)
                )
            else:
                columns.append([value] * m)
        return [list(row) for row in zip(*columns, strict=True)]

    def check(self, i: int, row: list[Any]) -> None:
        """Checks microbatch `i`'s flat inputs against the traced example."""
        for name, expected, value in zip(
            self._pipe.input_names, self._pipe.input_specs, row, strict=True
        ):
            if isinstance(value, torch.Tensor):
                _check_microbatch(name, expected, value, i)
            else:
                check_input(name, expected, value)

    def targets(self, target: Any, flat: list[Any]) -> list[Any]:
        """Per microbatch, its piece of `target` (None: no target), split with
        the batch's flat inputs `flat`: each microbatch's target holds the
        rows of that microbatch's examples."""
        m = self.num_microbatches
        if target is None:
            return [None] * m
        _refuse_numbers(target)
        dim = self._chunk_dims.get("target", 0)
        leaves, spec = pytree.tree_flatten(target)
        batch = None if dim is None else self._split_input(flat)
        split = [
            self._split_target(leaf, dim, batch)
            if isinstance(leaf, torch.Tensor) and dim is not None
            else [leaf] * m
            for leaf in leaves
        ]
        return [pytree.tree_unflatten([col[i] for col in split], spec) for i in range(m)]

    def _split_input(self, flat: list[Any]) -> tuple[str, torch.Tensor, int] | None:
        """The first input split into microbatches: (name, value, dimension)."""
        for name, value in zip(self._pipe.input_names, flat, strict=True):
            if isinstance(value, torch.Tensor):
                d = self._chunk_dims.get(name, 0)
                if d is not None and value.dim() > d:
                    return name, value, d
        return None

    def _split_target(
        self, leaf: torch.Tensor, dim: int, batch: tuple[str, torch.Tensor, int] | None
    ) -> list[torch.Tensor]:
        """A target tensor split with the batch: one row per example, or k
        rows per example (a (batch * seq,) target of a (batch, seq) input),
        each microbatch taking its examples' rows. Anything else would pair
        targets with other examples' inputs, so it is refused."""
        m = self.num_microbatches
        if batch is None:
            return _chunk(leaf, m, dim, "target")
        name, value, d = batch
        examples = value.shape[d]
        rows = leaf.shape[dim] if leaf.dim() > dim else 0
        if rows == examples:
            return _chunk(leaf, m, dim, "target")
        if rows and rows % examples == 0 and examples >= m:
            per = rows // examples
            sizes = [per * (examples // m + (1 if i < examples % m else 0)) for i in range(m)]
            return [piece.contiguous() for piece in torch.split(leaf, sizes, dim)]
        raise ValueError(
            f"the target has shape {tuple(leaf.shape)} but input '{name}' has shape "
            f"{tuple(value.shape)}: along dimension {dim} the target must have one row per "
            f"example ({examples}, as '{name}' along dimension {d}), or the same number of rows "
            "per example (a (batch * seq,) target of a (batch, seq) batch), so that both split "
            "into the same microbatches; pass the target of this batch, or "
            "chunk_dims={'target': None} to give every microbatch the whole target"
        )


def _refuse_numbers(target: Any) -> None:
    """A target given as a Python list of numbers (not a tensor) would reach
    the loss whole, in every microbatch."""
    if isinstance(target, (list, tuple)) and target:
        leaves = pytree.tree_leaves(target)
        if all(isinstance(v, (bool, int, float)) for v in leaves):
            raise TypeError(
                f"the target is a {type(target).__name__} of {len(leaves)} Python numbers; pass "
                "a tensor (torch.tensor(target)), which splits into microbatches with the batch"
            )


def merge(pieces: list[Any]) -> Any:
    """One output from its microbatch pieces: concatenated (scalars stacked)."""
    first = pieces[0]
    if not isinstance(first, torch.Tensor):
        return first
    if first.dim() == 0:
        return torch.stack(pieces)
    return torch.cat(pieces, dim=0)


def to_device(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(
        lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v, value
    )


def _chunk(value: torch.Tensor, m: int, dim: int, name: str) -> list[torch.Tensor]:
    size = value.shape[dim] if value.dim() > dim else None
    if size is None or size < m:
        raise ValueError(
            f"input '{name}' has shape {tuple(value.shape)}: dimension {dim} must split into "
            f"{m} microbatches of at least one row each; pass a batch of at least "
            f"num_microbatches={m} rows, or chunk_dims={{'{name}': ...}} to split along another "
            "dimension (None: replicate)"
        )
    # Contiguous, like the traced example: graphs may view their inputs.
    return [piece.contiguous() for piece in torch.tensor_split(value, m, dim)]


def _check_microbatch(name: str, expected: Any, piece: torch.Tensor, i: int) -> None:
    try:
        check_input(name, expected, piece)
    except ValueError as err:
        raise ValueError(f"microbatch {i}: {err}") from None
