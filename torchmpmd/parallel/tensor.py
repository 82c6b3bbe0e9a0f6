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

What crosses a stage boundary is replicated: a stage's outputs are
redistributed to `Replicate` and handed to the executor as local tensors,
and each tp rank sends its copy to the tp rank of the same coordinate on the
consuming stage (the transport runs over the mesh's "pp" group of this
rank's coordinates), so nothing is gathered or scattered on the way; the
gradients come back the same way, and `from_local`'s backward makes a
received value's gradient replicated before it is sent. Exactness: a
sharded matmul's sums are added in another order (float64 agrees to ~1e-16).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from . import tensor_ops  # noqa: F401  (sharding strategies DTensor lacks)

__all__ = ["STYLES", "TensorParallel", "TensorPlan", "TiedShards", "replicated"]

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
        return TensorPlan(tuple(plan.items()))

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
    """`value` redistributed to replicated over its mesh (a graph node the
    stage rewrite inserts where a styled module's output leaves it)."""
    if isinstance(value, DTensor) and not all(p.is_replicate() for p in value.placements):
        return value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)
    return value


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

    @property
    def size(self) -> int:
        return int(self.mesh.size())

    def shard(
        self,
        stages: Mapping[int, torch.nn.Module],
        aliases: Mapping[str, list[str]],
        source: torch.nn.Module | None,
    ) -> dict[str, Placement]:
        """Makes every parameter of `stages` a DTensor placed as the plan
        says (each tensor once, whatever names it has); returns the
        placement of each parameter by its model name."""
        done: dict[int, torch.nn.Parameter] = {}
        placed: dict[str, Placement] = {}
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
                    dt = distribute_tensor(param.detach(), self.mesh, [placement])
                    new = torch.nn.Parameter(dt, requires_grad=param.requires_grad)
                    done[id(param)] = new
                owner_path, _, leaf = name.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                setattr(owner, leaf, new)
                for n in names:
                    placed[n] = placement
        return placed

    def rewrite(self, module: torch.nn.Module) -> fx.GraphModule:
        """The traced stage as its tp ranks run it: a copy (sharing its
        parameters; the stage itself stays as traced, so every rank
        describes the same job) in which

        - every tensor that enters the graph other than a parameter (inputs,
          received values, buffers, constants, tensors made from nothing,
          such as a causal mask) becomes a replicated DTensor, so that every
          op, in the forward and in autograd's backward, sees DTensors only;
        - the values a styled module hands to the rest of the graph are
          redistributed as its style says (`_REPLICATED_OUTPUT`), where the
          module ends.
        """
        assert isinstance(module, fx.GraphModule), "tensor parallelism runs traced stages"
        graph = copy.deepcopy(module.graph)
        copied = fx.GraphModule(module, graph, class_name=type(module).__name__)
        copied.add_submodule("_tp_replicated", _Replicated(self.mesh))
        for node in list(graph.nodes):
            if _enters(node, copied):
                _insert_after(graph, node, "_tp_replicated", list(node.users))
                continue
            stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
            styled = next((p for p in stack if self.plan.style_of(p) in _REPLICATED_OUTPUT), None)
            if styled is not None:
                outside = [u for u in node.users if not _inside(u, styled)]
                if outside:
                    _insert_after(graph, node, "_tp_replicated", outside)
        graph.lint()
        copied.recompile()
        return copied

    def tied_shards(self, ties: Sequence[tuple[int, Sequence[int]]]) -> TiedShards:
        """The sum of tied weights' gradient shards over their holders (see
        `TiedShards`), for `ties`: (node, holder pipeline ranks)."""
        return TiedShards(self.root, ties)

    def wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """A stage callable whose outputs are handed back replicated and local."""
        mesh = self.mesh

        def local(value: Any) -> Any:
            if isinstance(value, DTensor):
                if any(not p.is_replicate() for p in value.placements):
                    value = value.redistribute(mesh, [Replicate()])
                return value.to_local()
            return value

        def run(*args: Any) -> Any:
            return pytree.tree_map(local, call(*args))

        return run


class _Replicated(torch.nn.Module):
    """A plain tensor as a replicated DTensor over the tp mesh (differentiable:
    its gradient comes back replicated and local); a DTensor redistributed
    to replicated."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, value: Any) -> Any:
        if isinstance(value, DTensor):
            return replicated(value)
        if isinstance(value, torch.Tensor):
            return DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
        return value


def _enters(node: fx.Node, module: fx.GraphModule) -> bool:
    """Whether `node` brings a tensor into the graph from outside any op on
    DTensors: an input, a buffer or constant, an op that reads no tensor."""
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if node.op == "placeholder":
        return True
    if node.op == "get_attr":
        return not isinstance(getattr(module, str(node.target), None), torch.nn.Parameter)
    if node.op == "call_function":
        return not node.all_input_nodes
    return False


def _insert_after(graph: fx.Graph, node: fx.Node, target: str, users: list[fx.Node]) -> None:
    """Calls module `target` on `node`'s value, for `users`."""
    with graph.inserting_after(node):
        placed = graph.call_module(target, (node,))
    placed.meta = dict(node.meta)
    for user in users:
        user.replace_input_with(node, placed)


class TiedShards:
    """The pipeline's sum of a tied weight's gradients under tensor
    parallelism: the copies' gradients are DTensors placed alike, so each
    tp rank adds up its shards with the same tp coordinate's on the other
    holder ranks (the executor exchanges plain tensors only). One process
    group per tie and (dp, tp) coordinate, of the tie's holder ranks, made
    by its members in the same order."""

    def __init__(self, mesh: DeviceMesh, ties: Sequence[tuple[int, Sequence[int]]]) -> None:
        """`ties`: (node, the pipeline ranks holding a copy) of each tie
        whose copies live on more than one pipeline rank."""
        names = tuple(mesh.mesh_dim_names or ())
        grid = mesh.mesh.movedim(names.index("pp"), 0)
        per_pp = grid.reshape(grid.shape[0], -1)  # pp coordinate x the others
        me = dist.get_rank()
        self._groups: dict[int, dist.ProcessGroup] = {}
        for node, holders in ties:
            for column in range(per_pp.shape[1]):
                ranks = [int(per_pp[h, column]) for h in sorted(holders)]
                if me in ranks:
                    group = dist.new_group(ranks, use_local_synchronization=True)
                    self._groups[node] = group

    def __bool__(self) -> bool:
        return bool(self._groups)

    @torch.no_grad()
    def reduce(self, params: Mapping[int, torch.nn.Parameter]) -> None:
        """Sums each tie's gradient over its holders (after the schedule,
        before data parallelism averages it)."""
        for node, group in self._groups.items():
            param = params[node]
            if param.grad is None:  # a copy the step did not reach adds zeros
                param.grad = torch.zeros_like(param)
            grad = param.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)
