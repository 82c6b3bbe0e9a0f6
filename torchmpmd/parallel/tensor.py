"""Tensor parallelism inside a stage, over the mesh's "tp" dimension.

A plan in Hugging Face's format maps module-path patterns to styles
(`{"model.layers.*.self_attn.q_proj": "colwise", ...}`); every parameter of
a local stage becomes a DTensor over the tp mesh with the model's global
shape, placed as its module's style says (Megatron's column- and
row-parallel layers: colwise shards a linear layer's output features,
weight rows and bias; rowwise its input features, weight columns, bias
replicated; embedding_rowwise the vocabulary).

A traced stage is the model's own aten program with global shapes. Its tp
ranks run a copy of it (`TensorParallel.rewrite`) on DTensors: every tensor
entering the graph other than a parameter (inputs, received values,
buffers, constants, tensors made from nothing such as a causal mask) is
made a replicated DTensor, so that every op, forward and backward, sees
DTensors only; DTensor's sharding propagation then places each value and
inserts the collectives. Where a styled module hands its result to the rest
of the graph, the copy redistributes it as the style says: a row-parallel
layer's partial sums are all-reduced there, a "_rep" column-parallel
layer's output gathered, a vocabulary-parallel embedding's masked sums
reduced (as torch's and Hugging Face's module hooks do); a plain colwise
layer's output stays sharded into the next op (attention heads).

What crosses a stage boundary goes from each tp rank to the tp rank of the
same coordinate on the consuming stage (the transport runs over the mesh's
"pp" group of this rank's coordinates), as its local part, so nothing is
gathered or scattered on the way: whole (`Replicate`), or under sequence
parallelism a floating activation as each rank's sequence slice
(`TensorParallel.boundary`, a function of the transfer's spec, so both ends
agree). The gradients come back the same way. Under sequence parallelism
(a plan with "sequence_parallel" modules) the residual stream stays
sharded along the sequence between layers, as Megatron's: row-parallel
layers reduce-scatter, column-parallel layers gather their input.
Exactness: a sharded matmul's sums are added in another order (float64
agrees to the last bits, where a model computes in float64 throughout).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from ..graph.pipe import StageSpec, TensorSpec
from ..graph.stage import as_stage
from . import tensor_ops  # noqa: F401  (sharding strategies DTensor lacks)
from .tensor_grads import ShardedGrads
from .tensor_random import draws_random, random_op

__all__ = ["STYLES", "TensorParallel", "TensorPlan", "placed", "replicated"]

# Each style: the placement of a module's weight and of its other parameters
# (bias), over the tp dimension; sequence_parallel and replicate keep the
# parameters whole.
_COLWISE = (Shard(0), Shard(0))
_ROWWISE = (Shard(1), Replicate())
_WHOLE = (Replicate(), Replicate())
STYLES: dict[str, tuple[Placement, Placement]] = {
    "colwise": _COLWISE,
    "colwise_rep": _COLWISE,
    "colwise_gather_output": _COLWISE,
    "rowwise": _ROWWISE,
    "rowwise_rep": _ROWWISE,
    "embedding_rowwise": (Shard(0), Replicate()),
    "replicate": _WHOLE,
    "sequence_parallel": _WHOLE,
}


# Styles whose module hands its output on replicated (Hugging Face's and
# torch's output layouts): the all-reduce of a row-parallel layer's partial
# sums, the all-gather of a "_rep" / "gather_output" column-parallel one, a
# vocabulary-parallel embedding's masked sum. Other outputs stay as DTensor
# placed them until an op needs them otherwise.
_REPLICATED_OUTPUT = {
    "colwise_rep",
    "colwise_gather_output",
    "rowwise",
    "rowwise_rep",
    "embedding_rowwise",
}


# Under sequence parallelism (a plan with "sequence_parallel" modules, as
# Megatron's): the styles whose module hands its output on sequence-sharded
# instead (a reduce-scatter of a row-parallel layer's or a vocabulary-parallel
# embedding's partial sums), and the placement a styled module's activation
# inputs take where they enter it (torch's SequenceParallel and
# ColwiseParallel(input_layouts=Shard(1)): norms on sequence shards, an
# all-gather of the sequence into each column-parallel layer).
_SEQUENCE_OUTPUT = {"rowwise", "embedding_rowwise"}
_INPUT_PLACEMENT = {
    "sequence_parallel": "_tp_enter_sequence",
    "colwise": "_tp_enter_replicated",
    "colwise_rep": "_tp_enter_replicated",
    "colwise_gather_output": "_tp_enter_replicated",
}


@functools.cache
def _pattern(key: str) -> re.Pattern[str]:
    """A plan key as a regular expression: `*` stands for one path component."""
    return re.compile(
        ".".join("[^.]+" if part == "*" else re.escape(part) for part in key.split("."))
    )


@dataclass(frozen=True)
class TensorPlan:
    """Module-path patterns and their styles, in Hugging Face's `tp_plan`
    format; the first pattern that matches a module's whole path wins."""

    rules: tuple[tuple[str, str], ...]
    where: str = "tp_plan"  # where it came from, for messages
    explicit: bool = True  # the user's (else the model's own)

    @staticmethod
    def of(plan: Mapping[str, str], where: str = "tp_plan") -> TensorPlan:
        if not isinstance(plan, Mapping):
            raise TypeError(
                f"{where} must map module-path patterns to styles, e.g. "
                f"{{'layers.*.mlp.up_proj': 'colwise'}}, got {type(plan).__name__}"
            )
        for key, style in plan.items():
            if not isinstance(key, str) or not isinstance(style, str):
                raise TypeError(f"{where}: {key!r}: {style!r}: patterns and styles are strings")
            if style not in STYLES:
                raise ValueError(
                    f"{where}: {key!r} has style {style!r}, which torchmpmd does not run; use "
                    f"one of {', '.join(STYLES)}"
                )
        return TensorPlan(tuple(plan.items()), where, where == "tp_plan")

    @staticmethod
    def for_model(plan: Mapping[str, str] | None, source: torch.nn.Module | None) -> TensorPlan:
        """`plan`, or the model's own (a Hugging Face model's `_tp_plan`, or
        its config's `base_model_tp_plan` under the base model's prefix)."""
        if plan is not None:
            return TensorPlan.of(plan)
        own = getattr(source, "_tp_plan", None)
        if isinstance(own, Mapping) and own:
            return TensorPlan.of(own, f"{type(source).__name__}._tp_plan")
        config = getattr(source, "config", None)
        base = getattr(config, "base_model_tp_plan", None)
        if isinstance(base, Mapping) and base:
            prefix = getattr(source, "base_model_prefix", "")
            if prefix and hasattr(source, prefix):
                base = {f"{prefix}.{k}": v for k, v in base.items()}
            return TensorPlan.of(base, f"{type(config).__name__}.base_model_tp_plan")
        raise ValueError(
            "PipelineRunner: the mesh has a 'tp' dimension but no tensor-parallel plan was "
            "given and the model has none of its own (a Hugging Face model's _tp_plan or "
            "config.base_model_tp_plan); pass options=mpmd.RunnerOptions(tp_plan={'layers.*."
            "mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': 'rowwise', ...})"
        )

    @property
    def sequence_parallel(self) -> bool:
        """Whether the plan keeps the residual stream sharded along the
        sequence (any module styled "sequence_parallel")."""
        return any(style == "sequence_parallel" for _, style in self.rules)

    def style_of(self, module_path: str) -> str | None:
        for key, style in self.rules:
            if _pattern(key).fullmatch(module_path):
                return style
        return None

    def placement(self, name: str, source: torch.nn.Module | None) -> Placement:
        """Where parameter `name` (its model path) lies over tp."""
        module_path, _, leaf = name.rpartition(".")
        style = self.style_of(module_path)
        if style is None:
            return Replicate()
        weight, other = STYLES[style]
        owner = _submodule(source, module_path)
        if isinstance(owner, torch.nn.Embedding) and style.startswith("colwise"):
            return Shard(1)  # an embedding's output features are its weight's columns
        return weight if leaf == "weight" else other


