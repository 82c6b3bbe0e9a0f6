"""Parallelism inside a pipeline stage, over a DeviceMesh's dimensions other
than the pipeline's "pp": one protocol (`protocol.Parallelism`) that the
runtime drives through the mesh's layout (`layout.Layout`, read once), and
its implementations, each registered with the dimensions it runs over:
data parallelism by replication (`Replicas`, over "dp" or "dp_replicate":
gradients averaged, overlapping the schedule), FSDP2 (`FSDP`, over "dp"
with data_parallel="fsdp", "dp_shard", or both "dp_replicate" and
"dp_shard": HSDP), expert parallelism (`ExpertParallel`, over "ep":
`expert.py`, a mixture of experts' experts sharded, tokens dispatched by
all-to-all) and tensor parallelism (`TensorParallel`, over "tp":
`tensor.py`, the plan's sharding and the stage rewrite, with
`tensor_plan.py`, `tensor_random.py`, `tensor_grads.py`,
`tensor_checks.py`). A parallelism of your own subclasses `Parallelism`
and registers a `Kind` (docs/architecture.md, "Adding a parallelism")."""

from __future__ import annotations

import warnings
from typing import Any

from .expert import ExpertParallel, shard_experts
from .fsdp import FSDP
from .layout import Layout
from .protocol import Asked, Kind, Parallelism, RankStages, kinds, register
from .replicate import Replicas
from .tensor import TensorParallel

__all__ = [
    "FSDP",
    "Asked",
    "ExpertParallel",
    "Kind",
    "Layout",
    "Parallelism",
    "RankStages",
    "Replicas",
    "TensorParallel",
    "kinds",
    "register",
    "shard_experts",
]

# Former names, which were torch's DTensor placement names too.
_RENAMED = {"Replicate": "Replicas", "Shard": "FSDP", "Placement": "RankStages"}


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module 'torchmpmd.parallel' has no attribute {name!r}")
    warnings.warn(
        f"torchmpmd.parallel.{name} is deprecated: it is torchmpmd.parallel.{new} now ({name} "
        "is also a torch.distributed.tensor placement's name)",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[new]
