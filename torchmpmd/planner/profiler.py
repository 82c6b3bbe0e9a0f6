"""Profiling a model on one microbatch: per unit forward and backward time,
the activation bytes autograd saves, and what crosses between units."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..graph.frontend import _check_signature, trace
from ..graph.inputs import example_inputs
from ..graph.markers import _tracing
from ..graph.pipe import Pipe
from .results import Profile, UnitTransfer
from .split_profile import (
    StageTimes,
    evict_caches,
    evicting,
    saved_bytes,
    stage_times,
    storage_of,
)
from .units import Recorder, candidate_units

__all__ = ["LossFn", "profile"]


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
        caller: str = "mpmd.balance",
    ) -> None:
        self.model = model
        self.caller = caller
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

    def cold(self) -> contextlib.AbstractContextManager[None]:
        """Where W and gradient additions are timed from cold caches (CPU)."""
        return contextlib.nullcontext() if self.cuda_devices else evicting()

    def forward(self) -> Any:
        """The model's forward, then the loss (the last stage computes it)."""
        out = self.model(*self.args, **self.kwargs)
        if self.loss is None:
            return out
        loss_fn, target = self.loss
        if target is not None:
            return loss_fn(out, target)
        try:  # a loss may read no target (`lambda out, _: out.loss`), as the runner allows
            return loss_fn(out, None)
        except Exception as err:
            raise TypeError(
                f"{self.caller}: loss_fn(output, target) failed with no example_target "
                f"({type(err).__name__}: {err}); pass example_target=..., one microbatch's "
                "target (the rows of example_args), as the runner's step gets target=..."
            ) from err

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
            key, size = storage_of(t)
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
    args, kwargs = example_inputs("mpmd.balance", example_args, example_kwargs)
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
    split_backward: bool = False,
    selective: bool = False,
    traceable: bool = False,
    caller: str = "mpmd.balance",
) -> Profile:
    """Measures the candidate units of `model` on one microbatch.

    One forward and backward records the module calls (`candidate_units`
    picks the units, at least `min_units` where the model allows) and warms
    up; one more records the activation bytes autograd saves in each unit
    (`saved_tensors_hooks`; parameters and buffers are not activations);
    then `repeats` passes are timed and each unit gets its median. With
    `loss_fn`, the last unit also computes `loss_fn(output, example_target)`
    (as the last stage does) and the backward starts from the loss;
    otherwise from gradients of ones on the model's outputs.
    A trace of the model cut at every unit gives what crosses each cut,
    and the activation bytes: what each unit's traced graph saves, as the
    runtime's stages run those graphs (the hooks' where it does not trace).
    With `split_backward`, every unit is also timed as a stage on the graphs
    the runtime runs (`split_profile`): F, B, and the split backward's I and
    W apart from B; those times are the profile's (the hooks' are kept only
    where the model cannot be traced at every unit). With `selective`, the
    unit-stages are timed that way too, and once more under selective
    recompute (`Profile.selective`, what the planner weighs against a
    memory limit). With `traceable`, a model `mpmd.trace` cannot trace at
    all fails with the trace's error before the timed passes (`caller`
    starts the messages about the loss and the trace).
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
    prof = _Profiler(model, args, kwargs, loss, caller)
    with torch.random.fork_rng(devices=prof.cuda_devices), _buffers_restored(model):
        recorder = Recorder(model)
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
        units = candidate_units(model, recorder.calls, min_units)
        # Traced before the timed passes, so that an untraceable model fails first.
        traced = _traced_transfers(model, args, kwargs, units)
        if traced is None and traceable:
            _check_traceable(model, args, kwargs, caller)
        sizes = prof.run(units, saved=True)
        passes = [prof.run(units, saved=False) for _ in range(repeats)]
    forward, backward = _median_times(units, passes)
    activation = [sizes.saved.get(k, 0) for k in range(len(units))]

    graph_times: list[StageTimes] | None = None
    selective_times: list[StageTimes] | None = None
    if traced is None:  # not traceable at every unit: the bytes each unit reads
        kept = units
        transfers = tuple(
            UnitTransfer(src=k - 1, dst=(k,), bytes=sizes.input_bytes.get(k, 0))
            for k in range(1, len(units))
        )
        tied: tuple[tuple[tuple[int, ...], int], ...] = ()
    else:
        kept, transfers, tied, pipe = traced
        if split_backward or selective:
            with (
                torch.random.fork_rng(devices=prof.cuda_devices),
                _buffers_restored(model),
                prof.cold(),
            ):
                graph_times = stage_times(pipe, args, kwargs, repeats, prof.sync, loss)
        if selective and graph_times is not None:
            with torch.random.fork_rng(devices=prof.cuda_devices), _buffers_restored(model):
                selective_times = stage_times(
                    pipe, args, kwargs, repeats, prof.sync, loss, selective=True
                )
    owner: list[int] = []  # a unit that cannot start a stage joins the one before
    for u in units:
        owner.append(kept.index(u) if u in kept else owner[-1])

    def merged(values: Sequence[float]) -> list[float]:
        out = [0.0] * len(kept)
        for k, v in enumerate(values):
            out[owner[k]] += v
        return out

    unit_params = _unit_parameters(model, kept, None if traced is None else traced[3])
    held = tuple(sum(p.numel() * p.element_size() for p in group) for group in unit_params)
    with prof.cold():
        accumulate = _accumulate_times(unit_params, repeats, prof.sync)
    if graph_times is None:
        # The bytes the runtime's stages save: their traced graphs', where
        # the model traces at every unit (its aten ops may save more than
        # the eager modules the hooks saw); else the hooks'.
        graph_bytes = None
        if traced is not None:
            with torch.random.fork_rng(devices=prof.cuda_devices), _buffers_restored(model):
                graph_bytes = saved_bytes(traced[3], args, kwargs, loss)
        return Profile(
            units=tuple(kept),
            forward=tuple(merged(forward)),
            backward=tuple(merged(backward)),
            activation_bytes=tuple(
                int(v) for v in (graph_bytes if graph_bytes is not None else merged(activation))
            ),
            transfers=transfers,
            tied=tied,
            parameter_bytes=held,
            accumulate=accumulate,
        )
    # Every time and activation from the traced unit-stages, as the
    # runtime runs them.
    found = _from_stages(kept, graph_times, transfers, tied, selective_times)
    return dataclasses.replace(found, parameter_bytes=held, accumulate=accumulate)


def _unit_parameters(
    model: torch.nn.Module, units: Sequence[str], pipe: Pipe | None
) -> list[list[torch.Tensor]]:
    """The parameters each unit holds: its stage's in the pipe cut at every
    unit (a tied parameter in each stage that uses it, as the runtime places
    it); untraced, its module's, and those of no unit with the first."""
    if pipe is not None and pipe.num_stages == len(units):
        return [list(pipe.stage(i).parameters()) for i in range(pipe.num_stages)]
    held: list[list[torch.Tensor]] = [[] for _ in units]
    for name, p in model.named_parameters():
        owner = max(
            (k for k, u in enumerate(units) if u == "" or name.startswith(u + ".")),
            default=0,
            key=lambda k: len(units[k]),
        )
        held[owner].append(p)
    return held


