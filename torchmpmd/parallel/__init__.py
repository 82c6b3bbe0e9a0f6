"""Parallelism around the pipeline, over a DeviceMesh's "dp" dimension:
`Replicate` (gradients averaged, overlapping the schedule) and `Shard`
(FSDP2 per stage: sharded between uses, reduce-scattered after each stage's
last backward)."""

from .fsdp import Shard
from .protocol import StageParallelism, wrap
from .replicate import Replicate

__all__ = ["Replicate", "Shard", "StageParallelism", "wrap"]
