# Type stub for the private native core. Use the torchmpmd package instead.
from enum import Enum

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
