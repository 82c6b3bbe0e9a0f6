"""`mpmd.trace`: from an unmodified nn.Module to a partitioned `Pipe`.

The model is captured with torch.export (non-strict, so real Python runs and
Hugging Face models work) and functionalised, so in-place ops become
out-of-place ones that can be split between stages. The graph is serialised
into the C++ stage compiler (`_C.graph.partition`), and its `StagePlan` is
turned back into one `torch.fx.GraphModule` per stage whose parameters keep
the model's own names.
"""

from __future__ import annotations

import contextlib
import math
import operator
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .. import _C
from .markers import STAGE_END_OP, _tracing
from .pipe import Pipe, StageSpec, TensorSpec, TransferInfo
from .plan import Plan, StageNodes, partition

__all__ = ["trace"]

_ASSERT_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
}

# Ops whose outputs carry no gradient even for float tensors.
_NON_DIFFERENTIABLE = {
    torch.ops.aten.detach.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.full_like.default,
    torch.ops.aten.rand_like.default,
    torch.ops.aten.randn_like.default,
    torch.ops.aten.randint_like.default,
}

# Recomputing a node in every stage that reads it beats sending its value
# when it costs at most this many flops per output element (elementwise,
# indexing and shape ops; not real matrix products).
_REPLICATE_FLOPS_PER_ELEMENT = 64


def trace(
    model: torch.nn.Module,
    example_args: Any = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    split_before: Sequence[str] | None = None,
    split_after: Sequence[str] | None = None,
) -> Pipe:
    """Traces `model` on one microbatch and splits it into pipeline stages.

    Stages come from `mpmd.mark_stage_end` calls in the model, or from module
    paths: `split_before=["layers.4"]` starts a stage at that module,
    `split_after=[...]` ends one there. The returned `Pipe` holds one
    `torch.fx.GraphModule` per stage, sharing the model's parameters.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"mpmd.trace: model must be a torch.nn.Module, got {type(model).__name__}")
    if split_before is not None and split_after is not None:
        raise ValueError(
            "mpmd.trace: pass split_before or split_after, not both; "
            "a stage boundary is either at the start or at the end of a module"
        )
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs = dict(example_kwargs or {})
    points = split_before if split_before is not None else split_after
    if isinstance(points, str):
        raise TypeError(
            f"mpmd.trace: split points must be a list of module paths, got the string {points!r}; "
            f"write [{points!r}]"
        )

    with warnings.catch_warnings():
        # torch.export's own use of a deprecated pytree API (torch >= 2.13).
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        exported = _export(model, args, kwargs)
        functional = exported.run_decompositions({})
    graph = functional.graph_module.graph
    _restore_no_grad_regions(graph, exported)
    del exported
    marker_after = _remove_markers(graph)
    _remove_asserts(graph)
    graph.lint()

    if points is not None and marker_after:
        raise ValueError(
            f"mpmd.trace: the model calls mpmd.mark_stage_end {len(marker_after)} time(s) and "
            f"{'split_before' if split_before is not None else 'split_after'} is given too; "
            "define stages one way: remove the markers or the split list"
        )
    builder = _GraphBuilder(model, functional, args, kwargs)
    stage_graph = builder.serialise()
    if points is None:
        mode = _C.graph.SplitMode.markers
    elif split_before is not None:
        mode = _C.graph.SplitMode.before
    else:
        mode = _C.graph.SplitMode.after
    module_paths = [name for name, _ in model.named_modules(remove_duplicate=False)]
    spec = _C.graph.SplitSpec(
        mode=mode,
        points=list(points or []),
        module_paths=module_paths,
        marker_positions=[builder.position_after(node) for node in marker_after],
    )
    return builder.build_pipe(partition(stage_graph, spec))


# --------------------------------------------------------------------------- export


class _ModuleTracker:
    """Knows which module calls are in progress, to say where tracing failed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.stack: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        def pre(module: torch.nn.Module, _args: Any) -> None:
            if id(module) in self._names:
                self.stack.append((self._names[id(module)], type(module).__name__))

        def post(module: torch.nn.Module, _args: Any, _out: Any) -> None:
            if id(module) in self._names and self.stack:
                self.stack.pop()

        handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(pre),
            torch.nn.modules.module.register_module_forward_hook(post),
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _export(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ExportedProgram:
    tracker = _ModuleTracker(model)
    try:
        with _tracing(), tracker.watch():
            return torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # re-raised with where and what to do
        raise RuntimeError(_trace_failure_message(exc, tracker.stack)) from exc


def _trace_failure_message(exc: Exception, stack: list[tuple[str, str]]) -> str:
    if stack:
        path, cls = stack[-1]
        where = f"in module '{path}' ({cls})" if path else f"in the root module ({cls})"
    else:
        where = "outside any module call"
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "/torch/" not in f.filename and "/torchmpmd/" not in f.filename
    ]
    line = f" at {frames[-1].filename}:{frames[-1].lineno} `{frames[-1].line}`" if frames else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = str(exc)
    if "which is not a known type" in text or "register a pytree" in text:
        hint = (
            "the model returns or takes an object torch cannot flatten into tensors; return "
            "only tensors (for Hugging Face models pass use_cache=False)"
        )
    elif "data-dependent" in text or "GuardOnDataDependent" in text:
        hint = (
            "control flow depends on tensor values; make it depend on shapes or constants, "
            "or use torch.cond"
        )
    else:
        hint = "make that code traceable by torch.export (non-strict), or move it out of forward"
    return (
        f"mpmd.trace could not trace the model {where}{line}: {type(exc).__name__}: {first}. "
        f"To fix: {hint}."
    )


