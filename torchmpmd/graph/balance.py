"""`mpmd.balance`: where to cut a model so that the pipeline's step is shortest.

Two separable steps:

- `profile` runs the model once per pass on one microbatch and measures, per
  *unit* (a candidate stage: see `_candidate_units`), forward and backward time
  and the activation bytes autograd saves, plus every value that crosses
  between units (from one trace of the model cut at every unit).
- `search` tries splits of those units into stages on the project's simulator
  (`_C.schedule.lower` + `simulate`, what `compile_schedule(...).simulate()`
  runs) and keeps the one with the shortest predicted step: every split when
  there are at most `EXHAUSTIVE_LIMIT`, otherwise a local search from the even
  split and from the min-max (bottleneck) partition.

Units are timed boundary to boundary: a unit's forward runs from its forward
pre-hook to the next unit's, so code between modules (a residual add, a
`torch.cat`) counts for the unit before it, which is where `mpmd.trace`'s
`split_before` puts it. Backward is timed the same way, from the gradient of
one unit's inputs to the gradient of the previous unit's inputs.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _C
from ..schedule.builtins import OneFOneB
from ..schedule.costs import Costs, timeline_from_native
from ..schedule.program import _spec
from ..schedule.task import Schedule
from ..schedule.timeline import Timeline
from .format import human_bytes, table
from .frontend import _check_signature, trace
from .markers import STAGE_END_OP, _tracing

__all__ = [
    "EXHAUSTIVE_LIMIT",
    "Balance",
    "Profile",
    "StageCost",
    "UnitTransfer",
    "balance",
    "profile",
    "search",
    "simulate",
]

# Splits tried one by one up to this many; beyond, a local search.
EXHAUSTIVE_LIMIT = 20_000

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


# --------------------------------------------------------------------------- results


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

    def __post_init__(self) -> None:
        n = len(self.units)
        if n < 1:
            raise ValueError("Profile: needs at least one unit")
        for name in ("forward", "backward", "activation_bytes"):
            values = getattr(self, name)
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


# --------------------------------------------------------------------------- units


@dataclass(slots=True)
class _Call:
    path: str
    module: torch.nn.Module
    children: list[int] = field(default_factory=list)
    ops: int = 0  # operations dispatched while this call was the innermost


# torch leaves TorchDispatchMode's __init_subclass__ and __init__ unannotated.
class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Module calls (a tree, in call order) and the ops that ran inside each;
    counts `mark_stage_end` calls (run under `_tracing`, they dispatch an op)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.calls: list[_Call] = []
        self.stack: list[int] = []
        self.markers = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        if func is STAGE_END_OP:
            self.markers += 1
        if self.stack:
            self.calls[self.stack[-1]].ops += 1
        return func(*args, **(kwargs or {}))

    def _pre(self, module: torch.nn.Module, _args: Any) -> None:
        path = self.names.get(id(module))
        if path is None:
            return
        index = len(self.calls)
        self.calls.append(_Call(path, module))
        if self.stack:
            self.calls[self.stack[-1]].children.append(index)
        self.stack.append(index)

    def _post(self, module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if id(module) in self.names and self.stack:
            self.stack.pop()

    def hooks(self) -> list[torch.utils.hooks.RemovableHandle]:
        """Global module hooks that record every call of the model's modules."""
        return [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
            torch.nn.modules.module.register_module_forward_hook(self._post),
        ]


