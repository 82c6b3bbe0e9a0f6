"""`mpmd.plan`: the layout (pp x dp x tp over the devices, pure SPMD
included), schedule, stages per rank, split and number of microbatches with
the shortest simulated step for a model on N devices.

The model is profiled on one microbatch and on its first half of rows
(`profile`, as `balance` does; `rows.RowCosts`: a fixed cost per call and a
cost per row per unit), so a prediction holds at any microbatch size.
Every candidate is then weighed on the simulator alone, for the same
global batch (`batch_size` rows):

- each layout (`layouts.Layout`): pp pipeline ranks from 1 (no pipeline:
  DDP's, FSDP2's or tp's job) to the model's units, dp data-parallel
  replicas, replicated or FSDP2-sharded, and tp tensor-parallel ranks
  where the model has a tp plan (`tensor_costs`); each replica takes
  `batch_size / dp` rows;
- on each, each built-in schedule (or the given ones) with its own stages
  per rank (pp = 1: one stage, 1F1B over the microbatches, i.e. gradient
  accumulation), at each number of microbatches the replica's rows allow
  (`num_ranks <= m <= 4 * stages`; under a memory limit down to one row
  per microbatch), split by `search` (the best split for that schedule,
  within the memory limit), its gradient reduction and FSDP gathers
  simulated beside the schedule, priced by collectives calibrated on the
  job's own process group (`links`);
- under a memory limit also with the stages of rank 0 and with every stage
  recomputed, selectively (matmul, attention and convolution outputs kept)
  or in full: `Plan.recompute`, for `RunnerOptions(recompute=...)`.

The fastest candidate is the plan (the simplest within `tolerance`); the
others are kept, ranked, with why they lost. Where the ranks compute on
one host's CPU, the fastest candidates with and without a pipeline are
stepped on the job in turns and every candidate predicted at the level
the measured one of its kind measured (`pipeline_level`). Without
`batch_size` the pipeline over `num_ranks` ranks alone is weighed, per
microbatch. Without links (no process group to calibrate, none given)
layouts with dp, tp or ep are not weighed, and `Plan.notes` says so. Not
searched: a recompute set per rank beyond the two above, or a mix of
modes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..graph.inputs import example_inputs
from ..schedule.task import Schedule
from .balancer import on_rank_zero
from .candidates import (
    Candidate,
    Plan,
    choose,
    nothing_fits,
    per_batch,
)
from .contention import Slowed, contention, cores, in_compute_cost, share_a_host
from .expert_costs import ExpertShares, over_ep
from .expert_costs import probe as probe_experts
from .job_runs import charged, dp_per_byte, per_call_costs, runs
from .layouts import Layout, LinkPrices, StageCharges, layouts_of
from .pipeline_level import on_the_job
from .profiler import LossFn, profile
from .results import Balance
from .rows import RowCosts, first_rows
from .splits import check_limits
from .tensor_costs import PerCall, TensorShares, over_tp, probe, tp_fits
from .weigh import (
    batch_rows,
    check_counts,
    may_split_backward,
    microbatch_counts,
    policies,
    schedule_classes,
    stage_counts,
    weigh,
)

__all__ = ["Candidate", "Plan", "batch_rows", "plan"]


def plan(
    model: torch.nn.Module,
    example_args: Any,
    num_ranks: int,
    *,
    num_microbatches: int | None = None,
    batch_size: int | None = None,
    memory_limit: float | None = None,
    device_memory: float | None = None,
    layouts: Sequence[Layout | dict[str, Any]] | str | None = None,
    tp_plan: dict[str, Any] | None = None,
    links: LinkPrices | None = None,
    optimizer_state: float = 2.0,
    loss_fn: LossFn | None = None,
    example_target: Any = None,
    example_kwargs: dict[str, Any] | None = None,
    schedules: Sequence[type[Schedule]] | None = None,
    bandwidth: float = 0.0,
    latency: float = 0.0,
    repeats: int = 5,
    tolerance: float = 0.03,
) -> Plan:
    """The fastest layout, schedule, stages per rank, split and number of
    microbatches for `model` on `num_ranks` devices, on the simulator (see
    the module docstring). `example_args` is one microbatch; `batch_size`
    the rows of the global batch every layout takes.

    `layouts`: those to weigh (`mpmd.Layout`s or dicts such as
    {"pp": 2, "dp": 2}), "pipeline" for pp = num_ranks alone, or None for
    every layout of num_ranks devices (with batch_size; the pipeline alone
    without). `tp_plan`: the tensor-parallel plan layouts with tp use (the
    model's own by default; none: no tp). `links`: what collectives cost
    (`mpmd.calibrate(group)`, or `mpmd.Links.from_machine(...)`); by
    default calibrated on the default process group when there is one.

    `memory_limit`: bytes of activations per rank; `device_memory`: bytes
    per device in all (activations, parameters, gradients and
    `optimizer_state` values per parameter, AdamW's two moments by
    default, sharded as the layout shards them). A candidate whose every
    split exceeds it is rejected, and if every one does, the error gives
    the smallest peak. `schedules`: the schedule classes to weigh (default
    every built-in). `bandwidth`/`latency` price the pipeline's sends
    (default: the links' point-to-point, else free).

    `tolerance`: candidates predicted within this fraction of the fastest
    are taken as equal, and the simplest of them is the plan: the fewest
    stages, then no tp, then replicated over FSDP, then no split backward,
    then the least recompute, then the smallest peak. 0: the fastest
    prediction wins.

    Under torch.distributed (initialised, several processes), call it on
    every rank: the links are calibrated on every rank, rank 0 profiles and
    searches, and every rank gets its plan.
    """
    if not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ValueError(f"mpmd.plan: num_ranks must be a positive int, got {num_ranks!r}")
    check_limits(memory_limit, bandwidth, latency)
    if memory_limit is not None and device_memory is not None:
        raise ValueError(
            "mpmd.plan: give memory_limit (activations per rank) or device_memory (all a "
            "device holds), not both"
        )
    if device_memory is not None:
        check_limits(device_memory, 0.0, 0.0)
    if not isinstance(optimizer_state, int | float) or optimizer_state < 0:
        raise ValueError(
            f"mpmd.plan: optimizer_state is values per parameter (AdamW: 2, SGD: 0), got "
            f"{optimizer_state!r}"
        )
    if not isinstance(tolerance, int | float) or not 0 <= tolerance < 1:
        raise ValueError(f"mpmd.plan: tolerance must be in [0, 1), got {tolerance!r}")
    _check_loss(loss_fn, example_target)
    classes = schedule_classes(schedules)
    check_counts(num_microbatches, batch_size)
    wanted = _layouts(layouts, num_ranks, batch_size)
    notes: list[str] = []
    if links is None and (wanted is None or any(w.num_devices > w.pp for w in wanted)):
        links = _calibrated(num_ranks, notes, _parameter_bytes(model))
    slowdown, in_compute, shared, level_on_job = 1.0, 0.0, None, False
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == num_ranks > 1:
        slowdown, in_compute = contention(), in_compute_cost()
        # CPU ranks of one host: each kind of layout (with a pipeline, or
        # without one) is predicted at its level on the job (`pipeline_level`).
        level_on_job = share_a_host() and _on_cpu(model)
        if slowdown > 1.05:  # the same on every rank (rank 0's, broadcast)
            notes.append(
                f"the ranks compute {slowdown:.2f}x slower together than one alone (they share "
                "cores or memory: measured); the profile's times and the collectives beside "
                "them (whose threads take the same cores) are scaled by that"
            )
            if links is not None:
                links = Slowed(links, slowdown)
            found = cores()
            if num_ranks * found[1] > found[0]:
                shared = found
                notes.append(
                    f"{num_ranks} ranks of {found[1]:g} thread(s) share {found[0]:g} cores: a "
                    "pipeline's tasks are simulated at that slowdown where every rank computes, "
                    "faster where fewer do (its bubbles)"
                )
        level_on_job = level_on_job or shared is not None
    job_runs = runs(
        model,
        example_args,
        example_kwargs,
        (loss_fn, example_target),
        tp_plan,
        num_ranks,
        wanted,
        notes,
    )
    if bandwidth == latency == 0.0 and links is not None:
        send = getattr(links, "send", None)
        bandwidth = float(getattr(send, "bandwidth", 0.0) or 0.0)
        latency = float(getattr(send, "latency", 0.0) or 0.0)
        if bandwidth == float("inf"):
            bandwidth = 0.0
    limit = device_memory if device_memory is not None else memory_limit
    search_args = _Search(
        classes=classes,
        num_microbatches=num_microbatches,
        batch_size=batch_size,
        limits=(limit, bandwidth, latency),
        links=links,
        optimizer_state=float(optimizer_state),
        counted=device_memory is not None,
        in_compute=in_compute,
        cores=shared,
    )

    def run() -> Plan:
        start = time.perf_counter()
        costs, shares = _profiles(
            model,
            example_args,
            example_kwargs,
            num_ranks=num_ranks,
            repeats=repeats,
            loss=(loss_fn, example_target),
            split=any(may_split_backward(cls) for cls in classes),
            selective=limit is not None,
            tp=(wanted is None or any(w.tp * w.ep > 1 for w in wanted), tp_plan),
            halve=batch_size is not None,
        )
        costs = costs.slowed(slowdown)
        searching = search_args
        if job_runs:
            per_byte = dp_per_byte(
                job_runs[1], costs, search_args.links, num_ranks, notes, anchored=level_on_job
            )
            searching = dataclasses.replace(
                search_args,
                dp_per_byte=per_byte,
                tp_calls=per_call_costs(
                    job_runs,
                    costs,
                    shares.tensor,
                    search_args.links,
                    in_compute,
                    notes,
                    per_byte,
                    num_ranks,
                )
                if shares.tensor is not None
                else {},
            )
        candidates = wanted
        if candidates is None:
            candidates = _every_layout(num_ranks, len(costs.full.units), shares, links, notes)
        found: list[tuple[Candidate, Balance | None]] = []
        for layout in candidates:
            found += searching.layout(layout, costs, shares)
        return _chosen(found, searching, num_ranks, tolerance, notes, start)

    if not level_on_job:
        return on_rank_zero(run)
    example, loss = (example_args, example_kwargs), (loss_fn, example_target)
    return on_the_job(on_rank_zero(run), model, example, loss, tp_plan, tolerance)


class _Shares(NamedTuple):
    """What tp and ep shard of each unit (None: the model has no tp plan,
    no experts)."""

    tensor: TensorShares | None
    experts: ExpertShares | None


@dataclasses.dataclass(frozen=True, slots=True)
class _Search:
    """What every layout's candidates are weighed with."""

    classes: list[type[Schedule]]
    num_microbatches: int | None
    batch_size: int | None
    limits: tuple[float | None, float, float]
    links: LinkPrices | None
    optimizer_state: float
    counted: bool
    in_compute: float  # seconds a collective between a stage's ops adds (`in_compute_cost`)
    # Per tp size, each unit's cost per call under tp beyond the model (measured on the job).
    tp_calls: Mapping[int, PerCall] = dataclasses.field(default_factory=dict)
    # Compute seconds per gradient byte averaged (measured on the job, `job_runs.dp_per_byte`).
    dp_per_byte: float = 0.0
    # Where the ranks outnumber the cores they share: the cores and the
    # threads one rank computes with (`contention.cores`; None: not shared).
    cores: tuple[float, float] | None = None

    def layout(
        self, layout: Layout, costs: RowCosts, shares: _Shares
    ) -> list[tuple[Candidate, Balance | None]]:
        """Every schedule, stage count, microbatch count and recompute
        policy on `layout`, each at its best split."""
        replica = self.batch_size // layout.replicas if self.batch_size else None
        why = _refused(layout, self.batch_size, shares, self.num_microbatches)
        if why:
            cls = self.classes[0]
            return [(_refusal(cls, layout, why), None)]
        charges = None
        if self.batch_size is not None and (layout.replicas > 1 or self.counted):
            charges = StageCharges(layout, self.links, self.optimizer_state, self.counted)
        out = []
        for cls in self._classes(layout):
            for stages in stage_counts(cls, layout.pp):
                capped = self.limits[0] is not None
                counts = microbatch_counts(
                    self.num_microbatches, replica, layout.pp, capped, stages
                )
                for m in counts:
                    rows = replica / m if replica else costs.rows
                    prof = costs.at(rows)
                    if shares.tensor is not None and layout.tp > 1:
                        fixed = costs.at(0.0) if costs.fixed_cost_known else None
                        prof = over_tp(
                            prof,
                            shares.tensor,
                            layout.tp,
                            self.links,
                            rows,
                            fixed,
                            self.in_compute,
                            self.tp_calls.get(layout.tp),
                        )
                    if shares.experts is not None:
                        prof = over_ep(
                            prof, shares.experts, layout.ep, self.links, rows, self.in_compute
                        )
                    if layout.ep == 1:
                        prof = charged(prof, self.dp_per_byte, layout.dp, m)
                    for policy in policies(cls, stages, m, layout.pp, self.limits[0], prof):
                        out.append(
                            weigh(
                                cls,
                                stages,
                                m,
                                layout,
                                prof,
                                policy,
                                self.limits,
                                charges,
                                self._sharing(layout),
                            )
                        )
        return out

    def _sharing(self, layout: Layout) -> tuple[float, float] | None:
        """The cores the ranks share, and those one pipeline rank takes: it
        stands for the ranks of its replicas and tp and ep groups, which
        compute beside it."""
        if self.cores is None or layout.pp == 1:
            return None
        cores, threads = self.cores
        return cores, threads * layout.num_devices / layout.pp

    def _classes(self, layout: Layout) -> list[type[Schedule]]:
        """pp = 1: one stage, the first single-stage class (1F1B by default:
        gradient accumulation holding one microbatch's activations)."""
        if layout.pp > 1:
            return self.classes
        single = [c for c in self.classes if c.stages_per_rank == 1]
        return single[:1]


def _refused(layout: Layout, batch_size: int | None, shares: _Shares, m: int | None) -> str:
    """Why `layout` cannot take the batch ('' where it can)."""
    replicas = layout.replicas
    if batch_size is not None and batch_size % replicas:
        over = "dp" if layout.ep == 1 else "dp x ep"
        return f"batch_size={batch_size} does not divide over {over}={replicas}"
    if batch_size is not None and m is not None and (batch_size // replicas) % m:
        return f"a replica's {batch_size // replicas} rows do not divide into num_microbatches={m}"
    if layout.ep > 1:
        if shares.experts is None:
            return "the model has no experts modules (mpmd.trace(..., experts=[...]) names them)"
        why = shares.experts.fits(layout.ep)
        if why:
            return why
    if layout.tp > 1:
        if shares.tensor is None:
            return "the model has no tensor-parallel plan (pass tp_plan=...)"
        return tp_fits(shares.tensor, layout.tp)
    return ""


def _refusal(cls: type[Schedule], layout: Layout, why: str) -> Candidate:
    return Candidate(
        name=f"{cls.__name__}(-)",
        schedule=None,
        num_stages=layout.pp,
        num_microbatches=0,
        split_before=[],
        predicted_step_time=float("inf"),
        predicted_peak_bytes=[],
        rejected=why,
        layout=layout,
    )


def _layouts(value: Any, num_ranks: int, batch_size: int | None) -> list[Layout] | None:
    """The layouts asked for (None: every one of num_ranks devices)."""
    if value is None:
        return None if batch_size is not None else [Layout(pp=num_ranks)]
    if value == "pipeline":
        return [Layout(pp=num_ranks)]
    if isinstance(value, str | Layout | dict):
        raise TypeError(
            f"mpmd.plan: layouts is a list of mpmd.Layout (or dicts), 'pipeline', or None; got "
            f"{value!r}; write layouts=[{value!r}]"
        )
    out = [Layout.of(v) for v in value]
    for w in out:
        if w.num_devices != num_ranks:
            raise ValueError(
                f"mpmd.plan: layout {w} takes {w.num_devices} devices but num_ranks={num_ranks}; "
                "pp x dp x ep x tp must be the number of devices"
            )
        if w.replicas > 1 and batch_size is None:
            raise ValueError(
                f"mpmd.plan: layout {w} splits the global batch over {w.replicas} replicas; pass "
                "batch_size=... (rows of the global batch)"
            )
    if not out:
        raise ValueError("mpmd.plan: layouts is empty; leave it out to weigh every layout")
    return out


def _every_layout(
    num_ranks: int,
    units: int,
    shares: _Shares,
    links: LinkPrices | None,
    notes: list[str],
) -> list[Layout]:
    if links is None:
        return [Layout(pp=num_ranks)]
    sizes = [t for t in range(2, num_ranks + 1) if num_ranks % t == 0]
    tps = [1] + (sizes if shares.tensor is not None else [])
    eps = [1] + [e for e in sizes if shares.experts is not None and not shares.experts.fits(e)]
    if shares.tensor is None and num_ranks > 1:
        notes.append(
            "tp not weighed: the model has no tensor-parallel plan of its own (pass tp_plan=...)"
        )
    return layouts_of(num_ranks, max_pp=units, tp_sizes=tps, ep_sizes=eps)


def _on_cpu(model: torch.nn.Module) -> bool:
    """The model's tensors on the CPU (or meta) and the job not on NCCL."""
    tensors = (*model.parameters(), *model.buffers())
    return dist.get_backend() != "nccl" and all(t.device.type in ("cpu", "meta") for t in tensors)


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _calibrated(num_ranks: int, notes: list[str], gradients: int) -> LinkPrices | None:
    """The default process group's links, calibrated on every rank (up to
    the size of the model's gradients, clamped to 8-128 MiB: a fit from
    small messages misses what a cache-sized buffer hides); None (and a
    note) without one."""
    if num_ranks == 1:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == num_ranks:
        from .links import DEFAULT_SIZES, calibrate

        largest = min(max(gradients, 8 << 20), 128 << 20)
        return calibrate(sizes=(*DEFAULT_SIZES, largest))
    notes.append(
        "collectives not priced (no process group of num_ranks ranks to calibrate, no links "
        "given): layouts with dp or tp not weighed; call it under torchrun on every rank, or "
        "pass links=mpmd.Links.from_machine(...)"
    )
    return None


def _profiles(
    model: torch.nn.Module,
    example_args: Any,
    example_kwargs: dict[str, Any] | None,
    *,
    num_ranks: int,
    repeats: int,
    loss: tuple[LossFn | None, Any],
    split: bool,
    selective: bool,
    tp: tuple[bool, dict[str, Any] | None],
    halve: bool,
) -> tuple[RowCosts, _Shares]:
    """The profile on the example and, to learn each unit's fixed cost, on
    its first half of rows; the tp and ep shares where they are weighed."""
    loss_fn, target = loss

    def measured(args: Any, kwargs: Any, target: Any) -> Any:
        return profile(
            model,
            args,
            kwargs,
            min_units=2 * num_ranks,
            repeats=repeats,
            loss_fn=loss_fn,
            example_target=target,
            split_backward=split,
            selective=selective,
            traceable=True,
            caller="mpmd.plan",
        )

    full = measured(example_args, example_kwargs, target)
    rows = batch_rows(example_args, example_kwargs)
    costs = RowCosts(full, max(rows, 1))
    if halve and rows >= 2:
        half = rows // 2
        cut = first_rows((example_args, example_kwargs, target), rows, half)
        costs = RowCosts(full, rows, measured(*cut), half)
    shares = _Shares(None, None)
    if tp[0] and num_ranks > 1:
        args, kwargs = example_inputs("mpmd.plan", example_args, example_kwargs)
        shares = _Shares(
            probe(model, args, kwargs, full.units, tp[1], max(rows, 1)),
            probe_experts(model, args, kwargs, full.units, max(rows, 1)),
        )
    return costs, shares


def _chosen(
    found: list[tuple[Candidate, Balance | None]],
    search: _Search,
    num_ranks: int,
    tolerance: float,
    notes: list[str],
    start: float,
) -> Plan:
    batch_size = search.batch_size
    ran = sorted((c for c in found if c[1] is not None), key=lambda c: per_batch(c[0], batch_size))
    if not ran:
        what = "device_memory" if search.counted else "memory_limit"
        raise ValueError(nothing_fits([c for c, _ in found], search.limits[0], what))
    best, slower = choose([c for c, _ in ran], batch_size, tolerance)
    balance = next(b for c, b in ran if c is best)
    assert balance is not None and best.schedule is not None
    pipeline_only = all(c.layout is not None and c.layout == Layout(pp=num_ranks) for c, _ in found)
    notes.extend(_close_calls(best, [c for c, _ in ran], batch_size, tolerance))
    return Plan(
        schedule=best.schedule,
        split_before=best.split_before,
        num_microbatches=best.num_microbatches,
        num_ranks=num_ranks,
        recompute=best.recompute,
        predicted_step_time=best.predicted_step_time,
        predicted_peak_bytes=best.predicted_peak_bytes,
        alternatives=tuple(slower + [c for c, b in found if b is None]),
        seconds_planning=time.perf_counter() - start,
        balance=balance,
        layout=None if pipeline_only else best.layout,
        batch_size=batch_size,
        state_bytes=best.state_bytes,
        notes=tuple(notes),
    )


def _close_calls(
    best: Candidate, ran: list[Candidate], batch_size: int | None, tolerance: float
) -> list[str]:
    """Why another run may plan otherwise: the closest candidate of another
    layout or stage count just outside the tolerance (the profile's timings
    move by a few percent from run to run on a shared machine)."""
    mine = per_batch(best, batch_size)
    for c in ran:
        if c.layout == best.layout and c.num_stages == best.num_stages:
            continue
        ratio = per_batch(c, batch_size) / max(mine, 1e-30)
        if ratio <= 1 + 2 * tolerance:
            return [
                f"close call: {c.name} on {c.layout} is predicted {ratio:.3f}x the plan, within "
                f"twice the tolerance; a run whose profile times differ by a few percent may "
                f"choose it (mpmd.refine measures both on the job)"
            ]
        break
    return []


def _check_loss(loss_fn: Any, example_target: Any) -> None:
    """A loss that reads no target (`lambda out, _: out.loss`) needs no
    example_target, as the runner's step needs none; one that does is told
    so at the profile's first forward."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"mpmd.plan: loss_fn must be callable as loss_fn(output, target), got "
            f"{type(loss_fn).__name__}"
        )
    if loss_fn is None and example_target is not None:
        raise ValueError(
            "mpmd.plan: example_target is given but no loss_fn reads it; pass the "
            "PipelineRunner's loss_fn too (e.g. loss_fn=F.cross_entropy), or leave "
            "example_target out"
        )
