"""Schedules as data: tasks and per-rank task lists."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .. import _C

__all__ = ["Schedule", "Task"]

Kind = str
# The task kinds the native core defines (its task-kind table), by letter.
_KINDS = tuple(_C.schedule.TaskKind.__members__)


@dataclass(frozen=True, slots=True)
class Task:
    """One piece of work: forward (F), full backward (B), input-grad (I) or
    weight-grad (W) of `stage` on `microbatch`."""

    kind: Kind
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Task kind must be one of {', '.join(_KINDS)}; got {self.kind!r}")
        for field_name in ("stage", "microbatch"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"Task {field_name} must be an int, got {value!r} ({type(value).__name__})"
                )
            # Negative values are left to the schedule's validation, which
            # names the task in its grid; beyond int32 nothing can hold them.
            if not -(2**31) <= value < 2**31:
                raise ValueError(f"Task {field_name} {value} is out of range (32-bit int)")

    def __str__(self) -> str:
        """torch.distributed.pipelining's action format: '2F5'."""
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Task:
        """Reads an action like '2F5' (stage 2, forward, microbatch 5)."""
        t = _C.schedule.parse_action(text.strip())
        return Task(t.kind.name, t.stage, t.microbatch)

    def _native(self) -> _C.schedule.Task:
        return _C.schedule.Task(
            _C.schedule.TaskKind.__members__[self.kind], self.stage, self.microbatch
        )


class Schedule:
    """A pipeline schedule: where stages live and what each rank runs, in order.

    Subclass and implement `tasks` (and `placement`, if stages should not be
    dealt round-robin): the schedule is just data, checked by
    `compile_schedule` before anything runs.
    """

    def __init__(self, num_microbatches: int) -> None:
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        self.num_microbatches = num_microbatches

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        """Stage -> rank. Default: round-robin ("loop"), stage s on rank s % num_ranks."""
        return [s % num_ranks for s in range(num_stages)]

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        """Per rank, the tasks it runs, in order."""
        raise NotImplementedError(f"{type(self).__name__} must implement tasks()")

    # ---- plain lists and the action format

    @staticmethod
    def from_lists(
        tasks: Sequence[Sequence[Task | str]],
        placement: Sequence[int],
        num_microbatches: int | None = None,
    ) -> Schedule:
        """A schedule given as per-rank lists of tasks (or action strings like '1B0')."""
        lists = [[t if isinstance(t, Task) else Task.parse(t) for t in rank] for rank in tasks]
        bad = [r for r in placement if not isinstance(r, int) or isinstance(r, bool)]
        if bad:
            raise TypeError(
                f"Schedule.from_lists: placement gives each stage's rank as an int, got {bad[0]!r} "
                f"({type(bad[0]).__name__})"
            )
        if num_microbatches is None:
            num_microbatches = 1 + max((t.microbatch for r in lists for t in r), default=0)
        return _ListSchedule(lists, list(placement), num_microbatches)

    @staticmethod
    def from_csv(text: str, placement: Sequence[int]) -> Schedule:
        """Reads torch.distributed.pipelining's CSV: one row per rank, one action per cell."""
        rows = [
            [cell.strip() for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))
        ]
        return Schedule.from_lists(rows, placement)

    def to_csv(self, num_stages: int, num_ranks: int) -> str:
        """Writes the schedule's task lists in torch.distributed.pipelining's CSV format."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for rank in self.tasks(num_stages, num_ranks, self.num_microbatches):
            writer.writerow([str(t) for t in rank])
        return out.getvalue()

    def with_recompute(self, stages: Iterable[int] | None = None) -> Schedule:
        """This schedule with a recompute (R) right before each backward (B or I)
        of `stages` (default: every stage).

        Their forwards then keep only their received inputs, and the backward
        runs the forward again first (stage-level activation checkpointing):
        a stage holds one microbatch's activations instead of one per
        microbatch in flight, for one more forward per microbatch.
        """
        return _Recompute(self, None if stages is None else frozenset(stages))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_microbatches={self.num_microbatches})"


class _ListSchedule(Schedule):
    def __init__(self, lists: list[list[Task]], placement: list[int], num_microbatches: int):
        super().__init__(num_microbatches)
        self._lists = lists
        self._placement = placement

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        return list(self._placement)

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        return [list(r) for r in self._lists]


class _Recompute(Schedule):
    def __init__(self, base: Schedule, stages: frozenset[int] | None) -> None:
        super().__init__(base.num_microbatches)
        self._base = base
        self._stages = stages

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        return self._base.placement(num_stages, num_ranks)

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        outside = sorted(s for s in self._stages or () if not 0 <= s < num_stages)
        if outside:
            raise ValueError(
                f"with_recompute: stages {outside} do not exist; the pipeline has stages "
                f"0..{num_stages - 1}"
            )
        out = []
        for rank in self._base.tasks(num_stages, num_ranks, num_microbatches):
            row = []
            for t in rank:
                if t.kind in ("B", "I") and (self._stages is None or t.stage in self._stages):
                    row.append(Task("R", t.stage, t.microbatch))
                row.append(t)
            out.append(row)
        return out

    def __repr__(self) -> str:
        which = "" if self._stages is None else f"stages={sorted(self._stages)}"
        return f"{self._base!r}.with_recompute({which})"
