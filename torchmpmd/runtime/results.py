"""What the ranks share after the schedule, and the collectives on the
gradients and timelines: the step's losses and `eval_step`'s outputs (from
the last stage's rank), the global gradient norm (`clip_grad_norm_`), every
rank's measured timeline (`gather_timeline`)."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from .. import _C
from ..graph.pipe import Pipe
from ..schedule.task import Task
from ..schedule.timeline import COLLECTIVES, EXCHANGES, Timeline, TimelineEvent
from .checks import clip_options
from .collective import Collective
from .microbatch import merge
from .transport import all_gather, broadcast

__all__: list[str] = []

_T = TypeVar("_T")


def done(value: _T | None) -> _T:
    """A per-microbatch result the executor must have filled in."""
    if value is None:
        raise RuntimeError("torchmpmd: a microbatch finished without its result")
    return value


class LossMean(NamedTuple):
    """The loss rank's microbatch losses and their mean, being summed over
    its replicas (`start_loss_mean`)."""

    per_mb: torch.Tensor
    total: torch.Tensor  # this replica's mean; the replicas' sum once `work` is done
    work: dist.Work | None  # None: no replicas
    replicas: int


def start_loss_mean(
    collective: Collective,
    src: int,
    losses: list[torch.Tensor | None],
    device: torch.device,
    replicas: dist.ProcessGroup | None,
) -> LossMean | None:
    """On the last stage's rank `src`: its microbatch losses, and their mean
    started summing over its data-parallel `replicas` (if any) before the
    step's gradient averaging is waited for (on the group's queue behind
    it, so its latency runs under those waits, not after them); None
    elsewhere. Every rank of a replica group holds the same stages: all of
    them start it, or none."""
    if collective.rank != src:
        return None
    # float64 holds a float32 or float64 loss exactly.
    per_mb = torch.stack([done(loss).double() for loss in losses]).to(device)
    total = per_mb.mean().reshape(1)
    if replicas is None:
        return LossMean(per_mb, total, None, 1)
    work = dist.all_reduce(total, group=replicas, async_op=True)
    return LossMean(per_mb, total, work, dist.get_world_size(replicas))


def settle(started: LossMean | None) -> None:
    """Waits for a started loss mean whatever its outcome (a step failing
    before `share_losses`: Gloo aborts the process when a group is
    destroyed with a collective of its own pending)."""
    if started is not None and started.work is not None:
        with contextlib.suppress(RuntimeError):
            started.work.wait()


def share_losses(
    collective: Collective,
    src: int,
    num_microbatches: int,
    device: torch.device,
    started: LossMean | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's per-microbatch losses from the last stage's rank `src`
    (`started` there, by `start_loss_mean`), on every rank, and their mean
    (over every data-parallel shard's too: the global batch's loss)."""
    n = num_microbatches
    if started is not None:
        if started.work is not None:
            started.work.wait()
        both = torch.cat([started.per_mb, started.total / started.replicas])
    else:
        both = torch.empty(n + 1, dtype=torch.float64, device=device)
    broadcast(collective.transport, both, src, collective.timeout, "the step's losses")
    return both[n], both[:n]


def share_outputs(
    collective: Collective,
    src: int,
    pipes: list[Pipe],
    outputs: list[list[Any] | None],
    device: torch.device,
) -> list[torch.Tensor]:
    """The loss rank's merged outputs, on every rank (shapes come from the
    plans of the microbatches' pipes; `check_mergeable` passed them)."""
    specs = [p.stage_specs[p.num_stages - 1] for p in pipes]
    spec = specs[0]
    out = []
    for i, one in enumerate(spec.output_specs[spec.num_sends :]):
        if one is None:  # refused by check_mergeable before the call
            raise RuntimeError("torchmpmd: eval_step reached a model output of no tensor")
        if collective.rank == src:
            t = merge([done(o)[i] for o in outputs]).contiguous()
        else:
            pieces = [s.output_specs[s.num_sends + i] for s in specs]
            rows = sum(p.shape[0] if p is not None and p.shape else 1 for p in pieces)
            shape = (rows, *one.shape[1:]) if one.shape else (rows,)
            t = torch.empty(shape, dtype=one.dtype, device=device)
        what = f"the model output '{spec.output_names[spec.num_sends + i]}'"
        broadcast(collective.transport, t, src, collective.timeout, what)
        out.append(t)
    return out