def replicated(value: Any) -> Any:
    """`value` redistributed to replicated over its mesh (where a styled
    module's output leaves it, and a stage's outputs), its gradient made
    replicated too on the way back: module boundaries carry whole values
    both ways, as torch's tensor-parallel hooks make them (a gradient left
    partial cannot go back into a vocabulary-parallel embedding's masked
    sum)."""
    return placed(value, Replicate())


def placed(value: Any, placement: Placement) -> Any:
    """`value` (a DTensor over a 1-D mesh) redistributed to `placement`, and
    its gradient on the way back too (see `replicated`); anything else as it is."""
    if isinstance(value, DTensor):
        return _Place.apply(value, placement)  # type: ignore[no-untyped-call]
    return value


def _redistribute(value: DTensor, placement: Placement) -> DTensor:
    if all(p == placement for p in value.placements):
        return value
    return value.redistribute(value.device_mesh, [placement] * value.device_mesh.ndim)


class _Place(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: DTensor, placement: Placement) -> DTensor:
        ctx.placement = placement
        return _redistribute(value, placement)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (_redistribute(grad, ctx.placement) if isinstance(grad, DTensor) else grad), None


def _inside(node: fx.Node, path: str) -> bool:
    """Whether graph node `node` belongs to the module at `path` (or one in it)."""
    stack = node.meta.get("nn_module_stack") or {}
    return any(p == path for p, _ in stack.values())


