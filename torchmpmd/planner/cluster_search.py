"""`mpmd.search_cluster`: the layout, schedule, microbatches and recompute
with the shortest step for a transformer on N devices of a described
machine, each candidate priced as `mpmd.project` prices it.

Layouts: every pp x tp x dp = N. pp from 1 (no pipeline: FSDP, with TP
where tp > 1) to the number of layers; tp divides the query and key-value
heads (a tp rank computes whole heads) and stays in a node (its four
collectives per layer each way are on the critical path of every layer);
dp, the rest, divides the global batch. Where pp > 1, each schedule class
(default: the built-ins) with its own stages per rank, at each number of
microbatches m dividing the per-replica batch with pp <= m <= 4 x pp x
stages per rank; recompute off and on. With pp = 1, gradient accumulation
(OneFOneB on one rank) over each m dividing the per-replica batch.

A candidate's step is `project`'s: the same profile, even split, links,
simulator and FSDP time, simulated once (`Program.predict`). Its memory
per device, on the pipeline rank holding the most: the simulated
activation peak plus the model state of the rank's stages (layers,
embedding, head, split over tp; norms left out, as the FSDP time leaves
them out) under FSDP with bf16 compute (FSDP2's MixedPrecisionPolicy):
bf16 (`bytes_per_value`) parameters gathered whole once before the step
and bf16 gradients accumulated whole and reduce-scattered once after it
(the one exposed gather and reduce-scatter `project` charges; torchtitan
under pp does not reshard after forward), and fp32 master parameters and
AdamW's two fp32 moments sharded over dp: 4 + 12 / dp bytes a parameter.
Left out: buffers, fragmentation, the CUDA context. With pp = 1 this
over-counts FSDP resharding after each layer (which holds about two layers
whole, and gathers three times as much).

Skipped unsimulated, where a lower bound shows they cannot win (their
rows say so, `_Search.bounds` and `memory_bound` say how): a candidate
whose model state and one microbatch of its largest stage exceed the
memory, and one costlier than `_CHEAP` stage-microbatches whose step bound
is beyond the fastest found, or whose memory bound is over the memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..graph.format import human_bytes, table
from ..schedule import builtins
from ..schedule.kinds import TABLE, recomputes
from ..schedule.program import Lowering
from ..schedule.task import Schedule
from .cluster import Machine, TransformerShape, _even, _fsdp_time, _link, _profile
from .results import Profile, _seconds
from .splits import _Simulator

__all__ = ["ClusterCandidate", "ClusterPlan", "search_cluster"]

# Stages x microbatches above which a candidate is simulated only if its
# bounds say it could win (16 stages x 16 microbatches take ~10 ms).
_CHEAP = 256
_ROWS = 12  # rows `ClusterPlan.__repr__` shows; the rest are counted
_ORDER = ("OneFOneB", "GPipe", "Eager1F1B", "ZeroBubbleH1", "Interleaved1F1B", "ZBV", "DualPipeV")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterCandidate:
    """One layout, schedule, microbatching and recompute weighed. With
    pp = 1, `schedule` is OneFOneB(m) on one rank: gradient accumulation
    over m microbatches; None where it was refused before a schedule was
    built. Memory is bytes per device on the fullest pipeline rank (see the
    module docstring); where not simulated, a lower bound (0: none)."""

    pp: int
    tp: int
    dp: int
    schedule: Schedule | None
    stages_per_rank: int
    num_microbatches: int
    microbatch_size: int  # sequences per microbatch
    recompute: bool  # full activation checkpointing (R before each backward)
    step_time: float = math.inf  # seconds, projected (inf: not simulated)
    tokens_per_second_per_device: float = 0.0
    activation_bytes: int = 0  # the simulated activation peak on the fullest rank
    state_bytes: int = 0  # its parameters, gradients and optimizer states
    memory_per_device: int = 0
    fits_memory: bool = False  # simulated, and memory_per_device <= Machine.memory
    simulated: bool = False
    rejected: str = ""  # why it is not the choice ("" for the choice)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The mesh's dimensions of size > 1, outermost first (("dp",) on
        one device): tp innermost (inside a node), pp next (its sends stay
        inside a node while tp x pp fits in one), dp outermost (FSDP between
        nodes), the placement whose links `project` prices. For
        `init_device_mesh(device, c.mesh_shape, mesh_dim_names=c.mesh_dim_names)`."""
        return tuple(n for n in ("dp", "pp", "tp") if getattr(self, n) > 1) or ("dp",)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.mesh_dim_names)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterPlan:
    """What `search_cluster` chose, and the other candidates: `alternatives`
    holds the slower ones (fastest first), then those over the memory,
    those skipped by a bound and those refused, each with `rejected`."""

    choice: ClusterCandidate
    alternatives: tuple[ClusterCandidate, ...]
    global_batch_size: int
    seq_len: int
    memory: float  # Machine.memory
    candidates_simulated: int
    seconds_searching: float = field(default=0.0, compare=False)

    @property
    def num_devices(self) -> int:
        return self.choice.pp * self.choice.tp * self.choice.dp

    def __repr__(self) -> str:
        c = self.choice
        head = (
            f"ClusterPlan: pp={c.pp} x tp={c.tp} x dp={c.dp} (mesh {c.mesh_dim_names} "
            f"{c.mesh_shape}), {_name(c)}, {c.num_microbatches} microbatches of "
            f"{c.microbatch_size}, recompute={c.recompute}: {_seconds(c.step_time)} per step, "
            f"{c.tokens_per_second_per_device:.1f} tokens/s per device, "
            f"{human_bytes(c.memory_per_device)} of {human_bytes(self.memory)} per device "
            f"({self.candidates_simulated} of {1 + len(self.alternatives)} candidates "
            f"simulated in {self.seconds_searching:.1f} s)\n"
        )
        rows = [_row("choice", c), *(_row("", a) for a in self.alternatives[: _ROWS - 1])]
        columns = ["", "pp", "tp", "dp", "schedule", "microbatches", "size", "recompute"]
        columns += ["step", "tokens/s/device", "memory", "rejected"]
        text = head + table("candidates (projected):", columns, rows)
        rest = self.alternatives[_ROWS - 1 :]
        if rest:
            counts = {g: sum(_group(a) == g for a in rest) for g in _GROUPS}
            what = ", ".join(f"{n} {g}" for g, n in counts.items() if n)
            text += f"\n... {len(rest)} more in .alternatives: {what}"
        return text