def _candidate_units(
    model: torch.nn.Module, calls: Sequence[_Call], min_units: int = 1
) -> list[str]:
    """The units a model is cut between, from its module calls in call order.

    Starting from the root's calls, a call is replaced by the calls it makes
    when it runs a stack of layers (it is a ModuleList, Sequential or
    ModuleDict, or calls items of one) or wraps a single module, unless it is
    itself an item of a stack (a layer stays whole). So a GPT gives its
    embeddings, each block, the final norm and the head. While there are
    fewer units than `min_units`, the unit with the most parameters that
    calls modules is replaced by those calls. A unit can start a stage only
    if its module runs once and runs at least one operation; other units
    stay inside the unit before them.
    """
    if not calls:
        return []
    total_ops = _total_ops(calls)
    modules = dict(model.named_modules(remove_duplicate=False))

    def is_item(path: str) -> bool:
        parent, _, _ = path.rpartition(".")
        return isinstance(modules.get(parent), _CONTAINERS)

    def expands(i: int) -> bool:
        c = calls[i]
        if not c.children or is_item(c.path):
            return False
        return (
            isinstance(c.module, _CONTAINERS)
            or len(c.children) == 1
            or any(is_item(calls[k].path) for k in c.children)
        )

    def flatten(i: int) -> list[int]:
        return [u for k in calls[i].children for u in (flatten(k) if expands(k) else [k])]

    runs: dict[str, int] = {}
    for c in calls:
        runs[c.path] = runs.get(c.path, 0) + 1

    def usable(units: list[int]) -> list[str]:
        paths = [calls[units[0]].path]
        for u in units[1:]:
            path = calls[u].path
            if runs[path] == 1 and total_ops[u] > 0 and path not in paths:
                paths.append(path)
        return paths

    units = flatten(0) or [0]
    while len(usable(units)) < min_units:
        splittable = [u for u in units if calls[u].children]
        if not splittable:
            break
        big = max(splittable, key=lambda u: sum(p.numel() for p in calls[u].module.parameters()))
        at = units.index(big)
        units[at : at + 1] = calls[big].children
    return usable(units)


def _total_ops(calls: Sequence[_Call]) -> list[int]:
    total = [c.ops for c in calls]
    for i in reversed(range(len(calls))):  # children come after their parent
        for k in calls[i].children:
            total[i] += total[k]
    return total


# --------------------------------------------------------------------------- profiling


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


@dataclass(slots=True)
class _Pass:
    """What the hooks of one forward + backward recorded."""

    pre: dict[int, float] = field(default_factory=dict)
    grad: dict[int, float] = field(default_factory=dict)
    saved: dict[int, int] = field(default_factory=dict)
    input_bytes: dict[int, int] = field(default_factory=dict)
    current: int = 0
    start: float = 0.0
    forward_end: float = 0.0
    backward_start: float = 0.0
    end: float = 0.0


LossFn = Callable[[Any, Any], torch.Tensor]


class _Profiler:
    def __init__(
        self,
        model: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loss: tuple[LossFn, Any] | None,
    ) -> None:
        self.model = model
        self.args = args
        self.kwargs = kwargs
        self.loss = loss
        tensors = [*model.parameters(), *model.buffers(), *_tensors((args, kwargs))]
        cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.cuda_devices = cuda
        self.sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.fixed_storages = {
            t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]
        }

    def forward(self) -> Any:
        """The model's forward, then the loss (the last stage computes it)."""
        out = self.model(*self.args, **self.kwargs)
        if self.loss is not None:
            loss_fn, target = self.loss
            out = loss_fn(out, target)
        return out

    def run(self, units: Sequence[str], saved: bool) -> _Pass:
        """One forward and backward, timing the units (and what autograd saves
        in each, if `saved`)."""
        rec = _Pass()
        handles: list[torch.utils.hooks.RemovableHandle] = []

        def on_grad(k: int) -> Callable[[torch.Tensor], None]:
            def hook(_grad: torch.Tensor) -> None:
                self.sync()
                rec.grad[k] = min(rec.grad.get(k, math.inf), time.perf_counter())

            return hook

        def on_call(k: int) -> Callable[[torch.nn.Module, Any, Any], None]:
            def hook(_module: torch.nn.Module, args: Any, kwargs: Any) -> None:
                if k in rec.pre:
                    return
                self.sync()
                rec.pre[k] = time.perf_counter()
                rec.current = k
                inputs = _tensors((args, kwargs))
                rec.input_bytes[k] = sum(
                    t.numel() * t.element_size() for t in inputs if t.is_floating_point()
                )
                for t in inputs:
                    if t.requires_grad:
                        handle = t.register_hook(on_grad(k))  # type: ignore[no-untyped-call]
                        handles.append(handle)

            return hook

        counted: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # no plain storage
                key, size = id(t), t.numel() * t.element_size()
            if key not in counted and key not in self.fixed_storages:
                counted.add(key)
                rec.saved[rec.current] = rec.saved.get(rec.current, 0) + size
            return t

        for k, path in enumerate(units):
            if k == 0:  # the first unit starts with the forward
                continue
            module = self.model.get_submodule(path)
            handles.append(module.register_forward_pre_hook(on_call(k), with_kwargs=True))
        try:
            hooks = (
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                if saved
                else contextlib.nullcontext()
            )
            self.sync()
            rec.start = time.perf_counter()
            with hooks:
                out = self.forward()
            self.sync()
            rec.forward_end = time.perf_counter()
            self.backward(out, rec)
        finally:
            for h in handles:
                h.remove()
        return rec

    def backward(self, out: Any, rec: _Pass) -> None:
        outs = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
        rec.backward_start = rec.end = time.perf_counter()
        if not outs or not self.params:
            return
        grads = [torch.ones_like(t) for t in outs]
        self.sync()
        rec.backward_start = time.perf_counter()
        torch.autograd.grad(outs, self.params, grads, allow_unused=True)
        self.sync()
        rec.end = time.perf_counter()


