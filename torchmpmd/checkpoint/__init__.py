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

`save` writes into a temporary directory and renames it into place once every
rank has finished: a directory at `path` is always a complete checkpoint.

`extra` values must be equal on every rank (the step, the data position),
except `extra["per_rank"]`, which is kept per rank (random generator states):
`load` returns each rank its own.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ..graph.pipe import place_tensor

if TYPE_CHECKING:
    from ..runtime.runner import PipelineRunner

__all__ = ["async_save", "is_complete", "latest", "load", "local_model", "save"]

_PER_RANK = "per_rank"


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
    runner: PipelineRunner, optimizer: torch.optim.Optimizer | None
) -> tuple[torch.nn.Module, dict[str, Any]]:
    view = local_model(runner)
    if optimizer is None:
        model_sd, _ = get_state_dict(view, [])
        return view, {"model": model_sd}
    model_sd, optim_sd = get_state_dict(view, optimizer)
    return view, {"model": model_sd, "optim": optim_sd}


def _merge_param_groups(optim_sd: dict[str, Any], runner: PipelineRunner) -> None:
    """Makes `param_groups` the whole model's, as the unpipelined optimizer's:
    group i lists the parameters of group i on every rank, in the model's
    order. Every rank then writes the same entry (one copy in the checkpoint)."""
    groups = optim_sd.get("param_groups", [])
    if not dist.is_initialized():
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, groups)
    if len({len(g) for g in everyone}) != 1:
        raise ValueError(
            "checkpoint.save: the ranks' optimizers have different numbers of parameter groups "
            f"({[len(g) for g in everyone]}); build the same groups on every rank (empty ones too)"
        )
    aliases = runner.parameter_aliases()
    order = {n: i for i, n in enumerate(dict.fromkeys(ns[0] for ns in aliases.values()))}
    for i, group in enumerate(groups):
        names: set[str] = set()
        for rank_groups in everyone:
            other = rank_groups[i]
            mismatch = {
                k for k in set(group) | set(other) if k != "params" and group.get(k) != other.get(k)
            }
            if mismatch:
                raise ValueError(
                    f"checkpoint.save: parameter group {i} has other settings on another rank "
                    f"({sorted(mismatch)}); use the same hyperparameters on every rank"
                )
            names.update(other["params"])
        group["params"] = sorted(names, key=lambda n: order.get(n, len(order)))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _with_extra(state: dict[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    if not extra:
        return state
    common = {k: v for k, v in extra.items() if k != _PER_RANK}
    out = dict(state)
    if common:
        out["extra"] = common
    if _PER_RANK in extra:
        out[f"{_PER_RANK}.rank{_rank()}"] = extra[_PER_RANK]
    return out


def save(
    path: str | os.PathLike[str],
    runner: PipelineRunner,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Writes a checkpoint of every rank's stages (collective: call on all ranks)."""
    target = Path(path)
    tmp = _staging_dir(target)
    _, state = _state(runner, optimizer)
    if "optim" in state:
        _merge_param_groups(state["optim"], runner)
    dcp_save(_with_extra(state, extra), checkpoint_id=str(tmp))
    _commit(tmp, target)


def async_save(
    path: str | os.PathLike[str],
    runner: PipelineRunner,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Future[None]:
    """Like `save`, but returns once the state is staged (copied): training
    may go on while DCP writes. The future completes when the checkpoint is
    in place. Wait for it before the next `async_save` (collective)."""
    target = Path(path)
    tmp = _staging_dir(target)
    _, state = _state(runner, optimizer)
    if "optim" in state:
        _merge_param_groups(state["optim"], runner)
    written = dcp_async_save(_with_extra(state, extra), checkpoint_id=str(tmp))
    done: Future[None] = Future()

    def finish(f: Any) -> None:
        try:
            f.result()
            _commit(tmp, target, barrier=False)
            done.set_result(None)
        except BaseException as err:  # reported through the future
            done.set_exception(err)

    upload = written.upload_completion if hasattr(written, "upload_completion") else written
    upload.add_done_callback(finish)
    return done


def load(
    path: str | os.PathLike[str],
    runner: PipelineRunner,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Loads this rank's stages (and optimizer state) from a checkpoint written
    by any layout, or by the plain model; returns `extra` (with this rank's
    `per_rank`, if saved). Collective: call on all ranks."""
    source = Path(path)
    if not is_complete(source):
        raise FileNotFoundError(
            f"checkpoint {source} is missing or incomplete (no .metadata): pass a directory "
            "written by mpmd.checkpoint.save or dcp.save"
        )
    view, state = _state(runner, optimizer)
    metadata = FileSystemReader(str(source)).read_metadata()
    keys = metadata.state_dict_metadata
    extra_keys = [k for k in keys if k.startswith("extra.")]
    own = f"{_PER_RANK}.rank{_rank()}"
    if extra_keys:
        state["extra"] = _template(keys, "extra")
    if any(k == own or k.startswith(own + ".") for k in keys):
        state[own] = _template(keys, own)
    missing = [k for k in _flat_keys(state.get("model", {}), "model") if k not in keys]
    if missing:
        raise KeyError(
            f"checkpoint {source} has no entry for {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}: it was written for another model"
        )
    local_groups = [list(g["params"]) for g in state.get("optim", {}).get("param_groups", [])]
    dcp_load(state, checkpoint_id=str(source))
    if "optim" in state:
        # The checkpoint lists the whole model's parameters; this rank's are its own.
        loaded = state["optim"]["param_groups"]
        if len(loaded) != len(local_groups):
            raise ValueError(
                f"checkpoint {source} has {len(loaded)} optimizer parameter groups, this rank's "
                f"optimizer {len(local_groups)}: build the optimizer with the same groups"
            )
        for group, mine in zip(loaded, local_groups, strict=True):
            group["params"] = mine
    set_state_dict(
        view,
        [optimizer] if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    extra = dict(state.get("extra", {}))
    if own in state:
        extra[_PER_RANK] = state[own]
    return extra


def _template(keys: Mapping[str, Any], prefix: str) -> Any:
    """A nested dict shaped like the saved entries under `prefix`, for DCP to
    load into: an empty tensor where a tensor was saved, None where an object was."""

    def leaf(meta: Any) -> Any:
        if isinstance(meta, TensorStorageMetadata):
            return torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        return None

    if prefix in keys:
        return leaf(keys[prefix])
    out: dict[str, Any] = {}
    for k, meta in keys.items():
        if k.startswith(prefix + "."):
            parts = k[len(prefix) + 1 :].split(".")
            node = out
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = leaf(meta)
    return out


def _flat_keys(tree: Mapping[str, Any], prefix: str) -> list[str]:
    return [f"{prefix}.{k}" for k in tree]


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a finished checkpoint (DCP writes `.metadata` last,
    and `save` renames the directory into place after that)."""
    return (Path(path) / ".metadata").is_file()


def latest(directory: str | os.PathLike[str], prefix: str = "step-") -> Path | None:
    """The newest complete checkpoint `directory/<prefix><number>`, if any."""
    root = Path(directory)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        suffix = child.name.removeprefix(prefix)
        if child.name.startswith(prefix) and suffix.isdigit() and is_complete(child):
            found.append((int(suffix), child))
    return max(found)[1] if found else None


def _staging_dir(target: Path) -> Path:
    """A temporary directory beside `target`, the same name on every rank."""
    name = [f".{target.name}.partial-{uuid.uuid4().hex[:8]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return target.parent / name[0]


def _commit(tmp: Path, target: Path, barrier: bool = True) -> None:
    """Renames the finished `tmp` to `target` (rank 0, after every rank wrote)."""
    if barrier and dist.is_initialized():
        dist.barrier()
    if _rank() == 0:
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    if barrier and dist.is_initialized():
        dist.barrier()
