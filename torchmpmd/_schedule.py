"""Schedules as data: per-rank task lists, compiled into checked programs."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass

from . import _C
from ._costs import Costs, timeline_from_native
from ._pipe import Pipe
from ._timeline import Timeline

__all__ = ["Program", "Schedule", "Task", "compile_schedule"]

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
            getattr(_C.schedule.TaskKind, self.kind), self.stage, self.microbatch
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


def _graph_of(pipe: Pipe | int) -> _C.schedule.PipelineGraph:
    if isinstance(pipe, Pipe):
        return _C.schedule.PipelineGraph.from_plan(pipe.plan)
    if isinstance(pipe, int):
        return _C.schedule.PipelineGraph.chain(pipe)
    raise TypeError(f"expected a Pipe or a number of stages, got {type(pipe).__name__}")


def _spec(
    schedule: Schedule, num_stages: int, num_ranks: int, forward_only: bool
) -> _C.schedule.ScheduleSpec:
    m = schedule.num_microbatches
    placement = [int(r) for r in schedule.placement(num_stages, num_ranks)]
    lists = schedule.tasks(num_stages, num_ranks, m)
    if len(lists) != num_ranks:
        raise ValueError(
            f"{type(schedule).__name__}.tasks returned {len(lists)} task lists for {num_ranks} ranks"
        )
    native = []
    for r, rank_tasks in enumerate(lists):
        row = []
        for i, t in enumerate(rank_tasks):
            if not isinstance(t, Task):
                raise TypeError(
                    f"{type(schedule).__name__}.tasks: rank {r} position {i} is "
                    f"{type(t).__name__}, not mpmd.Task"
                )
            if forward_only and t.kind != "F":
                continue
            row.append(t._native())
        native.append(row)
    return _C.schedule.ScheduleSpec(num_ranks, m, placement, native, forward_only)


class Program:
    """A schedule lowered for a pipeline: per rank, tasks plus the sends and
    receives they need, validated (dependencies, deadlock) before anything runs."""

    def __init__(self, native: _C.schedule.Program, schedule: Schedule, pipe: Pipe | None):
        self._native = native
        self.schedule = schedule
        self.pipe = pipe

    @property
    def num_ranks(self) -> int:
        return self._native.num_ranks

    @property
    def num_stages(self) -> int:
        return self._native.num_stages

    @property
    def placement(self) -> list[int]:
        return list(self._native.spec.placement)

    def tasks(self, rank: int) -> list[Task]:
        """The compute tasks of `rank`, in program order."""
        return [
            Task(i.task.kind.name, i.task.stage, i.task.microbatch)
            for i in self._native.ranks[rank]
            if i.op == _C.schedule.Op.compute
        ]

    def instructions(self, rank: int) -> list[str]:
        """The whole program of `rank`, tasks and messages, as text."""
        return [repr(i) for i in self._native.ranks[rank]]

    def simulate(self, costs: Costs | None = None) -> Timeline:
        """Predicts the step: when each task runs on each rank, step time, bubble
        fraction and peak activation memory per rank (see `Costs`)."""
        costs = costs if costs is not None else Costs()
        acts = self.pipe.activation_bytes() if self.pipe is not None else None
        native = _C.schedule.simulate(self._native, costs.native(self.num_stages, acts))
        return timeline_from_native(native, costs.unit)

    def grid(self) -> str:
        """One line per rank in action format ('0F0 0F1 0B0 ...')."""
        return _C.schedule.render_grid(self._native.spec, [])

    def __repr__(self) -> str:
        return (
            f"Program({type(self.schedule).__name__}, {self.num_stages} stages on "
            f"{self.num_ranks} ranks, {self._native.spec.num_microbatches} microbatches)\n"
            + self.grid()
        )


def compile_schedule(
    schedule: Schedule,
    pipe: Pipe | int,
    num_ranks: int,
    *,
    forward_only: bool = False,
    costs: Costs | None = None,
) -> Program:
    """Lowers `schedule` for `pipe` (or a chain of that many stages) on `num_ranks` ranks.

    Raises ValueError naming the offending tasks, with a per-rank grid, when
    the schedule is incomplete, misplaced, out of dependency order or would
    deadlock. `costs` (default: uniform) only decide the order in which the
    lowering interleaves messages of different rank pairs.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected an mpmd.Schedule, got {type(schedule).__name__}")
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    graph = _graph_of(pipe)
    spec = _spec(schedule, graph.num_stages, num_ranks, forward_only)
    native_costs = (costs or Costs()).native(graph.num_stages)
    native = _C.schedule.lower(graph, spec, native_costs)
    return Program(native, schedule, pipe if isinstance(pipe, Pipe) else None)
