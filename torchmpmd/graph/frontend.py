"""`mpmd.trace`: from an unmodified nn.Module to a partitioned `Pipe`.

The model is captured with torch.export (non-strict, so real Python runs and
Hugging Face models work) and functionalised, so in-place ops become
out-of-place ones that can be split between stages. `builder` serialises the
graph for the C++ stage compiler (`plan.partition`) and turns the plan back
into one `torch.fx.GraphModule` per stage whose parameters keep the model's
own names.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from .. import _C
from .builder import GraphBuilder
from .diagnose import ModuleTracker, host_random_message, trace_failure_message
from .experts import experts_modules, traced_as_calls
from .inputs import example_inputs
from .markers import RECOMPUTE_REGION_OP, STAGE_END_OP, TRACE_LOCK, _tracing
from .pipe import Pipe
from .plan import partition

__all__ = ["trace"]

_ASSERT_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
}


def trace(
    model: torch.nn.Module,
    example_args: Any = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    split_before: Sequence[str] | None = None,
    split_after: Sequence[str] | None = None,
    experts: Sequence[str] | None = None,
) -> Pipe:
    """Traces `model` on one microbatch and splits it into pipeline stages.

    Stages come from `mpmd.mark_stage_end` calls in the model, or from module
    paths: `split_before=["layers.4"]` starts a stage at that module,
    `split_after=[...]` ends one there. (`mpmd.trace` also takes
    `num_stages=N`, which asks `torchmpmd.planner` for the split.) The
    returned `Pipe` holds one `torch.fx.GraphModule` per stage, sharing the
    model's parameters.

    A mixture of experts' experts modules (`graph.experts`: found by
    themselves, or named by `experts=["layers.*.moe.experts"]`; `[]` for
    none) are traced as one call each and run as modules, with the routed
    tokens' shapes of each microbatch; an expert parallelism shards them.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"mpmd.trace: model must be a torch.nn.Module, got {type(model).__name__}")
    if split_before is not None and split_after is not None:
        raise ValueError(
            "mpmd.trace: pass split_before or split_after, not both; "
            "a stage boundary is either at the start or at the end of a module"
        )
    args, kwargs = example_inputs("mpmd.trace", example_args, example_kwargs)
    _check_signature(model, args, kwargs)
    points = split_before if split_before is not None else split_after
    if isinstance(points, str):
        raise TypeError(
            f"mpmd.trace: split points must be a list of module paths, got the string {points!r}; "
            f"write [{points!r}]"
        )
    bad = [p for p in points or [] if not isinstance(p, str)]
    if bad:
        raise TypeError(
            f"mpmd.trace: split points are module paths (strings) such as 'layers.4', got "
            f"{bad[0]!r} ({type(bad[0]).__name__}); name the module where a stage starts "
            "(split_before) or ends (split_after)"
        )
    args, kwargs = _example_inputs(model, args, kwargs)

    with warnings.catch_warnings():
        # torch.export's own use of a deprecated pytree API (torch >= 2.13).
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        exported = _export(
            model, args, kwargs, experts_modules(model, experts), experts is not None
        )
        functional = exported.run_decompositions({})
    graph = functional.graph_module.graph
    _restore_module_stacks(graph, exported)
    _restore_no_grad_regions(graph, exported)
    del exported
    # Asserts first: a marker's boundary is the node after it, never a check
    # that is about to go.
    _remove_asserts(graph)
    _mark_recompute_regions(graph)
    marker_after = _remove_markers(graph)
    graph.lint()

    if points is not None and marker_after:
        raise ValueError(
            f"mpmd.trace: the model calls mpmd.mark_stage_end {len(marker_after)} time(s) and "
            f"{'split_before' if split_before is not None else 'split_after'} is given too; "
            "define stages one way: remove the markers or the split list"
        )
    builder = GraphBuilder(model, functional, args, kwargs)
    stage_graph = builder.serialise()
    if not stage_graph.outputs:
        raise ValueError(
            f"mpmd.trace: {type(model).__name__}.forward returns no tensor computed from its "
            f"inputs (it returned {builder.describe_outputs()}); a pipeline needs the model's "
            "output (or its loss): return it from forward"
        )
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

    # A new batch shape is traced under the autocast this one was (the graph
    # records its casts): mixed precision holds for every shape.
    autocast = _autocast_now()

    def trace_again(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Pipe:
        with TRACE_LOCK, contextlib.ExitStack() as stack:
            for kind, dtype in autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            return trace(
                model,
                args,
                kwargs,
                split_before=split_before,
                split_after=split_after,
                experts=experts,
            )

    return builder.build_pipe(partition(stage_graph, spec), trace_again)


def _autocast_now() -> list[tuple[str, torch.dtype]]:
    """The device types torch.autocast is on for here, with their dtypes."""
    return [
        (kind, torch.get_autocast_dtype(kind))
        for kind in ("cpu", "cuda", "xpu", "mps", "hpu")
        if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    ]


# --------------------------------------------------------------------------- export


def _check_signature(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Rejects example inputs that cannot be a call of `model.forward`."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # not introspectable: export will say
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        params = ", ".join(
            str(p.replace(annotation=inspect.Parameter.empty, default=inspect.Parameter.empty))
            for p in signature.parameters.values()
        )
        raise TypeError(
            f"mpmd.trace: the example inputs do not fit {type(model).__name__}.forward"
            f"({params}): {err}; pass one microbatch of the model's inputs, e.g. "
            "mpmd.trace(model, (x,), {'attention_mask': mask})"
        ) from None


def _example_inputs(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example inputs as the trace takes them: each tensor an input of its
    own, and on the meta device when the model is.

    torch.export traces one tensor passed twice (`model(idx, targets=idx)`,
    `{"query": h, "key": h}`) as one value, so the graph would read the first
    argument wherever the second is used, and every later call with
    different tensors there would be silently wrong: a tensor sharing storage
    with an earlier one (the same object, or a view of it) is traced from a
    copy, so that no two inputs alias in the trace.

    A model built on the meta device cannot run ops that mix its tensors
    with real ones (`torch.triu(..., device=idx.device)` beside a meta
    weight), so real inputs are traced as meta tensors of the same shape and
    dtype: the pipe's input checks still take real batches, and a retrace at
    run time (real microbatches, the model still meta) does the same.
    """
    to_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    flat, spec = pytree.tree_flatten((args, kwargs))
    seen: set[tuple[str, int]] = set()
    out = []
    for value in flat:
        if isinstance(value, torch.Tensor):
            memory = _memory_of(value)
            if memory in seen:
                value = value.detach().clone().requires_grad_(value.requires_grad)
            else:
                seen.add(memory)
            if to_meta and not value.is_meta:
                value = value.detach().to("meta").requires_grad_(value.requires_grad)
        out.append(value)
    new_args, new_kwargs = pytree.tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs)


def _memory_of(value: torch.Tensor) -> tuple[str, int]:
    """What identifies a tensor's memory: its storage, which its views share
    (the key of torch's own storage deepcopy), or the tensor itself where it
    has none (a tensor subclass)."""
    try:
        return ("storage", int(value.untyped_storage()._cdata))
    except (RuntimeError, NotImplementedError, TypeError):
        return ("tensor", id(value))


def _export(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    experts: dict[str, torch.nn.Module],
    named: bool,
) -> ExportedProgram:
    tracker = ModuleTracker(model)
    try:
        with _tracing(), tracker.watch(), _checkpoints_marked(), traced_as_calls(experts, named):
            exported = torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # re-raised with where and what to do
        raise RuntimeError(trace_failure_message(exc, tracker.stack, model)) from exc
    if tracker.host_random is not None:
        raise RuntimeError(host_random_message(*tracker.host_random))
    return exported


@contextlib.contextmanager
def _checkpoints_marked() -> Iterator[None]:
    """Records where `torch.utils.checkpoint` regions begin and end while tracing.

    Both forms run their function as a plain call between two
    `recompute_region` marks: the non-reentrant form's saved-tensor hooks
    would otherwise vanish into plain ops, and the reentrant form runs its
    region under no_grad inside an autograd Function, which export records
    as no_grad for the region and everything after it (cutting the gradient
    eager mode gives). The stages recompute the marked ops in their backward.
    """
    module = torch.utils.checkpoint
    function = module.CheckpointFunction
    own_apply = function.__dict__.get("apply")  # None: inherited from autograd.Function
    generator = module._checkpoint_without_reentrant_generator

    def apply(run: Callable[..., Any], _preserve_rng_state: bool, *args: Any) -> Any:
        RECOMPUTE_REGION_OP(True)
        out = run(*args)
        RECOMPUTE_REGION_OP(False)
        return out

    def marked(*_args: Any, **_kwargs: Any) -> Iterator[None]:
        RECOMPUTE_REGION_OP(True)
        yield
        RECOMPUTE_REGION_OP(False)

    setattr(function, "apply", staticmethod(apply))  # noqa: B010 (class attribute)
    module._checkpoint_without_reentrant_generator = marked
    try:
        yield
    finally:
        module._checkpoint_without_reentrant_generator = generator
        if own_apply is None:
            delattr(function, "apply")
        else:
            setattr(function, "apply", own_apply)  # noqa: B010


# ----------------------------------------------------------------- graph rewrites


def _node_sources(node: fx.Node) -> Iterator[tuple[str, int]]:
    pending = list(node.meta.get("from_node", ()))
    while pending:
        src = pending.pop()
        yield src.name, src.graph_id
        pending.extend(getattr(src, "from_node", ()) or ())


def _restore_module_stacks(graph: fx.Graph, exported: ExportedProgram) -> None:
    """Gives nodes that came out of a higher-order region their module path.

    torch.export wraps `torch.no_grad()`, `torch.autocast(...)` and reentrant
    checkpoint regions into higher-order ops over a submodule; inlined by the
    decomposition, their nodes keep only the root module in their stack, so a
    split point inside such a region "never ran". The submodule's own nodes
    still have their stack: a node takes the stack of its namesake there, and
    a node with no namesake (a cast autocast inserted) that of its users.
    """
    training = exported.graph_module
    inner: dict[str, dict[str, Any]] = {}  # region node -> inner node name -> stack
    for node in training.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            stacks: dict[str, Any] = {}
            _collect_stacks(training, node, stacks)
            inner[node.name] = stacks
    if not inner:
        return
    region_id = id(training.graph)
    orphans = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        regions = [inner[n] for n, gid in _node_sources(node) if gid == region_id and n in inner]
        if not regions:
            continue
        stack = regions[0].get(node.name)
        if stack:
            node.meta["nn_module_stack"] = dict(stack)
        else:
            orphans.append(node)
    for node in reversed(orphans):
        users = [u for u in node.users if u.meta.get("nn_module_stack")]
        if users:
            node.meta["nn_module_stack"] = dict(users[0].meta["nn_module_stack"])


def _collect_stacks(owner: fx.GraphModule, region: fx.Node, out: dict[str, Any]) -> None:
    for arg in region.args:
        if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
            continue
        sub = getattr(owner, str(arg.target), None)
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op != "call_function":
                continue
            if isinstance(node.target, torch._ops.HigherOrderOperator):
                _collect_stacks(sub, node, out)
            elif node.meta.get("nn_module_stack"):
                out[node.name] = node.meta["nn_module_stack"]


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
        # A stage marker is an identity in eager mode, even under no_grad: the
        # gradient flows through it, so it is never part of a region.
        if node.target is STAGE_END_OP or (
            isinstance(parent, fx.Node) and parent.target is STAGE_END_OP
        ):
            continue
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


def _mark_recompute_regions(graph: fx.Graph) -> None:
    """Tags the ops between each pair of recompute marks with the region's
    number (`meta["recompute_region"]`; nested regions join the outer one)
    and deletes the marks."""
    depth, region = 0, -1
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is RECOMPUTE_REGION_OP:
            begin = bool(node.args[0])
            if begin and depth == 0:
                region += 1
            depth = depth + 1 if begin else max(depth - 1, 0)
            graph.erase_node(node)
        elif depth > 0:
            node.meta["recompute_region"] = region


def _remove_asserts(graph: fx.Graph) -> None:
    # Metadata checks torch.export inserts; the pipeline checks inputs itself,
    # and keeping them would send values across stages just to assert on them.
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERT_OPS and not node.users:
            graph.erase_node(node)
