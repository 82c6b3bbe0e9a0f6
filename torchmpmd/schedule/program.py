"""Compiling a schedule for a pipeline: lowered, validated per-rank programs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import _C
from ..graph.format import human_bytes, table
from ..graph.pipe import Pipe
from . import kinds
from .costs import Costs, timeline_from_native
from .kinds import TABLE
from .task import Schedule, Task, check_placement, require_schedule, task_from_native
from .timeline import Timeline, TimelineEvent

__all__ = [
    "Edge",
    "Lowering",
    "Prediction",
    "Program",
    "StageCollectives",
    "StageGraph",
    "compile_schedule",
]


@dataclass(frozen=True, slots=True)
class StageCollectives:
    """What a stage's data parallelism does around its tasks of a training
    step, as torch.distributed.pipelining's UNSHARD / RESHARD / REDUCE_GRAD
    actions. The lowering places them in each rank's program (`UNSHARD(s)`
    before the stage's first task, `REDUCE_grads(s)` right after the task
    that finishes its weight gradients), the runner runs them there, and the
    simulator charges them (`Costs.unshard`, `Costs.reduce_grads`,
    `Costs.unsharded_bytes`). Forward-only programs have none."""

    unshard: bool = False  # gather the parameters (FSDP), resharded at the reduction
    reduce_grads: bool = False  # reduce the gradients beside the rest of the schedule

    def native(self) -> _C.schedule.StageCollectives:
        return _C.schedule.StageCollectives(self.unshard, self.reduce_grads)


Collectives = StageCollectives | Sequence[StageCollectives] | None


def _simulated_exchanges(
    timeline: Timeline, forward: list[float], backward: list[float]
) -> list[TimelineEvent]:
    """Expert parallelism's all-to-alls inside the simulated tasks that
    charge them (`Costs.exchange`): in a forward the dispatch ends at the
    task's middle and the combine ends it; in a backward (B, I) the other
    way round, as autograd runs them."""
    out = []
    for t in timeline.tasks:
        if t.sub_tasks:
            continue
        info = TABLE[t.kind]
        spent = forward[t.stage] if not info.backward else backward[t.stage]
        if spent <= 0 or (info.backward and not info.emits_input_grads):
            continue
        mid, half = (t.start + t.end) / 2, spent / 2
        first, second = ("dispatch", "combine") if not info.backward else ("combine", "dispatch")
        for kind, end in ((first, mid), (second, t.end)):
            out.append(
                TimelineEvent(t.rank, kind, t.stage, t.microbatch, end - half, end, "simulated")
            )
    return out


def _collectives(collectives: Collectives, num_stages: int) -> list[_C.schedule.StageCollectives]:
    """One entry per stage (the same for all when one is given), or none."""
    if collectives is None:
        return []
    if isinstance(collectives, StageCollectives):
        return [collectives.native()] * num_stages
    per_stage = list(collectives)
    if len(per_stage) != num_stages or not all(isinstance(c, StageCollectives) for c in per_stage):
        raise ValueError(
            f"collectives must be one mpmd.StageCollectives, or one per stage ({num_stages}), "
            f"got {collectives!r}"
        )
    return [c.native() for c in per_stage]


@dataclass(frozen=True, slots=True)
class Edge:
    """Value `value`, computed by stage `src`, read by stage `dst` (`bytes` per microbatch)."""

    value: int
    src: int
    dst: int
    bytes: int
    requires_grad: bool = True


@dataclass(frozen=True, slots=True)
class StageGraph:
    """What a schedule is lowered for: the stages, the values crossing between
    them, and the groups of stages sharing a tied parameter (with its bytes,
    the size of its gradient). A `Pipe` has one; a planner weighing splits of
    a model builds one per split."""

    num_stages: int
    edges: tuple[Edge, ...] = ()
    tied: tuple[tuple[tuple[int, ...], int], ...] = ()

    def native(self) -> _C.schedule.PipelineGraph:
        edges = [
            _C.schedule.Edge(e.value, e.src, e.dst, e.bytes, e.requires_grad) for e in self.edges
        ]
        tied = [_C.schedule.TiedGroup(i, list(s), b) for i, (s, b) in enumerate(self.tied)]
        return _C.schedule.PipelineGraph(self.num_stages, edges, tied)


def _graph_of(pipe: Pipe | int | StageGraph) -> _C.schedule.PipelineGraph:
    if isinstance(pipe, Pipe):
        plan = pipe.plan
        edges = [
            _C.schedule.Edge(e.value, e.src, e.dst, e.bytes, e.requires_grad) for e in plan.edges()
        ]
        tied = [_C.schedule.TiedGroup(t.node, list(t.stages), 0) for t in plan.tied]
        return _C.schedule.PipelineGraph(plan.num_stages, edges, tied)
    if isinstance(pipe, StageGraph):
        return pipe.native()
    if isinstance(pipe, int) and not isinstance(pipe, bool):
        return _C.schedule.PipelineGraph.chain(pipe)
    raise TypeError(
        f"expected a Pipe, a StageGraph or a number of stages, got {type(pipe).__name__}"
    )


@dataclass(frozen=True, slots=True)
class Prediction:
    """The simulator's step time and per-rank peak activation bytes, without
    the timeline's events (what a planner compares between splits)."""

    step_time: float
    peak_activation_bytes: tuple[int, ...]


