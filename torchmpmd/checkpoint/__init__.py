"""Checkpoints of a pipeline as ordinary `torch.distributed.checkpoint` (DCP)
directories, keyed like the unpipelined model, loadable into any layout.

A checkpoint holds `model` and `optim` exactly as
`torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`
keys them for the unpipelined model (model entries by FQN, a tied parameter
under each of its names; optimizer state by the parameter's first FQN), plus
the user's `extra`. Each rank contributes its own stages through a view that
holds its tensors under the model's names (`local_model`); DCP writes each
rank's part and one copy of what several ranks hold (tied weights, data-
parallel replicas), and reads back just what a rank's stages need, so another
split, schedule or number of ranks loads it, and so does the plain model with
DCP's standard calls.

`save` writes into a staging directory beside `path` and renames it into
place once every rank has finished: at any moment `path` is absent, the old
complete checkpoint or the new complete one, never a partial one. It
replaces only a checkpoint it wrote (paths.py); anything else at `path` is
refused before a byte is written. Every stored item has a CRC-32 in the
checkpoint's manifest, checked at `load` (storage.py).

`load` runs no code from the files: DCP's `.metadata` is unpickled with DCP's
own classes only, and every other object weights-only
(`weights_only=False` opts out, for files you trust).

`extra` holds tensors and plain Python data, equal on every rank (the step,
the data position), except `extra["per_rank"]`, which is kept per rank
(random generator states): `load` returns each rank its own. DCP stores a
dict, and a list holding tensors or dicts, entry by entry under joined names
(`extra.rng.0`), which do not say which was a list or what a key's type was:
`save` also stores each value's layout (its containers, under `extra.LAYOUT`),
from which `load` rebuilds them as they were.

`save` and `load` are collectives: every rank checks in first (agree.py), and
a rank that does not call them fails the others within `timeout`. What a
rank can find wrong on its own (a refusal, an optimizer that holds other
parameters) it finds before the check-in and posts there, so every rank
raises it before any collective of DCP's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ..graph.pipe import place_tensor
from .agree import (
    PER_RANK,
    check_extra,
    check_in,
    compare_extra,
    digest_extra,
    digest_groups,
)
from .checks import check_entries, check_runner
from .errors import CheckpointError, describe, raise_agreed, unwrap
from .errors import own_rank as _rank
from .extra import extra_templates, with_extra
from .gathered import agree, save_gathered
from .hf import HFLoadResult, load_hf, save_hf
from .paths import Target, abandon, commit, plan
from .storage import ChecksumWriter, PlainDataPlanner, VerifyingReader
from .world import checkpoint_group, joined, single_process_dcp

if TYPE_CHECKING:
    from ..runtime.runner import PipelineRunner

__all__ = [
    "CheckpointError",
    "HFLoadResult",
    "async_save",
    "is_complete",
    "latest",
    "load",
    "load_hf",
    "local_model",
    "save",
    "save_hf",
]

# The directory where this process's last `latest` found no checkpoint, for
# the message of `load(None)`.
_found_none_in: Path | None = None


def local_model(runner: PipelineRunner) -> torch.nn.Module:
    """A module holding this rank's parameters and buffers under the model's
    names (a tied one under every name the model gives it, its first name
    first), for DCP's state-dict functions."""
    view = torch.nn.Module()
    tensors: dict[str, tuple[torch.Tensor, bool]] = {}
    for module in runner.local_modules():
        for prefix, owner in module.named_modules(remove_duplicate=False):
            for leaf, t in [*owner._parameters.items(), *owner._buffers.items()]:
                if t is None:
                    continue
                name = f"{prefix}.{leaf}" if prefix else leaf
                persistent = leaf not in owner._non_persistent_buffers_set
                tensors.setdefault(name, (t, persistent))
    aliases = runner.parameter_aliases()
    order = list(dict.fromkeys(n for names in aliases.values() for n in names))
    order += [n for n in tensors if n not in aliases]
    placed: set[str] = set()
    for name in order:
        source = next((a for a in aliases.get(name, [name]) if a in tensors), None)
        if source is None or name in placed:
            continue
        t, persistent = tensors[source]
        place_tensor(view, name, t, persistent=persistent)
        placed.add(name)
    return view


