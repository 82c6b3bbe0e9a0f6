"""Parallelism around the pipeline, over a DeviceMesh's "dp" dimension:
`Replicate` (gradients averaged, overlapping the schedule) and `Shard`
(FSDP2 per stage: sharded between uses, reduce-scattered after each stage's
last backward)."""

from .fsdp import Shard
from .protocol import Placement, StageParallelism, collectives, names, register, wrap
from .replicate import Replicate

__all__ = [
    "Placement",
    "Replicate",
    "Shard",
    "StageParallelism",
    "collectives",
    "names",
    "register",
    "wrap",
]
