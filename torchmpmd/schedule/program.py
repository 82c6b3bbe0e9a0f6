"""Compiling a schedule for a pipeline: lowered, validated per-rank programs."""

from __future__ import annotations

from .. import _C
from ..graph.pipe import Pipe
from .costs import Costs, timeline_from_native
from .task import Schedule, Task, check_placement, require_schedule
from .timeline import Timeline

__all__ = ["Program", "compile_schedule"]


def _graph_of(pipe: Pipe | int) -> _C.schedule.PipelineGraph:
    if isinstance(pipe, Pipe):
        plan = pipe.plan
        edges = [
            _C.schedule.Edge(e.value, e.src, e.dst, e.bytes, e.requires_grad) for e in plan.edges()
        ]
        tied = [_C.schedule.TiedGroup(t.node, list(t.stages), 0) for t in plan.tied]
        return _C.schedule.PipelineGraph(plan.num_stages, edges, tied)
    if isinstance(pipe, int) and not isinstance(pipe, bool):
        return _C.schedule.PipelineGraph.chain(pipe)
    raise TypeError(f"expected a Pipe or a number of stages, got {type(pipe).__name__}")


def _spec(
    schedule: Schedule, num_stages: int, num_ranks: int, forward_only: bool
) -> _C.schedule.ScheduleSpec:
    m = schedule.num_microbatches
    placement = check_placement(
        schedule.placement(num_stages, num_ranks), f"{type(schedule).__name__}.placement()"
    )
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
        # Read once: each access to a field of the native program copies it.
        spec = native.spec
        self.num_ranks: int = native.num_ranks
        self.num_stages: int = native.num_stages
        self.num_microbatches: int = spec.num_microbatches
        self._placement = tuple(spec.placement)
        self._ranks: list[list[_C.schedule.Instruction]] | None = None

    @property
    def placement(self) -> list[int]:
        """Stage -> rank."""
        return list(self._placement)

    def _instructions(self, rank: int) -> list[_C.schedule.Instruction]:
        if self._ranks is None:
            self._ranks = self._native.ranks
        return self._ranks[rank]

    def tasks(self, rank: int) -> list[Task]:
        """The compute tasks of `rank`, in program order."""
        return [
            Task(i.task.kind.name, i.task.stage, i.task.microbatch)
            for i in self._instructions(rank)
            if i.op == _C.schedule.Op.compute
        ]

    def instructions(self, rank: int) -> list[str]:
        """The whole program of `rank`, tasks and messages, as text."""
        return [repr(i) for i in self._instructions(rank)]

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
            f"{self.num_ranks} ranks, {self.num_microbatches} microbatches)\n" + self.grid()
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
    require_schedule(schedule, "compile_schedule")
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    graph = _graph_of(pipe)
    spec = _spec(schedule, graph.num_stages, num_ranks, forward_only)
    native_costs = (costs or Costs()).native(graph.num_stages)
    native = _C.schedule.lower(graph, spec, native_costs)
    return Program(native, schedule, pipe if isinstance(pipe, Pipe) else None)
