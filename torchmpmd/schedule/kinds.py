"""The native task-kind table (csrc/schedule/task_kinds.cpp), read once:
what each kind of task does. Python code asks it by what a kind does
(recomputes, splits the backward) instead of naming letters, so a new kind
is described in the table alone."""

from __future__ import annotations

from .. import _C

__all__ = [
    "BACKWARD",
    "RECOMPUTE",
    "TABLE",
    "WHOLE_BACKWARD",
    "part_of_backward",
    "recomputes",
    "waits_for_recompute",
]

# By letter, in the table's order.
TABLE: dict[str, _C.schedule.TaskKindInfo] = {k.letter: k for k in _C.schedule.task_kind_table()}
WHOLE_BACKWARD = 3  # BackwardPart::kWholeBackward: input and weight gradients

# The kind that runs a stage's forward (also in forward-only steps).
FORWARD: str = next(k.letter for k in TABLE.values() if k.in_forward_only)
# The kind that runs a stage's forward again for its backward.
RECOMPUTE: str = next(k.letter for k in TABLE.values() if k.recomputes)
# The kind that runs a stage's whole backward (input and weight gradients).
BACKWARD: str = next(k.letter for k in TABLE.values() if k.backward_parts == WHOLE_BACKWARD)
INPUT_PART = 1  # BackwardPart::kInputGradPart


def recomputes(kind: str) -> bool:
    """Whether `kind` runs the forward again (activation checkpointing)."""
    return TABLE[kind].recomputes


def part_of_backward(kind: str) -> bool:
    """Whether `kind` computes part of a backward only (I, W): its stage must
    be split into input- and weight-gradient graphs."""
    return 0 < TABLE[kind].backward_parts < WHOLE_BACKWARD


def waits_for_recompute(kind: str) -> bool:
    """Whether `kind` waits for its (stage, microbatch)'s recompute when the
    schedule has one (the backward kinds that read what the forward kept)."""
    return RECOMPUTE in TABLE[kind].after_own