@contextlib.contextmanager
def _buffers_restored(model: torch.nn.Module) -> Iterator[None]:
    """Profiling runs must not change the model (BatchNorm statistics)."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _inputs(
    model: torch.nn.Module, example_args: Any, example_kwargs: dict[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"mpmd.balance: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    if isinstance(example_args, list):
        raise TypeError(
            "mpmd.balance: example_args is a list; pass the positional arguments of one "
            "microbatch as a tuple, e.g. (x,)"
        )
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs = dict(example_kwargs or {})
    _check_signature(model, args, kwargs)
    tensors = [*model.parameters(), *model.buffers(), *_tensors((args, kwargs))]
    if any(t.is_meta for t in tensors):
        raise ValueError(
            "mpmd.balance: the model or its example inputs are on the meta device, so "
            "nothing can be timed; balance a copy on a real device and pass its "
            "split_before to mpmd.trace"
        )
    return args, kwargs


def profile(
    model: torch.nn.Module,
    example_args: Any = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    min_units: int = 1,
    repeats: int = 5,
    loss_fn: LossFn | None = None,
    example_target: Any = None,
) -> Profile:
    """Measures the candidate units of `model` on one microbatch.

    One forward and backward records the module calls (`_candidate_units`
    picks the units, at least `min_units` where the model allows) and warms
    up; one more records the activation bytes autograd saves in each unit
    (`saved_tensors_hooks`; parameters and buffers are not activations);
    then `repeats` passes are timed and each unit gets its median. With
    `loss_fn`, the last unit also computes `loss_fn(output, example_target)`
    (as the last stage does) and the backward starts from the loss;
    otherwise from gradients of ones on the model's outputs.
    A trace of the model cut at every unit gives what crosses each cut.
    The model's parameters, gradients, buffers and random state are left as
    they were.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"mpmd.balance: repeats must be a positive int, got {repeats!r}")
    args, kwargs = _inputs(model, example_args, example_kwargs)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"mpmd.balance: loss_fn must be callable, got {type(loss_fn).__name__}")
    if loss_fn is None and example_target is not None:
        raise ValueError(
            "mpmd.balance: example_target is only read by loss_fn; pass loss_fn too "
            "(the PipelineRunner's, e.g. loss_fn=F.cross_entropy)"
        )
    loss = (loss_fn, example_target) if loss_fn is not None else None
    prof = _Profiler(model, args, kwargs, loss)
    with torch.random.fork_rng(devices=prof.cuda_devices), _buffers_restored(model):
        recorder = _Recorder(model)
        handles = recorder.hooks()
        try:
            with _tracing(), recorder:
                out = prof.forward()
        finally:
            for h in handles:
                h.remove()
        if recorder.markers:
            raise ValueError(
                f"mpmd.balance: the model calls mpmd.mark_stage_end {recorder.markers} time(s), "
                "so its stages are set in its code; trace it without num_stages, or remove "
                "the markers to let mpmd.balance choose the split"
            )
        prof.backward(out, _Pass())
        del out
        units = _candidate_units(model, recorder.calls, min_units)
        sizes = prof.run(units, saved=True)
        passes = [prof.run(units, saved=False) for _ in range(repeats)]
    forward, backward = _median_times(units, passes)
    activation = [sizes.saved.get(k, 0) for k in range(len(units))]

    traced = _traced_transfers(model, args, kwargs, units)
    if traced is None:  # not traceable at every unit: the bytes each unit reads
        kept = units
        transfers = tuple(
            UnitTransfer(src=k - 1, dst=(k,), bytes=sizes.input_bytes.get(k, 0))
            for k in range(1, len(units))
        )
        tied: tuple[tuple[tuple[int, ...], int], ...] = ()
    else:
        kept, transfers, tied = traced
    owner: list[int] = []  # a unit that cannot start a stage joins the one before
    for u in units:
        owner.append(kept.index(u) if u in kept else owner[-1])

    def merged(values: Sequence[float]) -> list[float]:
        out = [0.0] * len(kept)
        for k, v in enumerate(values):
            out[owner[k]] += v
        return out

    return Profile(
        units=tuple(kept),
        forward=tuple(merged(forward)),
        backward=tuple(merged(backward)),
        activation_bytes=tuple(int(v) for v in merged(activation)),
        transfers=transfers,
        tied=tied,
    )


