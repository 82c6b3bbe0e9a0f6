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
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from ..graph.experts import experts_calls
from ..graph.pipe import Pipe, StageSpec, TensorSpec
from ..graph.stage import as_stage
from . import tensor_ops  # noqa: F401  (sharding strategies DTensor lacks)
from .expert_dispatch import ExpertsOverTp
from .protocol import Asked, Kind, Parallelism, Parallelize, RankStages, not_sharded_over, register
from .replicate import broadcast_from_first
from .tensor_checks import check_plan
from .tensor_grads import ShardedGrads
from .tensor_plan import (
    _INPUT_PLACEMENT,
    _REPLICATED_OUTPUT,
    _SEQUENCE_OUTPUT,
    STYLES,
    TensorPlan,
)
from .tensor_random import draws_random, random_op, share_generators, with_random_ops

__all__ = ["STYLES", "TensorParallel", "TensorPlan", "placed", "replicated"]


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


class TensorParallel(Parallelism):
    """A runner's tensor parallelism: the plan, over the mesh's "tp"
    dimension (`mesh`, a slice of the runner's whole mesh `root`)."""

    name = "tp"
    dims = ("tp",)
    # The executor exchanges plain tensors: the tied weights' DTensor
    # gradients are summed over their holders here (`ShardedGrads`).
    sums_ties = True
    # A traced stage runs its rewritten copy: split through autograd.
    rewrites_stages = True
    # Its reduce_grads places the stage's gradients as their parameters.
    rewrites_grads = True
    # DTensor's collectives take the tp mesh's one group, whichever side of
    # a fused task runs them: the sides run in order.
    overlaps_sides = False

    def __init__(
        self,
        plan: TensorPlan,
        mesh: DeviceMesh,
        root: DeviceMesh,
        parallelize: Parallelize | None = None,
    ) -> None:
        self.plan, self.mesh, self.root = plan, mesh, root
        # The user's fn(stage, stage_mesh) (RunnerOptions.parallelize), or None.
        self.parallelize = parallelize
        self._grads: ShardedGrads | None = None
        self._bucket_bytes = 25 * 2**20

    @property
    def size(self) -> int:
        return int(self.mesh.size())

    @property
    def stage_mesh(self) -> DeviceMesh:
        """The mesh a stage is parallel over: every dimension of the runner's
        but the pipeline's (("dp", "tp"), or "tp" alone)."""
        names = tuple(n for n in self.root.mesh_dim_names or () if n != "pp")
        return self.root[names] if len(names) > 1 else self.mesh

    # ---- the parallelism protocol (protocol.Parallelism)

    def groups(self) -> list[dist.ProcessGroup]:
        return [self.mesh.get_group()]

    def transfer_shape(self, spec: TensorSpec, shape: list[int]) -> list[int]:
        placement = self.boundary(spec)
        if isinstance(placement, Shard):
            shape = list(shape)
            shape[placement.dim] //= self.size
        return shape

    def shard_meta(self, stages: Mapping[int, torch.nn.Module], pipe: Pipe) -> None:
        """A model on the meta device: each rank allocates only its shards."""
        if any(p.is_meta for m in stages.values() for p in m.parameters()):
            self.place_parameters(stages, pipe.parameter_aliases, pipe.source)

    def shard(self, stages: Mapping[int, torch.nn.Module], pipe: Pipe) -> None:
        """The plan shards the traced stages; the user's `parallelize` any."""
        graphs = {s: m for s, m in stages.items() if as_stage(m).graph_module is not None}
        self.place_parameters(graphs, pipe.parameter_aliases, pipe.source)
        self.apply_parallelize(stages)

    def wrap_forward(
        self,
        stage: torch.nn.Module,
        call: Callable[..., Any],
        spec: StageSpec,
        transfers: Mapping[int, TensorSpec],
    ) -> Callable[..., Any]:
        """A traced stage runs its rewrite on DTensors; a stage cut by hand
        runs the user's tensor parallelism as it is (its random ops drawn as
        a traced stage's are: tensor_random)."""
        graph = as_stage(stage).graph_module
        inner: Callable[..., Any] = (
            self.rewrite(graph, spec, transfers) if graph is not None else with_random_ops(call)
        )
        return self.wrap(inner, spec, transfers)

    def attach(self, stages: RankStages) -> None:
        self._grads = ShardedGrads(self.root, stages.modules, stages.ties)
        self._bucket_bytes = stages.bucket_bytes

    def make_equal(self, tensors: list[torch.Tensor]) -> None:
        """An init drawn on each tp rank (its own generator) must leave the
        replicated tensors (norms, biases) alike: tp rank 0's."""
        if self.size > 1:
            whole = not_sharded_over(tensors, self.dims)
            broadcast_from_first(self.mesh.get_group(), whole, self._bucket_bytes)

    def on_call(self, kind: str, device: torch.device) -> None:
        """Stages draw random numbers (dropout): tp peers draw alike."""
        if kind in ("step", "eval_step"):
            share_generators(self.mesh.get_group(), device)

    def reduce_grads(self, stage: int) -> None:
        """Before a data parallelism reduces them: gradients placed as their
        parameters."""
        if self._grads is not None:
            self._grads.place(stage)

    def finish(self, tied: Mapping[int, torch.nn.Parameter]) -> None:
        if self._grads is not None:
            self._grads.finish(tied)

    # ---- what the hooks use

    def apply_parallelize(self, stages: Mapping[int, torch.nn.Module]) -> None:
        """Calls the user's `parallelize(stage, stage_mesh)` on each stage (a
        stage cut by hand as the user's own module, whose parameters the
        runner then finds again), after the plan sharded the traced ones."""
        if self.parallelize is None:
            return
        for _, module in sorted(stages.items()):
            stage = as_stage(module)
            self.parallelize(stage.state_root, self.stage_mesh)
            stage.refresh_state()

    def place_parameters(
        self,
        stages: Mapping[int, torch.nn.Module],
        aliases: Mapping[str, list[str]],
        source: torch.nn.Module | None,
    ) -> None:
        """Makes every parameter of `stages` a DTensor placed as the plan
        says (each tensor once, whatever names it has)."""
        done: dict[int, torch.nn.Parameter] = {}
        for s, module in sorted(stages.items()):
            # Experts modules stay whole over tp (every tp rank runs its
            # experts on the whole batch; expert parallelism shards them).
            graph = as_stage(module).graph_module
            experts = [f"{n.target}." for n in experts_calls(graph.graph)] if graph else []
            for name, param in list(module.named_parameters(remove_duplicate=False)):
                if isinstance(param, DTensor) or name.startswith(tuple(experts)):
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

    def rewrite(
        self,
        module: fx.GraphModule,
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
        experts = {
            str(n.target): ExpertsOverTp(module.get_submodule(str(n.target)), self.mesh, replicated)
            for n in experts_calls(graph)
        }
        parts: dict[str, torch.nn.Module] = {
            **randoms,
            **experts,
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


def _claim(names: tuple[str, ...] | None, left: tuple[str, ...], asked: Asked) -> tuple[str, ...]:
    if "tp" in left:
        return ("tp",)
    if asked.tp_plan is not None:
        raise ValueError(
            "PipelineRunner: tp_plan needs a mesh with a 'tp' dimension, e.g. "
            "init_device_mesh('cpu', (pp, tp), mesh_dim_names=('pp', 'tp'))"
        )
    return ()


def _make(mesh: DeviceMesh, dims: tuple[str, ...], pipe: Pipe, asked: Asked) -> TensorParallel:
    """The stages' tensor parallelism over the mesh's "tp" dimension,
    checked before anything is compiled or exchanged."""
    eager = [s for s in range(pipe.num_stages) if as_stage(pipe.stage(s)).graph_module is None]
    if eager and asked.parallelize is None:
        raise ValueError(
            f"PipelineRunner: stages {eager} were cut by hand (mpmd.from_stages), which a "
            "tp_plan cannot reach (it shards traced stages); pass options=mpmd.RunnerOptions("
            "parallelize=fn) with fn(stage, stage_mesh) applying your own tensor parallelism, "
            "e.g. parallelize_module(stage, stage_mesh['tp'], {'mlp.up': ColwiseParallel(), "
            "'mlp.down': RowwiseParallel()})"
        )
    if len(eager) == pipe.num_stages:  # no traced stage: the plan is not needed
        return TensorParallel(TensorPlan(()), mesh["tp"], mesh, asked.parallelize)
    if asked.compile:
        raise ValueError(
            "PipelineRunner: torch.compile of tensor-parallel stages is not supported yet; "
            "leave RunnerOptions.compile off with a 'tp' mesh dimension"
        )
    plan = TensorPlan.for_model(asked.tp_plan, pipe.source)
    if pipe.source is not None:
        check_plan(plan, pipe.source, int(mesh["tp"].size()))
    return TensorParallel(plan, mesh["tp"], mesh, asked.parallelize)


register(Kind("tp", ("tp",), _claim, _make, order=0, options=("tp_plan", "parallelize")))
