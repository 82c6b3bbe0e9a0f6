"""Runs of the model on the job: what `mpmd.plan` adds to its prices of
data and tensor parallelism from steps measured on every rank
(`torchmpmd/job_probe.py` runs them; the planner does not import the
runtime, so the probe is registered here with `set_probe`).

`runs` steps the model as one stage without tp (dp over every rank) and
with each tp size weighed, one microbatch of the example per replica.

- **Data parallelism** (`dp_per_byte`). On the job the gradient averaging
  takes more than the links price: on CPU, Gloo's threads take the cores
  the backward runs on, and the last bucket waits for the slowest rank.
  What the run without tp exceeds its prediction by (its compute as the
  profile prices it, the all-reduce as the links do) becomes a
  compute cost per gradient byte averaged, which `charged` adds to a
  replicated layout's backward calls.
- **Tensor parallelism** (`per_call_costs`). What a tp run's forward and
  backward exceed their prediction by goes to each unit per call by its
  planned modules (`tensor_costs.per_call`): tp's dispatch and collective
  waits come per call, so the charge holds at any microbatch size.

Both compare the runner's figures with the model computed alone on every
rank in turns with them (`Run.alone_forward`, `alone_backward`), brought
to the profile's level: on a shared machine the profile and the runs are
seconds apart and its speed is not the same (a dp step measured 1.5x its
profile in one plan, its forward alone 1.5x too, and all of it went to the
averaging's price). The dp charge is the exception where the ranks share
cores: pipelines are then predicted at their own run's level on the job
(`pipeline_level`), and dp's is anchored to its own run likewise
(`dp_per_byte(anchored=True)`). Without those figures, the job's offset
is the run without tp's forward's excess (its backward in proportion): not
that run's backward, which averages every gradient over all the ranks and
which, taken as the offset, cancelled tp's whole backward excess where the
gradients were large (57 MiB on 2 ranks: tp 2 predicted 0.65x its step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..graph.inputs import example_inputs
from .layouts import Layout, LinkPrices
from .profiler import LossFn
from .results import Profile
from .rows import RowCosts
from .tensor_costs import PerCall, TensorShares, over_tp, per_call, planned_sizes, undivided

__all__ = ["Run", "charged", "dp_per_byte", "per_call_costs", "runs", "set_probe"]


class Run(NamedTuple):
    """One layout's step measured on the job: the slowest rank's medians."""

    forward: float  # seconds of the stage's F task
    backward: float  # of its B task
    step: float  # of the whole runner.step (gradient averaging included)
    # The model's forward (with the loss) and backward computed alone on
    # every rank in turns with those steps: the job's compute level at the
    # moments they ran (0: not measured).
    alone_forward: float = 0.0
    alone_backward: float = 0.0


# (model, args, kwargs, loss_fn, target, tp_plan, tp) -> its Run; a collective.
Probe = Callable[
    [torch.nn.Module, tuple[Any, ...], dict[str, Any], LossFn | None, Any, Any, int], Run
]
_probe: list[Probe] = []


def set_probe(fn: Probe) -> None:
    """How `mpmd.plan` steps a layout on the job (the runtime's runner)."""
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
) -> dict[int, Run]:
    """{tp size: its run}, tp 1 (dp over every rank) first; {} outside a job
    of `num_ranks` ranks, where no layout with tp or with replicas and no ep
    is weighed, or for a model without real weights. A collective: every rank calls it
    with the same arguments."""
    if not _probe or not (dist.is_available() and dist.is_initialized()):
        return {}
    if dist.get_world_size() != num_ranks or num_ranks == 1:
        return {}
    sizes = planned_sizes(model, tp_plan)
    weighed = {w.tp for w in wanted} if wanted is not None else set(range(2, num_ranks + 1))
    tps = [
        t
        for t in sorted(weighed)
        if t > 1 and sizes is not None and num_ranks % t == 0 and not undivided(sizes, t)
    ]
    # The dp charge goes to layouts with replicas and no ep (the experts'
    # own averaging is priced apart): nothing to measure without one.
    if wanted is not None and not tps and not any(w.replicas > 1 and w.ep == 1 for w in wanted):
        return {}
    if any(p.is_meta for p in model.parameters()):
        notes.append(
            "data and tensor parallelism were priced from the profile and the links alone: "
            "the model has meta parameters, so it was not stepped on the job (materialize it "
            "to have them measured)"
        )
        return {}
    args, kwargs = example_inputs("mpmd.plan", example_args, example_kwargs)
    loss_fn, target = loss
    return {t: _probe[0](model, args, kwargs, loss_fn, target, tp_plan, t) for t in [1, *tps]}


def _ring(group: int) -> float:
    """The bytes a ring all-reduce moves per byte reduced."""
    return 2.0 * (group - 1) / group


