"""Parallelism inside and around a pipeline stage, over a DeviceMesh's
dimensions: data parallelism over "dp" (`Replicate`: gradients averaged,
overlapping the schedule; `Shard`: FSDP2 per stage, sharded between uses,
reduce-scattered after each stage's last backward), the protocol the runner
drives them through (`protocol.py`), and tensor parallelism over "tp"
(`tensor.py`: a plan's sharding and the stage rewrite; `tensor_random.py`,
`tensor_grads.py`, `tensor_checks.py`)."""

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