def _median_times(units: Sequence[str], passes: Sequence[_Pass]) -> tuple[list[float], list[float]]:
    n = len(units)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    for rec in passes:
        missing = [units[k] for k in range(1, n) if k not in rec.pre]
        if missing:
            raise RuntimeError(
                f"mpmd.balance: module '{missing[0]}' ran in the first forward of the example "
                "but not in a later one; the model must run the same modules on every call"
            )
        starts = [rec.start] + [rec.pre[k] for k in range(1, n)] + [rec.forward_end]
        for k in range(n):
            fwd[k].append(max(starts[k + 1] - starts[k], 0.0))
        # Gradient of unit k's inputs ready: the end of unit k's backward. A
        # unit without differentiable inputs ends where the next one does.
        ends = [0.0] * (n + 1)
        ends[n] = rec.backward_start
        for k in range(n - 1, 0, -1):
            ends[k] = min(max(rec.grad.get(k, ends[k + 1]), ends[k + 1]), rec.end)
        ends[0] = max(rec.end, ends[1] if n > 1 else rec.end)
        for k in range(n):
            bwd[k].append(ends[k] - ends[k + 1])
    return [statistics.median(v) for v in fwd], [statistics.median(v) for v in bwd]


def _traced_transfers(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    units: Sequence[str],
) -> tuple[list[str], tuple[UnitTransfer, ...], tuple[tuple[tuple[int, ...], int], ...]] | None:
    """What crosses between units: `mpmd.trace` cut before every unit. A unit
    the trace refuses as a boundary (named in its error, e.g. one whose ops
    are all recomputed where needed, which leaves an empty stage) is merged
    into the unit before it; None if the model cannot be traced that way."""
    points = list(units[1:])
    for _ in range(8):
        try:
            pipe = trace(model, args, kwargs, split_before=points)
        except ValueError as err:
            named = re.findall(r"(?:split_before|names module) '([^']+)'", str(err))
            bad = next((p for p in named if p in points), None)
            if bad is None:
                return None
            points.remove(bad)
            continue
        except (RuntimeError, TypeError):
            return None
        plan = pipe.plan
        transfers = tuple(
            UnitTransfer(
                src=t.src_stage, dst=t.dst_stages, bytes=t.bytes, requires_grad=t.requires_grad
            )
            for t in plan.transfers
        )
        tied = tuple(
            (
                t.stages,
                pipe.tied_parameters[t.node].numel() * pipe.tied_parameters[t.node].element_size(),
            )
            for t in plan.tied
        )
        return [units[0], *points], transfers, tied
    return None


# --------------------------------------------------------------------------- search