@torch.no_grad()
def clip_grad_norm(
    collective: Collective,
    counted: list[torch.nn.Parameter],
    params: list[torch.nn.Parameter],
    device: torch.device,
    max_norm: Any,
    norm_type: Any,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """`PipelineRunner.clip_grad_norm_`: the norm over `counted` (each
    parameter once over the pipeline), then every gradient of `params`
    scaled."""
    max_norm, norm_type = clip_options(max_norm, norm_type)
    options = f"max_norm={max_norm!r}, norm_type={norm_type!r}"
    grads = [p.grad for p in counted if p.grad is not None]
    inf = norm_type == float("inf")

    def reduce(tensors: list[torch.Tensor]) -> torch.Tensor:
        norms = torch.stack(
            [torch.linalg.vector_norm(t.double(), norm_type) for t in tensors]
            or [torch.zeros((), dtype=torch.float64, device=device)]
        )
        return norms.max() if inf else norms.pow(norm_type).sum()

    # DTensor gradients (FSDP's over dp, tensor parallelism's over tp): a
    # shard's part is reduced over each mesh dimension the gradient is
    # sharded along; along the others its copies are equal, counted once.
    sharded: dict[tuple[str, ...], list[DTensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            names = g.device_mesh.mesh_dim_names or ()
            # Sharded: any placement but a copy or a partial sum (FSDP's
            # strided shards over a tp shard too).
            dims = tuple(
                names[i]
                for i, p in enumerate(g.placements)
                if not (p.is_replicate() or p.is_partial())
            )
            sharded.setdefault(dims, []).append(g)
    whole = sharded.pop((), [])
    local = reduce([g for g in grads if not isinstance(g, DTensor)] + [g.to_local() for g in whole])
    with collective.call("clip_grad_norm_", options=options):
        # After the check-in: a replica that does not clip fails the check-in
        # instead of leaving this all-reduce waiting.
        for dims, group in sorted(sharded.items()):
            part = reduce([g.to_local() for g in group]).to(device)
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            for dim in dims:
                dist.all_reduce(part, op=op, group=group[0].device_mesh.get_group(dim))
            local = torch.maximum(local, part) if inf else local + part
        parts = all_gather(
            collective.transport,
            local.reshape(1, 1).to(device),
            collective.timeout,
            "the gradients' norms",
        )
    gathered = torch.cat([part.reshape(-1) for part in parts])
    total = gathered.max() if inf else gathered.sum().pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            f"{float(total)}; pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with implicit_replication():  # the factor scales DTensor gradients too
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    dtype = grads[0].dtype if grads else torch.float32
    return total.to(dtype)


def gather_timeline(
    collective: Collective, timeline: Timeline | None, num_ranks: int, device: torch.device
) -> Timeline:
    """`PipelineRunner.gather_timeline`: every rank's last measured timeline."""
    if timeline is None:
        raise RuntimeError("gather_timeline: run a step first")
    # Measured events are tasks, data-parallel collectives and exchanges
    # inside tasks (their labels stay on their rank).
    kinds = [*_C.schedule.TaskKind.__members__, *COLLECTIVES, *EXCHANGES]
    me = collective.rank
    totals = [timeline.peak_activation_bytes[me], *_messages(timeline, me)]
    # float64 holds nanosecond times and byte counts (< 2**53) exactly; the
    # first row carries the rank's peak and message bytes.
    rows: list[list[float]] = [[*totals, 0, 0, 0, 0]]
    for e in timeline.events:
        rows.append(
            [kinds.index(e.kind), e.stage, e.microbatch, e.start, e.end, e.held_bytes, e.kept_bytes]
        )
        # A fused task's parts: a row each after its own, kind -1 - index,
        # with when it ran and its lane where measured (else lane -1).
        spans = e.part_spans or [(0.0, 0.0, -1)] * len(e.sub_tasks)
        rows += [
            [-1 - kinds.index(p.kind), p.stage, p.microbatch, a, b, lane, 0]
            for p, (a, b, lane) in zip(e.sub_tasks, spans, strict=True)
        ]
    table = torch.tensor(rows, dtype=torch.float64, device=device)
    with collective.call("gather_timeline"):
        gathered = all_gather(collective.transport, table, collective.timeout, "the timelines")
        parts = [p.cpu().tolist() for p in gathered]
    events = []
    for rank, part in enumerate(parts):
        rest = part[1:]
        i = 0
        while i < len(rest):
            k, s, mb, start, end, h, b = rest[i]
            sub, spans = [], []
            while i + 1 < len(rest) and rest[i + 1][0] < 0:
                i += 1
                pk, ps, pmb, a, z, lane, _ = rest[i]
                sub.append(Task(kinds[-1 - int(pk)], int(ps), int(pmb)))
                spans.append((a, z, int(lane)))
            i += 1
            measured = tuple(spans) if spans and spans[0][2] >= 0 else ()
            events.append(
                TimelineEvent(
                    rank,
                    kinds[int(k)],
                    int(s),
                    int(mb),
                    start,
                    end,
                    "",
                    int(h),
                    int(b),
                    tuple(sub),
                    measured,
                )
            )
    peaks, sent, received = ([int(part[0][i]) for part in parts] for i in range(3))
    return Timeline(num_ranks, events, "measured", "s", peaks, [], sent, received)


def _messages(timeline: Timeline, rank: int) -> tuple[int, int]:
    """`rank`'s sent and received bytes in `timeline` (-1: not known)."""
    if not timeline.sent_bytes:
        return -1, -1
    return timeline.sent_bytes[rank], timeline.received_bytes[rank]