def _spec(
    schedule: Schedule,
    num_stages: int,
    num_ranks: int,
    forward_only: bool,
    collectives: Collectives = None,
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
            if forward_only:
                # Evaluation runs the forward parts alone (a fused task
                # left with one part runs it as a simple task).
                kept = [p for p in t.parts if kinds.TABLE[p.kind].in_forward_only]
                if not kept:
                    continue
                t = Task.fused(*kept) if len(kept) > 1 else kept[0]
            row.append(t._native())
        native.append(row)
    return _C.schedule.ScheduleSpec(
        num_ranks, m, placement, native, forward_only, _collectives(collectives, num_stages)
    )


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
        """The compute tasks of `rank`, in program order (a fused task as one;
        its `parts` are what it runs)."""
        return [
            task_from_native(i.task)
            for i in self._instructions(rank)
            if i.op == _C.schedule.Op.compute
        ]

    def instructions(self, rank: int) -> list[str]:
        """The whole program of `rank`, tasks, messages and collectives, as text."""
        return [repr(i) for i in self._instructions(rank)]

    def simulate(self, costs: Costs | None = None) -> Timeline:
        """Predicts the step: when each task runs on each rank, step time, bubble
        fraction and peak activation memory per rank (see `Costs`)."""
        costs = costs if costs is not None else Costs()
        timeline = timeline_from_native(self._simulated(costs), costs.unit)
        timeline.sent_bytes, timeline.received_bytes = self.message_bytes()
        exchanges = costs.exchanges(self.num_stages)
        if exchanges is not None:
            timeline.events.extend(_simulated_exchanges(timeline, *exchanges))
        return timeline

    def message_bytes(self) -> tuple[list[int], list[int]]:
        """Per rank, the bytes of the step's messages it sends and receives
        (activations, gradients, tied gradients)."""
        op = _C.schedule.Op
        sent, received = [0] * self.num_ranks, [0] * self.num_ranks
        for r in range(self.num_ranks):
            for i in self._instructions(r):
                if i.op == op.send:
                    sent[r] += i.bytes
                elif i.op == op.recv:
                    received[r] += i.bytes
        return sent, received

    def predict(self, costs: Costs | None = None) -> Prediction:
        """`simulate`'s step time and peak activation bytes alone (no events
        built: cheap enough to call for thousands of candidate splits)."""
        native = self._simulated(costs if costs is not None else Costs())
        EK = _C.schedule.EventKind
        spans = [e for e in native.events if e.kind in (EK.compute, EK.collective)]
        step, _ = _C.schedule.timeline_stats(
            [e.rank for e in spans], [e.start for e in spans], [e.end for e in spans]
        )
        return Prediction(step, tuple(native.peak_activation_bytes))

    def _simulated(self, costs: Costs) -> _C.schedule.Timeline:
        """The native simulator's run of this program under `costs`."""
        acts = self.pipe.activation_bytes() if self.pipe is not None else None
        return _C.schedule.simulate(self._native, costs.native(self.num_stages, acts))

    def grid(self) -> str:
        """One line per rank in action format ('0F0 0F1 0B0 ...')."""
        return _C.schedule.render_grid(self._native.spec, [])

    def __repr__(self) -> str:
        sent, received = self.message_bytes()
        rows = [(r, human_bytes(sent[r]), human_bytes(received[r])) for r in range(self.num_ranks)]
        return (
            f"Program({type(self.schedule).__name__}, {self.num_stages} stages on "
            f"{self.num_ranks} ranks, {self.num_microbatches} microbatches)\n"
            + self.grid().rstrip("\n")
            + "\n\n"
            + table("Messages per step (bytes per rank)", ["rank", "sent", "received"], rows)
        )


class Lowering:
    """A schedule's task lists, checked and converted once for `num_stages`
    stages on `num_ranks` ranks, lowered for any graph of that many stages.
    `compile_schedule` is one lowering; a planner weighing many splits of a
    model keeps one and compiles each split's `StageGraph`."""

    def __init__(
        self,
        schedule: Schedule,
        num_stages: int,
        num_ranks: int,
        *,
        forward_only: bool = False,
        collectives: Collectives = None,
    ) -> None:
        require_schedule(schedule, "compile_schedule")
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
        self.schedule = schedule
        self.num_stages = num_stages
        self.num_ranks = num_ranks
        self._spec = _spec(schedule, num_stages, num_ranks, forward_only, collectives)

    def compile(self, graph: Pipe | int | StageGraph, costs: Costs | None = None) -> Program:
        """Lowers and validates the programs for `graph` (see `compile_schedule`)."""
        native_graph = _graph_of(graph)
        if native_graph.num_stages != self.num_stages:
            raise ValueError(
                f"this lowering is for {self.num_stages} stages; the graph has "
                f"{native_graph.num_stages}"
            )
        return self._lower(native_graph, costs, graph if isinstance(graph, Pipe) else None)

    def _lower(
        self, graph: _C.schedule.PipelineGraph, costs: Costs | None, pipe: Pipe | None
    ) -> Program:
        native_costs = (costs or Costs()).native(self.num_stages)
        return Program(_C.schedule.lower(graph, self._spec, native_costs), self.schedule, pipe)


def compile_schedule(
    schedule: Schedule,
    pipe: Pipe | int | StageGraph,
    num_ranks: int,
    *,
    forward_only: bool = False,
    costs: Costs | None = None,
    collectives: Collectives = None,
) -> Program:
    """Lowers `schedule` for `pipe` (or a chain of that many stages, or a
    `StageGraph`) on `num_ranks` ranks.

    Raises ValueError naming the offending tasks, with a per-rank grid, when
    the schedule is incomplete, misplaced, out of dependency order or would
    deadlock. `costs` (default: uniform) only decide the order in which the
    lowering interleaves messages of different rank pairs. `collectives`
    (one `StageCollectives` for every stage, or one per stage) puts the
    stages' data-parallel unshard and gradient reduction in the program.
    """
    require_schedule(schedule, "compile_schedule")
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    graph = _graph_of(pipe)
    lowering = Lowering(
        schedule, graph.num_stages, num_ranks, forward_only=forward_only, collectives=collectives
    )
    return lowering._lower(graph, costs, pipe if isinstance(pipe, Pipe) else None)