def _submodule(source: torch.nn.Module | None, path: str) -> torch.nn.Module | None:
    if source is None:
        return None
    try:
        return source.get_submodule(path)
    except AttributeError:
        return None


@dataclass(frozen=True)
class TensorParallel:
    """A runner's tensor parallelism: the plan, over the mesh's "tp" dimension."""

    plan: TensorPlan
    mesh: DeviceMesh  # 1-D: "tp"
    root: DeviceMesh  # the runner's whole mesh ("pp", ["dp",] "tp")
    # The user's fn(stage, stage_mesh) (RunnerOptions.parallelize), or None.
    parallelize: Callable[[torch.nn.Module, DeviceMesh], object] | None = None

    @property
    def size(self) -> int:
        return int(self.mesh.size())

    @property
    def stage_mesh(self) -> DeviceMesh:
        """The mesh a stage is parallel over: ("dp", "tp"), or "tp" alone."""
        names = tuple(self.root.mesh_dim_names or ())
        return self.root["dp", "tp"] if "dp" in names else self.mesh

    def apply_parallelize(self, stages: Mapping[int, torch.nn.Module]) -> None:
        """Calls the user's `parallelize(stage, stage_mesh)` on each stage (a
        stage cut by hand as the user's own module, whose parameters the
        runner then finds again), after the plan sharded the traced ones."""
        if self.parallelize is None:
            return
        for _, module in sorted(stages.items()):
            stage = as_stage(module)
            self.parallelize(module if stage.traced else stage.state_root, self.stage_mesh)
            stage.refresh_state()

    def shard(
        self,
        stages: Mapping[int, torch.nn.Module],
        aliases: Mapping[str, list[str]],
        source: torch.nn.Module | None,
    ) -> None:
        """Makes every parameter of `stages` a DTensor placed as the plan
        says (each tensor once, whatever names it has)."""
        done: dict[int, torch.nn.Parameter] = {}
        for s, module in sorted(stages.items()):
            for name, param in list(module.named_parameters(remove_duplicate=False)):
                if isinstance(param, DTensor):
                    continue
                names = aliases.get(name, [name])
                wanted = {str(self.plan.placement(n, source)) for n in names}
                if len(wanted) > 1:
                    raise ValueError(
                        f"tp_plan: parameter {name!r} of stage {s} is shared as {names}, "
                        f"which the plan places differently ({sorted(wanted)}); give every "
                        "name of a shared parameter the same style"
                    )
                placement = self.plan.placement(names[0], source)
                if isinstance(placement, Shard) and param.shape[placement.dim] % self.size:
                    raise ValueError(
                        f"tp_plan: parameter {name!r} of stage {s} has {param.shape[placement.dim]}"
                        f" rows along dimension {placement.dim}, which {self.size} tp ranks "
                        "cannot share evenly; choose a tp size that divides it, or another style"
                    )
                new = done.get(id(param))
                if new is None:
                    # A meta tensor is cut without a message (each rank
                    # its own shard, allocated later); a real one is tp
                    # rank 0's, scattered.
                    first = None if param.is_meta else 0
                    dt = distribute_tensor(
                        param.detach(), self.mesh, [placement], src_data_rank=first
                    )
                    new = torch.nn.Parameter(dt, requires_grad=param.requires_grad)
                    done[id(param)] = new
                owner_path, _, leaf = name.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                setattr(owner, leaf, new)

    def boundary(self, spec: TensorSpec) -> Placement:
        """How a value that crosses stages travels between each tp rank pair:
        under sequence parallelism a floating-point activation whose sequence
        dimension (1, batch first) the tp ranks share evenly goes as each
        rank's slice of it (`Shard(1)`); anything else whole (`Replicate`).
        A function of the transfer's spec alone, so that the producing and
        the consuming stage agree without a message."""
        shape = spec.shape
        if (
            self.plan.sequence_parallel
            and spec.dtype.is_floating_point
            and len(shape) >= 2
            and shape[1] >= self.size
            and shape[1] % self.size == 0
        ):
            return Shard(1)
        return Replicate()

    def local_shape(self, spec: TensorSpec) -> list[int]:
        """The shape of each tp rank's part of a transfer (`boundary`)."""
        shape = list(spec.shape)
        placement = self.boundary(spec)
        if isinstance(placement, Shard):
            shape[placement.dim] //= self.size
        return shape

    def rewrite(
        self,
        module: torch.nn.Module,
        spec: StageSpec | None = None,
        transfers: Mapping[int, TensorSpec] | None = None,
    ) -> fx.GraphModule:
        """The traced stage as its tp ranks run it: a copy (sharing its
        parameters; the stage itself stays as traced, so every rank
        describes the same job) in which

        - every tensor that enters the graph other than a parameter (inputs,
          received values, buffers, constants, tensors made from nothing,
          such as a causal mask) becomes a replicated DTensor, so that every
          op, in the forward and in autograd's backward, sees DTensors only;
          a value received as sequence shards (`boundary`, from `spec`'s
          received values and their `transfers` specs) becomes a DTensor
          sharded along the sequence;
        - every random op that reads a tensor runs through
          `tensor_random.random_op`: the same draws on every tp peer, and
          on sharded values the unsharded model's (`tensor_random`);
        - the values a styled module hands to the rest of the graph are
          redistributed as its style says (`_REPLICATED_OUTPUT`), where the
          module ends; under sequence parallelism row-parallel layers and
          vocabulary-parallel embeddings hand them on sequence-sharded
          (a reduce-scatter), and a module's inputs are placed as its style
          needs where they enter it (`_INPUT_PLACEMENT`: sequence-parallel
          modules (norms) take sequence shards, column-parallel layers the
          whole sequence, an all-gather).
        """
        assert isinstance(module, fx.GraphModule), "tensor parallelism runs traced stages"
        graph = copy.deepcopy(module.graph)
        sequence = self.plan.sequence_parallel
        received = self._received(graph, spec, transfers or {})
        attributes: set[fx.Node] = set()  # parameters, buffers, constants
        for node in list(graph.nodes):
            if node.op == "get_attr":
                # Looked up on the stage at every call: a data parallelism
                # (FSDP) swaps the stage's parameters between uses.
                target = str(node.target)
                with graph.inserting_before(node):
                    looked_up = graph.call_module("_tp_attributes", (target,))
                looked_up.meta = dict(node.meta)
                node.replace_all_uses_with(looked_up)
                graph.erase_node(node)
                attributes.add(looked_up)
                parameter = isinstance(_attribute(module, target), torch.nn.Parameter)
                if not parameter and isinstance(looked_up.meta.get("val"), torch.Tensor):
                    attributes.add(
                        _insert_after(graph, looked_up, "_tp_replicated", list(looked_up.users))
                    )
            elif _enters(node):
                target = "_tp_sequence" if node in received else "_tp_replicated"
                _insert_after(graph, node, target, list(node.users))
        for node in list(graph.nodes):
            stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
            styled = next((p for p in stack if self.plan.style_of(p) in _REPLICATED_OUTPUT), None)
            if styled is not None:
                outside = [u for u in node.users if not _inside(u, styled)]
                if outside:
                    to_sequence = sequence and self.plan.style_of(styled) in _SEQUENCE_OUTPUT
                    target = "_tp_sequence" if to_sequence else "_tp_replicated"
                    _insert_after(graph, node, target, outside)
        if sequence:
            self._place_module_inputs(graph, attributes)
        randoms = _random_nodes(graph)
        graph.lint()
        parts: dict[str, torch.nn.Module] = {
            **randoms,
            "_tp_attributes": _Attributes(module),
            "_tp_replicated": _Placed(self.mesh, Replicate()),
            "_tp_sequence": _Placed(self.mesh, Shard(1)),
            "_tp_enter_replicated": _Placed(self.mesh, Replicate(), both_ways=False),
            "_tp_enter_sequence": _Placed(self.mesh, Shard(1), both_ways=False),
        }
        return fx.GraphModule(parts, graph, class_name=type(module).__name__)

    def _received(
        self, graph: fx.Graph, spec: StageSpec | None, transfers: Mapping[int, TensorSpec]
    ) -> set[fx.Node]:
        """The placeholders of values received as sequence shards."""
        if spec is None or not self.plan.sequence_parallel:
            return set()
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        received = placeholders[spec.num_user_inputs :]
        return {
            node
            for node, value in zip(received, spec.recv_values, strict=True)
            if isinstance(self.boundary(transfers[value]), Shard)
        }

    def _place_module_inputs(self, graph: fx.Graph, attributes: set[fx.Node]) -> None:
        """Where an activation (not one of the stage's `attributes`) enters a
        module whose style places its inputs (`_INPUT_PLACEMENT`): one
        redistribution per value and placement (q, k and v projections share
        one all-gather of their input)."""
        uses: dict[tuple[fx.Node, str], list[fx.Node]] = {}
        for node in graph.nodes:
            stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
            for path in stack:
                target = _INPUT_PLACEMENT.get(self.plan.style_of(path) or "")
                if target is None:
                    continue
                for value in node.all_input_nodes:
                    if (
                        value not in attributes
                        and isinstance(value.meta.get("val"), torch.Tensor)
                        and not _inside(value, path)
                    ):
                        uses.setdefault((value, target), []).append(node)
        for (value, target), users in uses.items():
            _insert_after(graph, value, target, users)

    def gradients(
        self, stages: Mapping[int, torch.nn.Module], ties: Sequence[tuple[int, Sequence[int]]]
    ) -> ShardedGrads:
        """What becomes of the local `stages`' gradients in each step (see
        `ShardedGrads`); `ties`: (node, holder pipeline ranks)."""
        return ShardedGrads(self.root, stages, ties)

    def wrap(
        self,
        call: Callable[..., Any],
        spec: StageSpec | None = None,
        transfers: Mapping[int, TensorSpec] | None = None,
    ) -> Callable[..., Any]:
        """A stage callable whose outputs are handed back as local tensors:
        the values it sends placed as they travel (`boundary`: this rank's
        sequence slice, or whole), the model's outputs replicated."""
        sends = (
            [self.boundary((transfers or {})[v]) for v in spec.send_values]
            if spec is not None
            else []
        )

        def local(value: Any, placement: Placement) -> Any:
            return placed(value, placement).to_local() if isinstance(value, DTensor) else value

        def run(*args: Any) -> Any:
            out = call(*args)
            if isinstance(out, (tuple, list)) and sends:
                head = [local(v, p) for v, p in zip(out, sends, strict=False)]
                tail = [
                    pytree.tree_map(lambda v: local(v, Replicate()), v) for v in out[len(sends) :]
                ]
                return type(out)(head + tail)
            return pytree.tree_map(lambda v: local(v, Replicate()), out)

        return run


