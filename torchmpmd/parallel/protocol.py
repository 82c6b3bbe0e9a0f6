"""What a data parallelism does to a rank's stages around the schedule: one
small interface (`StageParallelism`) that the runner drives, with
`Replicate` and `Shard` (FSDP2) as its implementations, and `wrap` making
the one a runner's options ask for."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..schedule.program import StageCollectives
from .fsdp import Parallelize, Shard
from .replicate import Replicate

__all__ = ["Placement", "StageParallelism", "collectives", "names", "register", "wrap"]


class StageParallelism(Protocol):
    """Called by the runner, in this order, around each step. `unshard` and
    `reduce_grads` run inside the schedule, where the program has them (its
    `collectives`), so the simulator sees them too."""

    # The `data_parallel` option that asks for it ("replicate", "fsdp").
    name: str
    # Whether new microbatch shapes (traced again, stages of their own) work.
    allows_new_shapes: bool

    def start_step(self) -> None:
        """Before the schedule."""

    def unshard(self, stage: int) -> None:
        """Before `stage`'s first task of the step (with `collectives.unshard`),
        and before split stages are first traced; gathering twice is a no-op."""

    def reduce_grads(self, stage: int) -> None:
        """Right after the task that finishes `stage`'s weight gradients for
        the step (its last B or W), while the rank runs the rest (with
        `collectives.reduce_grads`)."""

    def finish(self) -> None:
        """After the schedule: every gradient is final when it returns."""

    def after_eval(self) -> None:
        """After a forward-only step."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a parallelism wraps a rank's stages: what its factory is given."""

    mesh: DeviceMesh
    dp_group: dist.ProcessGroup  # the mesh's "dp" dimension
    stages: dict[int, torch.nn.Module]  # this rank's stages, by index
    # The local copies of tied parameters: the pipeline sums their gradients
    # across stages itself, so a parallelism keeps them whole.
    tied: list[torch.nn.Parameter]
    parallelize: Parallelize | None  # the user's own sharding function
    bucket_bytes: int


Factory = Callable[[Placement], StageParallelism]

# The `data_parallel` options, each with what makes it and the collectives
# its stages get in the program.
_KINDS: dict[str, tuple[Factory, StageCollectives]] = {}


def register(name: str, factory: Factory, stage_collectives: StageCollectives) -> None:
    """Makes `RunnerOptions(data_parallel=name)` wrap the stages with
    `factory(placement)`, and put `stage_collectives` (which the
    parallelism's `unshard` / `reduce_grads` run) in every stage's program."""
    _KINDS[name] = (factory, stage_collectives)


def names() -> list[str]:
    """The `data_parallel` options there are, in the order they were registered."""
    return list(_KINDS)


def collectives(mode: str) -> StageCollectives:
    """What the data parallelism `mode` puts in its stages' programs."""
    return _KINDS[mode][1]


register(
    "replicate",
    lambda p: Replicate(
        p.dp_group, {s: m.parameters() for s, m in p.stages.items()}, p.tied, p.bucket_bytes
    ),
    Replicate.collectives,
)
register(
    "fsdp",
    lambda p: Shard(p.mesh["dp"], p.stages, p.tied, p.parallelize, p.bucket_bytes),
    Shard.collectives,
)


def wrap(
    mode: str | None,
    mesh: DeviceMesh | None,
    dp_group: dist.ProcessGroup | None,
    stages: dict[int, torch.nn.Module],
    tied: Iterable[torch.nn.Parameter],
    parallelize: Parallelize | None,
    bucket_bytes: int,
) -> StageParallelism | None:
    """The data parallelism `mode` (a registered name, or None) over the
    mesh's "dp" dimension for this rank's `stages`."""
    if mode is None or mesh is None or dp_group is None:
        return None
    placement = Placement(mesh, dp_group, stages, list(tied), parallelize, bucket_bytes)
    return _KINDS[mode][0](placement)
