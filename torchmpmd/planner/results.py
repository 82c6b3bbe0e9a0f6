"""What the planner measures and chooses: a model's units and their costs
(`Profile`), one stage of a split (`StageCost`) and the chosen split
(`Balance`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..graph.format import human_bytes, table
from ..schedule.task import Schedule
from ..schedule.timeline import Timeline

__all__ = ["Balance", "Profile", "StageCost", "UnitTransfer"]


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitTransfer:
    """A value computed in unit `src` and read by units `dst` (`bytes` per microbatch)."""

    src: int
    dst: tuple[int, ...]
    bytes: int
    requires_grad: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """Per-unit costs of one microbatch: what `search` splits.

    `units[i]` is a module path; a stage can start at any unit but the first.
    Times are seconds, bytes per microbatch. `tied` lists the units that share
    a tied parameter, with its size (its gradient crosses between stages).
    """

    units: tuple[str, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    transfers: tuple[UnitTransfer, ...]
    tied: tuple[tuple[tuple[int, ...], int], ...] = ()
    # The split backward's I and W per unit, measured apart from B (None:
    # not measured, I = W = B / 2). A stage that starts at the first unit has
    # no input gradient: its W is the whole backward.
    input_grad: tuple[float, ...] | None = None
    weight_grad: tuple[float, ...] | None = None
    # The same units under selective recompute (None: not measured): their
    # forward, backward (recomputing what is not kept), I, W and the bytes
    # kept. Its transfers are the same as this profile's.
    selective: Profile | None = None
    # Bytes each unit holds from its input gradient (I) to its weight
    # gradient (W) under the split backward: the forward's tensors W reads
    # and the output gradients I made for it (None: not measured, half the
    # activation bytes).
    weight_grad_bytes: tuple[int, ...] | None = None
    # Seconds to add one microbatch's weight gradients into those of the
    # step's earlier microbatches, per unit (the backward and W times above
    # are a step's first, which takes its gradients as they are; None: not
    # measured).
    accumulate: tuple[float, ...] | None = None
    # Bytes of the parameters each unit holds (a stage holds its units';
    # gradients and optimizer states follow them). None: not known.
    parameter_bytes: tuple[int, ...] | None = None
    # Of those, the bytes of experts' parameters (expert parallelism divides
    # them over ep; None: no experts, or not known).
    expert_bytes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.units)
        if n < 1:
            raise ValueError("Profile: needs at least one unit")
        if self.selective is not None and self.selective.units != self.units:
            raise ValueError("Profile.selective must profile the same units")
        if (self.input_grad is None) != (self.weight_grad is None):
            raise ValueError("Profile: give input_grad and weight_grad together, or neither")
        for name in (
            "forward",
            "backward",
            "activation_bytes",
            "input_grad",
            "weight_grad",
            "weight_grad_bytes",
            "accumulate",
            "parameter_bytes",
            "expert_bytes",
        ):
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != n:
                raise ValueError(f"Profile.{name} gives {len(values)} values for {n} units")
            if any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"Profile.{name} must be finite and non-negative, got {values}")
        for t in self.transfers:
            if not 0 <= t.src < n or any(not t.src < d < n for d in t.dst):
                raise ValueError(
                    f"Profile: transfer {t} must go from a unit to later units (0..{n - 1})"
                )
        for units, _ in self.tied:
            if any(not 0 <= u < n for u in units):
                raise ValueError(f"Profile: tied units {units} must be in 0..{n - 1}")

    @staticmethod
    def chain(
        units: Sequence[str],
        forward: Sequence[float],
        backward: Sequence[float] | None = None,
        activation_bytes: Sequence[int] | None = None,
        cut_bytes: Sequence[int] | None = None,
    ) -> Profile:
        """Units where each one reads only the previous one's output (`cut_bytes[i]`
        crossing between units i and i+1); backward defaults to 2x forward."""
        n = len(units)
        cuts = list(cut_bytes) if cut_bytes is not None else [1] * (n - 1)
        if len(cuts) != n - 1:
            raise ValueError(f"Profile.chain: cut_bytes gives {len(cuts)} values for {n - 1} cuts")
        return Profile(
            units=tuple(units),
            forward=tuple(float(f) for f in forward),
            backward=tuple(float(b) for b in (backward or [2 * f for f in forward])),
            activation_bytes=tuple(int(a) for a in (activation_bytes or [0] * n)),
            transfers=tuple(
                UnitTransfer(src=i, dst=(i + 1,), bytes=int(c)) for i, c in enumerate(cuts)
            ),
        )

    @property
    def cut_bytes(self) -> tuple[int, ...]:
        """Bytes crossing a single cut before units[1], units[2], ..."""
        return tuple(
            sum(t.bytes for t in self.transfers if t.src < k <= max(t.dst))
            for k in range(1, len(self.units))
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCost:
    """One stage of a split: its units and summed per-microbatch costs."""

    units: tuple[str, ...]
    forward: float  # seconds
    backward: float  # seconds
    activation_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Balance:
    """The split `mpmd.balance` chose, with the simulator's prediction for it and
    for the even split. Pass `split_before` to `mpmd.trace`."""

    split_before: list[str]
    predicted_step: float  # seconds, simulated
    stage_costs: tuple[StageCost, ...]
    peak_activation_bytes: list[int]  # per rank, simulated
    even_split_before: list[str]
    even_step: float  # seconds, simulated
    schedule: Schedule
    num_ranks: int
    method: str  # "exhaustive" or "local search"
    splits_simulated: int
    profile: Profile = field(repr=False, compare=False)
    timeline: Timeline = field(repr=False, compare=False)

    @property
    def num_stages(self) -> int:
        return len(self.stage_costs)

    @property
    def speedup(self) -> float:
        """Predicted step of the even split over the chosen one's."""
        return self.even_step / self.predicted_step if self.predicted_step > 0 else 1.0

    def __repr__(self) -> str:
        rows = [
            (
                s,
                _rank_of(self, s),
                _span(c.units),
                _seconds(c.forward),
                _seconds(c.backward),
                human_bytes(c.activation_bytes),
            )
            for s, c in enumerate(self.stage_costs)
        ]
        head = (
            f"Balance: {self.num_stages} stages, {self.schedule!r} on {self.num_ranks} ranks "
            f"({self.method}, {self.splits_simulated} splits simulated)\n"
            f"  split_before={self.split_before}\n"
            f"  predicted step {_seconds(self.predicted_step)}; even split "
            f"{_seconds(self.even_step)} ({self.speedup:.2f}x), "
            f"split_before={self.even_split_before}\n"
            f"  peak activations per rank: "
            + ", ".join(human_bytes(b) for b in self.peak_activation_bytes)
            + "\n"
        )
        return head + table(
            "per microbatch:",
            ["stage", "rank", "units", "forward", "backward", "activations"],
            rows,
        )


def _rank_of(result: Balance, stage: int) -> int:
    return int(result.schedule.placement(result.num_stages, result.num_ranks)[stage])


def _span(units: tuple[str, ...]) -> str:
    return units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]} ({len(units)})"


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
