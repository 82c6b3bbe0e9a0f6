"""Splitting a stage's backward into an input-gradient and a weight-gradient graph.

Zero-bubble schedules run the backward of a stage in two tasks: I computes the
gradients of the stage's inputs (which the previous stage is waiting for) and
W, later, the gradients of its weights. Like JaxPP, we split by dataflow, not
with autograd hooks: the stage's forward and backward are traced once into a
joint graph, and its nodes are cut into three graphs

    F: (params, inputs)                 -> (outputs, saved)
    I: (params, saved_I, output grads)  -> (input grads, saved_W from I)
    W: (params, saved_W)                -> (weight grads)

where a backward node needed for an input gradient belongs to I and the rest
to W; everything W needs from I is passed along instead of recomputed, so I
and W together do the work of one backward. The three are plain graphs of ATen
ops without autograd, so each can be compiled with torch.compile.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .markers import TRACE_LOCK, compiled
from .pipe import static_numel

__all__: list[str] = []


def _ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _mutates(node: fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target._schema.is_mutable
    )


# What selective recompute keeps: outputs of the ops whose recomputation
# would cost most (matrix multiplications, attention, convolutions).
SELECTIVE_KEPT_OPS = {
    torch.ops.aten.mm,
    torch.ops.aten.addmm,
    torch.ops.aten.bmm,
    torch.ops.aten.baddbmm,
    torch.ops.aten.convolution,
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
}


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)
    if packet in SELECTIVE_KEPT_OPS or torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_recompute_context() -> tuple[Any, Any]:
    """`torch.utils.checkpoint`'s contexts for selective recompute of an eager
    forward: the same ops kept as `keeps` keeps in a split stage's graphs."""
    contexts: tuple[Any, Any] = create_selective_checkpoint_contexts(_keep_matmuls)  # type: ignore[no-untyped-call]
    return contexts


def keeps(node: fx.Node) -> bool:
    """Whether selective recompute keeps `node`'s value rather than recompute it:
    costly ops, random ops (a replay would draw other numbers) and writes."""
    target = node.target
    if target is operator.getitem and isinstance(node.args[0], fx.Node):
        return keeps(node.args[0])
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return (
        target.overloadpacket in SELECTIVE_KEPT_OPS
        or torch.Tag.nondeterministic_seeded in target.tags
        or target._schema.is_mutable
    )


def _rematerialize(gm: fx.GraphModule, outs: Sequence[Any], tangents: Sequence[fx.Node]) -> None:
    """Makes the backward nodes of a joint graph recompute the forward values
    they read that selective recompute does not keep (copies placed before
    the first node that reads an output gradient), so F saves only kept
    values and its inputs."""
    graph = gm.graph
    forward = {n for n in _ancestors(outs) if n.op == "call_function"}
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    after_tangents: set[fx.Node] = set(tangents)
    for n in nodes:
        if n not in after_tangents and any(a in after_tangents for a in n.all_input_nodes):
            after_tangents.add(n)
    first = next((n for n in nodes if n.op == "call_function" and n in after_tangents), None)
    if first is None:
        return
    copies: dict[fx.Node, fx.Node] = {}

    def recomputed(value: fx.Node) -> fx.Node:
        if value not in forward or keeps(value) or position[value] > position[first]:
            return value
        if value not in copies:
            args = fx.map_arg(value.args, recomputed)
            kwargs = fx.map_arg(value.kwargs, recomputed)
            with graph.inserting_before(first):
                copy = graph.call_function(value.target, args, kwargs)  # type: ignore[arg-type]
            copy.meta = dict(value.meta)
            copies[value] = copy
        return copies[value]

    for node in nodes[position[first] :]:
        if node.op == "call_function" and node not in forward:
            node.args = fx.map_arg(node.args, recomputed)
            node.kwargs = fx.map_arg(node.kwargs, recomputed)
    graph.lint()
    gm.recompile()