@dataclass(frozen=True, slots=True)
class _Eval:
    starts: tuple[int, ...]  # first unit of each stage
    step: float
    peak: tuple[int, ...]  # per rank
    crossing: int  # bytes sent per microbatch

    def key(self, limit: float | None) -> tuple[float, float, int, int, tuple[int, ...]]:
        over = max(0.0, max(self.peak, default=0) - limit) if limit is not None else 0.0
        return (over, self.step, max(self.peak, default=0), self.crossing, self.starts)


class _Simulator:
    """Predicted step of splits of a profile, memoised.

    `compile_schedule` lowers against a Pipe or a chain of 1-byte edges;
    here each split gets a graph whose edges carry the bytes of the values
    crossing its cuts (skip connections included), lowered with the same
    schedule spec (built once) and simulated by the same native simulator.
    """

    def __init__(
        self,
        profile: Profile,
        num_stages: int,
        num_ranks: int,
        spec: _C.schedule.ScheduleSpec,
        bandwidth: float,
        latency: float,
    ) -> None:
        self.profile = profile
        self.n = num_stages
        self.num_ranks = num_ranks
        self.spec = spec
        self.bandwidth = bandwidth
        self.latency = latency
        self.cache: dict[tuple[int, ...], _Eval] = {}
        self._f = [0.0, *itertools.accumulate(profile.forward)]
        self._b = [0.0, *itertools.accumulate(profile.backward)]
        self._a = [0, *itertools.accumulate(profile.activation_bytes)]

    def stages(self, starts: tuple[int, ...]) -> list[tuple[float, float, int]]:
        """Per stage: forward, backward, activation bytes."""
        bounds = [*starts, len(self.profile.units)]
        return [
            (self._f[e] - self._f[s], self._b[e] - self._b[s], self._a[e] - self._a[s])
            for s, e in itertools.pairwise(bounds)
        ]

    def costs(self, starts: tuple[int, ...]) -> Costs:
        stages = self.stages(starts)
        return Costs(
            forward=[f for f, _, _ in stages],
            backward=[b for _, b, _ in stages],
            activation_bytes=[a for _, _, a in stages],
            unit="s",
            bandwidth=self.bandwidth,
            latency=self.latency,
        )

    def _native(self, starts: tuple[int, ...]) -> tuple[_C.schedule.Timeline, int]:
        stage_of = [bisect.bisect_right(starts, u) - 1 for u in range(len(self.profile.units))]
        edges = []
        crossing = 0
        for value, t in enumerate(self.profile.transfers):
            src = stage_of[t.src]
            for dst in sorted({stage_of[d] for d in t.dst} - {src}):
                edges.append(_C.schedule.Edge(value, src, dst, t.bytes, t.requires_grad))
                crossing += t.bytes
        tied = []
        for i, (units, nbytes) in enumerate(self.profile.tied):
            stages = sorted({stage_of[u] for u in units})
            if len(stages) > 1:
                tied.append(_C.schedule.TiedGroup(i, stages, nbytes))
        costs = self.costs(starts).native(self.n)
        graph = _C.schedule.PipelineGraph(self.n, edges, tied)
        program = _C.schedule.lower(graph, self.spec, costs)
        return _C.schedule.simulate(program, costs), crossing

    def evaluate(self, starts: tuple[int, ...]) -> _Eval:
        found = self.cache.get(starts)
        if found is None:
            native, crossing = self._native(starts)
            compute = [e for e in native.events if e.kind == _C.schedule.EventKind.compute]
            step, _ = _C.schedule.timeline_stats(
                [e.rank for e in compute], [e.start for e in compute], [e.end for e in compute]
            )
            found = _Eval(starts, step, tuple(native.peak_activation_bytes), crossing)
            self.cache[starts] = found
        return found

    def timeline(self, starts: tuple[int, ...]) -> Timeline:
        return timeline_from_native(self._native(starts)[0], "s")


def _even_starts(num_units: int, num_stages: int) -> tuple[int, ...]:
    """Equal numbers of units per stage; the first `num_units % num_stages` get one more."""
    q, r = divmod(num_units, num_stages)
    return tuple(s * q + min(s, r) for s in range(num_stages))