def _state(
    runner: PipelineRunner, optimizer: torch.optim.Optimizer | None, call: str
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """This rank's model (and optimizer) state, keyed like the unpipelined
    model's. Local: no collective. Raises naming this rank where its
    optimizer holds a parameter that is not the runner's."""
    view = local_model(runner)
    if optimizer is not None:
        known = {id(p) for p in view.parameters()}
        for i, group in enumerate(optimizer.param_groups):
            stray = next((p for p in group["params"] if id(p) not in known), None)
            if stray is not None:
                raise ValueError(
                    f"checkpoint.{call}: rank {_rank()}'s optimizer holds a parameter of shape "
                    f"{list(stray.shape)} (in parameter group {i}) that is not one of the "
                    "runner's on this rank: build the optimizer from runner.parameters()"
                )
    if not view.state_dict():
        # A rank whose stages hold no tensor (get_state_dict refuses an empty model).
        empty: dict[str, Any] = {"model": {}}
        if optimizer is not None:
            empty["optim"] = {
                "state": {},
                "param_groups": [
                    {**{k: v for k, v in g.items() if k != "params"}, "params": []}
                    for g in optimizer.param_groups
                ],
            }
        return view, empty
    try:
        if optimizer is None:
            model_sd, _ = get_state_dict(view, [])
            return view, {"model": model_sd}
        model_sd, optim_sd = get_state_dict(view, optimizer)
    except Exception as err:
        raise RuntimeError(
            f"checkpoint.{call}: rank {_rank()} cannot collect its model and optimizer state: "
            f"get_state_dict raised {type(err).__name__}: {err}"
        ) from err
    return view, {"model": model_sd, "optim": optim_sd}


def _merge_param_groups(
    optim_sd: dict[str, Any], everyone: list[Any], runner: PipelineRunner, call: str
) -> None:
    """Makes `param_groups` the whole model's, as the unpipelined optimizer's:
    group i lists the parameters of group i on every rank, in the model's
    order. Every rank then writes the same entry (one copy in the checkpoint).
    `everyone`: each rank's `digest_groups`, from the check-in, alike on every
    rank, so every rank raises the same error where they do not fit."""
    groups = optim_sd.get("param_groups", [])
    if len({len(g) for g in everyone}) != 1:
        raise ValueError(
            f"checkpoint.{call}: the ranks' optimizers have different numbers of parameter "
            f"groups ({[len(g) for g in everyone]}); build the same groups on every rank (empty "
            "ones too)"
        )
    aliases = runner.parameter_aliases()
    order = {n: i for i, n in enumerate(dict.fromkeys(ns[0] for ns in aliases.values()))}
    for i, group in enumerate(groups):
        names: set[str] = set()
        first = everyone[0][i]["settings"]
        for r, rank_groups in enumerate(everyone):
            other = rank_groups[i]["settings"]
            mismatch = sorted(
                k for k in set(first) | set(other) if first.get(k, [""])[0] != other.get(k, [""])[0]
            )
            if mismatch:
                shown = "; ".join(
                    f"{k}: {first[k][1] if k in first else 'not set'} on rank 0, "
                    f"{other[k][1] if k in other else 'not set'} on rank {r}"
                    for k in mismatch[:3]
                )
                raise ValueError(
                    f"checkpoint.{call}: parameter group {i} has other settings on rank {r} than "
                    f"on rank 0 ({shown}); use the same hyperparameters on every rank"
                )
            names.update(rank_groups[i]["params"])
        group["params"] = sorted(names, key=lambda n: order.get(n, len(order)))


# This process's last async_save: its path and future (a later save or load
# waits for it to finish: the two would share the checkpoint group).
_pending: tuple[Path, Future[None]] | None = None


def _after_pending(call: str, seconds: float) -> None:
    """Waits until this process's previous async_save has finished, at most
    `seconds`; raises TimeoutError (every rank then, from the check-in) if
    it has not."""
    if _pending is None:
        return
    path, written = _pending
    done, _ = futures.wait([written], timeout=seconds)
    if not done:
        raise TimeoutError(
            f"checkpoint.{call}: the previous async_save({str(path)!r}) of rank {_rank()} is "
            f"still writing after {seconds:g} s (a save or load waits for it, at most the "
            "timeout); wait for its future (future.result()) first, or raise timeout="
        )


def _timeout(timeout: float | None, runner: PipelineRunner, call: str) -> float:
    seconds = runner.timeout if timeout is None else timeout
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
        raise ValueError(f"checkpoint.{call}: timeout={timeout!r}; pass seconds > 0 (or None)")
    return float(seconds)


def _begin_save(
    call: str,
    path: str | os.PathLike[str],
    runner: PipelineRunner,
    optimizer: torch.optim.Optimizer | None,
    extra: Mapping[str, Any] | None,
    timeout: float | None,
) -> tuple[Target, dict[str, Any], float]:
    """The check-in of a save: every rank is there, built its state, `extra`
    is plain data and equal on every rank, and rank 0 found `path` safe to
    write; raises on every rank alike otherwise, before anything is written.
    Returns where to write, what (this rank's state, with `extra`) and the
    call's timeout."""
    seconds = _timeout(timeout, runner, call)
    problem: Exception | None = None
    target: Target | None = None
    digest: dict[str, list[str]] = {}
    state: dict[str, Any] = {}
    try:
        _after_pending(call, seconds)
        if path is None:
            raise TypeError(f"checkpoint.{call}: path is None; name a checkpoint directory")
        check_extra(extra)
        digest = digest_extra(extra)
        _, state = _state(runner, optimizer, call)
        if _rank() == 0:
            target = plan(path)
    except Exception as err:
        problem = err
    groups = digest_groups(state["optim"]["param_groups"]) if "optim" in state else None
    shared = (
        {
            "path": str(target.path),
            "staging": str(target.staging),
            "created": [str(p) for p in target.created],
        }
        if target is not None
        else None
    )
    entries = check_in(
        call,
        path,
        seconds,
        {"error": describe(problem), "extra": digest, "target": shared, "groups": groups},
    )
    raise_agreed([e["error"] for e in entries], problem)
    compare_extra(entries)
    without = [r for r, e in enumerate(entries) if e["groups"] is None]
    if "optim" in state or without:
        if without and len(without) != len(entries):
            raise ValueError(
                f"checkpoint.{call}: rank(s) {without} passed no optimizer and the others did; "
                "pass the optimizer on every rank, or on none"
            )
        if "optim" in state:
            _merge_param_groups(state["optim"], [e["groups"] for e in entries], runner, call)
    decided = entries[0]["target"]
    target = Target(
        path=Path(decided["path"]),
        staging=Path(decided["staging"]),
        created=tuple(Path(p) for p in decided["created"]),
    )
    return target, with_extra(state, extra, _rank()), seconds


def save(
    path: str | os.PathLike[str],
    runner: PipelineRunner,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
    checksums: bool = True,
) -> None:
    """Writes a checkpoint of every rank's stages (collective: call on all
    ranks). `path` must be new, empty, or a checkpoint `save` wrote; anything
    else there is refused before a byte is written. A checkpoint at `path` is
    replaced by renames: at any moment `path` is absent (between the two
    renames), the old complete checkpoint, or the new complete one.
    `extra`: tensors and plain Python data, equal on every rank except
    `extra["per_rank"]`. `timeout`: seconds the ranks wait for each other at
    the start (default: the runner's). `checksums`: a CRC-32 of every stored
    item, checked by `load`."""
    check_runner(runner, "save")
    with joined(runner) as world:
        target, state, seconds = _begin_save("save", path, runner, optimizer, extra, timeout)
        if world is not None:
            save_gathered(world, target, state, seconds, checksums)
            return
        try:
            writer = ChecksumWriter(target.staging, checksums=checksums)
            dcp_save(state, storage_writer=writer, process_group=_group(seconds))
        except BaseException as err:
            if _rank() == 0:
                abandon(target)
            if isinstance(err, CheckpointException):
                raise unwrap(err, "save", target.path) from None
            raise
        problem: Exception | None = None
        if _rank() == 0:
            try:
                commit(target)
            except Exception as err:
                problem = err
        agree(problem, seconds, "save")


def _group(seconds: float) -> dist.ProcessGroup | None:
    """The group DCP runs its collectives on (world.checkpoint_group)."""
    return checkpoint_group(seconds) if dist.is_initialized() else None


def async_save(
    path: str | os.PathLike[str],
    runner: PipelineRunner,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
    checksums: bool = True,
) -> Future[None]:
    """Like `save`, but returns once the state is staged (copied): training
    may go on while DCP writes. The future completes when this rank's part
    is written (on rank 0: when the checkpoint is in place). Wait for it
    before the next `async_save` (collective). Blocks for the check-in and
    the copy; not thread-safe. A later save or load waits for this one to
    finish (at most its timeout). A runner without a process group
    (`testing.LocalPipeline`) saves before returning."""
    global _pending
    check_runner(runner, "async_save")
    with joined(runner) as world:
        if world is not None:
            save(path, runner, optimizer, extra, timeout=timeout, checksums=checksums)
            saved: Future[None] = Future()
            saved.set_result(None)
            return saved
        target, state, seconds = _begin_save("async_save", path, runner, optimizer, extra, timeout)
        try:
            writer = ChecksumWriter(target.staging, checksums=checksums)
            written = dcp_async_save(state, storage_writer=writer, process_group=_group(seconds))
        except BaseException as err:
            if _rank() == 0:
                abandon(target)
            if isinstance(err, CheckpointException):
                raise unwrap(err, "async_save", target.path) from None
            raise
        done: Future[None] = Future()
        rank = _rank()

        def finish(f: Any) -> None:
            try:
                f.result()
            except BaseException as err:  # reported through the future
                if rank == 0:
                    abandon(target)
                if isinstance(err, CheckpointException):
                    err = unwrap(err, "async_save", target.path)
                done.set_exception(err)
                return
            try:
                if rank == 0:
                    commit(target)
                done.set_result(None)
            except BaseException as err:
                done.set_exception(err)

        upload = written.upload_completion if hasattr(written, "upload_completion") else written
        upload.add_done_callback(finish)
        _pending = (target.path, done)
        return done


def load(
    path: str | os.PathLike[str] | None,
    runner: PipelineRunner,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    weights_only: bool = True,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Loads this rank's stages (and optimizer state) from a checkpoint written
    by any layout, or by the plain model; returns `extra` (with this rank's
    `per_rank`, if saved). Collective: call on all ranks. Stored items are
    checked against their checksums (where `save` wrote them).
    `weights_only=True` builds nothing but DCP's metadata, tensors and plain
    data from the files; `weights_only=False` unpickles them as DCP does,
    which runs any code they name: only for files you trust."""
    check_runner(runner, "load")
    if path is None:
        where = f" (latest({str(_found_none_in)!r}) found none)" if _found_none_in else ""
        raise FileNotFoundError(
            f"checkpoint.load: path is None: no checkpoint to load{where}. "
            "checkpoint.latest(dir) returns None until dir holds a complete checkpoint: check "
            "for None and start from scratch"
        )
    source = Path(path)
    with joined(runner) as world:
        seconds = _timeout(timeout, runner, "load")
        check_in("load", source, seconds, {})
        problem: Exception | None = None
        try:
            _after_pending("load", seconds)
            reader, view, state, own, local_groups = _prepare_load(
                source, runner, optimizer, weights_only
            )
        except Exception as err:
            problem = err
        agree(problem, seconds, "load")
        planner = PlainDataPlanner(source, weights_only=weights_only)
        try:
            if world is not None:  # each rank reads its own entries
                with single_process_dcp():
                    dcp_load(state, storage_reader=reader, planner=planner, no_dist=True)
            else:
                dcp_load(
                    state, storage_reader=reader, planner=planner, process_group=_group(seconds)
                )
        except CheckpointException as err:
            raise unwrap(err, "load", source) from None
    if "optim" in state:
        # The checkpoint lists the whole model's parameters; this rank's are its own.
        for group, mine in zip(state["optim"]["param_groups"], local_groups, strict=True):
            group["params"] = mine
    if state["model"]:
        set_state_dict(
            view,
            [optimizer] if optimizer is not None else [],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
        )
    elif optimizer is not None:
        # No tensor on this rank (set_state_dict refuses an empty model): only
        # the groups' settings load.
        for group, saved in zip(
            optimizer.param_groups, state["optim"]["param_groups"], strict=True
        ):
            group.update({k: v for k, v in saved.items() if k != "params"})
    extra = dict(state.get("extra", {}))
    if own in state:
        extra[PER_RANK] = state[own]
    return extra


def _prepare_load(
    source: Path,
    runner: PipelineRunner,
    optimizer: torch.optim.Optimizer | None,
    weights_only: bool,
) -> tuple[VerifyingReader, torch.nn.Module, dict[str, Any], str, list[list[Any]]]:
    """What a load reads into, checked against the checkpoint's metadata:
    every entry there, with the same shape."""
    if not is_complete(source):
        raise FileNotFoundError(
            f"checkpoint {source} is missing or incomplete (no .metadata): pass a directory "
            "written by mpmd.checkpoint.save or dcp.save"
        )
    reader = VerifyingReader(source, weights_only=weights_only)
    keys = reader.read_metadata().state_dict_metadata
    view, state = _state(runner, optimizer, "load")
    own = f"{PER_RANK}.rank{_rank()}"
    state.update(extra_templates(reader, keys, source, ("extra", own)))
    local_groups = [list(g["params"]) for g in state.get("optim", {}).get("param_groups", [])]
    check_entries(source, state, keys, optimizer)
    return reader, view, state, own, local_groups


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a finished checkpoint (DCP writes `.metadata` last,
    and `save` renames the directory into place after that)."""
    return (Path(path) / ".metadata").is_file()


def latest(directory: str | os.PathLike[str], prefix: str = "step-") -> Path | None:
    """The newest complete checkpoint `directory/<prefix><number>`, if any."""
    global _found_none_in
    root = Path(directory)
    found = []
    if root.is_dir():
        for child in root.iterdir():
            suffix = child.name.removeprefix(prefix)
            if child.name.startswith(prefix) and suffix.isdigit() and is_complete(child):
                found.append((int(suffix), child))
    _found_none_in = None if found else root
    return max(found)[1] if found else None
