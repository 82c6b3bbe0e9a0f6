"""What every checkpoint call checks before it starts: the runner it was
given, and (at load) that the checkpoint holds every entry of this rank's
state with its shape, and an optimizer of the same type and settings."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..runtime.local import LocalPipeline
from ..runtime.runner import PipelineRunner

__all__: list[str] = []

_GROUPS = "optim.param_groups."


def check_runner(runner: object, call: str) -> None:
    """Raises TypeError unless `runner` is a `PipelineRunner` (this rank's)."""
    if isinstance(runner, PipelineRunner):
        return
    if isinstance(runner, LocalPipeline):
        raise TypeError(
            f"checkpoint.{call}: runner is a testing.LocalPipeline, which holds one runner per "
            f"rank; call checkpoint.{call} on every rank's runner: "
            f"lp.on_all_ranks(lambda r: mpmd.checkpoint.{call}(path, r))"
        )
    kind = type(runner).__qualname__
    if type(runner).__module__ != "builtins":
        kind = f"{type(runner).__module__}.{kind}"
    raise TypeError(
        f"checkpoint.{call}: runner is {'None' if runner is None else f'a {kind}'}, "
        "not a PipelineRunner: pass this rank's mpmd.PipelineRunner (a plain model saves and "
        "loads with torch.distributed.checkpoint or save_pretrained)"
    )


def check_entries(
    source: Path,
    state: dict[str, Any],
    keys: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Raises naming the entries of `state` the checkpoint lacks or holds
    with another shape, or how its optimizer differs from `optimizer`."""
    flat, _ = flatten_state_dict(state)
    missing = [k for k in flat if k not in keys]
    model = [k for k in missing if k.startswith("model.")]
    if model:
        raise KeyError(
            f"checkpoint {source} has no entry for {model[:5]}"
            f"{' ...' if len(model) > 5 else ''}: it was written for another model"
        )
    if missing and not any(k.startswith("optim.") for k in keys):
        raise KeyError(
            f"checkpoint {source} holds no optimizer state (it was saved without an "
            "optimizer): load it with optimizer=None to start the optimizer afresh"
        )
    if any(k.startswith(_GROUPS) for k in missing):
        _optimizer_differs(source, flat, keys, type(optimizer).__name__)
    if missing:
        raise KeyError(
            f"checkpoint {source} has no optimizer state for {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}: it was saved with another optimizer "
            "(or other optimizer settings); load it with optimizer=None to start afresh"
        )
    for k, value in flat.items():
        meta = keys[k]
        if (
            isinstance(value, torch.Tensor)
            and isinstance(meta, TensorStorageMetadata)
            and tuple(meta.size) != tuple(value.shape)
        ):
            raise ValueError(
                f"checkpoint {source}: {k!r} has shape {list(meta.size)} in the checkpoint "
                f"and {list(value.shape)} in this rank's model: it was written for a model "
                "of other sizes"
            )


def _settings(keys: Any) -> dict[str, set[str]]:
    """Each parameter group's settings (by group index), from flat keys
    `optim.param_groups.<i>.<setting>[.<part>]`."""
    out: dict[str, set[str]] = {}
    for k in keys:
        if k.startswith(_GROUPS):
            parts = k[len(_GROUPS) :].split(".")
            if len(parts) > 1:
                out.setdefault(parts[0], set()).add(parts[1])
    return out


def _optimizer_differs(source: Path, flat: Any, keys: Any, local_type: str) -> None:
    """Raises saying how the checkpoint's optimizer parameter groups differ
    from this rank's: their number, or the settings they hold (another
    optimizer type: Adam's `betas` where SGD has `momentum`)."""
    saved, local = _settings(keys), _settings(flat)
    if len(saved) != len(local):
        raise ValueError(
            f"checkpoint {source} has {len(saved)} optimizer parameter group(s), this rank's "
            f"optimizer {len(local)}: build the optimizer with the same groups"
        )
    for i in sorted(local, key=int):
        extra = sorted(saved.get(i, set()) - local[i])
        lacks = sorted(local[i] - saved.get(i, set()))
        if not extra and not lacks:
            continue
        parts = []
        if extra:
            parts.append(
                f"has the settings {', '.join(extra)}, which this rank's {local_type} lacks"
            )
        if lacks:
            which = "which it has" if extra else f"which this rank's {local_type} has"
            parts.append(f"lacks {', '.join(lacks)}, {which}")
        guess = _optimizers_with(saved.get(i, set()))
        saved_as = f" (the settings of torch.optim.{' or '.join(guess)})" if guess else ""
        raise ValueError(
            f"checkpoint {source} was saved with another optimizer or other optimizer "
            f"settings: its parameter group {i} {', and '.join(parts)}{saved_as}. Build the "
            "optimizer the checkpoint was saved with (the same type and settings), or load "
            "with optimizer=None to load the model only and start the optimizer afresh"
        )


def _optimizers_with(settings: set[str]) -> list[str]:
    """The torch.optim optimizers whose parameter groups hold exactly
    `settings` (a learning-rate scheduler's `initial_lr` aside)."""
    wanted = settings - {"params", "initial_lr"}
    found = []
    probe = [torch.nn.Parameter(torch.zeros(2, 2))]
    for name in sorted(dir(torch.optim)):
        cls = getattr(torch.optim, name)
        if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
            continue
        build: Any = cls  # an optimizer's own arguments, all defaulted (or it fails below)
        try:
            group = build(probe).param_groups[0]
        except Exception:  # needs arguments of its own: not a candidate
            continue
        if set(group) - {"params"} == wanted:
            found.append(name)
    return found
