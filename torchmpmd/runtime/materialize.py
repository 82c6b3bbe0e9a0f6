"""Stages of a model described on the meta device: each rank allocates only
its own stages, on its device, and the user fills them.

`mpmd.trace` takes a model whose parameters and buffers are on the meta
device (`with torch.device("meta"): model = Model(cfg)`); its stages hold
meta tensors. A runner allocates the tensors of its local stages, and only
those, uninitialised (`allocate`), one tensor per tensor object so tied
weights stay tied. They are then filled by `runner.load_state_dict`, a
checkpoint, or `runner.init_weights(fn)`, which calls `fn` on the model's
own submodules with this rank's tensors in place of their meta ones, so a
model's `reset_parameters` / `_init_weights` work unchanged. Non-persistent
buffers (RoPE tables, masks) are in no state dict: `fn` must compute them,
as a model's own init does (torchtitan's `init_weights` recomputes its RoPE
table), or the model is built with real buffers and meta parameters only
(accelerate's `init_empty_weights()`), whose buffers are then copied. A
tensor still unwritten at the first step is an error naming it, never
garbage silently trained on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..graph.eager import EagerStage

__all__: list[str] = []

# init_weights swaps tensors into the user's model: one rank at a time when
# ranks are threads of one process (torchmpmd.testing).
_SWAP_LOCK = threading.Lock()


@dataclass(slots=True)
class _Fresh:
    stage: int
    name: str
    tensor: torch.Tensor
    version: int


class Allocation:
    """The tensors a rank allocated for its meta stages, until written."""

    def __init__(self) -> None:
        self._fresh: dict[int, _Fresh] = {}

    def add(self, stage: int, name: str, tensor: torch.Tensor) -> None:
        self._fresh.setdefault(id(tensor), _Fresh(stage, name, tensor, tensor._version))

    def check(self, modules: dict[int, torch.nn.Module], rank: int) -> None:
        """Raises if a tensor allocated here is still unwritten (and still in use)."""
        if not self._fresh:
            return
        in_use = {id(t) for m in modules.values() for t in [*m.parameters(), *m.buffers()]}
        unwritten = sorted(
            (f.stage, f.name)
            for key, f in self._fresh.items()
            if key in in_use and f.tensor._version == f.version
        )
        if unwritten:
            names = ", ".join(f"'{n}' (stage {s})" for s, n in unwritten[:8])
            more = f" and {len(unwritten) - 8} more" if len(unwritten) > 8 else ""
            raise RuntimeError(
                f"rank {rank}: the model was traced on the meta device and {names}{more} were "
                "allocated but never written: fill them with runner.load_state_dict(...), a "
                "checkpoint, or runner.init_weights(fn) (non-persistent buffers such as RoPE "
                "tables must be computed by fn)"
            )
        self._fresh.clear()


def retarget_devices(module: torch.nn.Module, device: torch.device) -> None:
    """Makes a traced stage create its tensors on `device`: the trace baked
    the device it saw (`arange(..., device=meta)` for a meta model, `cpu`
    for a model traced on the CPU) into the graph; every such device (those
    of the stage's inputs, parameters and buffers when traced) becomes
    `device`. Devices the model named otherwise are left alone."""
    if not isinstance(module, torch.fx.GraphModule):
        return
    traced: set[torch.device] = set()
    for node in module.graph.nodes:
        val = node.meta.get("val")
        if node.op in ("placeholder", "get_attr") and isinstance(val, torch.Tensor):
            traced.add(val.device)
    traced |= {t.device for t in [*module.parameters(), *module.buffers()]} - {device}
    traced.add(torch.device("meta"))
    changed = False
    for node in module.graph.nodes:
        value = node.kwargs.get("device")
        if isinstance(value, torch.device) and value in traced and value != device:
            node.kwargs = {**node.kwargs, "device": device}
            changed = True
    if changed:
        module.recompile()


def _slots(owner: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's own parameter and buffer slots (name -> tensor or None)."""
    return cast(dict[str, Any], owner._parameters), cast(dict[str, Any], owner._buffers)


def allocate(modules: dict[int, torch.nn.Module], device: torch.device) -> Allocation:
    """Replaces every meta tensor of `modules` by an uninitialised one on
    `device` (one per tensor object: tied weights stay one tensor)."""
    allocation = Allocation()
    memo: dict[int, torch.Tensor] = {}
    for stage, module in modules.items():
        root = module.module if isinstance(module, EagerStage) else module
        for path, owner in root.named_modules(remove_duplicate=False):
            for slots in _slots(owner):
                for leaf, t in list(slots.items()):
                    if t is None or not t.is_meta:
                        continue
                    if id(t) not in memo:
                        empty = torch.empty_like(t, device=device)
                        memo[id(t)] = (
                            torch.nn.Parameter(empty, requires_grad=t.requires_grad)
                            if isinstance(t, torch.nn.Parameter)
                            else empty
                        )
                    slots[leaf] = memo[id(t)]
                    allocation.add(stage, f"{path}.{leaf}" if path else leaf, memo[id(t)])
        if isinstance(module, EagerStage):
            module._mirror()
    return allocation


def init_weights(
    fn: Callable[[torch.nn.Module], object],
    modules: dict[int, torch.nn.Module],
    source: torch.nn.Module | None,
    aliases: dict[str, list[str]],
) -> int:
    """Calls `fn(m)` on each submodule of the model that owns (directly) a
    parameter or buffer of the local stages, with the local tensors in
    place of its own while `fn` runs; returns how many modules it called.
    A tensor `fn` replaces (rather than writes in place) becomes the local one."""
    local: dict[str, torch.Tensor] = {}
    for m in modules.values():
        for name, t in [
            *m.named_parameters(remove_duplicate=False),
            *m.named_buffers(remove_duplicate=False),
        ]:
            for alias in aliases.get(name, [name]):
                local.setdefault(alias, t)
    held = {id(t) for t in local.values()}
    roots = [source] if source is not None else []
    roots += [m.module for m in modules.values() if isinstance(m, EagerStage)]
    called = 0
    seen: set[int] = set()
    with _SWAP_LOCK, torch.no_grad():
        for root in roots:
            for path, owner in root.named_modules(remove_duplicate=False):
                if id(owner) in seen or not (owner._parameters or owner._buffers):
                    continue
                seen.add(id(owner))
                called += _call_on(fn, owner, path, local, held, modules)
    return called


def _call_on(
    fn: Callable[[torch.nn.Module], object],
    owner: torch.nn.Module,
    path: str,
    local: dict[str, torch.Tensor],
    held: set[int],
    modules: dict[int, torch.nn.Module],
) -> int:
    swapped: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
    for slots in _slots(owner):
        for leaf, t in list(slots.items()):
            if t is None:
                continue
            mine = t if id(t) in held else local.get(f"{path}.{leaf}" if path else leaf)
            if mine is not None:
                swapped.append((slots, leaf, t, mine))
                slots[leaf] = mine
    if not swapped:
        return 0
    try:
        fn(owner)
    finally:
        for slots, leaf, original, mine in swapped:
            now = slots.get(leaf)
            if now is not None and now is not mine:
                _replace(modules, mine, now)
            if original is not mine:
                slots[leaf] = original  # the model keeps its own (meta) tensor
    return 1


def _replace(modules: dict[int, torch.nn.Module], old: torch.Tensor, new: torch.Tensor) -> None:
    """Makes every local slot holding `old` hold `new` (fn assigned a new tensor)."""
    for m in modules.values():
        root = m.module if isinstance(m, EagerStage) else m
        for owner in root.modules():
            for slots in _slots(owner):
                for leaf, t in list(slots.items()):
                    if t is old:
                        slots[leaf] = new
        if isinstance(m, EagerStage):
            m._mirror()
