"""Gantt charts of timelines (`mpmd.viz.plot`); defined in `torchmpmd.schedule.viz`."""

from .schedule.viz import plot

__all__ = ["plot"]
