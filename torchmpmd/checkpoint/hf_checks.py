"""What `save_hf` and `load_hf` check before they write or read (hf.py):
where a save may write, that the config it writes describes the model, and
which checkpoint keys a load ignores as `from_pretrained` does."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

__all__: list[str] = []

# The sizes a config must share with the model's own config: a config of
# other sizes builds a model the weights do not fit (or, for
# tie_word_embeddings, one whose head save_hf did not write).
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def check_target(given: str | os.PathLike[str], target: Path) -> None:
    """Raises, before anything is written, where `save_hf` may not write
    the directory `target` (`given`, resolved)."""
    shown = str(given) if str(given) == str(target) else f"{str(given)!r} ({target})"
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise ValueError(
            f"save_hf: {shown} is the working directory or a directory above it; save_hf "
            "writes a new directory in its place: save into a directory of its own, e.g. "
            "'hf/final'"
        )
    if Path(given).is_symlink() or (target.exists() and not target.is_dir()):
        raise FileExistsError(f"save_hf: {shown} exists and is not a directory: pass a new path")
    if target.is_dir() and any(target.iterdir()):
        raise FileExistsError(
            f"save_hf: {shown} is not empty; save_hf writes a new directory (pass a new path, "
            "or move what it holds yourself)"
        )
    parent = target.parent
    while not os.path.lexists(parent):
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(
            f"save_hf: cannot create {shown}: its parent {parent} is a file, not a directory; "
            "pass a path under a directory (or move the file)"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"save_hf: cannot write {shown}: the directory {parent} is not writable by this "
            "process; save to a directory you can write to"
        )


def config_to_write(config: Any, source: torch.nn.Module | None, path: object) -> tuple[Any, bool]:
    """The config `save_hf` writes as config.json: `config`, checked to be
    a Hugging Face config (a `PretrainedConfig`) of this model's type and
    sizes where the model has one of its own, else the model's own; None
    (with a warning) where there is neither. And whether the tensors' names
    are still to be checked against it (`check_config_names`: a config
    given for a model without one of its own)."""
    own = getattr(source, "config", None)
    if not callable(getattr(own, "save_pretrained", None)):
        own = None
    if config is None:
        if own is None:
            warnings.warn(
                f"save_hf: the model has no Hugging Face config (.config) and config= was not "
                f"passed: {path} gets the weights without the config.json that from_pretrained "
                "needs. Pass config= (a transformers PretrainedConfig describing the model, e.g. "
                "LlamaConfig(...)) to write one",
                stacklevel=4,
            )
        return own, False
    if not callable(getattr(config, "save_pretrained", None)):
        raise TypeError(
            f"save_hf: config is a {type(config).__qualname__}, not a Hugging Face config: pass "
            "a transformers PretrainedConfig (e.g. model.config, or "
            "AutoConfig.from_pretrained(name)), or leave config=None to write the model's own"
        )
    if own is not None:
        _same_model(config, own)
    return config, own is None


def _same_model(config: Any, own: Any) -> None:
    """Raises where `config` describes another model than the model's own
    config `own`: another model_type, or other sizes."""
    theirs, mine = getattr(config, "model_type", ""), getattr(own, "model_type", "")
    fix = "pass the model's own config (model.config), or leave config=None to write it"
    if theirs and mine and theirs != mine:
        raise ValueError(
            f"save_hf: config describes a {theirs!r} model, but the pipeline's model is a "
            f"{mine!r} one (its own config): from_pretrained would build a {theirs!r} model "
            f"and find none of these weights; {fix}"
        )
    differ = [
        (name, getattr(config, name, None), getattr(own, name, None))
        for name in _SIZES
        if getattr(config, name, None) is not None
        and getattr(own, name, None) is not None
        and getattr(config, name) != getattr(own, name)
    ]
    if differ:
        shown = ", ".join(f"{n}={a!r}" for n, a, _ in differ)
        own_shown = ", ".join(f"{n}={b!r}" for n, _, b in differ)
        raise ValueError(
            f"save_hf: config has {shown}, where the model's own config has {own_shown}: "
            f"from_pretrained would build a model of other sizes, which these weights do not "
            f"fit; {fix}"
        )


def check_config_names(config: Any, shapes: dict[str, list[int]]) -> None:
    """For a model without a config of its own: raises where the model
    `config` describes (its `architectures`' class, else its base model)
    has no place for the tensors save_hf writes (`shapes`, by name) or
    holds them with other shapes. Skipped where transformers cannot build
    that model."""
    try:
        import transformers

        names = getattr(config, "architectures", None) or []
        cls: Any = getattr(transformers, names[0], None) if names else None
        auto: Any = transformers.AutoModel
        with torch.device("meta"):
            built = cls(config) if cls is not None else auto.from_config(config)
    except Exception:  # not a model transformers builds: nothing to compare with
        return
    prefix = str(getattr(built, "base_model_prefix", "") or "")
    expected = {n: list(t.shape) for n, t in built.state_dict().items()}
    unplaced, other_shape = [], []
    for name, shape in shapes.items():
        key = next((k for k in candidates(name, prefix) if k in expected), None)
        if key is None:
            unplaced.append(name)
        elif expected[key] != shape:
            other_shape.append(f"{name!r} has shape {expected[key]} there, {shape} here")
    what = type(built).__name__
    fix = "pass the config of this model (its type and sizes), or save it another way"
    if other_shape:
        raise ValueError(
            f"save_hf: config describes a {what} of other sizes ({'; '.join(other_shape[:3])}): "
            f"from_pretrained would refuse these weights; {fix}"
        )
    if unplaced and (cls is not None or len(unplaced) == len(shapes)):
        raise ValueError(
            f"save_hf: config describes a {what}, which has no place for "
            f"{', '.join(repr(n) for n in unplaced[:5])}"
            f"{f' and {len(unplaced) - 5} more' if len(unplaced) > 5 else ''} of the "
            f"{len(shapes)} tensors saved: from_pretrained would leave them out; {fix}"
        )


def candidates(name: str, prefix: str) -> list[str]:
    """The keys a checkpoint may hold `name` under: as it is, and (as
    `from_pretrained` does) without or with the base model's prefix."""
    out = [name]
    if prefix and name.startswith(prefix + "."):
        out.append(name[len(prefix) + 1 :])
    elif prefix:
        out.append(f"{prefix}.{name}")
    return out


def ignored_on_load(source: torch.nn.Module | None, names: set[str]) -> list[re.Pattern[str]]:
    """The patterns of checkpoint keys `from_pretrained` ignores where the
    model has no place for them: the model's (and its modules')
    `_keys_to_ignore_on_load_unexpected`, and the RoPE tables and position
    ids older checkpoints saved (`rotary_emb.inv_freq`, `position_ids`),
    where the model has such buffers. `names`: every name of the model's
    tensors."""
    found: list[str] = []
    for module in source.modules() if source is not None else []:
        found += list(getattr(module, "_keys_to_ignore_on_load_unexpected", None) or [])
    if any(n.endswith("rotary_emb.inv_freq") for n in names):
        found.append(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in names):
        found.append(r"(^|\.)position_ids$")
    return [re.compile(p) for p in dict.fromkeys(found)]


def non_persistent(source: torch.nn.Module | None) -> set[str]:
    """The names of the model's non-persistent buffers (in no checkpoint of
    the model's own, but in some older ones, which `from_pretrained` loads)."""
    if source is None:
        return set()
    out = set()
    for prefix, module in source.named_modules(remove_duplicate=False):
        for leaf in module._non_persistent_buffers_set:
            out.add(f"{prefix}.{leaf}" if prefix else leaf)
    return out
