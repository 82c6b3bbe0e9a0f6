"""The stage plan as Python objects: the one place that reads the native plan.

`partition` runs the C++ stage compiler (`_C.graph.partition`) and copies its
`StagePlan` once into frozen dataclasses. Every other module reads these, so
no caller pays for pybind11 copying a whole vector on each nested access, and
the boundary with the native core is typed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _C

__all__ = ["BufferUpdate", "Edge", "Plan", "StageNodes", "TiedParameter", "Transfer", "partition"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """Value `value` (a node id) sent from `src_stage` directly to each of `dst_stages`."""

    value: int
    src_stage: int
    dst_stages: tuple[int, ...]
    bytes: int
    requires_grad: bool


@dataclass(frozen=True, slots=True)
class Edge:
    """One (value, destination stage) pair of a transfer: what a schedule is lowered against."""

    value: int
    src: int
    dst: int
    bytes: int
    requires_grad: bool


@dataclass(frozen=True, slots=True)
class TiedParameter:
    """A parameter (node id `node`) that several stages hold; their gradients are summed."""

    node: int
    stages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BufferUpdate:
    """The stage writes node `value` into buffer node `buffer` (e.g. running statistics)."""

    buffer: int
    value: int


@dataclass(frozen=True, slots=True)
class StageNodes:
    """The node ids one stage reads, computes and writes, in its graph's order."""

    inputs: tuple[int, ...]  # user inputs
    recvs: tuple[int, ...]  # values received from earlier stages
    sends: tuple[int, ...]  # values sent to later stages
    params: tuple[int, ...]
    buffers: tuple[int, ...]
    compute: tuple[int, ...]
    buffer_updates: tuple[BufferUpdate, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """Which stage computes what, and every value that crosses between stages."""

    stages: tuple[StageNodes, ...]
    transfers: tuple[Transfer, ...]
    tied: tuple[TiedParameter, ...]
    outputs: tuple[int, ...]  # the model's outputs, computed by the last stage

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def edges(self) -> list[Edge]:
        """Every transfer fanned out into one edge per destination stage."""
        return [
            Edge(t.value, t.src_stage, dst, t.bytes, t.requires_grad)
            for t in self.transfers
            for dst in t.dst_stages
        ]

    def tied_stages(self, node: int) -> tuple[int, ...]:
        return next(t.stages for t in self.tied if t.node == node)

    @staticmethod
    def from_native(native: _C.graph.StagePlan) -> Plan:
        # Each field is read once: every access copies the whole vector.
        inputs, recvs, sends = native.inputs, native.recvs, native.sends
        params, buffers, compute = native.params, native.buffers, native.compute
        updates = native.buffer_updates
        stages = tuple(
            StageNodes(
                inputs=tuple(inputs[s]),
                recvs=tuple(recvs[s]),
                sends=tuple(sends[s]),
                params=tuple(params[s]),
                buffers=tuple(buffers[s]),
                compute=tuple(compute[s]),
                buffer_updates=tuple(BufferUpdate(u.buffer, u.value) for u in updates[s]),
            )
            for s in range(native.num_stages)
        )
        transfers = tuple(
            Transfer(t.value, t.src_stage, tuple(t.dst_stages), t.bytes, t.requires_grad)
            for t in native.transfers
        )
        tied = tuple(TiedParameter(t.node, tuple(t.stages)) for t in native.tied)
        return Plan(stages, transfers, tied, tuple(native.outputs))


def partition(graph: _C.graph.StageGraph, spec: _C.graph.SplitSpec) -> Plan:
    """Assigns nodes to stages and infers transfers (C++); ValueError naming
    node and module when the split is invalid."""
    return Plan.from_native(_C.graph.partition(graph, spec))
