"""Running programs (the Python side of `csrc/runtime`): `PipelineRunner`, the
per-step stage callables, microbatching, transports and the in-process harness."""

from .options import RunnerOptions
from .runner import PipelineRunner, StepOutput
from .transport import C10dTransport, LocalWorld, Transport
from .tune import CpuTuning, tune_cpu

__all__ = [
    "C10dTransport",
    "CpuTuning",
    "LocalWorld",
    "PipelineRunner",
    "RunnerOptions",
    "StepOutput",
    "Transport",
    "tune_cpu",
]
