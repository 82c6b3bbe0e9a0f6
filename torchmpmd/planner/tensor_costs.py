"""What tensor parallelism does to a unit's costs, for the layouts with tp.

A tp plan (Hugging Face's format, the model's own by default: the runner's
`TensorPlan`) shards some modules' matrices over tp; the rest of a unit
runs whole on every tp rank. `probe` runs the model once on the example
and records, per unit: the share of its FLOPs in the planned modules
(torch's `FlopCounterMode`, so the figure does not drift with timing
noise), the share of its parameter bytes they hold, and the tensors their
collectives carry: a row-parallel module's output is summed over tp in the
forward (one all-reduce), a column-parallel module's input gradient in the
backward (one per distinct input: q, k and v reading one tensor share it),
a replicated-output column module's output gathered in the forward.
`over_tp` turns a unit's measured F, B, I, W into those of one tp rank:
the planned share divided by tp, the rest whole, plus the collectives
priced by the calibrated links (the runtime issues them in the stage's
compute, so they are not overlapped). Sequence-parallel plans trade each
all-reduce for a reduce-scatter and an all-gather of the same bytes, priced
as the all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..parallel.tensor_plan import TensorPlan
from .layouts import LinkPrices
from .results import Profile

__all__ = ["PerCall", "TensorShares", "over_tp", "per_call", "probe"]


@dataclass(frozen=True, slots=True)
class TensorShares:
    """Per unit, what a tp plan shards, measured at `rows` rows."""

    rows: int
    compute: tuple[float, ...]  # share of the unit's FLOPs in planned modules
    parameters: tuple[float, ...]  # share of its parameter bytes
    forward_bytes: tuple[tuple[int, ...], ...]  # each forward collective's bytes
    backward_bytes: tuple[tuple[int, ...], ...]  # each backward collective's bytes
    divisible: tuple[int, ...]  # sizes the planned dimensions divide by (gcd)
    modules: tuple[int, ...] = ()  # planned modules per unit (outermost)


def _unit_of(path: str, units: Sequence[str]) -> int:
    """The unit a module path lies in (the longest unit path it starts with)."""
    best, size = 0, -1
    for k, u in enumerate(units):
        if (path == u or path.startswith(u + ".") or u == "") and len(u) > size:
            best, size = k, len(u)
    return best


def probe(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    units: Sequence[str],
    tp_plan: Mapping[str, object] | None,
    rows: int,
) -> TensorShares | None:
    """The tp shares of `model`'s units under `tp_plan` (the model's own
    when None); None when there is no plan or it names no module."""
    styled = _styled(model, tp_plan)
    if not styled:
        return None
    n = len(units)
    fwd: list[list[int]] = [[] for _ in range(n)]
    bwd: list[list[int]] = [[] for _ in range(n)]
    seen: list[set[int]] = [set() for _ in range(n)]
    handles = []

    def hook(path: str, style: str) -> Any:
        k = _unit_of(path, units)

        def record(_m: torch.nn.Module, inputs: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if not isinstance(out, torch.Tensor):
                return
            if style.startswith("rowwise") or style == "colwise_rep":
                fwd[k].append(out.numel() * out.element_size())
            if style.startswith("colwise") or style == "sequence_parallel":
                x = inputs[0] if inputs else None
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    key = x.untyped_storage().data_ptr()
                    if key not in seen[k]:
                        seen[k].add(key)
                        bwd[k].append(x.numel() * x.element_size())

        return record

    modules = dict(model.named_modules())
    for path, style in styled.items():
        handles.append(modules[path].register_forward_hook(hook(path, style)))
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    counts = {
        key.split(".", 1)[1] if "." in key else "": sum(v.values())
        for key, v in counter.get_flop_counts().items()
        if key != "Global"
    }
    compute, parameters, planned_modules = [], [], []
    for k, u in enumerate(units):
        inside = [p for p in styled if _unit_of(p, units) == k]
        total = counts.get(u, 0)
        outer = [p for p in inside if not any(p.startswith(q + ".") for q in inside)]
        planned_modules.append(len(outer))
        planned = sum(counts.get(p, 0) for p in outer)
        compute.append(min(planned / total, 1.0) if total else 0.0)
        own = _parameters(modules.get(u, model) if u else model)
        mine = sum(_parameters(modules[p]) for p in inside)
        parameters.append(min(mine / own, 1.0) if own else 0.0)
    return TensorShares(
        rows=rows,
        compute=tuple(compute),
        parameters=tuple(parameters),
        forward_bytes=tuple(tuple(v) for v in fwd),
        backward_bytes=tuple(tuple(v) for v in bwd),
        divisible=_divisible(styled, modules),
        modules=tuple(planned_modules),
    )


def _styled(model: torch.nn.Module, tp_plan: Mapping[str, object] | None) -> dict[str, str]:
    """Module path -> its tp style, for the modules `tp_plan` shards."""
    try:
        plan = TensorPlan.for_model(tp_plan, model)
    except ValueError:
        return {}
    return {
        path: style
        for path, _ in model.named_modules()
        if path and (style := plan.style_of(path)) is not None and style != "replicate"
    }


def planned_sizes(
    model: torch.nn.Module, tp_plan: Mapping[str, object] | None
) -> tuple[int, ...] | None:
    """The dimensions tp must divide under `tp_plan` (None: no plan)."""
    styled = _styled(model, tp_plan)
    return _divisible(styled, dict(model.named_modules())) if styled else None


def _divisible(
    styled: Mapping[str, str], modules: Mapping[str, torch.nn.Module]
) -> tuple[int, ...]:
    """The planned modules' dimensions tp must divide (`TensorShares.divisible`)."""
    return tuple(sorted({n for p, st in styled.items() for n in _sharded_sizes(modules[p], st)}))