def _row(label: str, c: ClusterCandidate) -> tuple[Any, ...]:
    size: tuple[Any, ...] = (c.num_microbatches, c.microbatch_size, "on" if c.recompute else "off")
    step: tuple[str, ...] = (_seconds(c.step_time), f"{c.tokens_per_second_per_device:.1f}")
    size, step = size if c.schedule else ("-",) * 3, step if c.simulated else ("-",) * 2
    memory = human_bytes(c.memory_per_device) if c.memory_per_device else "-"
    return (label, c.pp, c.tp, c.dp, _name(c), *size, *step, memory, c.rejected)


def _name(c: ClusterCandidate) -> str:
    if c.schedule is None:
        return "-"
    return "no pipeline" if c.pp == 1 else f"{type(c.schedule).__name__}({c.num_microbatches})"


_GROUPS = ("slower", "over memory", "skipped", "refused")


def _group(c: ClusterCandidate) -> str:
    if c.simulated:
        return "slower" if c.fits_memory else "over memory"
    return "skipped" if c.rejected.endswith("(bound)") else "refused"


def search_cluster(
    shape: TransformerShape,
    machine: Machine,
    num_devices: int,
    *,
    global_batch_size: int,
    seq_len: int,
    schedules: Sequence[type[Schedule]] | None = None,
    recompute: Iterable[bool] = (False, True),
) -> ClusterPlan:
    """The fastest way to train `shape` on `num_devices` devices of
    `machine` within `machine.memory`, as `mpmd.project` prices it (see
    the module docstring): a step is `global_batch_size` sequences of
    `seq_len` tokens, split over dp replicas and their microbatches.

    `schedules`: the schedule classes weighed where pp > 1 (default every
    built-in). `recompute`: the settings of full activation checkpointing
    weighed. Of candidates as fast, the simplest wins: the fewest pipeline
    ranks, stages per rank, no split backward, no recompute, the least
    memory. Raises ValueError if nothing fits `machine.memory`, naming the
    smallest memory found and what to change.
    """
    start = time.perf_counter()
    _check(shape, machine, num_devices, global_batch_size, seq_len)
    classes, settings = _classes(schedules), _settings(recompute)
    search = _Search(shape, machine, seq_len)
    found: list[ClusterCandidate] = []
    pending: list[tuple[bool, float, int, _Spec, _Bounds]] = []
    for spec in _specs(shape, machine, num_devices, global_batch_size, classes, settings):
        bounds = search.bounds(spec)
        low = 0 if isinstance(bounds, str) else bounds.memory(math.inf)
        if low > machine.memory:
            bounds = f"does not fit: at least {human_bytes(low)} > {human_bytes(machine.memory)}"
            bounds += " (bound)"
        if isinstance(bounds, str):
            found.append(_skipped(spec, bounds, low))
        else:
            costly = spec.pp * spec.spr * spec.m > _CHEAP
            pending.append((costly, bounds.step, len(pending), spec, bounds))
    fastest = math.inf
    # The cheap candidates first (all simulated), then the costly ones that
    # could still win, each in the order of its step bound.
    for costly, bound, _, spec, bounds in sorted(pending, key=lambda x: x[:3]):
        why, need = "", 0
        if costly and bound > fastest:
            why = f"at least {bound / fastest:.3f}x slower (bound)"
        elif costly:
            need, fast = search.memory_bound(spec, bounds, fastest)
            if need > machine.memory:
                why = f"{' as fast as the fastest' if fast else ''}: at least {human_bytes(need)}"
                why = f"does not fit{why} > {human_bytes(machine.memory)} (bound)"
        if why:
            found.append(_skipped(spec, why, need))
            continue
        c = search.simulate(spec, bounds, global_batch_size * seq_len / num_devices)
        if c.fits_memory:
            fastest = min(fastest, c.step_time)
        found.append(c)
    return _choose(found, machine, start, global_batch_size, seq_len)


