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
    x ep expert-parallel ranks x tp tensor-parallel ranks. `data_parallel`:
    how the replicas hold the parameters, "replicate" (DDP's all-reduce) or
    "fsdp" (FSDP2). The ep ranks hold E / ep of each experts module's
    experts and are data-parallel for the rest: dp x ep replicas of it."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    data_parallel: str = "replicate"

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "ep", "tp"):
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
        return self.pp * self.dp * self.ep * self.tp

    @property
    def replicas(self) -> int:
        """How many ranks split the global batch (dp x ep)."""
        return self.dp * self.ep

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The device mesh's dimension names in the order the runner reads
        them: "pp", then those of "dp", "ep", "tp" over 1."""
        return ("pp", *(n for n in ("dp", "ep", "tp") if getattr(self, n) > 1))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.mesh_dim_names)

    @property
    def spmd(self) -> bool:
        """No pipeline: one stage per device, the model whole (or over tp)."""
        return self.pp == 1

    def __str__(self) -> str:
        names = ("pp", "dp", "ep", "tp")
        parts = [f"{n} {getattr(self, n)}" for n in names if getattr(self, n) > 1]
        text = " x ".join(parts) or "1 device"
        if self.replicas > 1:
            text += f" ({self.data_parallel})"
        return text

    @staticmethod
    def of(value: Any) -> Layout:
        """A `Layout`, or a dict of its fields ({"pp": 2, "dp": 2})."""
        if isinstance(value, Layout):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"pp", "dp", "ep", "tp", "data_parallel"})
            if unknown:
                raise ValueError(
                    f"mpmd.plan: layout {value!r} has unknown key(s) {unknown}; a layout "
                    "gives pp, dp, ep, tp and data_parallel ('replicate' or 'fsdp')"
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
    ep_sizes: Iterable[int] = (1,),
    data_parallel: Sequence[str] = DATA_PARALLEL,
) -> list[Layout]:
    """Every pp x dp x ep x tp = `num_devices` with pp <= `max_pp` (the
    units a stage can start at), tp in `tp_sizes` and ep in `ep_sizes`; a
    layout with several replicas once per `data_parallel` mode."""
    out: list[Layout] = []
    tps = sorted({t for t in tp_sizes if num_devices % t == 0})
    eps = sorted({e for e in ep_sizes if num_devices % e == 0})
    for pp in range(1, min(max_pp, num_devices) + 1):
        for tp in tps:
            for ep in eps:
                if num_devices % (pp * tp * ep):
                    continue
                dp = num_devices // (pp * tp * ep)
                modes = data_parallel if dp * ep > 1 else ("replicate",)
                out.extend(Layout(pp=pp, dp=dp, ep=ep, tp=tp, data_parallel=m) for m in modes)
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
        return self.layout.data_parallel == "fsdp" and self.layout.replicas > 1

    def _time(self, kind: str, nbytes: float, group: int) -> float:
        if group <= 1 or self.links is None or nbytes <= 0:
            return 0.0
        return self.links.time(kind, float(nbytes), group_size=group)

    def _groups(self, nbytes: int, experts: int) -> list[tuple[float, int]]:
        """(bytes, group) pairs: the dense parameters over dp x ep, a rank's
        E / ep experts over dp."""
        lay = self.layout
        return [(nbytes - experts, lay.replicas), (experts / lay.ep, lay.dp)]

    def reduce(self, nbytes: int, experts: int = 0) -> float:
        kind = "reduce_scatter" if self.fsdp else "all_reduce"
        return sum(self._time(kind, b, g) for b, g in self._groups(nbytes, experts))

    def gather(self, nbytes: int, experts: int = 0) -> float:
        if not self.fsdp:
            return 0.0
        return sum(self._time("all_gather", b, g) for b, g in self._groups(nbytes, experts))

    def held(self, nbytes: int, experts: int = 0) -> int:
        """Parameters, gradients and optimizer states (experts: a rank's
        E / ep); under FSDP sharded over their replicas, plus the stage's
        parameters and gradients unsharded while it runs."""
        total = 0.0
        for b, group in self._groups(nbytes, experts):
            state = b * (2.0 + self.optimizer_state)
            total += state / group + 2 * b if self.fsdp else state
        return math.ceil(total)
