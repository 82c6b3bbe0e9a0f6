"""torchmpmd: MPMD pipeline parallelism for PyTorch.

pipe = mpmd.trace(model, example_args, split_before=["layers.4"])
print(pipe)                                  # stages, transfers, tied parameters
runner = mpmd.PipelineRunner(pipe, mpmd.schedules.OneFOneB(8), loss_fn=loss_fn)
out = runner.step(batch, target=labels)      # on every rank, under torchrun

The subpackages mirror the native layers: `graph` (tracing, the stage plan,
`Pipe`), `schedule` (tasks, schedules, programs, costs, timelines) and
`runtime` (the runner, transports, the in-process harness); above them,
`planner` (`balance`, `plan`, `project`: where to cut a model, the whole
plan, a cluster's step), `parallel` (what happens to a stage inside and around
the schedule: data and tensor parallelism) and `checkpoint`.
"""

import torch  # noqa: F401  (loads libtorch before the native core)

from . import _C, checkpoint, schedules, viz
from . import job_probe as _job_probe  # noqa: F401  (mpmd.plan steps layouts through it)
from .build import build
from .graph import Pipe, from_stages, mark_stage_end
from .planner import (
    Balance,
    ClusterCandidate,
    ClusterPlan,
    Layout,
    Link,
    Links,
    Machine,
    Plan,
    Projection,
    TransformerShape,
    balance,
    calibrate,
    plan,
    project,
    search_cluster,
    trace,
)
from .refine import refine
from .runtime import CpuTuning, PipelineRunner, RunnerOptions, StepOutput, tune_cpu
from .schedule import (
    Costs,
    Program,
    Schedule,
    StageCollectives,
    Task,
    Timeline,
    TimelineEvent,
    compile_schedule,
)
from .version import __version__

# A step failed: a peer died or stalled, a task raised, or a microbatch did not
# match the plan. The message names rank, peer, stage, microbatch and task.
PipelineError = _C.runtime.PipelineError
PipelineError.__module__ = "torchmpmd"

__all__ = [
    "Balance",
    "ClusterCandidate",
    "ClusterPlan",
    "Costs",
    "CpuTuning",
    "Layout",
    "Link",
    "Links",
    "Machine",
    "Pipe",
    "PipelineError",
    "PipelineRunner",
    "Plan",
    "Program",
    "Projection",
    "RunnerOptions",
    "Schedule",
    "StageCollectives",
    "StepOutput",
    "Task",
    "Timeline",
    "TimelineEvent",
    "TransformerShape",
    "__version__",
    "balance",
    "build",
    "calibrate",
    "checkpoint",
    "compile_schedule",
    "from_stages",
    "mark_stage_end",
    "plan",
    "project",
    "refine",
    "schedules",
    "search_cluster",
    "trace",
    "tune_cpu",
    "viz",
]
