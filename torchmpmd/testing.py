"""Test helpers: `LocalPipeline` runs every rank of a pipeline as a thread of
this process (defined in `torchmpmd.runtime.local`).

Fault injection goes through a public hook, never the runner's private
state: `LocalPipeline(..., wrap_stage=fn)` (or, for one `PipelineRunner`,
`options=mpmd.RunnerOptions(wrap_stage=fn)`), where `fn(rank, stage,
forward)` returns what runs in place of that stage's forward on that rank.
"""

from .runtime.local import LocalPipeline

__all__ = ["LocalPipeline"]
