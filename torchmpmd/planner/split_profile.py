"""What the split backward costs, unit by unit: B, I and W of each stage of a
pipe cut at every unit, timed with the graphs the runtime runs.

A zero-bubble schedule replaces each B with an I (input gradients) and a W
(weight gradients). Whether that pays off depends on what I + W cost against
B on the model at hand: the split graphs dispatch their ops from Python, I
keeps what W needs alive, and W reads it cold, so on some models I + W is a
few percent over B, more than the bubble it fills. Deriving I and W from B
(I = W = B / 2) hides that; these are measured. Each unit is traced alone as
a stage (`mpmd.trace` cut before every unit), given the inputs the whole
model computes for it, and timed as autograd's F and B on the stage's
traced graph (the aten ops the runtime dispatches, which cost more than the
eager module's calls on small layers) and as the `SplitStage` I / W graphs
the runtime builds, in turns.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint

from ..graph.pipe import Pipe, StageSpec
from ..graph.split import SplitStage, selective_recompute_context
from ..graph.stage import as_stage

__all__: list[str] = []


class StageTimes(NamedTuple):
    """One unit-stage measured: seconds of F, B, I and W (medians), the
    bytes its forward saves for the backward, and the bytes I keeps for W
    (what the stage holds between its I and its W: the forward's tensors W
    reads and the output gradients I computed for it)."""

    forward: float
    backward: float
    input_grad: float
    weight_grad: float
    saved_bytes: int
    kept_for_w_bytes: int


def _last_level_cache_bytes() -> int:
    """The CPU's largest cache (bytes), from sysfs; 32 MiB where not told."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 * 2**20)


_EVICTING: list[torch.Tensor] = []


