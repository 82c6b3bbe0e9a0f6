"""What a data parallelism does to a rank's stages around the schedule: one
small interface (`StageParallelism`) that the runner drives, with
`Replicate` and `Shard` (FSDP2) as its implementations, and `wrap` making
the one a runner's options ask for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .fsdp import Parallelize, Shard
from .replicate import Replicate

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["StageParallelism", "wrap"]


class StageParallelism(Protocol):
    """Called by the runner, in this order, around each step."""

    # The `data_parallel` option that asks for it ("replicate", "fsdp").
    name: str
    # Whether new microbatch shapes (traced again, stages of their own) work.
    allows_new_shapes: bool

    def start_step(self) -> None:
        """Before the schedule (and before split stages are first traced)."""

    def stage_done(self, stage: int) -> None:
        """Right after the task that finishes `stage`'s weight gradients for
        the step (its last B or W), while the rank runs the rest."""

    def finish(self) -> None:
        """After the schedule: every gradient is final when it returns."""

    def after_eval(self) -> None:
        """After a forward-only step."""


def wrap(
    mode: str | None,
    mesh: DeviceMesh | None,
    dp_group: dist.ProcessGroup | None,
    stages: dict[int, torch.nn.Module],
    tied: Iterable[torch.nn.Parameter],
    parallelize: Parallelize | None,
    bucket_bytes: int,
) -> StageParallelism | None:
    """The data parallelism `mode` ("replicate", "fsdp" or None) over the
    mesh's "dp" dimension for this rank's `stages`."""
    tied = list(tied)
    if mode == "replicate" and dp_group is not None:
        return Replicate(
            dp_group, {s: m.parameters() for s, m in stages.items()}, tied, bucket_bytes
        )
    if mode == "fsdp" and mesh is not None:
        return Shard(mesh["dp"], stages, tied, parallelize, bucket_bytes)
    return None
