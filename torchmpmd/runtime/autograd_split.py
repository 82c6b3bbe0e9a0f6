"""Split backward (I/W) of an eager stage, through autograd, without tracing.

A traced stage is cut into F/I/W graphs (`graph.split`). An eager stage
(`mpmd.from_stages`) has no graph to cut, so its split works on the autograd
graph its forward records, as torch.distributed.pipelining's zero-bubble
stages do:

- F runs the module with grad on, keeping its outputs and input leaves.
- I computes the gradients of the stage inputs (graph retained). On the way,
  a hook on every "branch node", where a path to a parameter leaves the paths
  to the inputs, keeps the gradient arriving there.
- W continues from the branch nodes to the parameters, one autograd call per
  group of parameters that share branch nodes, so nothing I computed is
  computed again. A stage without differentiable inputs (the first) does its
  whole backward in W, which the schedule places where the bubble was.

The state between F, I and W lives here, keyed by microbatch, and is dropped
at the next step's start (`reset`), also after a failed step.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.tensor import DTensor

__all__: list[str] = []


@dataclass(slots=True)
class _Group:
    """Parameters whose gradients continue from the same branch nodes."""

    params: set[Node]
    branches: set[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass(slots=True)
class _Pending:
    roots: list[torch.Tensor]  # outputs (the loss included); after I, those with a gradient
    leaves: list[torch.Tensor]  # inputs that take gradient
    groups: list[_Group] | None = None  # after I (None: no input takes gradient)
    root_grads: list[torch.Tensor] | None = None  # after I


def _node(t: torch.Tensor) -> Node | None:
    """A tensor's autograd node: its grad_fn, or a leaf's AccumulateGrad."""
    grad_fn: Node | None = t.grad_fn
    if grad_fn is not None:
        return grad_fn
    if not t.requires_grad:
        return None
    fn = t.view_as(t).grad_fn
    assert fn is not None
    acc: Node | None = fn.next_functions[0][0]
    return acc


class AutogradSplit:
    """F / I / W of one eager stage (see the module docstring)."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._params = [p for p in params if p.requires_grad]
        self._pending: dict[int, _Pending] = {}

    def reset(self) -> None:
        self._pending.clear()

    def keep(self, mb: int, outputs: list[torch.Tensor], leaves: list[torch.Tensor]) -> None:
        """After F: the outputs I and W of microbatch `mb` start from (sends,
        then the loss), and the input leaves that take gradient."""
        self._pending[mb] = _Pending(outputs, leaves)

    def input_grad(self, mb: int, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Gradients of the inputs (zeros where none flows); `grads` aligned
        with the outputs given to `keep` (None: no gradient for it)."""
        pending = self._pending[mb]
        pairs = [
            (o, g)
            for o, g in zip(pending.roots, grads, strict=True)
            if o.requires_grad and g is not None
        ]
        pending.roots = [o for o, _ in pairs]
        pending.root_grads = [g for _, g in pairs]
        roots, root_grads = pending.roots, pending.root_grads
        if not pending.leaves or not roots:
            return [torch.zeros_like(x) for x in pending.leaves]
        groups = _branch_groups(roots, pending.leaves, self._params)
        handles = []
        for group in groups:
            for branch in group.branches:
                handles.append(branch.register_prehook(_capture(group, branch)))
        try:
            input_grads = torch.autograd.grad(
                roots, pending.leaves, root_grads, retain_graph=True, allow_unused=True
            )
        finally:
            for h in handles:
                h.remove()
        # A root the input paths never reach starts its group itself.
        root_nodes = {_node(r) for r in roots}
        for group in groups:
            for branch in group.branches:
                if branch not in group.grads and branch in root_nodes:
                    group.grads[branch] = _seed(branch, roots, root_grads)
        pending.groups = groups
        return [
            g if g is not None else torch.zeros_like(x)
            for g, x in zip(input_grads, pending.leaves, strict=True)
        ]

    def weight_grad(self, mb: int) -> None:
        """Accumulates the parameters' gradients (.grad) of microbatch `mb`."""
        pending = self._pending.pop(mb)
        if not pending.roots or pending.root_grads is None:
            return
        if pending.groups is None:  # no input takes gradient: the whole backward
            params = [p for p in self._params if _node(p) is not None]
            if params:
                torch.autograd.backward(pending.roots, pending.root_grads, inputs=params)
            return
        nodes = [(p, _node(p)) for p in self._params]
        for group in pending.groups:
            edges, grads = [], []
            for branch, captured in group.grads.items():
                for k, g in enumerate(captured):
                    if g is not None:
                        edges.append(GradientEdge(branch, k))
                        grads.append(g)
            if not edges:
                continue
            # A branch below another gets its gradient from I, not again.
            handles = [
                b.register_prehook(lambda _g, kept=tuple(c): kept) for b, c in group.grads.items()
            ]
            try:
                # In the stage's parameter order, the same on every rank: placing
                # a DTensor gradient below may be a collective (tp peers must
                # issue them alike; a set's order follows object addresses).
                ordered = [(p, n) for p, n in nodes if n in group.params]
                params = [p for p, _ in ordered]
                dws = torch.autograd.grad(
                    edges, [GradientEdge(n, 0) for _, n in ordered], grads, allow_unused=True
                )
            finally:
                for h in handles:
                    h.remove()
            for p, dw in zip(params, dws, strict=True):
                # allow_unused: None for a parameter this microbatch does not reach
                if cast("torch.Tensor | None", dw) is None:
                    continue
                if isinstance(dw, DTensor) and isinstance(p, DTensor):
                    # As AccumulateGrad does: the gradient placed as its parameter.
                    dw = dw.redistribute(p.device_mesh, p.placements)
                if p.grad is None:
                    p.grad = dw.detach().clone()
                else:
                    p.grad.add_(dw)


def _capture(group: _Group, branch: Node) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.grads[branch] = tuple(grad_outputs)

    return hook


def _seed(
    node: Node, roots: list[torch.Tensor], root_grads: list[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """The gradient a root node starts with: its outputs' given gradients."""
    n_out = max((r.output_nr for r in roots if r.grad_fn is node), default=0) + 1
    out: list[torch.Tensor | None] = [None] * n_out
    for r, g in zip(roots, root_grads, strict=True):
        if r.grad_fn is node:
            before = out[r.output_nr]
            out[r.output_nr] = g if before is None else before + g
    return tuple(out)


def _branch_groups(
    roots: list[torch.Tensor], leaves: list[torch.Tensor], params: list[torch.nn.Parameter]
) -> list[_Group]:
    """Groups the parameters by the nodes where their paths leave the input paths."""
    root_nodes = [n for n in map(_node, roots) if n is not None]
    # Reverse edges: each node's parents (the nodes whose backward feeds it).
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = set(root_nodes)
    queue = collections.deque(root_nodes)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    # Nodes on a path from a root to an input.
    on_input_path: set[Node] = set()
    queue = collections.deque(n for n in map(_node, leaves) if n is not None and n in seen)
    on_input_path.update(queue)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in on_input_path:
                on_input_path.add(parent)
                queue.append(parent)
    stops = on_input_path | set(root_nodes)
    groups: list[_Group] = []
    owner: dict[Node, _Group] = {}
    for p in params:
        acc = _node(p)
        if acc is None or acc not in seen:
            continue  # not used by this stage's differentiable outputs
        branches: set[Node] = set()
        visited = {acc}
        queue = collections.deque([acc])
        while queue:
            node = queue.popleft()
            if node in stops:
                branches.add(node)
                continue
            for parent in parents[node]:
                if parent not in visited:
                    visited.add(parent)
                    queue.append(parent)
        merged = {id(owner[b]): owner[b] for b in branches if b in owner}
        group = _Group(params={acc}, branches=set(branches))
        for other in merged.values():
            group.params |= other.params
            group.branches |= other.branches
            groups.remove(other)
        groups.append(group)
        for b in group.branches:
            owner[b] = group
    return groups
