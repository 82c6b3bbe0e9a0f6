"""Schedules as data (the Python side of `csrc/schedule`): tasks, schedules and
the built-ins, compiling them into per-rank programs, costs, simulated and
measured timelines, and plots."""

from . import builtins
from .costs import Costs
from .program import Program, StageCollectives, compile_schedule
from .task import Schedule, Task
from .timeline import Timeline, TimelineEvent

__all__ = [
    "Costs",
    "Program",
    "Schedule",
    "StageCollectives",
    "Task",
    "Timeline",
    "TimelineEvent",
    "builtins",
    "compile_schedule",
]