class _Random(torch.nn.Module):
    """Random aten op `op` on DTensors, drawn as the unsharded stage draws
    (`tensor_random.random_op`)."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return random_op(self.op, args, kwargs)


def _random_nodes(graph: fx.Graph) -> dict[str, torch.nn.Module]:
    """Calls `_Random` in place of each random op of `graph` that reads a
    tensor (one made from nothing, `randn(shape)`, enters replicated:
    `_enters`); the modules, by name."""
    modules: dict[str, torch.nn.Module] = {}
    for node in list(graph.nodes):
        op = node.target
        if node.op != "call_function" or not node.all_input_nodes or not draws_random(op):
            continue
        name = "_tp_random_" + str(op).replace(".", "_")
        modules.setdefault(name, _Random(op))
        with graph.inserting_before(node):
            call = graph.call_module(name, node.args, node.kwargs)
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    return modules


class _Placed(torch.nn.Module):
    """A plain tensor as a DTensor over the tp mesh, this rank's part of a
    value placed as `placement` (differentiable: its gradient comes back
    placed alike, as a local tensor); a DTensor redistributed to
    `placement`, its gradient too (`both_ways`, see `placed`) or as
    DTensor's redistribution does (back to the placement it came in)."""

    def __init__(self, mesh: DeviceMesh, placement: Placement, both_ways: bool = True) -> None:
        super().__init__()
        self.mesh, self.placement, self.both_ways = mesh, placement, both_ways

    def forward(self, value: Any) -> Any:
        if isinstance(value, DTensor):
            if self.both_ways:
                return placed(value, self.placement)
            return _redistribute(value, self.placement)
        if isinstance(value, torch.Tensor):
            return DTensor.from_local(value, self.mesh, [self.placement], run_check=False)
        return value


def _enters(node: fx.Node) -> bool:
    """Whether `node` brings a tensor into the graph from outside any op on
    DTensors: an input, or an op that reads no tensor (a causal mask)."""
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if node.op == "placeholder":
        return True
    return node.op == "call_function" and not node.all_input_nodes


def _attribute(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


class _Attributes(torch.nn.Module):
    """The stage's attributes (parameters, buffers, constants) by path, read
    at every call (not copied: another parallelism may swap them)."""

    stage: torch.nn.Module

    def __init__(self, stage: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "stage", stage)  # not a submodule: not owned

    def forward(self, target: str) -> Any:
        return _attribute(self.stage, target)


def _insert_after(graph: fx.Graph, node: fx.Node, target: str, users: list[fx.Node]) -> fx.Node:
    """Calls module `target` on `node`'s value, for `users`."""
    with graph.inserting_after(node):
        placed = graph.call_module(target, (node,))
    placed.meta = dict(node.meta)
    for user in users:
        user.replace_input_with(node, placed)
    return placed