class _Spec(NamedTuple):
    pp: int
    tp: int
    dp: int
    cls: type[Schedule] | None  # None: the layout is refused, for `refusal`
    spr: int  # stages per rank
    m: int  # microbatches
    recompute: bool
    batch: int  # sequences per data-parallel replica
    refusal: str = ""


@dataclass(frozen=True, slots=True)
class _Bounds:
    """Per pipeline rank: its model state, its largest stage's activations
    of one microbatch, and (without recompute) the activation-seconds it
    holds at least (each microbatch's activations of each of its stages from
    the forward until the gradient comes back, past the later stages'
    forwards and backwards); per stage, one microbatch's activations; the
    split; a lower bound on the step."""

    step: float
    state: list[int]
    activation: list[int]
    held: list[float]
    stage_activation: list[int]
    starts: tuple[int, ...]

    def memory(self, fastest: float) -> int:
        """A lower bound on the memory per device of a step at most `fastest`."""
        ranks = zip(self.state, self.activation, self.held, strict=True)
        return round(max(s + max(a, h / fastest) for s, a, h in ranks))


class _Search:
    """One search's shape, machine and caches (profiles, lowerings, task orders)."""

    def __init__(self, shape: TransformerShape, machine: Machine, seq_len: int) -> None:
        self.shape, self.machine, self.seq_len = shape, machine, seq_len
        self.profiles: dict[tuple[int, int], Profile] = {}
        self.lowerings: dict[tuple[Any, ...], Lowering | str] = {}
        self.orders: dict[tuple[Any, ...], list[list[tuple[int, int]]] | None] = {}
        self.splits: dict[tuple[type[Schedule], int], bool] = {}

    def profile(self, tp: int, size: int) -> Profile:
        if (tp, size) not in self.profiles:
            self.profiles[tp, size] = _profile(
                self.shape, self.machine, tp=tp, microbatch_size=size, seq_len=self.seq_len
            )
        return self.profiles[tp, size]

    def bounds(self, spec: _Spec) -> _Bounds | str:
        """The candidate's bounds, or why it cannot run. The
        step bound, per rank: the forwards of the stages before its first
        (microbatch 0 reaches it no sooner), all its F + B (+ R), then the
        backwards of those stages (unless its schedule runs W tasks, which
        nothing waits for); plus the FSDP time."""
        shape, (p, t, d, cls, spr, m, recompute, batch, refusal) = self.shape, spec
        if cls is None:
            return refusal
        n = p * spr
        if n > shape.layers:
            return f"{n} stages for {shape.layers} layers: a stage holds a layer"
        try:
            placement = cls(m).placement(n, p)
        except (TypeError, ValueError) as err:
            return f"cannot run {n} stages on {p} ranks: {err}"
        if (cls, spr) not in self.splits:
            self.splits[cls, spr] = _splits_backward(cls, spr)
        split = self.splits[cls, spr]
        prof = self.profile(t, batch // m)
        starts = (0, *(prof.units.index(u) for u in _even(shape.layers, n)))
        spans = list(itertools.pairwise([*starts, len(prof.units)]))
        f = [sum(prof.forward[a:b]) for a, b in spans]
        back = [sum(prof.backward[a:b]) for a, b in spans]
        emit = [x / 2 if split else x for x in back]  # the part the gradient waits for
        acts = [sum(prof.activation_bytes[a:b]) for a, b in spans]
        params, per_param = _unit_parameters(shape, t), 2 * shape.bytes_per_value + 12 / d
        state, act, held = [0.0] * p, [0] * p, [0.0] * p
        busy, head, tail = [0.0] * p, [math.inf] * p, [math.inf] * p
        for s, (a, b) in enumerate(spans):
            r = placement[s]
            state[r] += per_param * sum(params[a:b])
            act[r] = max(act[r], acts[s])
            held[r] += 0 if recompute else m * acts[s] * (sum(f[s + 1 :]) + sum(emit[s + 1 :]))
            busy[r] += m * (f[s] * (2 if recompute else 1) + back[s])
            head[r] = min(head[r], sum(f[:s]))
            tail[r] = min(tail[r], 0.0 if split else sum(emit[:s]))
        fsdp = _fsdp_time(shape, self.machine, tp=t, pp=p, dp=d)
        step = max(h + w + e for h, w, e in zip(head, busy, tail, strict=True)) + fsdp
        return _Bounds(step, [round(x) for x in state], act, held, acts, starts)

    def memory_bound(self, spec: _Spec, bounds: _Bounds, fastest: float) -> tuple[int, bool]:
        """A lower bound on the candidate's memory per device, and whether
        it holds only for a step within `fastest` (the activation-seconds
        bound). Without recompute, also what its task order keeps live at
        once (`_live`: its task lists, a tenth of a simulation), where the
        cheaper bounds fit."""
        need = bounds.memory(fastest)
        fast = need > bounds.memory(math.inf)
        if need > self.machine.memory or spec.recompute:
            return need, fast
        key = (spec.cls, spec.pp, spec.spr, spec.m)
        if key not in self.orders and spec.cls is not None:
            self.orders[key] = _live(spec.cls(spec.m), spec.pp * spec.spr, spec.pp)
        order = self.orders.get(key)
        if order is None:
            return need, fast
        peaks = []
        for events, state in zip(order, bounds.state, strict=True):
            live = peak = 0
            for stage, sign in events:
                live += sign * bounds.stage_activation[stage]
                peak = max(peak, live)
            peaks.append(state + peak)
        return max(need, *peaks), fast and need >= max(peaks)

    def simulate(self, spec: _Spec, bounds: _Bounds, tokens: float) -> ClusterCandidate:
        """The candidate priced as `project` prices it: the same profile,
        even split, link and FSDP time; one prediction of the simulator."""
        p, t, d, cls, spr, m, recompute, batch, _ = spec
        assert cls is not None
        key = (cls, m, p, spr, recompute)
        if key not in self.lowerings:
            try:
                schedule = cls(m).with_recompute() if recompute else cls(m)
                self.lowerings[key] = Lowering(schedule, p * spr, p)
            except (TypeError, ValueError) as err:
                self.lowerings[key] = f"cannot run {p * spr} stages on {p} ranks: {err}"
        lowering = self.lowerings[key]
        if isinstance(lowering, str):
            return _skipped(spec, lowering, 0)
        simulator = _Simulator(self.profile(t, batch // m), lowering, *_link(self.machine, t, p))
        try:
            predicted = simulator.evaluate(bounds.starts)
        except ValueError as err:  # a schedule of the user's that does not lower
            return _skipped(spec, f"cannot run {p * spr} stages on {p} ranks: {err}", 0)
        step = predicted.step + _fsdp_time(self.shape, self.machine, tp=t, pp=p, dp=d)
        totals = [a + s for a, s in zip(predicted.peak, bounds.state, strict=True)]
        r = max(range(p), key=totals.__getitem__)
        fits = totals[r] <= self.machine.memory
        over = f"does not fit: {human_bytes(totals[r])} > {human_bytes(self.machine.memory)}"
        figures: dict[str, Any] = dict(step_time=step, tokens_per_second_per_device=tokens / step)
        figures |= dict(activation_bytes=int(predicted.peak[r]), state_bytes=bounds.state[r])
        figures |= dict(memory_per_device=int(totals[r]), fits_memory=fits, simulated=True)
        return ClusterCandidate(**_layout(spec), **figures, rejected="" if fits else over)


def _live(schedule: Schedule, n: int, p: int) -> list[list[tuple[int, int]]] | None:
    """Per rank, (stage, 1) where a microbatch's activations of a stage
    become live (its forward, or its recompute where it has one) and
    (stage, -1) where they may go (the first part of its backward): what
    the simulator keeps at least, by the task order alone (None: the
    schedule cannot run)."""
    try:
        lists = schedule.tasks(n, p, schedule.num_microbatches)
    except (TypeError, ValueError):
        return None
    ranks = [[t for task in rank for t in task.parts] for rank in lists]
    again = {(t.stage, t.microbatch) for rank in ranks for t in rank if recomputes(t.kind)}
    out = []
    for rank in ranks:
        events, held = [], set()
        for t in rank:
            key, info = (t.stage, t.microbatch), TABLE[t.kind]
            if info.recomputes or (info.in_forward_only and key not in again):
                events.append((t.stage, 1))
                held.add(key)
            elif info.backward and key in held:
                events.append((t.stage, -1))
                held.discard(key)
        out.append(events)
    return out


def _splits_backward(cls: type[Schedule], spr: int) -> bool:
    """Whether `cls` runs W tasks (asked on 2 ranks, 8 microbatches; True,
    the weaker step bound, where that cannot tell)."""
    try:
        return bool(cls(8).splits_backward(2 * spr, 2))
    except (TypeError, ValueError):
        return True


def _unit_parameters(shape: TransformerShape, tp: int) -> list[float]:
    """Parameters per tp rank of each unit: the embedding, the layers, the
    head (norms left out, as `_fsdp_time` leaves them out)."""
    h, head_dim = shape.hidden, shape.hidden // shape.heads
    layer = 2 * h * h + 2 * h * shape.kv_heads * head_dim
    layer += (3 if shape.gated else 2) * h * shape.ffn_hidden
    return [shape.vocab * h / tp, *([layer / tp] * shape.layers), shape.vocab * h / tp]


def _check(shape: Any, machine: Any, n: Any, batch: Any, seq_len: Any) -> None:
    if not isinstance(shape, TransformerShape):
        raise TypeError(
            "mpmd.search_cluster: shape must be an mpmd.TransformerShape (e.g. "
            f"TransformerShape.from_config(config)), got {type(shape).__name__}"
        )
    if not isinstance(machine, Machine):
        raise TypeError(f"mpmd.search_cluster: machine must be an mpmd.Machine, got {machine!r}")
    for name, value in (("num_devices", n), ("global_batch_size", batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mpmd.search_cluster: {name} must be a positive int, got {value!r}")


def _classes(schedules: Any) -> list[type[Schedule]]:
    if schedules is None:
        return [getattr(builtins, name) for name in _ORDER]
    example = "e.g. [mpmd.schedules.OneFOneB] (the search chooses the microbatches)"
    if isinstance(schedules, type | str | Schedule) or not isinstance(schedules, Iterable):
        raise TypeError(
            f"mpmd.search_cluster: schedules must be a list of Schedule classes, {example}; "
            f"got {schedules!r}"
        )
    out = list(schedules)
    for i, s in enumerate(out):
        if not (isinstance(s, type) and issubclass(s, Schedule)):
            raise TypeError(
                f"mpmd.search_cluster: schedules must be Schedule classes, {example}; "
                f"schedules[{i}] is {s!r}"
            )
    if not out:
        raise ValueError("mpmd.search_cluster: schedules is empty; leave it out for every built-in")
    return out


def _settings(recompute: Any) -> list[bool]:
    values = list(recompute) if isinstance(recompute, Iterable) else [recompute]
    if not values or not all(isinstance(v, bool) for v in values):
        raise ValueError(
            "mpmd.search_cluster: recompute must be a non-empty list of True / False (the "
            f"settings to weigh), e.g. (False, True); got {recompute!r}"
        )
    return list(dict.fromkeys(values))


def _specs(
    shape: TransformerShape,
    machine: Machine,
    n: int,
    batch: int,
    classes: list[type[Schedule]],
    settings: list[bool],
) -> list[_Spec]:
    """Every candidate: for each pp x tp x dp = n, each schedule class,
    microbatch count and recompute setting, or the layout refused (why);
    ValueError where the global batch is all that refuses every layout."""
    out, refused = [], []
    for p in (k for k in range(1, n + 1) if n % k == 0):
        for t in (k for k in range(1, n // p + 1) if n // p % k == 0):
            d, why = n // p // t, ""
            if p > shape.layers:
                why = f"pp={p} > {shape.layers} layers: a pipeline rank holds a layer"
            elif shape.kv_heads % t or shape.heads % t:
                name = "kv_heads" if shape.kv_heads % t else "heads"
                why = f"tp={t} does not divide {name}={getattr(shape, name)}: a tp rank "
                why += "computes whole heads"
            elif t > machine.devices_per_node:
                why = (
                    f"tp={t} > {machine.devices_per_node} devices per node: its 4 collectives "
                    "per layer each way, on the critical path, would cross nodes"
                )
            elif batch % d:
                why = f"global batch {batch} does not divide into dp={d} replicas"
                refused.append(d)
            if why:
                out.append(_Spec(p, t, d, None, 1, 0, False, 0, why))
                continue
            for cls in classes if p > 1 else [builtins.OneFOneB]:
                spr = cls.stages_per_rank if p > 1 else 1
                for m in _counts(batch // d, p, spr):
                    out += [_Spec(p, t, d, cls, spr, m, r, batch // d) for r in settings]
    if refused and all(s.cls is None for s in out):
        raise ValueError(
            f"mpmd.search_cluster: global_batch_size={batch} divides into the data-parallel "
            f"replicas of no layout of {n} devices (dp in {sorted(set(refused))}); pass a "
            f"multiple of {min(refused)}"
        )
    return out


def _counts(batch: int, pp: int, spr: int) -> list[int]:
    """Microbatch counts: those dividing the per-replica batch from pp up
    to 4 per stage (pp = 1: all of them), or one sequence each where the
    batch has fewer sequences than pipeline ranks."""
    top = batch if pp == 1 else min(batch, 4 * pp * spr)
    return [m for m in range(pp, top + 1) if batch % m == 0] or [batch]


def _layout(spec: _Spec) -> dict[str, Any]:
    try:
        schedule = spec.cls(spec.m) if spec.cls is not None else None
    except (TypeError, ValueError):
        schedule = None
    out = dict(pp=spec.pp, tp=spec.tp, dp=spec.dp, schedule=schedule, recompute=spec.recompute)
    size = spec.batch // spec.m if spec.m else 0
    return out | dict(stages_per_rank=spec.spr, num_microbatches=spec.m, microbatch_size=size)


def _skipped(spec: _Spec, why: str, memory: int) -> ClusterCandidate:
    """A candidate not simulated: `why`; `memory` where it is over (a bound)."""
    memory = memory if why.startswith("does not fit") else 0
    return ClusterCandidate(**_layout(spec), memory_per_device=memory, rejected=why)


def _simplicity(c: ClusterCandidate) -> tuple[Any, ...]:
    assert c.schedule is not None
    try:
        split = c.schedule.splits_backward(c.num_stages, c.pp)
    except (TypeError, ValueError):
        split = True
    return (c.pp, c.stages_per_rank, split, c.recompute, c.memory_per_device, c.step_time)


def _choose(
    found: list[ClusterCandidate],
    machine: Machine,
    start: float,
    batch: int,
    seq_len: int,
) -> ClusterPlan:
    ran = sorted((c for c in found if c.fits_memory), key=lambda c: c.step_time)
    if not ran:
        raise ValueError(_nothing_fits(found, machine))
    # Steps equal but for rounding (accumulation without tp) tie.
    best = min((c for c in ran if c.step_time <= ran[0].step_time * (1 + 1e-9)), key=_simplicity)

    def why(c: ClusterCandidate) -> str:
        ratio = c.step_time / best.step_time
        return f"{ratio:.3f}x slower" if ratio > 1 + 1e-9 else "as fast: the choice is simpler"

    slower = [dataclasses.replace(c, rejected=why(c)) for c in ran if c is not best]
    others = [c for c in found if not c.fits_memory]
    others.sort(key=lambda c: (_GROUPS.index(_group(c)), c.memory_per_device))
    return ClusterPlan(
        choice=best,
        alternatives=(*slower, *others),
        global_batch_size=batch,
        seq_len=seq_len,
        memory=machine.memory,
        candidates_simulated=sum(c.simulated for c in found),
        seconds_searching=time.perf_counter() - start,
    )


def _nothing_fits(found: list[ClusterCandidate], machine: Machine) -> str:
    sized = [c for c in found if c.memory_per_device]
    if not sized:
        reasons = "; ".join(dict.fromkeys(c.rejected for c in found))
        return f"mpmd.search_cluster: no candidate can run: {reasons}"
    low = min(sized, key=lambda c: c.memory_per_device)
    bound = "" if low.simulated else "at least "
    return (
        f"mpmd.search_cluster: nothing fits Machine.memory={human_bytes(machine.memory)} per "
        f"device; the smallest memory found is {bound}{human_bytes(low.memory_per_device)} per "
        f"device (pp={low.pp} x tp={low.tp} x dp={low.dp}, {_name(low)}, "
        f"{low.num_microbatches} microbatches of {low.microbatch_size}, recompute="
        f"{low.recompute}); to fit, use more devices (a larger pp x tp shards the model "
        "state further), a shorter seq_len, a smaller global_batch_size, or a machine with "
        "more memory"
    )
