"""Between the traced graph and the C++ stage compiler: serialising fx nodes
into a `StageGraph` (kinds, module stacks, bytes, what may be recomputed), and
building each stage's `torch.fx.GraphModule` from the typed plan."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .. import _C
from .diagnose import unsupported_input_message
from .experts import EXPERTS_OP, checkpointed_experts_message, experts_call
from .names import aliases_of, tensor_names
from .pipe import Pipe, StageSpec, TensorSpec, TransferInfo, static_numel
from .plan import Plan, StageNodes
from .stage import TracedStage

__all__ = ["GraphBuilder"]

# Ops whose outputs carry no gradient even for float tensors.
_NON_DIFFERENTIABLE = {
    torch.ops.aten.detach.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_ones.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_full.default,
    torch.ops.aten.full_like.default,
    torch.ops.aten.rand_like.default,
    torch.ops.aten.randn_like.default,
    torch.ops.aten.randint_like.default,
}

# Recomputing a node in every stage that reads it beats sending its value
# when it costs at most this many flops per output element (elementwise,
# indexing and shape ops; not real matrix products).
_REPLICATE_FLOPS_PER_ELEMENT = 64


# ---------------------------------------------------------------- serialisation


def _is_static(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and static_numel(val) is not None


def _tensor_bytes(val: Any) -> int:
    """Bytes of a traced value; a data-dependent shape counts 0 (it never crosses)."""
    if isinstance(val, torch.Tensor):
        return (static_numel(val) or 0) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_tensor_bytes(v) for v in val)
    return 0


def _has_float(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return val.is_floating_point() or val.is_complex()
    if isinstance(val, (tuple, list)):
        return any(_has_float(v) for v in val)
    return False


def _shape(x: Any) -> list[int]:
    return list(x.shape) if isinstance(x, torch.Tensor) else []


def _recompute_flops_per_element(node: fx.Node) -> float:
    """Rough cost of recomputing a node, per element of its output."""
    val = node.meta.get("val")
    ins = [a.meta.get("val") for a in node.all_input_nodes]
    if any(isinstance(v, torch.Tensor) and not _is_static(v) for v in [val, *ins]):
        return math.inf  # data-dependent shapes (MoE routing) stay in their stage
    out = val.numel() if isinstance(val, torch.Tensor) else 1
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    aten = torch.ops.aten
    if packet in (aten.linear, aten.mm, aten.bmm, aten.matmul, aten.addmm, aten.baddbmm):
        mat = ins[1] if packet in (aten.addmm, aten.baddbmm) else ins[0]
        inner = _shape(mat)[-1] if _shape(mat) else 1
        return 2.0 * inner
    if packet in (aten.convolution, aten.conv1d, aten.conv2d, aten.conv3d):
        weight = _shape(ins[1])
        return 2.0 * math.prod(weight[1:]) if weight else math.inf
    if packet is not None and "attention" in str(packet):
        key = _shape(ins[1])
        return 4.0 * math.prod(key[-2:]) if key else math.inf
    largest_in = max(
        (v.numel() for v in ins if isinstance(v, torch.Tensor)),
        default=0,
    )
    return max(1.0, largest_in / max(out, 1))


def _is_replicable(node: fx.Node) -> bool:
    target = node.target
    if target is EXPERTS_OP:
        return False  # a module's routed computation: never copied into another stage
    if node.op == "get_attr" or target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
        return False
    return _recompute_flops_per_element(node) <= _REPLICATE_FLOPS_PER_ELEMENT


def _module_stack(node: fx.Node) -> list[str]:
    stack = []
    for key, (path, _cls) in (node.meta.get("nn_module_stack") or {}).items():
        if not path:
            continue
        _, _, call = key.rpartition("@")
        stack.append(f"{path}@{call}" if "@" in key and call.isdigit() and call != "0" else path)
    return stack


def _target_name(node: fx.Node) -> str:
    if node.op == "get_attr":
        return f"get_attr {node.target}"
    target = node.target
    if target is operator.getitem:
        return "getitem"
    return (
        str(target)
        if isinstance(target, torch._ops.OperatorBase)
        else getattr(target, "__name__", str(target))
    )


@dataclass(frozen=True, slots=True)
class _UserInput:
    name: str
    node: fx.Node | None  # None: the input is a constant baked into the graph
    example: Any


class GraphBuilder:
    """Serialises the functional graph for C++ and builds stages from the plan."""

    def __init__(
        self,
        model: torch.nn.Module,
        program: ExportedProgram,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.model = model
        self.program = program
        self.graph = program.graph_module.graph
        self.signature = program.graph_signature
        # Placeholder name -> its input spec (kind, FQN of a parameter/buffer).
        self.input_specs = {spec.arg.name: spec for spec in self.signature.input_specs}
        self.nodes: list[fx.Node] = []
        self.ids: dict[fx.Node, int] = {}
        self.in_spec = program.call_spec.in_spec
        self.out_spec = program.call_spec.out_spec
        flat_inputs, spec = pytree.tree_flatten((args, kwargs))
        self.kwarg_order = list(kwargs)
        self.user_inputs = self._user_inputs(flat_inputs)
        self.spec_mismatch = spec != self.in_spec

    # ---- inputs / outputs

    def _user_inputs(self, flat: list[Any]) -> list[_UserInput]:
        placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        specs = [s for s in self.signature.input_specs if s.kind == InputKind.USER_INPUT]
        if len(specs) != len(flat):
            raise RuntimeError(
                f"mpmd.trace: torch.export saw {len(specs)} user inputs but the example inputs "
                f"flatten to {len(flat)}; pass tensors and plain Python values only"
            )
        names = _input_names(self.in_spec, len(flat))
        return [
            _UserInput(name, placeholders.get(spec.arg.name), value)
            for name, spec, value in zip(names, specs, flat, strict=True)
        ]

    def _parameter_owner(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for spec in self.signature.input_specs:
            if spec.kind == InputKind.PARAMETER:
                state[spec.arg.name] = self.model.get_parameter(spec.target)
            elif spec.kind == InputKind.BUFFER:
                state[spec.arg.name] = self.model.get_buffer(spec.target)
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                state[spec.arg.name] = self.program.constants[spec.target]
        return state

    # ---- serialisation

    def serialise(self) -> _C.graph.StageGraph:
        kinds = self.input_specs
        self.state = self._parameter_owner()
        g = _C.graph.StageGraph()
        for node in self.graph.nodes:
            if node.op == "output":
                continue
            val = node.meta.get("val")
            if node.op == "placeholder":
                spec = kinds[node.name]
                if spec.kind == InputKind.USER_INPUT:
                    kind, target = _C.graph.NodeKind.input, node.name
                    diff = isinstance(val, torch.Tensor) and bool(
                        self._example_of(node).requires_grad
                    )
                elif spec.kind == InputKind.PARAMETER:
                    kind, target = _C.graph.NodeKind.parameter, spec.target
                    diff = self.state[node.name].requires_grad
                elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                    kind, target, diff = _C.graph.NodeKind.buffer, spec.target, False
                else:
                    value = self.program.constants.get(spec.target) if spec.target else None
                    raise RuntimeError(unsupported_input_message(node, spec.kind.name, value))
                self._add(g, node, kind, target, diff, replicable=False, attached=False)
                continue
            replicable = _is_replicable(node)
            diff = (
                _has_float(val)
                and node.target not in _NON_DIFFERENTIABLE
                and node.op == "call_function"
            )
            self._add(
                g,
                node,
                _C.graph.NodeKind.compute,
                _target_name(node),
                diff,
                replicable=replicable,
                attached=node.target is operator.getitem,
            )
        out_node = self.graph.output_node()
        outputs = list(pytree.tree_leaves(out_node.args[0]))
        self.user_outputs: list[Any] = []
        updates = []
        for spec, value in zip(self.signature.output_specs, outputs, strict=True):
            if spec.kind == OutputKind.USER_OUTPUT:
                self.user_outputs.append(value)
            elif spec.kind == OutputKind.BUFFER_MUTATION:
                buffer = next(
                    n
                    for n in self.graph.nodes
                    if n.op == "placeholder" and kinds[n.name].target == spec.target
                )
                updates.append(_C.graph.BufferUpdate(self.ids[buffer], self.ids[value]))
            elif spec.kind == OutputKind.USER_INPUT_MUTATION:
                raise ValueError(
                    f"mpmd.trace: the model writes into its input '{spec.target}' in place; "
                    "a pipeline cannot write back into the caller's tensors: clone the input "
                    "inside the model before modifying it"
                )
            else:
                raise RuntimeError(f"mpmd.trace: unsupported graph output kind {spec.kind.name}")
        g.outputs = [self.ids[v] for v in self.user_outputs if isinstance(v, fx.Node)]
        g.buffer_updates = updates
        return g

    def describe_outputs(self) -> str:
        """What the traced forward returned, for messages: 'None', '(3, None)'."""
        flat = [v.name if isinstance(v, fx.Node) else repr(v) for v in self.user_outputs]
        value = pytree.tree_unflatten(flat, self.out_spec)
        return str(value).replace("'", "")

    def _example_of(self, node: fx.Node) -> Any:
        return next(u.example for u in self.user_inputs if u.node is node)

    def _add(
        self,
        g: _C.graph.StageGraph,
        node: fx.Node,
        kind: Any,
        target: str,
        differentiable: bool,
        *,
        replicable: bool,
        attached: bool,
    ) -> None:
        val = node.meta.get("val")
        self.ids[node] = g.add_node(
            name=node.name,
            kind=kind,
            target=target,
            inputs=[self.ids[i] for i in node.all_input_nodes],
            module_stack=_module_stack(node),
            bytes=_tensor_bytes(val),
            differentiable=differentiable,
            replicable=replicable,
            attached=attached,
            transferable=_is_static(val),
        )
        self.nodes.append(node)

    def position_after(self, node: fx.Node | None) -> int:
        return len(self.nodes) if node is None else self.ids[node]

    # ---- stage construction

    def build_pipe(
        self,
        plan: Plan,
        trace_again: Callable[[tuple[Any, ...], dict[str, Any]], Pipe] | None = None,
    ) -> Pipe:
        aliases = aliases_of(tensor_names(self.model))
        stages = []
        graph_modules = []
        for s in range(plan.num_stages):
            gm, spec = self._build_stage(plan, s, aliases)
            graph_modules.append(gm)
            stages.append(spec)
        transfers = [
            TransferInfo(
                value=t.value,
                name=self.nodes[t.value].name,
                spec=TensorSpec.of_tensor(self.nodes[t.value].meta["val"]),
                src_stage=t.src_stage,
                dst_stages=t.dst_stages,
                requires_grad=t.requires_grad,
            )
            for t in plan.transfers
        ]
        tied = {self._fqn(self.nodes[t.node]): t.stages for t in plan.tied}
        constant_outputs = {
            i: v for i, v in enumerate(self.user_outputs) if not isinstance(v, fx.Node)
        }
        return Pipe(
            stages=graph_modules,
            stage_specs=stages,
            transfers=transfers,
            tied=tied,
            plan=plan,
            input_names=[u.name for u in self.user_inputs],
            input_specs=[_input_spec(u.example) for u in self.user_inputs],
            in_spec=self.in_spec,
            out_spec=self.out_spec,
            kwarg_order=self.kwarg_order,
            input_node_names=[
                u.node.name if u.node is not None else None for u in self.user_inputs
            ],
            output_names=[v.name if isinstance(v, fx.Node) else None for v in self.user_outputs],
            constant_outputs=constant_outputs,
            parameter_aliases=aliases,
            tied_parameters={t.node: self.state[self.nodes[t.node].name] for t in plan.tied},
            trace_again=trace_again,
            source=self.model,
        )

    def _fqn(self, node: fx.Node) -> str:
        return str(self.input_specs[node.name].target)

    def _build_stage(
        self, plan: Plan, s: int, aliases: dict[str, list[str]]
    ) -> tuple[fx.GraphModule, StageSpec]:
        nodes = plan.stages[s]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        root = torch.nn.Module()
        input_names = []
        for i in nodes.inputs + nodes.recvs:
            node = self.nodes[i]
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            input_names.append(node.name)
        persistent = {
            spec.target: spec.persistent is not False
            for spec in self.signature.input_specs
            if spec.kind == InputKind.BUFFER
        }
        updated = {u.buffer for u in nodes.buffer_updates}
        written: dict[int, fx.Node] = {}
        for i in nodes.params + nodes.buffers:
            node = self.nodes[i]
            fqn = self._choose_alias(node, nodes, aliases)
            _install(root, fqn, self.state[node.name], persistent.get(self._fqn(node), True))
            env[node] = graph.get_attr(fqn)
            env[node].meta = dict(node.meta)
            if i in updated:
                # The stage writes the buffer's new value at its end (BatchNorm
                # statistics); its readers take a copy, so the write does not
                # change a tensor autograd saved from the read.
                written[i] = env[node]
                env[node] = graph.call_function(torch.ops.aten.clone.default, (written[i],))
                env[node].meta = dict(node.meta)
        outputs = [self.nodes[i] for i in nodes.sends]
        if s == plan.num_stages - 1:
            outputs += [self.nodes[i] for i in plan.outputs]
        # Checkpointed regions: this stage's ops of each, in program order.
        regions: dict[int, list[fx.Node]] = {}
        for i in nodes.compute:
            node = self.nodes[i]
            if node.op == "call_function" and "recompute_region" in node.meta:
                regions.setdefault(node.meta["recompute_region"], []).append(node)
        needed = {*outputs, *(self.nodes[u.value] for u in nodes.buffer_updates)}
        for i in nodes.compute:
            node = self.nodes[i]
            region = (
                regions.get(node.meta.get("recompute_region", -1))
                if node.op == "call_function"
                else None
            )
            if region is not None:
                if node.target is EXPERTS_OP:
                    raise ValueError(checkpointed_experts_message(node))
                # The region runs as one call, placed at its last op: every
                # input comes earlier, every outside reader later.
                if node is region[-1]:
                    _emit_recompute(graph, root, env, region, needed, len(root._modules))
                continue
            if node.op == "get_attr":
                target = str(node.target)
                _install(root, target, getattr(self.program.graph_module, target), True)
            if node.target is EXPERTS_OP:
                env[node] = experts_call(graph, root, node, env, self.model)
                continue
            env[node] = _copy(graph, node, env)
        for update in nodes.buffer_updates:
            graph.call_function(
                torch.ops.aten.copy_.default,
                (written[update.buffer], env[self.nodes[update.value]]),
            )
        graph.output(tuple(env[n] for n in outputs))
        for unused in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:
            graph.erase_node(unused)  # an experts module's, which the module reads itself
        graph.lint()
        gm = TracedStage(root, graph, class_name=f"Stage{s}")
        _fix_buffer_persistence(gm, root)
        spec = StageSpec(
            index=s,
            input_names=tuple(input_names),
            input_specs=tuple(
                TensorSpec.of(self.nodes[i].meta.get("val")) for i in nodes.inputs + nodes.recvs
            ),
            num_user_inputs=len(nodes.inputs),
            recv_values=nodes.recvs,
            send_values=nodes.sends,
            updates_buffers=bool(nodes.buffer_updates),
            output_names=tuple(n.name for n in outputs),
            output_specs=tuple(TensorSpec.of(n.meta.get("val")) for n in outputs),
            num_sends=len(nodes.sends),
        )
        return gm, spec

    def _choose_alias(self, node: fx.Node, nodes: StageNodes, aliases: dict[str, list[str]]) -> str:
        """Names a tied parameter after the module of this stage that uses it."""
        fqn = self._fqn(node)
        names = aliases.get(fqn, [fqn])
        if len(names) == 1:
            return fqn
        computed = set(nodes.compute)
        paths = [
            _module_stack(user)[-1].split("@")[0] if _module_stack(user) else ""
            for user in node.users
            if self.ids.get(user) in computed
        ]
        for path in paths:
            for name in names:
                if path and name.rpartition(".")[0] == path:
                    return name
        return fqn


def _copy(graph: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node]) -> fx.Node:
    """`node` copied into `graph`, a `view` as a `reshape`, an `aten.copy` with a gradient.

    Functionalisation records each `reshape` as the `view` the trace-time
    strides allowed; run with other strides (grad mode can change the layout
    an op returns: T5's attention under SDPA) that view fails. A reshape is
    the same view when the strides allow it, and a copy otherwise; the
    functional graph writes no view in place, so the values are the same.
    """
    copied = graph.node_copy(node, lambda n: env[n])
    if copied.target is torch.ops.aten.view.default:
        copied.target = torch.ops.aten.reshape.default
    elif copied.target is torch.ops.aten.copy.default:
        copied.target = _copy_into
    return copied


def _copy_into(dest: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`aten.copy` (what functionalisation makes of `dest.copy_(src)`, e.g.
    into a slice of a fresh `new_empty` buffer), with a gradient: autograd
    has no formula for `aten.copy`. `src` broadcast to `dest`'s shape, in
    its dtype and on its device."""
    return src.to(device=dest.device, dtype=dest.dtype).expand_as(dest).clone()


def _emit_recompute(
    graph: fx.Graph,
    root: torch.nn.Module,
    env: dict[fx.Node, fx.Node],
    region: list[fx.Node],
    needed: set[fx.Node],
    number: int,
) -> None:
    """Emits `region` (ops of one activation-checkpointed region) as a
    non-reentrant `torch.utils.checkpoint` call of a GraphModule of its own:
    the stage keeps the region's inputs and recomputes the rest in backward."""
    members = set(region)
    inputs: list[fx.Node] = []
    for node in region:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in inputs:
                inputs.append(arg)
    results = [
        n
        for n in region
        if isinstance(n.meta.get("val"), torch.Tensor)
        and (n in needed or any(u not in members for u in n.users))
    ]
    sub = fx.Graph()
    sub_env: dict[fx.Node, fx.Node] = {}
    for arg in inputs:
        sub_env[arg] = sub.placeholder(arg.name)
        sub_env[arg].meta = dict(arg.meta)
    for node in region:
        sub_env[node] = _copy(sub, node, sub_env)
    sub.output(tuple(sub_env[n] for n in results))
    name = f"recompute_{number}"
    root.add_module(name, fx.GraphModule(torch.nn.Module(), sub, class_name="Recompute"))
    call = graph.call_function(
        torch.utils.checkpoint.checkpoint,
        (graph.get_attr(name), *(env[a] for a in inputs)),
        {"use_reentrant": False},
    )
    for k, node in enumerate(results):
        env[node] = graph.call_function(operator.getitem, (call, k))
        env[node].meta = dict(node.meta)


def _install(root: torch.nn.Module, fqn: str, value: Any, persistent: bool) -> None:
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(value, torch.nn.Parameter):
        module.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(leaf, value, persistent=persistent)
    else:
        setattr(module, leaf, value)


def _fix_buffer_persistence(gm: fx.GraphModule, root: torch.nn.Module) -> None:
    # GraphModule copies buffers as persistent; keep the model's choice so
    # that state_dict keys match the unpipelined model.
    for name, module in root.named_modules():
        for buf in module._non_persistent_buffers_set:
            target = gm.get_submodule(name) if name else gm
            target._non_persistent_buffers_set.add(buf)


def _input_names(in_spec: pytree.TreeSpec, count: int) -> list[str]:
    """Readable names for flattened inputs: 'args[0]', 'input_ids', 'batch["x"]'."""
    names = []

    def walk(spec: pytree.TreeSpec, prefix: str) -> None:
        if spec.is_leaf():
            names.append(prefix)
            return
        keys = spec.context if isinstance(spec.context, list) else None
        for i, child in enumerate(_children(spec)):
            key = keys[i] if keys is not None else i
            walk(child, f"{prefix}[{key!r}]" if prefix else str(key))

    args_spec, kwargs_spec = _children(in_spec)
    for i, child in enumerate(_children(args_spec)):
        walk(child, f"args[{i}]")
    for key, child in zip(kwargs_spec.context, _children(kwargs_spec), strict=True):
        walk(child, key)
    return names if len(names) == count else [f"input {i}" for i in range(count)]


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    # torch >= 2.10 has TreeSpec.children(); 2.9 only the children_specs list.
    children = getattr(type(spec), "children", None)
    return list(spec.children()) if callable(children) else list(spec.children_specs)


def _input_spec(example: Any) -> TensorSpec | Any:
    return TensorSpec.of(example) if isinstance(example, torch.Tensor) else example
