"""Costs at any microbatch size: a unit's time is a fixed cost per call
(Python dispatch, kernel launches, the runtime's per-op overhead) plus a
cost per row, and the planner weighs microbatches of other sizes than the
example's.

A profile scaled linearly with rows (what `mpmd.plan` did before) misses the
fixed part: on torchtitan's Llama 3 debug model it predicted an
Interleaved1F1B of 16 small microbatches at 325-341 ms where it measured
792-846 ms. So the model is profiled twice, on the example and on its first
half of rows, and each unit's forward, backward, I and W get a line through
the two points (`RowCosts.at`): the slope is the cost per row, the
intercept the fixed cost per call, both clamped non-negative (a noisy pair
whose half costs more than the whole is taken as all fixed). Bytes (saved
activations, what crosses a cut) are proportional to rows. An example of
one row cannot be halved: its costs scale linearly, as before, and
`RowCosts.fixed_cost_known` says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .results import Profile

__all__ = ["RowCosts", "first_rows"]


def first_rows(tree: Any, rows: int, keep: int) -> Any:
    """`tree` with every tensor of `rows` rows (dim 0) cut to its first `keep`."""

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == rows:
            return leaf[:keep]
        return leaf

    return pytree.tree_map(cut, tree)


@dataclass(frozen=True, slots=True)
class RowCosts:
    """A model's profile at `rows` rows per microbatch and, where measured,
    at `half_rows`: `at(r)` is its profile at `r` rows."""

    full: Profile
    rows: int
    half: Profile | None = None
    half_rows: int = 0

    @property
    def fixed_cost_known(self) -> bool:
        return self.half is not None and _alike(self.full, self.half)

    def at(self, rows: float) -> Profile:
        """The profile at `rows` rows per microbatch."""
        if rows == self.rows:
            return self.full
        half = self.half if self.fixed_cost_known else None
        return _at(self.full, half, self.rows, self.half_rows, rows)

    def slowed(self, factor: float) -> RowCosts:
        """These costs with every time `factor` x (bytes unchanged)."""
        if factor == 1.0:
            return self
        half = None if self.half is None else _slowed(self.half, factor)
        return RowCosts(_slowed(self.full, factor), self.rows, half, self.half_rows)

    def fixed(self) -> tuple[float, ...]:
        """Per unit, the fixed forward + backward cost per call (seconds)."""
        if not self.fixed_cost_known:
            return tuple(0.0 for _ in self.full.units)
        assert self.half is not None
        one = _at(self.full, self.half, self.rows, self.half_rows, 0.0)
        return tuple(f + b for f, b in zip(one.forward, one.backward, strict=True))


def _alike(a: Profile, b: Profile) -> bool:
    """Whether two profiles have the same units, transfers and measured parts."""
    return (
        a.units == b.units
        and [(t.src, t.dst) for t in a.transfers] == [(t.src, t.dst) for t in b.transfers]
        and (a.input_grad is None) == (b.input_grad is None)
        and (a.selective is None) == (b.selective is None)
    )


def _line(full: float, half: float, r1: int, r0: int, rows: float) -> float:
    """The affine cost through (r0, half) and (r1, full) at `rows`, with a
    non-negative slope and intercept."""
    slope = max((full - half) / (r1 - r0), 0.0)
    fixed = min(max(full - slope * r1, 0.0), full)
    if fixed == 0.0:
        slope = full / r1
    return fixed + slope * rows


def _times(
    full: Sequence[float] | None,
    half: Sequence[float] | None,
    r1: int,
    r0: int,
    rows: float,
) -> tuple[float, ...] | None:
    if full is None:
        return None
    if half is None:
        return tuple(v * rows / r1 for v in full)
    return tuple(_line(f, h, r1, r0, rows) for f, h in zip(full, half, strict=True))


def _at(full: Profile, half: Profile | None, r1: int, r0: int, rows: float) -> Profile:
    factor = rows / r1
    forward = _times(full.forward, None if half is None else half.forward, r1, r0, rows)
    backward = _times(full.backward, None if half is None else half.backward, r1, r0, rows)
    assert forward is not None and backward is not None
    selective = None
    if full.selective is not None:
        selective = _at(full.selective, None if half is None else half.selective, r1, r0, rows)
    return dataclasses.replace(
        full,
        forward=forward,
        backward=backward,
        input_grad=_times(full.input_grad, None if half is None else half.input_grad, r1, r0, rows),
        weight_grad=_times(
            full.weight_grad, None if half is None else half.weight_grad, r1, r0, rows
        ),
        activation_bytes=tuple(round(a * factor) for a in full.activation_bytes),
        weight_grad_bytes=None
        if full.weight_grad_bytes is None
        else tuple(round(a * factor) for a in full.weight_grad_bytes),
        transfers=tuple(
            dataclasses.replace(t, bytes=round(t.bytes * factor)) for t in full.transfers
        ),
        selective=selective,
    )


def _slowed(prof: Profile, factor: float) -> Profile:
    def times(values: Sequence[float] | None) -> tuple[float, ...] | None:
        return None if values is None else tuple(v * factor for v in values)

    forward, backward = times(prof.forward), times(prof.backward)
    assert forward is not None and backward is not None
    return dataclasses.replace(
        prof,
        forward=forward,
        backward=backward,
        input_grad=times(prof.input_grad),
        weight_grad=times(prof.weight_grad),
        accumulate=times(prof.accumulate),
        selective=None if prof.selective is None else _slowed(prof.selective, factor),
    )