# ----------------------------------------------------------------- graph rewrites


def _node_sources(node: fx.Node) -> Iterator[tuple[str, int]]:
    pending = list(node.meta.get("from_node", ()))
    while pending:
        src = pending.pop()
        yield src.name, src.graph_id
        pending.extend(getattr(src, "from_node", ()) or ())


def _restore_no_grad_regions(graph: fx.Graph, exported: ExportedProgram) -> None:
    """Cuts the gradient where the model ran code under torch.no_grad().

    Functionalisation inlines `no_grad` regions and forgets them; their nodes
    still point at the region in the training graph (`from_node`). Detaching
    every value that leaves a region gives the same values and gradients.
    """
    training = exported.graph_module.graph
    regions = {
        (n.name, id(training))
        for n in training.nodes
        if n.op == "call_function"
        and n.target is torch.ops.higher_order.wrap_with_set_grad_enabled
        and n.args[0] is False
    }
    if not regions:
        return
    inside = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        parent = node.args[0] if node.target is operator.getitem else None
        if parent in inside or any(src in regions for src in _node_sources(node)):
            inside.add(node)
    for node in list(graph.nodes):
        if node not in inside or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        outside = [u for u in node.users if u not in inside]
        if not outside:
            continue
        with graph.inserting_after(node):
            detached = graph.call_function(torch.ops.aten.detach.default, (node,))
        detached.meta = {k: v for k, v in node.meta.items() if k != "from_node"}
        detached.meta["val"] = node.meta["val"].detach()
        for user in outside:
            user.replace_input_with(node, detached)


def _remove_markers(graph: fx.Graph) -> list[fx.Node | None]:
    """Deletes the mark_stage_end ops; returns, per marker, the node after it."""
    markers = [n for n in graph.nodes if n.op == "call_function" and n.target is STAGE_END_OP]
    after: list[fx.Node | None] = []
    for marker in markers:
        nxt = marker.next
        while nxt.op != "output" and (
            nxt.target is STAGE_END_OP
            or (nxt.target is operator.getitem and nxt.args[0] in markers)
        ):
            nxt = nxt.next
        after.append(None if nxt.op == "output" else nxt)
    for marker in markers:
        (values,) = marker.args
        for user in list(marker.users):
            if user.target is not operator.getitem:
                raise RuntimeError(
                    f"mpmd.trace: mark_stage_end result used by {user.format_node()}; "
                    "use its return value as the marked tensors"
                )
            user.replace_all_uses_with(values[user.args[1]])
            graph.erase_node(user)
    for marker in markers:
        graph.erase_node(marker)
    return after


def _remove_asserts(graph: fx.Graph) -> None:
    # Metadata checks torch.export inserts; the pipeline checks inputs itself,
    # and keeping them would send values across stages just to assert on them.
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERT_OPS and not node.users:
            graph.erase_node(node)


# ---------------------------------------------------------------- serialisation


def _tensor_bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
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
    out = val.numel() if isinstance(val, torch.Tensor) else 1
    ins = [a.meta.get("val") for a in node.all_input_nodes]
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


class _GraphBuilder:
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
                    raise RuntimeError(
                        f"mpmd.trace: the model takes a {spec.kind.name} input ('{node.name}'); "
                        "pipelines support tensors, parameters, buffers and constants"
                    )
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
            transferable=isinstance(val, torch.Tensor),
        )
        self.nodes.append(node)

    def position_after(self, node: fx.Node | None) -> int:
        return len(self.nodes) if node is None else self.ids[node]

    # ---- stage construction

    def build_pipe(self, plan: Plan) -> Pipe:
        aliases = _parameter_aliases(self.model)
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
        for i in nodes.params + nodes.buffers:
            node = self.nodes[i]
            fqn = self._choose_alias(node, nodes, aliases)
            _install(root, fqn, self.state[node.name], persistent.get(self._fqn(node), True))
            env[node] = graph.get_attr(fqn)
            env[node].meta = dict(node.meta)
        for i in nodes.compute:
            node = self.nodes[i]
            if node.op == "get_attr":
                target = str(node.target)
                _install(root, target, getattr(self.program.graph_module, target), True)
            env[node] = graph.node_copy(node, lambda n: env[n])
        for update in nodes.buffer_updates:
            graph.call_function(
                torch.ops.aten.copy_.default,
                (env[self.nodes[update.buffer]], env[self.nodes[update.value]]),
            )
        outputs = [self.nodes[i] for i in nodes.sends]
        if s == plan.num_stages - 1:
            outputs += [self.nodes[i] for i in plan.outputs]
        graph.output(tuple(env[n] for n in outputs))
        graph.lint()
        gm = fx.GraphModule(root, graph, class_name=f"Stage{s}")
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


def _parameter_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every name of every parameter and buffer, keyed by each of its names."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), []).append(name)
    return {name: names for names in by_id.values() for name in names}


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
