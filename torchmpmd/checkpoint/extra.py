"""How `extra` is stored and rebuilt: DCP stores a dict, and a list holding
tensors or dicts, entry by entry (`extra.rng.0`), so `save` also stores each
value's layout (its containers, under `LAYOUT`), from which `load` rebuilds
lists, non-str keys and empty dicts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .agree import PER_RANK, empty_like
from .errors import CheckpointError
from .storage import VerifyingReader

__all__ = ["LAYOUT", "extra_templates", "with_extra"]

# The entry holding the layout of `extra` and of each rank's `per_rank`.
LAYOUT = "torchmpmd_layout"


def with_extra(state: dict[str, Any], extra: Mapping[str, Any] | None, rank: int) -> dict[str, Any]:
    """`state` with `extra` (and this rank's `per_rank`) and their layouts."""
    if not extra:
        return state
    common = {k: v for k, v in extra.items() if k != PER_RANK}
    out = dict(state)
    layouts = {}
    if common:
        out["extra"] = common
        layouts["extra"] = (_layout(common),)
    if PER_RANK in extra:
        own = f"{PER_RANK}.rank{rank}"
        out[own] = extra[PER_RANK]
        layouts[own] = (_layout(extra[PER_RANK]),)
    # In a tuple, which DCP stores as one object, not entry by entry.
    out[LAYOUT] = layouts
    return out


def _layout(value: Any) -> Any:
    """`value`'s dicts and lists with everything else None: what `load` needs
    to rebuild it from DCP's entries (plain data, read weights-only)."""
    if isinstance(value, Mapping):
        out = empty_like(value)
        for k, v in value.items():
            out[k] = _layout(v)
        return out
    if isinstance(value, list):
        return [_layout(v) for v in value]
    return None


def extra_templates(
    reader: VerifyingReader, keys: Mapping[str, Any], source: Path, names: Iterable[str]
) -> dict[str, Any]:
    """For each of `names` the checkpoint holds, what DCP loads it into:
    shaped by its saved layout, or nested dicts for a checkpoint written
    without one (plain `dcp.save`)."""
    out: dict[str, Any] = {}
    for name in names:
        layout = f"{LAYOUT}.{name}"
        if layout in keys:
            stored = reader.read_object(layout)
            if not (isinstance(stored, tuple) and len(stored) == 1):
                raise CheckpointError(
                    f"checkpoint {source}: entry {layout!r} is not a layout; the checkpoint is "
                    "damaged"
                )
            out[name] = _rebuild(source, keys, name, stored[0])
        elif any(k == name or k.startswith(name + ".") for k in keys):
            out[name] = _template(keys, name)
    return out


def _leaf(meta: Any) -> Any:
    """What DCP loads an entry into: an empty tensor where a tensor was
    saved, None where an object was."""
    if isinstance(meta, TensorStorageMetadata):
        return torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return None


def _rebuild(source: Path, keys: Mapping[str, Any], name: str, layout: Any) -> Any:
    """The value saved under `name`, for DCP to load into, shaped by its
    layout: its dicts (with their types and keys) and lists, and `_leaf`
    where DCP stored an entry (a whole list or dict where DCP stored it as
    one object)."""
    if name in keys:
        return _leaf(keys[name])
    if isinstance(layout, Mapping):
        out = empty_like(layout)
        for k, v in layout.items():
            out[k] = _rebuild(source, keys, f"{name}.{k}", v)
        return out
    if isinstance(layout, list):
        return [_rebuild(source, keys, f"{name}.{i}", v) for i, v in enumerate(layout)]
    raise CheckpointError(
        f"checkpoint {source}: its layout of the saved values names {name!r}, which the "
        "checkpoint does not hold; the checkpoint is damaged"
    )


def _template(keys: Mapping[str, Any], prefix: str) -> Any:
    """A nested dict shaped like the saved entries under `prefix`, for DCP to
    load into (for a checkpoint without a layout)."""
    if prefix in keys:
        return _leaf(keys[prefix])
    out: dict[str, Any] = {}
    for k, meta in keys.items():
        if k.startswith(prefix + "."):
            parts = k[len(prefix) + 1 :].split(".")
            node = out
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = _leaf(meta)
    return out
