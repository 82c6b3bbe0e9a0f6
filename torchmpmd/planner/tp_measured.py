"""Tensor parallelism measured on the job: what `mpmd.plan` adds to its tp
prices from runs of the model on every rank (`torchmpmd/tp_probe.py` runs
them; the planner does not import the runtime, so it is registered here with
`set_tp_probe`).

`runs` measures the model as one stage without tp (dp over every rank) and
with each tp size weighed, and `per_call_costs` turns what a tp run exceeds
its prediction by, beyond what the run without tp exceeds its own by, into
a cost per call of each unit (`tensor_costs.per_call`): tp's dispatch and
collective waits come per call, so the charge holds at any microbatch size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..graph.inputs import example_inputs
from .layouts import Layout, LinkPrices
from .profiler import LossFn
from .rows import RowCosts
from .tensor_costs import PerCall, TensorShares, over_tp, per_call, planned_sizes

__all__ = ["per_call_costs", "runs", "set_tp_probe"]

# (model, args, kwargs, loss_fn, target, tp_plan, tp) -> the slowest rank's
# (forward, backward) seconds of the model as one stage; a collective.
TpProbe = Callable[
    [torch.nn.Module, tuple[Any, ...], dict[str, Any], LossFn | None, Any, Any, int],
    tuple[float, float],
]
_probe: list[TpProbe] = []


def set_tp_probe(fn: TpProbe) -> None:
    """How `mpmd.plan` measures tp on the job (the runtime's runner)."""
    _probe[:] = [fn]


def runs(
    model: torch.nn.Module,
    example_args: Any,
    example_kwargs: dict[str, Any] | None,
    loss: tuple[LossFn | None, Any],
    tp_plan: dict[str, Any] | None,
    num_ranks: int,
    wanted: Sequence[Layout] | None,
    notes: list[str],
) -> dict[int, tuple[float, float]]:
    """{tp size: (forward, backward) seconds measured} with tp 1 (dp alone)
    as the baseline; {} where no tp layout is weighed, outside a job of
    `num_ranks` ranks, or for a model without real weights. A collective:
    every rank calls it with the same arguments."""
    if not _probe or not (dist.is_available() and dist.is_initialized()):
        return {}
    if dist.get_world_size() != num_ranks or num_ranks == 1:
        return {}
    sizes = planned_sizes(model, tp_plan)
    if sizes is None:
        return {}
    weighed = {w.tp for w in wanted} if wanted is not None else set(range(2, num_ranks + 1))
    tps = sorted(
        t for t in weighed if t > 1 and num_ranks % t == 0 and all(n % t == 0 for n in sizes)
    )
    if not tps:
        return {}
    if any(p.is_meta for p in model.parameters()):
        notes.append(
            "tp was priced from the profile alone: the model has meta parameters, so it was "
            "not run on the job (materialize it to have tp measured)"
        )
        return {}
    args, kwargs = example_inputs("mpmd.plan", example_args, example_kwargs)
    loss_fn, target = loss
    out: dict[int, tuple[float, float]] = {}
    for t in [1, *tps]:
        out[t] = _probe[0](model, args, kwargs, loss_fn, target, tp_plan, t)
    return out


def per_call_costs(
    measured: dict[int, tuple[float, float]],
    costs: RowCosts,
    shares: TensorShares,
    links: LinkPrices | None,
    in_compute: float,
    notes: list[str],
) -> dict[int, PerCall]:
    """Per tp size, each unit's cost per call beyond `over_tp`'s model."""
    rows = costs.rows
    prof = costs.at(rows)
    fixed = costs.at(0.0) if costs.fixed_cost_known else None

    def predicted(tp: int) -> tuple[float, float]:
        p = over_tp(prof, shares, tp, links, rows, fixed, in_compute)
        return sum(p.forward), sum(p.backward)

    f1, b1 = measured[1]
    pf1, pb1 = predicted(1)
    out = {}
    for tp, (f, b) in sorted(measured.items()):
        if tp == 1:
            continue
        pf, pb = predicted(tp)
        extra_f, extra_b = (f - pf) - (f1 - pf1), (b - pb) - (b1 - pb1)
        out[tp] = per_call(shares, extra_f, extra_b)
        notes.append(
            f"tp {tp} measured on the job: forward {f * 1e3:.1f} ms, backward {b * 1e3:.1f} ms "
            f"against {pf * 1e3:.1f} and {pb * 1e3:.1f} predicted (without tp: "
            f"{f1 * 1e3:.1f} / {b1 * 1e3:.1f} against {pf1 * 1e3:.1f} / {pb1 * 1e3:.1f}); "
            f"the excess, {max(extra_f, 0) * 1e3:.1f} + {max(extra_b, 0) * 1e3:.1f} ms, is charged "
            "per call to the units' planned modules"
        )
    return out
