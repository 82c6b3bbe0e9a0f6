"""torchmpmd: MPMD pipeline parallelism for PyTorch.

pipe = mpmd.trace(model, example_args, split_before=["layers.4"])
print(pipe)                      # stages, transfers, tied parameters
"""

import torch  # noqa: F401  (loads libtorch before the native core)

from . import (
    _C,
    schedules,
)
from ._frontend import trace
from ._markers import mark_stage_end
from ._pipe import Pipe
from ._runner import PipelineRunner, StepOutput
from ._schedule import Program, Schedule, Task, compile_schedule
from ._timeline import Timeline, TimelineEvent

# A step failed: a peer died or stalled, a task raised, or a microbatch did not
# match the plan. The message names rank, peer, stage, microbatch and task.
PipelineError = _C.runtime.PipelineError
PipelineError.__module__ = "torchmpmd"

__all__ = [
    "Pipe",
    "PipelineError",
    "PipelineRunner",
    "Program",
    "Schedule",
    "StepOutput",
    "Task",
    "Timeline",
    "TimelineEvent",
    "compile_schedule",
    "mark_stage_end",
    "schedules",
    "trace",
]

__version__ = "0.1.0"
