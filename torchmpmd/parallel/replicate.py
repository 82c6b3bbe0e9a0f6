"""Data parallelism by replication: each data-parallel rank holds the same
stages, runs its own shard of the global batch, and the gradients are
averaged over the data-parallel group.

The averaging overlaps the schedule: the executor calls `grads_start(s)`
right before the task that finishes stage s's weight gradients for the step
(its last B or W). From then on, as in DDP, each bucket of at most
`bucket_bytes` (the stage's parameters in reverse order, as a backward
reaches them) goes out in one asynchronous all-reduce as soon as that task
has accumulated the last of its gradients, in bucket order on every rank, so
the reduction overlaps the stage's own last backward. `stage_done(s)`, right
after the task, sends the buckets it did not reach (a parameter without a
gradient this microbatch, a weight gradient put in place outside autograd),
while the rank computes its other stages. `finish()` sends the tied
parameters last, after the pipeline has summed their copies (so the average
is of the sums, which is the sum of the averages every holder keeps), waits
for every bucket and writes the averages back.

A bucket carries one flag per parameter besides the gradients: a parameter
no rank computed a gradient for (an unused MoE expert everywhere) keeps
`.grad = None`, as in the unpipelined model; one that some rank did not
reach counts zeros there.

Averaged gradients keep replicas equal only if they start equal: the runner
gives every replica dp rank 0's parameters and buffers (`broadcast_from_first`)
at construction, as DDP does, and again after `init_weights` /
`load_state_dict`, so replicas built from different seeds cannot train apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..graph.pipe import Pipe
from ..schedule.program import StageCollectives
from .protocol import (
    Asked,
    Kind,
    Parallelism,
    RankStages,
    dp_dimension_missing,
    not_sharded_over,
    register,
)

__all__ = ["Replicas", "broadcast_from_first", "local_shard"]

_P = TypeVar("_P", bound=torch.Tensor)

# The first bucket of a stage's gradients in its last backward (DDP's 1 MiB).
FIRST_BUCKET_BYTES = 2**20


@dataclass(slots=True)
class _Bucket:
    params: list[torch.nn.Parameter]
    flat: torch.Tensor  # gradients, then one has-gradient flag per parameter
    work: dist.Work | None


@dataclass(slots=True)
class _Early:
    """A stage's buckets while its last backward runs: each goes out once
    all of its parameters' gradients are final, in order."""

    stage: int
    buckets: list[list[torch.nn.Parameter]]
    waiting: list[int]  # per bucket, its parameters not final yet
    where: dict[int, int]  # id(parameter) -> its bucket
    sent: int = 0  # the buckets before it have gone out
    handles: list[RemovableHandle] = field(default_factory=list)
    final: set[int] = field(default_factory=set)  # id(parameter) of those counted
    # id(parameter) -> its slice of its bucket's buffer, which its gradient
    # is copied into as soon as it is final (while it is still in cache)
    views: dict[int, torch.Tensor] = field(default_factory=dict)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class Replicas(Parallelism):
    """Averages the gradients of this rank's stages over `group` (the mesh's
    `dims`), each replica running its own part of the batch."""

    name = "replicate"
    allows_new_shapes = True
    splits_batch = True
    # Whole stages on every replica: nothing to gather, gradients to average.
    collectives = StageCollectives(unshard=False, reduce_grads=True)

    def __init__(
        self,
        group: dist.ProcessGroup,
        dims: tuple[str, ...] = ("dp",),
        bucket_bytes: int = 25 * 2**20,
        *,
        select: Callable[[torch.nn.Parameter], bool] | None = None,
        divisor: int | None = None,
    ) -> None:
        self._group = group
        self.dims = dims
        self.size = dist.get_world_size(group)
        self.bucket_bytes = bucket_bytes
        # Which parameters of the stages it averages (None: all), and what
        # their sums over the group are divided by (None: the group's size;
        # more where the gradients are sums over more ranks than the group's:
        # experts over the expert-parallel ranks' tokens).
        self._select = select
        self.divisor = divisor or self.size
        self._stage_params: dict[int, list[torch.nn.Parameter]] = {}
        self._tied: list[torch.nn.Parameter] = []
        self._buckets: list[_Bucket] = []
        # Each bucket's flat buffer, kept from step to step (keyed by its
        # parameters): a new one each step was a fresh allocation of the
        # bucket's size, page faults and all (torch.cat: 8 ms a step on 13
        # MiB of gradients against 2 ms for DDP's copies into its own).
        self._flats: dict[tuple[int, ...], torch.Tensor] = {}
        self._early: dict[int, _Early] = {}
        # This step's bytes averaged, and those sent during the backward
        # that made them (step_metrics).
        self._sent_bytes = 0
        self._sent_in_backward = 0

    def groups(self) -> list[dist.ProcessGroup]:
        return [self._group]

    def attach(self, stages: RankStages) -> None:
        """Averages the parameters of `stages.modules` (each once), the tied
        ones last (`finish`)."""
        seen = {id(p) for p in stages.tied}
        for s, module in sorted(stages.modules.items()):
            own = []
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen and self._chosen(p):
                    seen.add(id(p))
                    own.append(p)
            self._stage_params[s] = own
        self._tied = [p for p in _unique(stages.tied) if p.requires_grad and self._chosen(p)]
        self.bucket_bytes = stages.bucket_bytes

    def _chosen(self, p: torch.nn.Parameter) -> bool:
        return self._select is None or self._select(p)

    def start_equal(self, tensors: list[torch.Tensor]) -> None:
        """Replicas start from the first's tensors, as DDP's do."""
        broadcast_from_first(self._group, not_sharded_over(tensors, self.dims), self.bucket_bytes)

    def make_equal(self, tensors: list[torch.Tensor]) -> None:
        self.start_equal(tensors)

    def start_step(self) -> None:
        if self._buckets:  # a step that failed: its averages may still write
            self._flats = {}
        self._buckets = []
        self._sent_bytes = self._sent_in_backward = 0
        self._drop_early()

    def step_metrics(self) -> dict[str, Any]:
        """The gradient bytes each rank averaged in the last step, and how
        many of them left while the backward that made them still ran."""
        return {
            "grad_bytes_averaged": self._sent_bytes,
            "grad_bytes_averaged_in_backward": self._sent_in_backward,
        }

    def _drop_early(self) -> None:
        """Removes the hooks a failed step left."""
        for early in self._early.values():
            early.remove()
        self._early = {}

    def after_eval(self) -> None:
        """Nothing: the replicas hold whole stages."""

    def unshard(self, stage: int) -> None:
        """Nothing: the replicas hold whole stages."""

    def grads_start(self, stage: int) -> None:
        """Sends each bucket of `stage` as soon as the coming task has made
        its gradients final (hooks after each gradient's accumulation)."""
        params = self._stage_params.get(stage, [])
        if self.size == 1 or not params:
            return
        # As DDP's: a small first bucket (the last layers' gradients) leaves
        # early in the backward however small the model.
        buckets = _buckets(
            params[::-1], self.bucket_bytes, min(self.bucket_bytes, FIRST_BUCKET_BYTES)
        )
        early = _Early(
            stage,
            buckets,
            [len(b) for b in buckets],
            {id(p): i for i, b in enumerate(buckets) for p in b},
        )
        for bucket in buckets:
            early.views.update((id(p), view) for p, view in _slices(bucket, self._flat(bucket)))
        self._early[stage] = early
        for p in params:
            hook = p.register_post_accumulate_grad_hook  # untyped in torch
            early.handles.append(hook(lambda param, early=early: self._final(early, param)))  # type: ignore[no-untyped-call]

    def _final(self, early: _Early, p: torch.nn.Parameter) -> None:
        i = early.where[id(p)]
        if i < early.sent:
            # Autograd accumulates a leaf's gradient once per backward; a
            # second time means the task ran two, after the bucket left.
            raise RuntimeError(
                f"torchmpmd: a parameter of stage {early.stage} got its gradient "
                "again after it was sent for averaging over the data-parallel "
                "group: the task that finishes the stage's weight gradients "
                "accumulated it twice"
            )
        if p.grad is not None:
            with torch.no_grad():
                early.views[id(p)].copy_(local_shard(p.grad).reshape(-1))
        if id(p) in early.final:
            return  # accumulated again before its bucket left: the copy is the sum
        early.final.add(id(p))
        early.waiting[i] -= 1
        while early.sent < len(early.buckets) and early.waiting[early.sent] <= 0:
            self._launch_bucket(early.buckets[early.sent], in_backward=True, copied=early.final)
            early.sent += 1

    def reduce_grads(self, stage: int) -> None:
        """Starts averaging `stage`'s gradients (all of this step's are
        final): those its last task did not send already."""
        early = self._early.pop(stage, None)
        if early is None:
            self._launch(self._stage_params.get(stage, []))
            return
        early.remove()
        for bucket in early.buckets[early.sent :]:
            self._launch_bucket(bucket)

    def finish(self, tied: Mapping[int, torch.nn.Parameter] | None = None) -> None:
        """Averages the tied parameters, waits for every bucket, writes back.
        A bucket that failed (a replica failed or left) is raised once every
        bucket's wait has ended: Gloo aborts the process when a group is
        destroyed with a collective of its own still pending."""
        self._launch(self._tied)
        buckets, self._buckets = self._buckets, []
        failed: RuntimeError | None = None
        for bucket in buckets:
            try:
                if bucket.work is not None:
                    bucket.work.wait()
            except RuntimeError as err:
                failed = failed or err
            if failed is None:
                _write_back(bucket, self.divisor)
        if failed is not None:
            self._flats = {}
            raise failed

    def _launch(self, params: list[torch.nn.Parameter]) -> None:
        if self.size == 1:
            if self.divisor != 1:
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            local_shard(p.grad).div_(self.divisor)
            return
        for group in _buckets(params, self.bucket_bytes):
            self._launch_bucket(group)

    def _flat(self, group: list[torch.nn.Parameter]) -> torch.Tensor:
        """The buffer of a bucket: its gradients, then a flag per parameter;
        kept from step to step while the parameters keep their dtype and
        device."""
        locals_ = [local_shard(p) for p in group]
        numel = sum(t.numel() for t in locals_) + len(group)
        key = tuple(id(p) for p in group)
        flat = self._flats.get(key)
        first = locals_[0]
        if flat is None or (flat.numel(), flat.dtype, flat.device) != (
            numel,
            first.dtype,
            first.device,
        ):
            flat = torch.empty(numel, dtype=first.dtype, device=first.device)
            self._flats[key] = flat
        return flat

    def _launch_bucket(
        self,
        group: list[torch.nn.Parameter],
        in_backward: bool = False,
        copied: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        """Sends a bucket: its gradients (those in `copied` are in its buffer
        already), a flag per parameter."""
        flat = self._flat(group)
        with torch.no_grad():
            for p, view in _slices(group, flat):
                if id(p) in copied:
                    continue
                if p.grad is not None:
                    view.copy_(local_shard(p.grad).reshape(-1))
                else:
                    view.zero_()
            flat[-len(group) :].copy_(
                torch.tensor([p.grad is not None for p in group], dtype=flat.dtype)
            )
        work = dist.all_reduce(flat, group=self._group, async_op=True)
        self._buckets.append(_Bucket(group, flat, work))
        nbytes = flat.numel() * flat.element_size()
        self._sent_bytes += nbytes
        if in_backward:
            self._sent_in_backward += nbytes


@torch.no_grad()
def broadcast_from_first(
    group: dist.ProcessGroup, tensors: list[torch.Tensor], bucket_bytes: int = 25 * 2**20
) -> None:
    """Gives every rank of `group` its first rank's `tensors` (in place), as
    DDP does at construction: replicas built apart (seeded by rank) start
    equal. Every rank passes the same tensors in the same order (collective),
    in buckets of at most `bucket_bytes`."""
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    first = dist.get_rank(group) == 0
    for bucket in _buckets([local_shard(t) for t in tensors], bucket_bytes):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.broadcast(flat, src=src, group=group)
        if first:
            continue
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _write_back(bucket: _Bucket, size: int) -> None:
    flags = bucket.flat[-len(bucket.params) :].tolist()
    with torch.no_grad():
        for (p, view), flag in zip(_slices(bucket.params, bucket.flat), flags, strict=True):
            if not flag:
                continue
            local = local_shard(p)
            total = view.view_as(local)
            if p.grad is not None:
                torch.div(total, size, out=local_shard(p.grad))
                continue
            mean = total / size
            if isinstance(p, DTensor):
                p.grad = DTensor.from_local(mean, p.device_mesh, p.placements, run_check=False)
            else:
                p.grad = mean


def _slices(
    group: list[torch.nn.Parameter], flat: torch.Tensor
) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Each parameter of a bucket with its slice of the bucket's buffer."""
    out, offset = [], 0
    for p in group:
        n = local_shard(p).numel()
        out.append((p, flat[offset : offset + n]))
        offset += n
    return out


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (tensor parallelism: the replicas of a
    tp coordinate hold the same shards), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _buckets(params: list[_P], bucket_bytes: int, first_bytes: int | None = None) -> list[list[_P]]:
    """Consecutive runs of parameters of one dtype and device, each at most
    `bucket_bytes` (the first at most `first_bytes`; a larger parameter
    alone)."""
    out: list[list[_P]] = []
    size = 0
    for p in params:
        nbytes = local_shard(p).numel() * p.element_size()
        last = out[-1] if out else None
        cap = first_bytes if len(out) == 1 and first_bytes is not None else bucket_bytes
        if (
            last is None
            or last[0].dtype != p.dtype
            or last[0].device != p.device
            or size + nbytes > cap
        ):
            out.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return out


def _unique(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _claim(names: tuple[str, ...] | None, left: tuple[str, ...], asked: Asked) -> tuple[str, ...]:
    """ "dp" (unless data_parallel asks for another), or torchtitan's
    "dp_replicate" alone (with "dp_shard" it is FSDP's hybrid sharding)."""
    if asked.data_parallel not in (None, Replicas.name):
        return ()
    if names is not None and "ep" in names and "dp" not in left:
        return ()  # expert parallelism runs the data parallelism over its ranks
    if "dp" in left:
        return ("dp",)
    if "dp_replicate" in left and "dp_shard" not in left:
        return ("dp_replicate",)
    if asked.data_parallel is not None and "dp_shard" not in left:  # FSDP's says why
        raise dp_dimension_missing(asked.data_parallel, names)
    return ()


def _make(mesh: DeviceMesh, dims: tuple[str, ...], pipe: Pipe, asked: Asked) -> Replicas:
    return Replicas(mesh[dims[0]].get_group(), dims, asked.bucket_bytes)


register(
    Kind(
        Replicas.name,
        ("dp", "dp_replicate"),
        _claim,
        _make,
        order=10,
        options=("data_parallel",),
    )
)
