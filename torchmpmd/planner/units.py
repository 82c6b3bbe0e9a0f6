"""The units a model is cut between: its module calls, recorded in call order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..graph.markers import STAGE_END_OP

__all__ = ["Recorder", "candidate_units"]

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


@dataclass(slots=True)
class _Call:
    path: str
    module: torch.nn.Module
    children: list[int] = field(default_factory=list)
    ops: int = 0  # operations dispatched while this call was the innermost


# torch leaves TorchDispatchMode's __init_subclass__ and __init__ unannotated.
class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Module calls (a tree, in call order) and the ops that ran inside each;
    counts `mark_stage_end` calls (run under `_tracing`, they dispatch an op)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.calls: list[_Call] = []
        self.stack: list[int] = []
        self.markers = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        if func is STAGE_END_OP:
            self.markers += 1
        if self.stack:
            self.calls[self.stack[-1]].ops += 1
        return func(*args, **(kwargs or {}))

    def _pre(self, module: torch.nn.Module, _args: Any) -> None:
        path = self.names.get(id(module))
        if path is None:
            return
        index = len(self.calls)
        self.calls.append(_Call(path, module))
        if self.stack:
            self.calls[self.stack[-1]].children.append(index)
        self.stack.append(index)

    def _post(self, module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if id(module) in self.names and self.stack:
            self.stack.pop()

    def hooks(self) -> list[torch.utils.hooks.RemovableHandle]:
        """Global module hooks that record every call of the model's modules."""
        return [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
            torch.nn.modules.module.register_module_forward_hook(self._post),
        ]


def candidate_units(
    model: torch.nn.Module, calls: Sequence[_Call], min_units: int = 1
) -> list[str]:
    """The units a model is cut between, from its module calls in call order.

    Starting from the root's calls, a call is replaced by the calls it makes
    when it runs a stack of layers (it is a ModuleList, Sequential or
    ModuleDict, or calls items of one) or wraps a single module, unless it is
    itself an item of a stack (a layer stays whole). So a GPT gives its
    embeddings, each block, the final norm and the head. While there are
    fewer units than `min_units`, the unit with the most parameters that
    calls modules is replaced by those calls, unless the model says it must
    stay whole (`no_split_classes`: a Hugging Face decoder layer is never cut). A unit can start a stage only
    if its module runs once and runs at least one operation; other units
    stay inside the unit before them.
    """
    if not calls:
        return []
    total_ops = _total_ops(calls)
    modules = dict(model.named_modules(remove_duplicate=False))
    whole = no_split_classes(model)

    def is_item(path: str) -> bool:
        parent, _, _ = path.rpartition(".")
        return isinstance(modules.get(parent), _CONTAINERS)

    def expands(i: int) -> bool:
        c = calls[i]
        if not c.children or is_item(c.path) or type(c.module).__name__ in whole:
            return False
        return (
            isinstance(c.module, _CONTAINERS)
            or len(c.children) == 1
            or any(is_item(calls[k].path) for k in c.children)
        )

    def flatten(i: int) -> list[int]:
        return [u for k in calls[i].children for u in (flatten(k) if expands(k) else [k])]

    runs: dict[str, int] = {}
    for c in calls:
        runs[c.path] = runs.get(c.path, 0) + 1

    def usable(units: list[int]) -> list[str]:
        paths = [calls[units[0]].path]
        for u in units[1:]:
            path = calls[u].path
            if runs[path] == 1 and total_ops[u] > 0 and path not in paths:
                paths.append(path)
        return paths

    units = flatten(0) or [0]
    while len(usable(units)) < min_units:
        splittable = [
            u for u in units if calls[u].children and type(calls[u].module).__name__ not in whole
        ]
        if not splittable:
            break
        big = max(splittable, key=lambda u: sum(p.numel() for p in calls[u].module.parameters()))
        at = units.index(big)
        units[at : at + 1] = calls[big].children
    return usable(units)


def no_split_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the modules a model says must stay whole on one device:
    Hugging Face's `_no_split_modules` (its decoder layers), on the model or
    any submodule (a vision tower, a language model inside it)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def _total_ops(calls: Sequence[_Call]) -> list[int]:
    total = [c.ops for c in calls]
    for i in reversed(range(len(calls))):  # children come after their parent
        for k in calls[i].children:
            total[i] += total[k]
    return total
