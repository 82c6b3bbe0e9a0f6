# Type stub for the private native core. Use the torchmpmd package instead.
# Its submodules are written as classes; every binding of csrc/bindings is
# here, so the type checker (mypy, in CI) sees no Any cross the boundary.
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import ClassVar, TypeVar

import torch
from torch._C._distributed_c10d import Store
from torch.distributed import ProcessGroup

_T = TypeVar("_T")

class Error(ValueError): ...

class graph:
    class NodeKind(Enum):
        input = ...
        parameter = ...
        buffer = ...
        compute = ...

    class SplitMode(Enum):
        markers = ...
        before = ...
        after = ...

    class Node:
        name: str
        kind: graph.NodeKind
        target: str
        inputs: list[int]
        module_stack: list[str]
        bytes: int
        module_path: str

    class BufferUpdate:
        buffer: int
        value: int
        def __init__(self, buffer: int, value: int) -> None: ...

    class StageGraph:
        outputs: list[int]
        buffer_updates: list[graph.BufferUpdate]
        nodes: list[graph.Node]
        def __init__(self) -> None: ...
        def add_node(
            self,
            name: str,
            kind: graph.NodeKind,
            target: str,
            inputs: list[int],
            module_stack: list[str],
            bytes: int,
            differentiable: bool,
            replicable: bool,
            attached: bool,
            transferable: bool,
        ) -> int: ...
        def __len__(self) -> int: ...

    class SplitSpec:
        def __init__(
            self,
            mode: graph.SplitMode,
            points: list[str],
            module_paths: list[str],
            marker_positions: list[int],
        ) -> None: ...

    class Transfer:
        value: int
        src_stage: int
        dst_stages: list[int]
        bytes: int
        requires_grad: bool

    class TiedParameter:
        node: int
        stages: list[int]

    class StagePlan:
        num_stages: int
        node_stage: list[int]
        requires_grad: list[bool]
        compute: list[list[int]]
        inputs: list[list[int]]
        params: list[list[int]]
        buffers: list[list[int]]
        recvs: list[list[int]]
        sends: list[list[int]]
        buffer_updates: list[list[graph.BufferUpdate]]
        transfers: list[graph.Transfer]
        tied: list[graph.TiedParameter]
        outputs: list[int]

    @staticmethod
    def partition(graph: graph.StageGraph, spec: graph.SplitSpec) -> graph.StagePlan: ...

class schedule:
    # Members come from the native task-kind table (csrc/schedule/task_kinds.cpp),
    # one per letter: F, B, I, W, R, ... Look them up as TaskKind.__members__[letter].
    class TaskKind:
        __members__: ClassVar[dict[str, schedule.TaskKind]]
        @property
        def name(self) -> str: ...
        def __int__(self) -> int: ...

    class TaskKindInfo:
        letter: str
        name: str
        required: bool
        backward: bool
        backward_parts: int
        in_forward_only: bool
        emits_input_grads: bool
        finishes_weight_grads: bool
        recomputes: bool
        charged_as: str
        default_cost: list[tuple[str, float]]
        after_own: str

    @staticmethod
    def task_kind_table() -> list[schedule.TaskKindInfo]: ...

    class Task:
        # A fused task answers its first part's kind, stage and microbatch.
        kind: schedule.TaskKind
        stage: int
        microbatch: int
        parts: list[schedule.Task]  # a fused task's parts; [] for a simple task
        def __init__(self, kind: schedule.TaskKind, stage: int, microbatch: int) -> None: ...

    @staticmethod
    def fuse(parts: Sequence[schedule.Task]) -> schedule.Task: ...
    @staticmethod
    def to_action(task: schedule.Task) -> str: ...
    @staticmethod
    def parse_action(text: str) -> schedule.Task: ...
    @staticmethod
    def fused_cost_key(task: schedule.Task) -> str: ...

    class Edge:
        value: int
        src: int
        dst: int
        bytes: int
        requires_grad: bool
        def __init__(
            self, value: int, src: int, dst: int, bytes: int, requires_grad: bool
        ) -> None: ...

    class TiedGroup:
        id: int
        stages: list[int]
        bytes: int
        def __init__(self, id: int, stages: Sequence[int], bytes: int) -> None: ...

    class PipelineGraph:
        num_stages: int
        edges: list[schedule.Edge]
        tied: list[schedule.TiedGroup]
        def __init__(
            self,
            num_stages: int,
            edges: Sequence[schedule.Edge],
            tied: Sequence[schedule.TiedGroup],
        ) -> None: ...
        @staticmethod
        def from_plan(plan: graph.StagePlan) -> schedule.PipelineGraph: ...
        @staticmethod
        def chain(num_stages: int, bytes: int = 1) -> schedule.PipelineGraph: ...

    class StageCollectives:
        unshard: bool
        reduce_grads: bool
        def __init__(self, unshard: bool = False, reduce_grads: bool = False) -> None: ...

    class ScheduleSpec:
        num_ranks: int
        num_microbatches: int
        placement: list[int]
        tasks: list[list[schedule.Task]]
        forward_only: bool
        collectives: list[schedule.StageCollectives]
        def __init__(
            self,
            num_ranks: int,
            num_microbatches: int,
            placement: Sequence[int],
            tasks: Sequence[Sequence[schedule.Task]],
            forward_only: bool = False,
            collectives: Sequence[schedule.StageCollectives] = ...,
        ) -> None: ...

    class Costs:
        time: list[list[float]]
        fused_time: dict[str, float]  # by fused_cost_key: '0F;3B'
        activation_bytes: list[int]
        weight_grad_bytes: list[int]
        unshard: list[float]
        reduce_grads: list[float]
        unsharded_bytes: list[int]
        latency: float
        bytes_per_unit: float
        overlap_comm: bool
        comm: list[list[float]]
        overlap_sides: bool
        shared_cores: float
        demand_per_rank: float
        def __init__(self) -> None: ...
        @staticmethod
        def uniform(
            num_stages: int,
            forward: float = 1.0,
            backward: float = 2.0,
            input_grad: float = 1.0,
            weight_grad: float = 1.0,
        ) -> schedule.Costs: ...

    class Op(Enum):
        compute = ...
        send = ...
        recv = ...
        reduce_tied = ...
        unshard = ...
        reduce_grads = ...

    class Payload(Enum):
        activation = ...
        grad = ...
        tied_grad = ...

    class Instruction:
        op: schedule.Op
        task: schedule.Task
        payload: schedule.Payload
        peer: int
        value: int
        microbatch: int
        src_stage: int
        stages: list[int]
        bytes: int
        tag: int

    class Program:
        spec: schedule.ScheduleSpec
        graph: schedule.PipelineGraph
        ranks: list[list[schedule.Instruction]]
        order: list[tuple[int, int]]
        num_ranks: int
        num_stages: int

    class EventKind(Enum):
        compute = ...
        transfer = ...
        wait = ...
        collective = ...

    class Event:
        kind: schedule.EventKind
        rank: int
        task: schedule.Task
        peer: int
        label: str
        start: float
        end: float

    class Timeline:
        num_ranks: int
        events: list[schedule.Event]
        peak_activation_bytes: list[int]
        peak_bytes: list[int]

    @staticmethod
    def validate(graph: schedule.PipelineGraph, spec: schedule.ScheduleSpec) -> None: ...
    @staticmethod
    def lower(
        graph: schedule.PipelineGraph, spec: schedule.ScheduleSpec, costs: schedule.Costs
    ) -> schedule.Program: ...
    @staticmethod
    def simulate(program: schedule.Program, costs: schedule.Costs) -> schedule.Timeline: ...
    @staticmethod
    def timeline_stats(
        ranks: Sequence[int],
        starts: Sequence[float],
        ends: Sequence[float],
        busy: Sequence[bool] = ...,
    ) -> tuple[float, float]: ...
    @staticmethod
    def render_grid(spec: schedule.ScheduleSpec, marks: Sequence[tuple[int, int]]) -> str: ...