def undivided(sizes: tuple[int, ...], tp: int) -> list[int]:
    """Those of `sizes` that `tp` does not divide."""
    return [s for s in sizes if s % tp]


def _parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _sharded_sizes(module: torch.nn.Module, style: str) -> list[int]:
    """The sizes tp must divide for `module` under `style`: a column
    module's output features, a row module's input features."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return []
    if isinstance(module, torch.nn.Embedding):
        return [weight.shape[1] if style.startswith("colwise") else weight.shape[0]]
    return [weight.shape[0] if style.startswith("colwise") else weight.shape[1]]


def tp_fits(shares: TensorShares, tp: int) -> str:
    """'' when every planned dimension divides by `tp`, else why not."""
    bad = undivided(shares.divisible, tp)
    if not bad:
        return ""
    return f"tp={tp} does not divide the planned modules' dimension {bad[0]}"


def over_tp(
    prof: Profile,
    shares: TensorShares,
    tp: int,
    links: LinkPrices | None,
    rows: float,
    fixed: Profile | None = None,
    in_compute: float = 0.0,
    measured: PerCall | None = None,
) -> Profile:
    """`prof` (at `rows` rows) as one of `tp` tensor-parallel ranks runs it.
    `fixed`: the same units' fixed cost per call (`RowCosts.at(0)`), which
    sharding does not divide: each rank still dispatches every op.
    `in_compute`: what each collective adds between a stage's ops beyond
    its own time (`contention.in_compute_cost`, measured). `measured`:
    per unit, what a forward and a backward call cost on the job beyond all
    that (`per_call`, from tp measured on the job)."""
    if tp == 1:
        return prof
    factor = rows / shares.rows

    def comm(sizes: tuple[int, ...]) -> float:
        if links is None:
            return 0.0
        return sum(links.time("all_reduce", b * factor, group_size=tp) + in_compute for b in sizes)

    keep = [1.0 - c + c / tp for c in shares.compute]
    forward = [comm(b) for b in shares.forward_bytes]
    backward = [comm(b) for b in shares.backward_bytes]
    if measured is not None:
        forward = [t + e for t, e in zip(forward, measured.forward, strict=True)]
        backward = [t + e for t, e in zip(backward, measured.backward, strict=True)]
    return _scaled(prof, keep, forward, backward, shares, tp, fixed)


@dataclass(frozen=True, slots=True)
class PerCall:
    """Seconds each unit's forward and backward call costs under tp beyond
    the model of `over_tp` (DTensor's dispatch, the collectives' waits on
    the job's ranks): what tp measured on the job adds."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]


def per_call(shares: TensorShares, extra_forward: float, extra_backward: float) -> PerCall:
    """A whole forward's and backward's unexplained seconds under tp, spread
    over the units by their planned modules (the work tp adds is per
    planned module: its DTensor ops and collectives), as a cost per call."""
    total = sum(shares.modules)
    weights = [m / total if total else 0.0 for m in shares.modules]
    return PerCall(
        tuple(max(extra_forward, 0.0) * w for w in weights),
        tuple(max(extra_backward, 0.0) * w for w in weights),
    )


def _scaled(
    prof: Profile,
    keep: list[float],
    forward: list[float],
    backward: list[float],
    shares: TensorShares,
    tp: int,
    fixed: Profile | None,
) -> Profile:
    def times(
        name: str, values: Sequence[float] | None, extra: list[float] | None
    ) -> tuple[float, ...] | None:
        if values is None:
            return None
        add = extra or [0.0] * len(values)
        base = getattr(fixed, name, None) if fixed is not None else None
        base = base if base is not None else [0.0] * len(values)
        return tuple(
            f + (v - f) * k + e for v, f, k, e in zip(values, base, keep, add, strict=True)
        )

    held = None
    if prof.parameter_bytes is not None:
        held = tuple(
            round(p * (1.0 - s + s / tp))
            for p, s in zip(prof.parameter_bytes, shares.parameters, strict=True)
        )
    # Each tp rank accumulates its shard of the planned parameters' gradients.
    accumulate = prof.accumulate
    if accumulate is not None:
        accumulate = tuple(
            a * (1.0 - s + s / tp) for a, s in zip(accumulate, shares.parameters, strict=True)
        )
    selective = prof.selective
    if selective is not None:
        below = fixed.selective if fixed is not None else None
        selective = _scaled(selective, keep, forward, backward, shares, tp, below)
    out_f = times("forward", prof.forward, forward)
    out_b = times("backward", prof.backward, backward)
    assert out_f is not None and out_b is not None
    return dataclasses.replace(
        prof,
        forward=out_f,
        backward=out_b,
        input_grad=times("input_grad", prof.input_grad, backward),
        weight_grad=times("weight_grad", prof.weight_grad, None),
        activation_bytes=tuple(
            round(a * k) for a, k in zip(prof.activation_bytes, keep, strict=True)
        ),
        weight_grad_bytes=None
        if prof.weight_grad_bytes is None
        else tuple(round(a * k) for a, k in zip(prof.weight_grad_bytes, keep, strict=True)),
        parameter_bytes=held,
        accumulate=accumulate,
        selective=selective,
    )