def _min_max_starts(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """The contiguous partition whose largest stage sum is smallest (the bottleneck)."""
    n = len(weights)
    prefix = [0.0, *itertools.accumulate(weights)]
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, num_stages + 1):
        for i in range(j, n - (num_stages - j) + 1):
            for k in range(j - 1, i):
                v = max(best[j - 1][k], prefix[i] - prefix[k])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, k
    starts = []
    i = n
    for j in range(num_stages, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return tuple(reversed(starts))


def _local_search(
    sim: _Simulator, seeds: Sequence[tuple[int, ...]], num_units: int, limit: float | None
) -> None:
    """Steepest descent from each seed, moving one cut by 1, 2, 4, ... units."""
    n = sim.n
    reach = max(1, num_units // n)
    for seed in seeds:
        current = sim.evaluate(seed)
        while True:
            moves = []
            for i in range(1, n):
                lo = current.starts[i - 1] + 1
                hi = (current.starts[i + 1] if i + 1 < n else num_units) - 1
                d = 1
                while d <= reach:
                    for v in (current.starts[i] - d, current.starts[i] + d):
                        if lo <= v <= hi:
                            moves.append((*current.starts[:i], v, *current.starts[i + 1 :]))
                    d *= 2
            if not moves:
                break
            candidate = min((sim.evaluate(m) for m in moves), key=lambda e: e.key(limit))
            if candidate.key(limit) >= current.key(limit):
                break
            current = candidate


def _check_num_stages(num_stages: Any) -> int:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool):
        raise TypeError(
            f"mpmd.balance: num_stages must be an int, got {num_stages!r} "
            f"({type(num_stages).__name__})"
        )
    if num_stages < 1:
        raise ValueError(f"mpmd.balance: num_stages must be at least 1, got {num_stages}")
    return num_stages


def _resolve_schedule(
    schedule: Any, num_stages: int, num_ranks: Any
) -> tuple[Schedule, int, _C.schedule.ScheduleSpec]:
    """The schedule (default 1F1B over 2 x num_stages microbatches) and number of
    ranks (default num_stages, or num_stages / 2 for a schedule that needs two
    stages per rank), checked by lowering it once."""
    if schedule is None:
        schedule = OneFOneB(2 * num_stages)
    elif isinstance(schedule, type) and issubclass(schedule, Schedule):
        raise TypeError(
            f"mpmd.balance: schedule is the class {schedule.__name__}; pass an instance with "
            f"its number of microbatches, e.g. schedule={schedule.__name__}({2 * num_stages})"
        )
    elif not isinstance(schedule, Schedule):
        raise TypeError(
            f"mpmd.balance: schedule must be an mpmd.Schedule such as "
            f"mpmd.schedules.OneFOneB(8), got {type(schedule).__name__}"
        )
    if num_ranks is not None and (
        not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1
    ):
        raise ValueError(f"mpmd.balance: num_ranks must be a positive int, got {num_ranks!r}")
    tries = [num_ranks] if num_ranks is not None else [num_stages]
    if num_ranks is None and num_stages % 2 == 0:
        tries.append(num_stages // 2)
    errors: list[ValueError] = []
    for ranks in tries:
        try:
            spec = _spec(schedule, num_stages, ranks, False)
            chain = _C.schedule.PipelineGraph.chain(num_stages)
            _C.schedule.lower(chain, spec, Costs().native(num_stages))
            return schedule, ranks, spec
        except ValueError as err:
            errors.append(err)
    which = " or ".join(str(r) for r in tries)
    raise ValueError(
        f"mpmd.balance: {schedule!r} cannot run {num_stages} stages on {which} ranks: "
        f"{errors[0]}; pass num_ranks=... or a num_stages and schedule that fit "
        "(OneFOneB: a multiple of num_ranks stages; ZBV and DualPipeV: 2 x num_ranks)"
    ) from errors[0]


def _check_limits(memory_limit: Any, bandwidth: Any, latency: Any) -> None:
    if memory_limit is not None and (
        not isinstance(memory_limit, (int, float))
        or isinstance(memory_limit, bool)
        or not memory_limit > 0
    ):
        raise ValueError(
            f"mpmd.balance: memory_limit is bytes per rank and must be positive, got "
            f"{memory_limit!r}"
        )
    for name, value in (("bandwidth", bandwidth), ("latency", latency)):
        if not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"mpmd.balance: {name} must be a non-negative number, got {value!r}")


def search(
    profile: Profile,
    num_stages: int,
    *,
    schedule: Schedule | None = None,
    num_ranks: int | None = None,
    memory_limit: float | None = None,
    bandwidth: float = 0.0,
    latency: float = 0.0,
) -> Balance:
    """The split of `profile`'s units into `num_stages` stages with the shortest
    simulated step under `schedule` on `num_ranks` ranks.

    Every split when there are at most `EXHAUSTIVE_LIMIT`; otherwise a local
    search from the even split and the min-max partition of forward +
    backward time, which never returns a split slower than the even one. With
    `memory_limit` (bytes per rank), only splits whose simulated peak
    activation bytes stay within it on every rank. `bandwidth` (bytes per
    second, 0: free) and `latency` (seconds per message) price transfers.
    """
    num_stages = _check_num_stages(num_stages)
    schedule, num_ranks, spec = _resolve_schedule(schedule, num_stages, num_ranks)
    _check_limits(memory_limit, bandwidth, latency)
    units = len(profile.units)
    if num_stages > units:
        raise ValueError(
            f"mpmd.balance: num_stages={num_stages} but the model has {units} unit(s) a stage "
            f"can start at ({', '.join(repr(u) for u in profile.units)}); a stage holds at least "
            f"one: use num_stages <= {units}, or cut inside a unit by hand with "
            "mpmd.trace(..., split_before=[...]) or mpmd.mark_stage_end"
        )
    sim = _Simulator(profile, num_stages, num_ranks, spec, float(bandwidth), float(latency))
    limit = float(memory_limit) if memory_limit is not None else None
    even = _even_starts(units, num_stages)
    if math.comb(units - 1, num_stages - 1) <= EXHAUSTIVE_LIMIT:
        method = "exhaustive"
        for cuts in itertools.combinations(range(1, units), num_stages - 1):
            sim.evaluate((0, *cuts))
    else:
        method = "local search"
        work = [f + b for f, b in zip(profile.forward, profile.backward, strict=True)]
        seeds = [even, _min_max_starts(work, num_stages)]
        if limit is not None:
            seeds.append(_min_max_starts([float(a) for a in profile.activation_bytes], num_stages))
        _local_search(sim, seeds, units, limit)
    best = min(sim.cache.values(), key=lambda e: e.key(limit))
    if limit is not None and max(best.peak) > limit:
        rank = best.peak.index(max(best.peak))
        smallest = "smallest" if method == "exhaustive" else "smallest found"
        raise ValueError(
            f"mpmd.balance: no split into {num_stages} stages keeps the simulated peak "
            f"activation memory of every rank within memory_limit={human_bytes(limit)}; the "
            f"{smallest} peak is {human_bytes(max(best.peak))} ({max(best.peak)} bytes, rank "
            f"{rank}, split_before={_names(profile, best.starts)}); raise memory_limit, use "
            "more stages or ranks, fewer microbatches in flight (OneFOneB rather than GPipe), "
            "or recompute (PipelineRunner(recompute=...))"
        )
    even_eval = sim.evaluate(even)
    bounds = itertools.pairwise([*best.starts, units])
    stage_costs = tuple(
        StageCost(units=profile.units[s:e], forward=f, backward=b, activation_bytes=a)
        for (s, e), (f, b, a) in zip(bounds, sim.stages(best.starts), strict=True)
    )
    return Balance(
        split_before=_names(profile, best.starts),
        predicted_step=best.step,
        stage_costs=stage_costs,
        peak_activation_bytes=list(best.peak),
        even_split_before=_names(profile, even),
        even_step=even_eval.step,
        schedule=schedule,
        num_ranks=num_ranks,
        method=method,
        splits_simulated=len(sim.cache),
        profile=profile,
        timeline=sim.timeline(best.starts),
    )


def _names(profile: Profile, starts: tuple[int, ...]) -> list[str]:
    return [profile.units[s] for s in starts[1:]]


def simulate(
    profile: Profile,
    split_before: Sequence[str],
    *,
    schedule: Schedule | None = None,
    num_ranks: int | None = None,
    bandwidth: float = 0.0,
    latency: float = 0.0,
) -> Timeline:
    """The simulated step of one split of `profile` (units named as in
    `split_before`), priced as `search` prices every split."""
    if isinstance(split_before, str):
        raise TypeError(f"mpmd.balance: split_before must be a list, write [{split_before!r}]")
    unknown = [u for u in split_before if u not in profile.units[1:]]
    if unknown:
        raise ValueError(
            f"mpmd.balance: {unknown[0]!r} is not a unit a stage can start at; the profile's "
            f"units are {', '.join(profile.units[1:])}"
        )
    starts = (0, *(profile.units.index(u) for u in split_before))
    if list(starts) != sorted(set(starts)):
        raise ValueError(
            f"mpmd.balance: split_before={list(split_before)} must name units once each, "
            "in the model's order"
        )
    num_stages = len(starts)
    schedule, num_ranks, spec = _resolve_schedule(schedule, num_stages, num_ranks)
    sim = _Simulator(profile, num_stages, num_ranks, spec, float(bandwidth), float(latency))
    return sim.timeline(starts)


# --------------------------------------------------------------------------- entry point


def balance(
    model: torch.nn.Module,
    example_args: Any,
    num_stages: int,
    *,
    schedule: Schedule | None = None,
    num_ranks: int | None = None,
    memory_limit: float | None = None,
    example_kwargs: dict[str, Any] | None = None,
    bandwidth: float = 0.0,
    latency: float = 0.0,
    loss_fn: LossFn | None = None,
    example_target: Any = None,
    repeats: int = 5,
) -> Balance:
    """Chooses where to cut `model` into `num_stages` stages for `schedule`.

    Profiles the model once on one microbatch (`profile`: per unit forward,
    backward, saved activations, what crosses each cut) and searches the
    splits on the simulator (`search`). `schedule` defaults to
    `OneFOneB(2 * num_stages)`; `num_ranks` to `num_stages` (or half of it for
    a schedule that needs two stages per rank). `memory_limit` caps each
    rank's simulated peak activation bytes; `bandwidth` (bytes/s) and
    `latency` (s) price transfers, which are free by default. `loss_fn` and
    `example_target` (one microbatch's) add the loss to the last stage's cost,
    as the runner computes it there.

    Under torch.distributed (initialised, several processes), call it on
    every rank: rank 0 profiles and searches, and every rank returns its
    result, since timings differ between processes and all ranks must cut
    the model the same way.

        found = mpmd.balance(model, (x,), 4)
        pipe = mpmd.trace(model, (x,), split_before=found.split_before)
    """
    num_stages = _check_num_stages(num_stages)
    _resolve_schedule(schedule, num_stages, num_ranks)  # fail before profiling
    _check_limits(memory_limit, bandwidth, latency)

    def run() -> Balance:
        prof = profile(
            model,
            example_args,
            example_kwargs,
            min_units=num_stages,
            repeats=repeats,
            loss_fn=loss_fn,
            example_target=example_target,
        )
        return search(
            prof,
            num_stages,
            schedule=schedule,
            num_ranks=num_ranks,
            memory_limit=memory_limit,
            bandwidth=bandwidth,
            latency=latency,
        )

    return _on_rank_zero(run)


_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "RuntimeError": RuntimeError,
}


def _on_rank_zero(run: Callable[[], Balance]) -> Balance:
    """`run()` on rank 0 of the default process group, its result (or error) on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return run()
    box: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", run())
        except Exception as err:  # every rank must hear of it, or they wait forever
            error = err
            box[0] = ("error", type(err).__name__, str(err))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    outcome = box[0]
    if outcome[0] == "error":
        raise _ERRORS.get(outcome[1], RuntimeError)(f"{outcome[2]} (on rank 0)")
    result: Balance = outcome[1]
    return result
