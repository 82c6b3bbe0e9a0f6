"""Stages of a model described on the meta device: each rank allocates only
its own stages, on its device, and the user fills them.

`mpmd.trace` takes a model whose parameters and buffers are on the meta
device (`with torch.device("meta"): model = Model(cfg)`); its stages hold
meta tensors. A runner allocates the tensors of its local stages, and only
those, uninitialised (`allocate`), one tensor per tensor object so tied
weights stay tied. They are then filled by `runner.load_state_dict`, a
checkpoint, or `runner.init_weights(fn)`, which calls `fn` on the model's
own submodules with this rank's tensors in place of their meta ones, so a
model's `reset_parameters` / `_init_weights` work unchanged;
`runner.init_weights()` calls the model's own root `init_weights()` once
instead, with every local tensor swapped in and the others left meta (where
writes cost nothing), as torchtitan's models initialise. Non-persistent
buffers (RoPE tables, masks) are in no state dict: `fn` must compute them,
as a model's own init does (torchtitan's `init_weights` recomputes its RoPE
table), or the model is built with real buffers and meta parameters only
(accelerate's `init_empty_weights()`), whose buffers are then copied. A
tensor still unwritten at the first step is an error naming it, never
garbage silently trained on. The runner then makes the copies of a tied
weight equal across ranks, and replicas equal across data parallelism.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from ..graph.stage import as_stage

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

    def allocated(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` was allocated here (its values came from no model)."""
        return id(tensor) in self._fresh

    @contextlib.contextmanager
    def copies_only(self) -> Iterator[None]:
        """Writes inside fill nothing: a tensor unwritten before (a replica's
        garbage broadcast over data parallelism) still is after."""
        unwritten = [f for f in self._fresh.values() if f.tensor._version == f.version]
        yield
        for f in unwritten:
            f.version = f.tensor._version

    def follow(self, modules: dict[int, torch.nn.Module]) -> None:
        """Tracks the tensors that took the place of allocated ones in
        `modules`, by name (FSDP's shards, cut from the allocated tensors'
        garbage): they must be written too. (A DTensor's own version counts
        writes through it; its local shard's does not.)"""
        for key, f in list(self._fresh.items()):
            module = modules[f.stage]
            root = as_stage(module).state_root
            path, _, leaf = f.name.rpartition(".")
            try:
                owner = root.get_submodule(path) if path else root
            except AttributeError:
                continue
            now = owner._parameters.get(leaf, owner._buffers.get(leaf))
            if now is None or now is f.tensor:
                continue
            del self._fresh[key]
            self._fresh[id(now)] = _Fresh(f.stage, f.name, now, now._version)

    def check(self, modules: dict[int, torch.nn.Module], rank: int) -> None:
        """Raises if a tensor allocated here is still unwritten (and still in
        use), or a stage holds a meta tensor where its own one was put."""
        if not self._fresh:
            return
        meta = [
            (s, name)
            for s, m in sorted(modules.items())
            for name, t in [*m.named_parameters(), *m.named_buffers()]
            if t.is_meta
        ]
        if meta:
            names = ", ".join(f"'{n}' (stage {s})" for s, n in meta[:8])
            raise RuntimeError(
                f"rank {rank}: {names} {'is' if len(meta) == 1 else 'are'} on the meta device: "
                "the model's own (meta) tensor took the place of the one this rank allocated "
                "(an init that assigns a parameter of the model rather than writing one); write "
                "into the tensors in place (torch.nn.init.*_, .copy_), or make ties before tracing"
            )
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