def _freshest_first(nodes: Iterable[fx.Node], part: set[fx.Node]) -> list[fx.Node]:
    """`part`'s nodes in a topological order that starts from the last node of
    `nodes` (each with its dependencies just before it), then the one before.

    W's nodes come in the joint backward's order: the last layer's weight
    gradients first, reading what I produced first. Run the other way, W
    starts from what I produced last, still in cache when W follows I. The
    ops and each gradient are the same; only independent work is reordered."""
    order: list[fx.Node] = []
    done: set[fx.Node] = set()
    for root in reversed(list(nodes)):
        if root not in part or root in done:
            continue
        stack: list[tuple[fx.Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if node in done:
                continue
            done.add(node)
            stack.append((node, True))
            stack.extend((a, False) for a in node.all_input_nodes if a in part and a not in done)
    return order


def _subgraph(
    source: fx.GraphModule,
    part: set[fx.Node],
    inputs: Sequence[fx.Node],
    outputs: Sequence[Any],
    freshest_first: bool = False,
) -> fx.GraphModule:
    """A GraphModule computing `outputs` from `inputs` with the nodes of `part`
    (in the source's order, or `_freshest_first`)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"in{i}_{node.name}")
        env[node].meta = dict(node.meta)

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op != "get_attr":
                raise AssertionError(f"split: node {n.name} is needed but not available")
            env[n] = graph.get_attr(str(n.target))
        return env[n]

    nodes = [n for n in source.graph.nodes if n in part and n.op == "call_function"]
    for node in _freshest_first(nodes, set(nodes)) if freshest_first else nodes:
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(lookup(o) if isinstance(o, fx.Node) else o for o in outputs))
    graph.eliminate_dead_code()
    return fx.GraphModule(source, graph)


@dataclass
class _Joint:
    forward: fx.GraphModule
    input_grad: fx.GraphModule
    weight_grad: fx.GraphModule
    num_outputs: int  # outputs of the stage function (sends, then the loss)
    saved_for_input_grad: list[int]  # indices into F's saved list
    saved_for_weight_grad: list[int]
    tangent_outputs: list[int]  # which outputs get a tangent (those requiring grad)
    tangent_examples: list[torch.Tensor]  # zeros of their shapes, for absent gradients
    num_input_grads: int
    input_grad_examples: list[torch.Tensor]  # zeros like each graded input
    grad_params: list[int]  # indices into the stage's parameter list


def split_joint(
    fn: Callable[..., list[torch.Tensor]],
    params: list[torch.Tensor],
    inputs: list[torch.Tensor],
    grad_inputs: list[int],
    selective: bool = False,
) -> _Joint:
    """Traces fn(params, inputs) -> outputs with its backward, and splits it.

    With `selective`, F passes on only the outputs of matmuls, attention and
    random ops (`keeps`); the backward recomputes everything else it reads.

    `grad_inputs` are the positions in `inputs` whose gradients I returns.
    Gradients go to every parameter that requires grad.
    """
    grad_params = [i for i, p in enumerate(params) if p.requires_grad]
    p_ex = [p.detach().clone().requires_grad_(p.requires_grad) for p in params]
    x_ex = [x.detach().clone().requires_grad_(i in grad_inputs) for i, x in enumerate(inputs)]
    with torch.enable_grad():
        probe = fn(p_ex, x_ex)
    tangent_outputs = [i for i, o in enumerate(probe) if o.requires_grad]
    # Output gradients arrive contiguous (received into fresh buffers), whatever
    # the layout of the output itself (a permuted view, channels-last): the
    # backward is traced for that layout, and I lays any other out so.
    tangents_ex = [
        torch.ones_like(probe[i], memory_format=torch.contiguous_format) for i in tangent_outputs
    ]

    def joint(
        ps: list[torch.Tensor], xs: list[torch.Tensor], ts: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        outs = fn(ps, xs)
        wrt = [xs[i] for i in grad_inputs] + [ps[i] for i in grad_params]
        roots = [outs[i] for i in tangent_outputs]
        grads = (
            torch.autograd.grad(roots, wrt, ts, allow_unused=True)
            if roots and wrt
            else [None] * len(wrt)
        )
        return list(outs), list(grads)

    with TRACE_LOCK, torch.enable_grad():
        gm = make_fx(joint)(p_ex, x_ex, tangents_ex)
    if any(_mutates(n) for n in gm.graph.nodes):
        # A backward formula that writes in place (adaptive pooling's `copy_`
        # into a view of a fresh buffer) leaves a node nothing reads, which a
        # cut by dataflow would drop. Functionalised, the write is a value.
        with TRACE_LOCK:
            gm = make_fx(functionalize(gm, remove="mutations"))(
                [p.detach() for p in p_ex],
                [x.detach() for x in x_ex],
                tangents_ex,
            )

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_p, n_x = len(params), len(inputs)
    p_nodes = placeholders[:n_p]
    x_nodes = placeholders[n_p : n_p + n_x]
    t_nodes = placeholders[n_p + n_x :]
    out_nodes = pytree.tree_leaves(gm.graph.output_node().args[0], is_leaf=lambda v: v is None)
    n_out = len(probe)
    outs, grads = out_nodes[:n_out], out_nodes[n_out:]
    grads_x, grads_p = grads[: len(grad_inputs)], grads[len(grad_inputs) :]
    if selective:
        _rematerialize(gm, outs, placeholders[len(params) + len(inputs) :])

    forward_part = {n for n in _ancestors(outs) if n.op == "call_function"}
    backward = {n for n in gm.graph.nodes if n.op == "call_function" and n not in forward_part}
    input_part = _ancestors(grads_x) & backward
    weight_part = (_ancestors(grads_p) & backward) - input_part
    dropped = [n for n in backward - input_part - weight_part if _mutates(n)]
    if dropped:
        raise RuntimeError(
            "split backward: the traced backward writes in place in a way the I/W cut cannot "
            f"place ({', '.join(f'{n.name} = {n.target}' for n in dropped)}); "
            "use full backward (B) for this stage"
        )
    # A projection of a multi-output op lives with the op, so only tensors
    # (never tuples) cross from one graph to the next.
    for node in gm.graph.nodes:
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            for part in (forward_part, input_part):
                if node.args[0] in part:
                    for other in (forward_part, input_part, weight_part):
                        other.discard(node)
                    part.add(node)

    def used_by(part: set[fx.Node]) -> list[fx.Node]:
        needed = []
        for node in gm.graph.nodes:
            if node in part:
                for a in node.all_input_nodes:
                    if a not in part and a not in needed:
                        needed.append(a)
        return needed

    def outputs_outside(part_outputs: Sequence[Any], part: set[fx.Node]) -> list[fx.Node]:
        return [o for o in part_outputs if isinstance(o, fx.Node) and o not in part]

    # What I and W read from outside themselves (besides parameters).
    i_needs = [
        n for n in used_by(input_part) + outputs_outside(grads_x, input_part) if n not in p_nodes
    ]
    w_needs = [
        n for n in used_by(weight_part) + outputs_outside(grads_p, weight_part) if n not in p_nodes
    ]
    from_forward = [
        n
        for n in dict.fromkeys(i_needs + w_needs)
        if n.op != "get_attr" and n not in t_nodes and n not in input_part
    ]
    saved_i = [n for n in i_needs if n in from_forward]
    saved_w_f = [n for n in w_needs if n in from_forward]
    passed_i_to_w = [n for n in w_needs if n in input_part or n in t_nodes]

    forward = _subgraph(gm, forward_part, p_nodes + x_nodes, [*outs, *from_forward])
    input_grad = _subgraph(gm, input_part, p_nodes + saved_i + t_nodes, [*grads_x, *passed_i_to_w])
    weight_grad = _subgraph(
        gm, weight_part, p_nodes + saved_w_f + passed_i_to_w, list(grads_p), freshest_first=True
    )
    index = {n: i for i, n in enumerate(from_forward)}
    return _Joint(
        forward=forward,
        input_grad=input_grad,
        weight_grad=weight_grad,
        num_outputs=n_out,
        saved_for_input_grad=[index[n] for n in saved_i],
        saved_for_weight_grad=[index[n] for n in saved_w_f],
        tangent_outputs=tangent_outputs,
        tangent_examples=[torch.zeros_like(t) for t in tangents_ex],
        num_input_grads=len(grad_inputs),
        input_grad_examples=[torch.zeros_like(inputs[i]) for i in grad_inputs],
        grad_params=grad_params,
    )


def data_dependent(module: torch.nn.Module | None) -> str | None:
    """Where a stage's graph computes a tensor whose shape depends on the data
    (`aten.nonzero` in module 'layers.1.moe'), or None (None too for a stage
    without a graph): such a stage cannot be split into I/W graphs traced for
    one microbatch's shapes."""
    if not isinstance(module, fx.GraphModule):
        return None
    for n in module.graph.nodes:
        value = n.meta.get("val")
        if (
            isinstance(n.target, torch._ops.OpOverload)
            and isinstance(value, torch.Tensor)
            and static_numel(value) is None
        ):
            where = list((n.meta.get("nn_module_stack") or {"": ("", "")}).values())[-1][0]
            return f"{n.target} in module '{where}'"
    return None


def _as_traced(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """`t` laid out with the strides its graph was traced with (a copy only
    where they differ: a gradient received contiguous for a channels-last
    output, an activation handed over as a permuted view)."""
    if t.layout != torch.strided or t.stride() == stride or t.dim() != len(stride):
        return t
    if any(st == 0 and n > 1 for st, n in zip(stride, t.shape, strict=True)):
        return t  # traced as a broadcast: no layout to copy into
    out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _own_storage(g: torch.Tensor, p: torch.Tensor, others: set[int]) -> bool:
    """Whether gradient `g` can become `p.grad` (detached) without a copy: a
    strided tensor that fills its storage exactly, strided like the
    parameter, in a storage none of `others` (data pointers of the storages
    of parameters, W's inputs and gradients taken before) uses. A view of a W
    result (`t(t(mm))`) qualifies; its detached alias is not a view."""
    if g.layout != torch.strided or p.layout != torch.strided:
        return False
    if g.stride() != p.stride() or g.dtype != p.dtype or g.storage_offset() != 0:
        return False
    storage = g.untyped_storage()
    return storage.nbytes() == g.numel() * g.element_size() and storage.data_ptr() not in others


class SplitStage:
    """One stage run as F / I / W graphs (see the module docstring)."""

    def __init__(
        self,
        module: fx.GraphModule,
        stage_fn: Callable[
            [list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]
        ],
        example_inputs: list[torch.Tensor],
        grad_inputs: list[int],
        compile_options: dict[str, Any] | None,
        loss_output: int | None = None,
        selective: bool = False,
    ) -> None:
        dynamic = data_dependent(module)
        if dynamic is not None:
            raise ValueError(
                f"{dynamic} computes a tensor whose shape depends on the data (e.g. MoE "
                "routing); split backward (I/W) traces a stage with the shapes of one "
                "microbatch: run this stage's whole backward (B), schedule.with_full_backward("
                "[stage]), as split_backward='auto' does by itself"
            )
        self._params = [p for _, p in module.named_parameters()]
        named_buffers = list(module.named_buffers())
        self._buffers = [b for _, b in named_buffers]
        n_params = len(self._params)
        # Buffers the stage writes (BatchNorm statistics): the traced forward
        # writes into copies and returns their new values after its outputs;
        # forward() puts them into the buffers, microbatch after microbatch.
        written = {
            str(n.args[0].target)
            for n in module.graph.nodes
            if n.target is torch.ops.aten.copy_.default
            and isinstance(n.args[0], fx.Node)
            and n.args[0].op == "get_attr"
        }
        self._updated = [i for i, (name, _) in enumerate(named_buffers) if name in written]

        def fn(state: list[torch.Tensor], xs: list[torch.Tensor]) -> list[torch.Tensor]:
            buffers = list(state[n_params:])
            for i in self._updated:
                buffers[i] = buffers[i].clone()
            outs = stage_fn(state[:n_params], buffers, xs)
            return [*outs, *(buffers[i] for i in self._updated)]

        state = self._params + self._buffers
        self.joint = split_joint(fn, state, example_inputs, grad_inputs, selective)
        # The graphs are traced for these layouts (a view in them may need it).
        self._input_strides = [x.stride() for x in example_inputs]
        self._loss_output = loss_output
        self._forward: Callable[..., Any] = self.joint.forward
        self._input_grad: Callable[..., Any] = self.joint.input_grad
        self._weight_grad: Callable[..., Any] = self.joint.weight_grad
        self._compiled = compile_options is not None
        if compile_options is not None:
            self._forward = compiled(self._forward, compile_options)
            self._input_grad = compiled(self._input_grad, compile_options)
            self._weight_grad = compiled(self._weight_grad, compile_options)

    def _state(self) -> list[torch.Tensor]:
        return [p.detach() for p in self._params] + list(self._buffers)

    def forward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Stage outputs, then every tensor I and W will need (buffers updated)."""
        laid_out = [_as_traced(x, s) for x, s in zip(inputs, self._input_strides, strict=True)]
        result = list(self._forward(*self._state(), *laid_out))
        if not self._updated:
            return result
        end = self.joint.num_outputs
        start = end - len(self._updated)
        with torch.no_grad():
            for i, value in zip(self._updated, result[start:end], strict=True):
                self._buffers[i].copy_(value)
        return result[:start] + result[end:]

    def input_grad(
        self, saved: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Gradients of the stage inputs, and what W needs."""
        j = self.joint
        tangents = []
        for i, zero in zip(j.tangent_outputs, j.tangent_examples, strict=True):
            given = output_grads[i] if i < len(output_grads) else None
            if i == self._loss_output:
                tangents.append(torch.ones_like(zero))  # d(loss)/d(loss)
            elif given is not None:
                tangents.append(_as_traced(given, zero.stride()))
            else:
                tangents.append(zero)  # an output no later stage differentiates
        result = list(
            self._input_grad(*self._state(), *(saved[i] for i in j.saved_for_input_grad), *tangents)
        )
        grads = [
            g if g is not None else zero
            for g, zero in zip(result[: j.num_input_grads], j.input_grad_examples, strict=True)
        ]
        passed = result[j.num_input_grads :]
        return grads, [saved[i] for i in j.saved_for_weight_grad] + passed

    def weight_grad(self, saved_w: Sequence[torch.Tensor]) -> None:
        """Accumulates the weight gradients into the parameters' .grad."""
        grads = self._weight_grad(*self._state(), *saved_w)
        # Storages a gradient must not take over (computed once, if needed).
        others: set[int] | None = None
        for i, g in zip(self.joint.grad_params, grads, strict=True):
            if g is None:
                continue
            p = self._params[i]
            if p.grad is not None:
                p.grad.add_(g)
                continue
            if others is None:
                others = {
                    t.untyped_storage().data_ptr()
                    for t in [*self._params, *self._buffers, *saved_w]
                    if t.layout == torch.strided
                }
            # Like autograd's AccumulateGrad: a fresh gradient only W holds,
            # laid out like its parameter, becomes .grad as it is. Not from a
            # compiled W, whose outputs may live in a pool it reuses (CUDA
            # graphs).
            if not self._compiled and _own_storage(g, p, others):
                p.grad = g.detach()
            else:
                p.grad = g.detach().clone()
            if g.layout == torch.strided:
                others.add(g.untyped_storage().data_ptr())
