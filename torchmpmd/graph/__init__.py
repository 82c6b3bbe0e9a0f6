"""From a model to stages (the Python side of `csrc/graph`): tracing, stage
markers, the typed stage plan, `Pipe`, and the split (I/W) backward graphs."""

from .eager import from_stages
from .frontend import trace
from .markers import mark_stage_end
from .pipe import Pipe, StageSpec, TensorSpec, TransferInfo

__all__ = [
    "Pipe",
    "StageSpec",
    "TensorSpec",
    "TransferInfo",
    "from_stages",
    "mark_stage_end",
    "trace",
]
