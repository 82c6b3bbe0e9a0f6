"""Test helpers: `LocalPipeline` runs every rank of a pipeline as a thread of
this process (defined in `torchmpmd.runtime.local`)."""

from .runtime.local import LocalPipeline

__all__ = ["LocalPipeline"]