def dp_per_byte(
    base: Run,
    costs: RowCosts,
    links: LinkPrices | None,
    num_ranks: int,
    notes: list[str],
    anchored: bool = False,
) -> float:
    """Compute seconds per gradient byte that averaging it over `num_ranks`
    replicas costs on the job beyond the links' price (>= 0). `anchored`:
    the excess is over the profile itself, so that the run measured is
    predicted as it measured (where pipelines are predicted at their own
    run's level on the job, `pipeline_level`); else over the model computed
    alone in the same turns, at the profile's level (where pipelines are
    predicted from the profile)."""
    prof = costs.at(costs.rows)
    grads = float(sum(prof.parameter_bytes or ()))
    if grads <= 0:
        return 0.0
    # Anchored, the excess is over the compute the prediction charges (the
    # profile, scaled by the measured contention): what the prediction of
    # this very run misses, so that it predicts the run it was measured
    # from. Else it is the step's over the model computed alone in the same
    # turns, brought to the profile's level: a moment of the machine slower
    # or faster than the profile's is not a cost of averaging.
    compute = sum(prof.forward) + sum(prof.backward)
    reduce = links.time("all_reduce", grads, group_size=num_ranks) if links is not None else 0.0
    alone = base.alone_forward + base.alone_backward
    if alone > 0 and not anchored:
        excess = (base.step - alone) * compute / alone - reduce
        against = (
            f"{alone * 1e3:.1f} ms of the model computed alone on each rank in the same turns "
            f"({compute * 1e3:.1f} ms as profiled)"
        )
    else:
        excess = base.step - compute - reduce
        against = (
            f"{compute * 1e3:.1f} ms of compute as profiled (forward "
            f"{sum(prof.forward) * 1e3:.1f} ms)"
        )
    per_byte = max(excess, 0.0) / grads / _ring(num_ranks)
    notes.append(
        f"dp {num_ranks} measured on the job: a step of one microbatch took "
        f"{base.step * 1e3:.1f} ms (its forward {base.forward * 1e3:.1f} ms) against {against} "
        f"and {reduce * 1e3:.1f} ms for averaging {grads / 2**20:.1f} MiB of gradients on "
        f"the links; the excess, {max(excess, 0.0) * 1e3:.1f} ms, is charged to the backward of "
        "every replicated layout by the gradient bytes it averages"
    )
    return per_byte


def charged(prof: Profile, per_byte: float, group: int, microbatches: int) -> Profile:
    """`prof` with each unit's backward call charged its share of the
    step's gradient averaging over `group` replicas (`dp_per_byte`)."""
    if per_byte <= 0 or group <= 1 or prof.parameter_bytes is None:
        return prof
    extra = [per_byte * _ring(group) * b / microbatches for b in prof.parameter_bytes]

    def plus(values: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if values is None:
            return None
        return tuple(v + e for v, e in zip(values, extra, strict=True))

    backward = plus(prof.backward)
    assert backward is not None
    # A split stage runs I and W instead of B: its W pays it.
    return dataclasses.replace(prof, backward=backward, weight_grad=plus(prof.weight_grad))


def per_call_costs(
    measured: dict[int, Run],
    costs: RowCosts,
    shares: TensorShares,
    links: LinkPrices | None,
    in_compute: float,
    notes: list[str],
    per_byte: float = 0.0,
    num_ranks: int = 1,
) -> dict[int, PerCall]:
    """Per tp size, each unit's cost per call beyond `over_tp`'s model (and,
    where the tp run has replicas, beyond the averaging `charged` prices at
    `per_byte` over its num_ranks / tp of them)."""
    rows = costs.rows
    prof = costs.at(rows)
    fixed = costs.at(0.0) if costs.fixed_cost_known else None

    def predicted(tp: int) -> tuple[float, float]:
        p = over_tp(prof, shares, tp, links, rows, fixed, in_compute)
        p = charged(p, per_byte, num_ranks // tp, 1) if tp > 1 else p
        return sum(p.forward), sum(p.backward)

    f1, b1 = measured[1].forward, measured[1].backward
    pf1, pb1 = predicted(1)
    # The job's offset from the profile, without the model computed alone:
    # the forward's (no averaging in it), the backward's in proportion.
    offset_f = f1 - pf1
    offset_b = offset_f * pb1 / pf1 if pf1 > 0 else 0.0
    out = {}
    for tp, run in sorted(measured.items()):
        if tp == 1:
            continue
        f, b = run.forward, run.backward
        pf, pb = predicted(tp)
        alone = run.alone_forward + run.alone_backward
        if alone > 0:
            # The tp run's figures at the profile's level: over the model
            # computed alone in the same turns, as the profile priced it
            # (one level for both: where ranks share cores, how a step's
            # time falls between its forward and backward varies more than
            # the step's).
            level = (pf1 + pb1) / alone
            extra_f, extra_b = f * level - pf, b * level - pb
            text = (
                f"the model alone in the same turns: {alone * 1e3:.1f} ms against "
                f"{(pf1 + pb1) * 1e3:.1f} as profiled"
            )
        else:
            extra_f, extra_b = (f - pf) - offset_f, (b - pb) - offset_b
            text = (
                f"without tp: {f1 * 1e3:.1f} / {b1 * 1e3:.1f} against {pf1 * 1e3:.1f} / "
                f"{pb1 * 1e3:.1f}, its averaging in its backward"
            )
        out[tp] = per_call(shares, extra_f, extra_b)
        notes.append(
            f"tp {tp} measured on the job: forward {f * 1e3:.1f} ms, backward {b * 1e3:.1f} ms "
            f"against {pf * 1e3:.1f} and {pb * 1e3:.1f} predicted ({text}); the excess at the "
            f"profile's level, {max(extra_f, 0) * 1e3:.1f} + {max(extra_b, 0) * 1e3:.1f} ms, is "
            "charged per call to the units' planned modules"
        )
    return out