def _accumulate_times(
    params: list[list[torch.Tensor]], repeats: int, sync: Callable[[], None]
) -> tuple[float, ...]:
    """Per unit, the seconds to add one microbatch's weight gradients into
    those earlier microbatches left (`p.grad.add_(g)` per parameter, as the
    split W and autograd's AccumulateGrad do), median of `repeats` after a
    warm-up; the first microbatch of a step takes its gradients as they are.
    On CPU (within `evicting()`) each pass starts from cold caches, as in a
    step, where other tasks run between two microbatches' additions."""
    out = []
    for group in params:
        if not group:
            out.append(0.0)
            continue
        into = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in group]
        grads = [torch.ones_like(g) for g in into]
        times = []
        for r in range(repeats + 1):
            evict_caches()
            sync()
            start = time.perf_counter()
            for a, g in zip(into, grads, strict=True):
                a.add_(g)
            sync()
            if r:
                times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return tuple(out)


def _from_stages(
    units: Sequence[str],
    times: Sequence[StageTimes],
    transfers: tuple[UnitTransfer, ...],
    tied: tuple[tuple[tuple[int, ...], int], ...],
    selective: Sequence[StageTimes] | None = None,
) -> Profile:
    return Profile(
        units=tuple(units),
        forward=tuple(t.forward for t in times),
        backward=tuple(t.backward for t in times),
        activation_bytes=tuple(t.saved_bytes for t in times),
        transfers=transfers,
        tied=tied,
        input_grad=tuple(t.input_grad for t in times),
        weight_grad=tuple(t.weight_grad for t in times),
        weight_grad_bytes=tuple(t.kept_for_w_bytes for t in times),
        selective=_from_stages(units, selective, transfers, tied) if selective else None,
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


def _check_traceable(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], caller: str
) -> None:
    """Raises the error of `mpmd.trace` on the whole model, if it has one
    (the trace cut at every unit can fail where the whole model traces)."""
    try:
        trace(model, args, kwargs)
    except (ValueError, TypeError, RuntimeError) as err:
        kind = next(k for k in (ValueError, TypeError, RuntimeError) if isinstance(err, k))
        raise kind(
            f"{caller}: the split it chooses is for mpmd.trace, which fails on this model: {err}"
        ) from err


def _traced_transfers(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    units: Sequence[str],
) -> (
    tuple[list[str], tuple[UnitTransfer, ...], tuple[tuple[tuple[int, ...], int], ...], Pipe] | None
):
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
        return [units[0], *points], transfers, tied, pipe
    return None
