"""The layouts `mpmd.plan` weighs: how N devices divide into pipeline ranks
(pp), data-parallel replicas (dp, replicated or FSDP2-sharded) and
tensor-parallel ranks (tp), and what each layout adds to a stage's costs.

pp = 1 is a layout like any other: pure data parallelism (torch's DDP's or
FSDP2's job) or tensor parallelism, one stage holding the whole model and
gradient accumulation over the microbatches. Every layout is weighed on the
same simulator as a pipeline: its profile taken at its own microbatch size
(`rows.RowCosts`), scaled over tp (`tensor_costs`), with its gradient
reduction (and FSDP gather) per stage simulated beside the schedule as the
runtime runs them (`StageCharges`: the lowering's UNSHARD / REDUCE_grads
instructions), priced by collectives measured on the job's own process
group (`links.calibrate`).

What a device holds besides activations (`StageCharges.held`): each
parameter, its gradient and the optimizer's state (`optimizer_state`
values per parameter, AdamW's two moments by default), all in the
parameter's dtype; FSDP shards the three over dp and holds one stage's
parameters and gradients unsharded from its gather to its reduction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Layout", "LinkPrices", "StageCharges", "layouts_of"]

DATA_PARALLEL = ("replicate", "fsdp")


class LinkPrices(Protocol):
    """What prices a collective: `links.Links` (calibrated, or from a `Machine`)."""

    def time(self, kind: str, nbytes: float, *, group_size: int | None = None) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """How the devices divide: pp pipeline ranks x dp data-parallel replicas
    x tp tensor-parallel ranks. `data_parallel`: how the dp replicas hold
    the parameters, "replicate" (DDP's all-reduce) or "fsdp" (FSDP2)."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    data_parallel: str = "replicate"

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mpmd.Layout: {name} must be a positive int, got {value!r}")
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(
                f"mpmd.Layout: data_parallel must be 'replicate' or 'fsdp', got "
                f"{self.data_parallel!r}"
            )

    @property
    def num_devices(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The device mesh's dimension names (pp first, as the runner reads
        them): ("pp",), ("pp", "dp"), ("pp", "tp") or ("pp", "dp", "tp")."""
        return ("pp", *(n for n in ("dp", "tp") if getattr(self, n) > 1))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.mesh_dim_names)

    @property
    def spmd(self) -> bool:
        """No pipeline: one stage per device, the model whole (or over tp)."""
        return self.pp == 1

    def __str__(self) -> str:
        parts = [f"{n} {getattr(self, n)}" for n in ("pp", "dp", "tp") if getattr(self, n) > 1]
        text = " x ".join(parts) or "1 device"
        if self.dp > 1:
            text += f" ({self.data_parallel})"
        return text

    @staticmethod
    def of(value: Any) -> Layout:
        """A `Layout`, or a dict of its fields ({"pp": 2, "dp": 2})."""
        if isinstance(value, Layout):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"pp", "dp", "tp", "data_parallel"})
            if unknown:
                raise ValueError(
                    f"mpmd.plan: layout {value!r} has unknown key(s) {unknown}; a layout "
                    "gives pp, dp, tp and data_parallel ('replicate' or 'fsdp')"
                )
            return Layout(**value)
        raise TypeError(
            f"mpmd.plan: a layout is an mpmd.Layout or a dict such as {{'pp': 2, 'dp': 2}}, "
            f"got {value!r}"
        )


def layouts_of(
    num_devices: int,
    *,
    max_pp: int,
    tp_sizes: Iterable[int],
    data_parallel: Sequence[str] = DATA_PARALLEL,
) -> list[Layout]:
    """Every pp x dp x tp = `num_devices` with pp <= `max_pp` (the units a
    stage can start at) and tp in `tp_sizes`; a layout with dp > 1 once per
    `data_parallel` mode."""
    out: list[Layout] = []
    tps = sorted({t for t in tp_sizes if num_devices % t == 0})
    for pp in range(1, min(max_pp, num_devices) + 1):
        if num_devices % pp:
            continue
        for tp in tps:
            if (num_devices // pp) % tp:
                continue
            dp = num_devices // pp // tp
            modes = data_parallel if dp > 1 else ("replicate",)
            out.extend(Layout(pp=pp, dp=dp, tp=tp, data_parallel=m) for m in modes)
    return out


@dataclass(frozen=True, slots=True)
class StageCharges:
    """What a layout's data parallelism costs a stage whose parameters take
    `nbytes` on a device: its gradient reduction (`reduce`, an all-reduce
    over dp, or FSDP's reduce-scatter), FSDP's gather (`gather`), and what
    the device holds for it beside activations (`held`)."""

    layout: Layout
    links: LinkPrices | None
    optimizer_state: float = 2.0  # values per parameter (AdamW: two moments)
    # Whether the simulated peaks count `held` (a limit on device memory) or
    # activations alone (a limit on activations).
    counted: bool = True

    @property
    def fsdp(self) -> bool:
        return self.layout.data_parallel == "fsdp" and self.layout.dp > 1

    def _time(self, kind: str, nbytes: int) -> float:
        if self.layout.dp <= 1 or self.links is None or nbytes <= 0:
            return 0.0
        return self.links.time(kind, float(nbytes), group_size=self.layout.dp)

    def reduce(self, nbytes: int) -> float:
        return self._time("reduce_scatter" if self.fsdp else "all_reduce", nbytes)

    def gather(self, nbytes: int) -> float:
        return self._time("all_gather", nbytes) if self.fsdp else 0.0

    def held(self, nbytes: int) -> int:
        """Parameters, gradients and optimizer states; under FSDP sharded
        over dp, plus the stage's parameters and gradients unsharded while
        it runs."""
        state = nbytes * (2.0 + self.optimizer_state)
        if not self.fsdp:
            return math.ceil(state)
        return math.ceil(state / self.layout.dp + 2 * nbytes)