@contextlib.contextmanager
def evicting() -> Iterator[None]:
    """Within it (a CPU profile), `evict_caches` writes a buffer of twice
    the CPU's last-level cache (64-256 MiB), allocated once and freed at
    its end; outside it (a GPU profile) `evict_caches` does nothing."""
    size = min(max(2 * _last_level_cache_bytes(), 64 * 2**20), 256 * 2**20)
    _EVICTING.append(torch.empty(size // 4, dtype=torch.float32))
    try:
        yield
    finally:
        _EVICTING.pop()


def evict_caches() -> None:
    """Within `evicting()`, writes its buffer, so that what a timed pass
    reads next comes from memory, as in a pipeline, where other
    microbatches' tasks run between a stage's W and what it reads (its
    forward's tensors, the gradients it adds into)."""
    if _EVICTING:
        _EVICTING[-1].fill_(1.0)


def storage_of(t: torch.Tensor) -> tuple[int, int]:
    """A saved tensor's storage (key, bytes): views of one storage count once."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # no plain storage
        return id(t), t.numel() * t.element_size()


def stage_times(
    pipe: Pipe,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    repeats: int,
    sync: Callable[[], None],
    loss: tuple[Callable[[Any, Any], torch.Tensor], Any] | None = None,
    selective: bool = False,
) -> list[StageTimes] | None:
    """Per stage of `pipe`: F, B, I and W seconds, each timed apart (medians
    of `repeats`) on the stage's traced graph, as the runtime runs it, the
    bytes its autograd forward saves for the backward and those its I keeps
    for its W (parameters and buffers apart); with `loss` (loss_fn, target) the last stage computes
    the loss too, as the runtime's last stage does. None where a stage
    cannot be split (its shapes depend on the data): such a stage runs B
    under every schedule. With `selective`, each stage runs as under
    `RunnerOptions(recompute="selective")`: its autograd forward inside
    `torch.utils.checkpoint` with the runtime's selective policy, its split
    graphs traced selective, and the bytes are what its split F keeps (the
    kept ops' outputs and the inputs the backward reads)."""
    flat = [
        v.contiguous() if isinstance(v, torch.Tensor) else v
        for v in pipe.flatten_inputs(args, kwargs)
    ]
    env = {n: v for n, v in zip(pipe.input_node_names, flat, strict=True) if n is not None}
    grad_values = {t.value for t in pipe.transfers if t.requires_grad}
    out: list[StageTimes] = []
    last = pipe.num_stages - 1
    for k, spec in enumerate(pipe.stage_specs):
        stage = pipe.stage(k)
        values = [env[n] for n in spec.input_names]
        with torch.no_grad():
            outputs = stage(*values)
        env.update(zip(spec.output_names, outputs, strict=True))
        gm = as_stage(stage).graph_module
        if gm is None:  # no graph to cut into I / W
            return None
        received = dict(
            zip(range(spec.num_user_inputs, len(values)), spec.recv_values, strict=True)
        )
        finish = _with_loss(pipe, spec, dict(env), loss if k == last else None)
        times = _stage_times(
            gm, values, received, grad_values, finish, repeats, sync, selective=selective
        )
        if times is None:
            return None
        out.append(times)
    return out


def saved_bytes(
    pipe: Pipe,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss: tuple[Callable[[Any, Any], torch.Tensor], Any] | None = None,
) -> list[int]:
    """Per stage of `pipe`, the bytes its traced graph's autograd forward
    saves for the backward (parameters and buffers apart), as the runtime's
    stages save them: the stages run one after the other on one autograd
    graph, untimed, and a tensor two stages save counts in the first (as in
    a stage holding both). The traced graph's aten ops may save more than
    the eager modules do (a matmul's reshaped copies)."""
    flat = [
        v.contiguous() if isinstance(v, torch.Tensor) else v
        for v in pipe.flatten_inputs(args, kwargs)
    ]
    env = {n: v for n, v in zip(pipe.input_node_names, flat, strict=True) if n is not None}
    counted: set[int] = set()
    for k in range(pipe.num_stages):
        stage = pipe.stage(k)
        counted |= {t.untyped_storage().data_ptr() for t in [*stage.parameters(), *stage.buffers()]}
    out: list[int] = []
    last = pipe.num_stages - 1
    with torch.enable_grad():
        for k, spec in enumerate(pipe.stage_specs):
            saved = _Saved(counted)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, _same):
                outputs = pipe.stage(k)(*(env[n] for n in spec.input_names))
                env.update(zip(spec.output_names, outputs, strict=True))
                if k == last and loss is not None:
                    _with_loss(pipe, spec, dict(env), loss)(outputs)
            counted.update(saved.sizes)
            out.append(saved.total)
    return out


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _Saved:
    """Bytes of the distinct storages packed, but those in `fixed` (a
    module's parameters and buffers, or what was counted before)."""

    def __init__(self, fixed: set[int]) -> None:
        self._fixed = fixed
        self.sizes: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key, size = storage_of(t)
        if key not in self._fixed:
            self.sizes[key] = size
        return t

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def _with_loss(
    pipe: Pipe,
    spec: StageSpec,
    env: dict[str, Any],
    loss: tuple[Callable[[Any, Any], torch.Tensor], Any] | None,
) -> Callable[[Sequence[Any]], list[torch.Tensor]]:
    """A stage's tensor outputs, or on the last stage (given `loss`) its sends
    and the loss of the model's outputs."""

    def finish(outs: Sequence[Any]) -> list[torch.Tensor]:
        if loss is None:
            return [o for o in outs if isinstance(o, torch.Tensor)]
        local = dict(env)
        local.update(zip(spec.output_names, outs, strict=True))
        value = loss[0](pipe.unflatten_outputs(local), loss[1])
        sends = [o for o in outs[: spec.num_sends] if isinstance(o, torch.Tensor)]
        return [*sends, value]

    return finish


def _stage_times(
    gm: torch.fx.GraphModule,
    values: list[Any],
    received: dict[int, int],
    grad_values: set[int],
    finish: Callable[[Sequence[Any]], list[torch.Tensor]],
    repeats: int,
    sync: Callable[[], None],
    *,
    selective: bool,
) -> StageTimes | None:
    slots = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    xs = [values[i] for i in slots]
    grad_inputs = [
        j
        for j, i in enumerate(slots)
        if received.get(i) in grad_values and values[i].is_floating_point()
    ]
    param_names = [n for n, _ in gm.named_parameters()]
    buffer_names = [n for n, _ in gm.named_buffers()]

    def fn(
        params: list[torch.Tensor], buffers: list[torch.Tensor], tensors: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        state = dict(zip(param_names, params, strict=True))
        state.update(zip(buffer_names, buffers, strict=True))
        call = list(values)
        for slot, x in zip(slots, tensors, strict=True):
            call[slot] = x
        return finish(torch.func.functional_call(gm, state, tuple(call)))

    try:
        split = SplitStage(gm, fn, xs, grad_inputs, None, selective=selective)
    except (ValueError, RuntimeError):  # data-dependent shapes: B only
        return None
    with torch.no_grad():
        tensor_outs = finish(gm(*values))
    grads = [torch.ones_like(o) if o.is_floating_point() else None for o in tensor_outs]
    params = list(gm.parameters())
    kept = [p.grad for p in params]

    fixed = {t.untyped_storage().data_ptr() for t in [*params, *gm.buffers()]}
    saved, for_w_saved = _Saved(fixed), _Saved(fixed)

    def full(count: bool = False) -> tuple[float, float]:
        leaves = [x.detach().requires_grad_(j in grad_inputs) for j, x in enumerate(xs)]
        call = list(values)
        for slot, x in zip(slots, leaves, strict=True):
            call[slot] = x
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(saved.pack, _same)
            if count
            else contextlib.nullcontext()
        )
        sync()
        start = time.perf_counter()
        with torch.enable_grad(), hooks:
            if selective:  # as the runtime's stage call under selective recompute
                raw = torch.utils.checkpoint.checkpoint(
                    gm, *call, use_reentrant=False, context_fn=selective_recompute_context
                )
                outs = finish(raw)
            else:
                outs = finish(gm(*call))
        sync()
        forward = time.perf_counter() - start
        pairs = [
            (o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad
        ]
        if not pairs:
            return forward, 0.0
        sync()
        start = time.perf_counter()
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        sync()
        return forward, time.perf_counter() - start

    def halves(count: bool = False) -> tuple[float, float]:
        kept_by_f = split.forward(xs)
        if count and selective:  # what the selective F keeps for I and W
            for t in kept_by_f[len(tensor_outs) :]:
                saved.pack(t)
        sync()
        start = time.perf_counter()
        _, for_w = split.input_grad(kept_by_f[len(tensor_outs) :], grads)
        sync()
        i_time = time.perf_counter() - start
        if count:  # what the stage holds from its I to its W
            for t in for_w:
                for_w_saved.pack(t)
        evict_caches()  # a zero-bubble W runs later, its tensors out of cache
        start = time.perf_counter()
        split.weight_grad(for_w)
        sync()
        return i_time, time.perf_counter() - start

    f: list[float] = []
    b: list[float] = []
    i: list[float] = []
    w: list[float] = []
    try:
        for r in range(repeats + 1):  # the first round warms up
            for p in params:
                p.grad = None
            tf, tb = full(count=r == 0 and not selective)
            for p in params:
                p.grad = None
            ti, tw = halves(count=r == 0)
            if r:
                f.append(tf)
                b.append(tb)
                i.append(ti)
                w.append(tw)
    finally:
        for p, g in zip(params, kept, strict=True):
            p.grad = g
    return StageTimes(
        statistics.median(f),
        statistics.median(b),
        statistics.median(i),
        statistics.median(w),
        saved.total,
        for_w_saved.total,
    )
