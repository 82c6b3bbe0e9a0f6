"""Parallelism around the pipeline: data parallelism over a DeviceMesh's
"dp" dimension (`Replicate`: gradients averaged, overlapping the schedule)."""

from .replicate import Replicate

__all__ = ["Replicate"]