class runtime:
    class PipelineError(RuntimeError): ...
    class TransportError(RuntimeError): ...

    @staticmethod
    def keep_freed_memory(mmap_threshold: int, trim_threshold: int) -> bool: ...
    @staticmethod
    def current_lane() -> int: ...

    class ProfilerContext:
        @staticmethod
        def current() -> runtime.ProfilerContext: ...
        @property
        def active(self) -> bool: ...
        def run(self, fn: Callable[[], _T]) -> _T: ...

    class Transport:
        rank: int
        size: int
        name: str
        device_type: str
        def send(self, tensor: torch.Tensor, peer: int, tag: int, timeout_s: float) -> None: ...
        def recv(self, tensor: torch.Tensor, peer: int, tag: int, timeout_s: float) -> None: ...
        def fail(self, reason: str) -> None: ...
        def abort(self, reason: str) -> None: ...
        def arm(self) -> None: ...
        def disarm(self) -> None: ...
        @property
        def abort_reason(self) -> str | None: ...

    class C10dTransport(Transport):
        def __init__(
            self,
            group: ProcessGroup,
            store: Store | None = None,
            key: str = "",
            poll_interval_s: float = 0.05,
        ) -> None: ...

    class LocalWorld:
        size: int
        def __init__(self, size: int) -> None: ...
        def transport(self, rank: int) -> runtime.Transport: ...
        def kill(self, rank: int) -> None: ...

    class ValueInfo:
        def __init__(
            self,
            id: int,
            name: str,
            shape: Sequence[int],
            dtype: torch.dtype,
            requires_grad: bool,
        ) -> None: ...

    class StageInfo:
        id: int
        inputs: list[int]
        outputs: list[int]
        has_loss: bool
        split: bool
        def __init__(
            self,
            id: int,
            inputs: Sequence[int],
            outputs: Sequence[int],
            has_loss: bool,
            split: bool = False,
        ) -> None: ...

    class Executor:
        rank: int
        step_start_unix_ns: int
        peak_held_bytes: int
        sent_bytes: int
        received_bytes: int
        def __init__(
            self,
            rank: int,
            program: schedule.Program,
            stages: Sequence[runtime.StageInfo],
            values: Sequence[runtime.ValueInfo],
            transport: runtime.Transport,
            tied: Mapping[int, torch.Tensor],
            timeout_s: float,
            max_early_recvs: int,
            training: bool,
            device: torch.device,
            measure_memory: bool = False,
        ) -> None: ...
        def run(
            self,
            forward: Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]],
            input_grad: Callable[
                [int, int, list[torch.Tensor], list[torch.Tensor | None]], list[torch.Tensor]
            ]
            | None = None,
            weight_grad: Callable[[int, int, list[torch.Tensor]], None] | None = None,
            shapes: dict[tuple[int, int], list[int]] = ...,
            stage_done: Callable[[int], None] | None = None,
            unshard: Callable[[int], None] | None = None,
            replay_rng: bool = True,
            grads_start: Callable[[int], None] | None = None,
            overlap: bool = False,
            backward_rng: set[int] = ...,
        ) -> None: ...
        # (kind, stage, microbatch, start_ns, end_ns, waited_ns, held_bytes,
        # kept_bytes); a fused task's kind is its action, '(0F3;3B1)OVERLAP_F_B'.
        def records(
            self,
        ) -> list[tuple[str, int, int, int, int, int, int, int, list[tuple[int, int, int]]]]: ...
