"""Running programs (the Python side of `csrc/runtime`): `PipelineRunner`, the
per-step stage callables, microbatching, transports and the in-process harness."""

from .runner import PipelineRunner, StepOutput
from .transport import C10dTransport, LocalWorld, Transport

__all__ = ["C10dTransport", "LocalWorld", "PipelineRunner", "StepOutput", "Transport"]