def _slots(owner: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's own parameter and buffer slots (name -> tensor or None)."""
    return cast(dict[str, Any], owner._parameters), cast(dict[str, Any], owner._buffers)


def allocate(modules: dict[int, torch.nn.Module], device: torch.device) -> Allocation:
    """Replaces every meta tensor of `modules` by an uninitialised one on
    `device` (one per tensor object: tied weights stay one tensor)."""
    allocation = Allocation()
    memo: dict[int, torch.Tensor] = {}
    for index, module in modules.items():
        stage = as_stage(module)
        for path, owner in stage.state_root.named_modules(remove_duplicate=False):
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
                    allocation.add(index, f"{path}.{leaf}" if path else leaf, memo[id(t)])
        stage.refresh_state()
    return allocation


def init_weights(
    fn: Callable[[torch.nn.Module], object] | None,
    modules: dict[int, torch.nn.Module],
    source: torch.nn.Module | None,
    aliases: dict[str, list[str]],
    rank: int,
) -> int:
    """Calls `fn(m)` on each submodule of the model that owns (directly) a
    parameter or buffer of the local stages or, with `fn=None`, the model's
    own root `init_weights()` / `reset_parameters()` once, with the local
    tensors in place of the model's own while it runs (the others stay meta,
    where writes cost nothing); returns how many calls it made. A tensor
    replaced (rather than written in place) gives the local one its values,
    if it has the local one's shape, dtype and device."""
    local: dict[str, torch.Tensor] = {}
    stage_of: dict[int, int] = {}
    for s, m in sorted(modules.items()):
        for name, t in [
            *m.named_parameters(remove_duplicate=False),
            *m.named_buffers(remove_duplicate=False),
        ]:
            stage_of.setdefault(id(t), s)
            for alias in aliases.get(name, [name]):
                local.setdefault(alias, t)
    held = {id(t) for t in local.values()}
    roots = [source] if source is not None else []
    # Stages cut by hand hold the user's own modules, not the model's.
    roots += [own for m in modules.values() if (own := as_stage(m).user_module) is not None]
    # The model's own tensors by object (an init that assigns one of them in
    # place of another makes a tie the trace did not see).
    model_names = {
        id(t): name
        for root in roots
        for name, t in [
            *root.named_parameters(remove_duplicate=False),
            *root.named_buffers(remove_duplicate=False),
        ]
    }
    called = 0
    seen: set[int] = set()
    with _SWAP_LOCK, torch.no_grad():
        for root in roots:
            owners = []
            for path, owner in root.named_modules(remove_duplicate=False):
                if id(owner) in seen or not (owner._parameters or owner._buffers):
                    continue
                seen.add(id(owner))
                owners.append((path, owner))
            calls = (
                [(_root_init(root, rank), owners)]
                if fn is None
                else [(functools.partial(fn, owner), [(path, owner)]) for path, owner in owners]
            )
            for call, where in calls:
                replaced = _swapped_call(call, where, local, held)
                if replaced is None:
                    continue
                called += 1
                for name, mine, new in replaced:
                    _check_tie(name, new, model_names, local, stage_of[id(mine)], rank)
                    _check_replacement(name, mine, new, stage_of[id(mine)], rank)
                for _, mine, new in replaced:
                    # Its values, not the object: the tie map, the executor
                    # and data parallelism hold the local tensor itself.
                    mine.copy_(new)
    return called


def _root_init(root: torch.nn.Module, rank: int) -> Callable[[], object]:
    """The model's own `init_weights()` (or `reset_parameters()`), called
    with no argument, as torchtitan's models initialise from their root."""
    for name in ("init_weights", "reset_parameters"):
        method = getattr(root, name, None)
        if not callable(method):
            continue
        try:
            required = [
                p.name
                for p in inspect.signature(method).parameters.values()
                if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            ]
        except (TypeError, ValueError):  # no signature (a builtin): call it as it is
            required = []
        if required:
            raise TypeError(
                f"init_weights(): rank {rank}: {type(root).__name__}.{name} takes {required}, "
                "so it initialises one module, not the model from its root; pass it as the "
                f"function: runner.init_weights({type(root).__name__}.{name})"
            )
        return cast(Callable[[], object], method)
    raise TypeError(
        f"init_weights(): rank {rank}: the model ({type(root).__name__}) has no init_weights() "
        "or reset_parameters() method to call on its root; pass a function that initialises "
        "one module, runner.init_weights(fn), which is called on each submodule holding a "
        "tensor of this rank's stages"
    )


_Slots = dict[str, Any]
_HF_INIT_MARK = "_is_hf_initialized"
_UNSET = object()


def _swapped_call(
    call: Callable[[], object],
    owners: list[tuple[str, torch.nn.Module]],
    local: dict[str, torch.Tensor],
    held: set[int],
) -> list[tuple[str, torch.Tensor, torch.Tensor]] | None:
    """Runs `call` with this rank's tensors in the slots of `owners` (the
    model's modules), then puts every slot back as it was; returns the local
    tensors `call` replaced, as (name, local tensor, new tensor), or None if
    no owner holds a local tensor (`call` is not made)."""
    slots: list[tuple[str, _Slots, str, Any, torch.Tensor | None]] = []
    for path, owner in owners:
        for table in _slots(owner):
            for leaf, t in list(table.items()):
                name = f"{path}.{leaf}" if path else leaf
                mine = None
                if t is not None:
                    mine = t if id(t) in held else local.get(name)
                slots.append((name, table, leaf, t, mine))
    if not any(mine is not None for *_, mine in slots):
        return None
    for _, table, leaf, _, mine in slots:
        if mine is not None:
            table[leaf] = mine
    # Hugging Face marks each module it initialised and skips it afterwards;
    # the mark speaks of the tensors the module held then (another rank's, in
    # one process, or the meta ones), never of this rank's fresh ones.
    marks = [(owner, owner.__dict__.pop(_HF_INIT_MARK, _UNSET)) for _, owner in owners]
    try:
        call()
    finally:
        for owner, mark in marks:
            owner.__dict__.pop(_HF_INIT_MARK, None)
            if mark is not _UNSET:
                owner.__dict__[_HF_INIT_MARK] = mark
        replaced = []
        for name, table, leaf, original, mine in slots:
            now = table.get(leaf)
            if mine is not None and now is not None and now is not mine:
                replaced.append((name, mine, now))
            # The model keeps its own (meta) tensors, whatever `call` assigned.
            table[leaf] = original
    return replaced


def _check_tie(
    name: str,
    new: torch.Tensor,
    model_names: dict[int, str],
    local: dict[str, torch.Tensor],
    stage: int,
    rank: int,
) -> None:
    """Refuses an init that assigns one of the model's tensors in place of
    another (`self.output.weight = self.tok_embeddings.weight`): a tie made
    after tracing, which the pipeline holds as two tensors that would train
    apart (and on a rank without the other, the model's meta tensor)."""
    other = model_names.get(id(new))
    if other is None:
        other = next((n for n, t in local.items() if t is new and n != name), None)
    if other is None or other == name:
        return
    raise ValueError(
        f"init_weights: rank {rank}: the init function assigns '{other}' in place of '{name}' "
        f"(stage {stage}), tying them, but the model was traced before that tie existed, so "
        "the pipeline holds them as two parameters that would train apart. Make the tie "
        "before tracing: tie them in the model's __init__, or call the model's own init on "
        "the meta model (writes on the meta device cost nothing) and then mpmd.trace it"
    )


def _check_replacement(
    name: str, mine: torch.Tensor, new: torch.Tensor, stage: int, rank: int
) -> None:
    """A tensor the init function assigned in place of a local one must fit
    where the stage uses it."""
    where = f"init_weights: rank {rank}: the init function replaced '{name}' (stage {stage})"
    if isinstance(mine, DTensor) or isinstance(new, DTensor):
        raise ValueError(
            f"{where}; the stage holds it as an FSDP shard (DTensor), which must be written in "
            "place (torch.nn.init.*_, .copy_) rather than replaced"
        )
    need = (tuple(mine.shape), mine.dtype, mine.device)
    given = (tuple(new.shape), new.dtype, new.device)
    if need != given:
        raise ValueError(
            f"{where} with a tensor of shape {given[0]}, dtype {given[1]} on {given[2]}, but "
            f"the stage needs shape {need[0]}, dtype {need[1]} on {need[2]}: write into the "
            "tensor in place (torch.nn.init.*_, .copy_) or assign one of that shape, dtype and "
            "device"
        )
