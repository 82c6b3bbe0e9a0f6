"""A Hugging Face checkpoint directory as `load_hf` reads it (`_Files`):
`model.safetensors` or the shards `model.safetensors.index.json` lists,
opened lazily, each tensor (or the part of it a rank holds) read on demand;
stacked experts read from their per-expert keys (`hf_experts`). A damaged
file or index fails naming it (`CheckpointError`)."""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .hf_experts import Converter, Stacked, stacked_keys

__all__ = ["INDEX_FILE", "SINGLE_FILE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(slots=True)
class _Files:
    """A Hugging Face checkpoint directory, read lazily (safetensors)."""

    directory: Path
    where: dict[str, Path] = field(default_factory=dict)  # key -> its file
    bytes_read: int = 0
    _stack: ExitStack = field(default_factory=ExitStack)
    _open: dict[Path, Any] = field(default_factory=dict)
    _keys: dict[Path, set[str]] = field(default_factory=dict)  # each open file's tensors
    # Stacked experts the per-expert keys make up, by parameter name (hf_experts).
    stacked: dict[str, Stacked] = field(default_factory=dict)

    def stack(self, found: list[Converter]) -> None:
        """Knows the stacked parameters the checkpoint's per-expert keys make up."""
        self.stacked = stacked_keys(self.where, found) if found else {}

    def has(self, key: str) -> bool:
        return key in self.where or key in self.stacked

    def location(self, key: str) -> str:
        """Where `key` is, for messages."""
        if key in self.stacked:
            return f"{self.directory} (per expert: {self.stacked[key].keys[0][0]!r}, ...)"
        return str(self.where[key])

    def consumed(self) -> set[str]:
        """The per-expert keys the stacked parameters read."""
        return {k for st in self.stacked.values() for row in st.keys for k in row}

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> _Files:
        """The checkpoint in the directory `path`, or in the directory of the
        file `path` names (its `model.safetensors`, index, or a lone
        safetensors file)."""
        given = Path(path)
        directory, only = given, None
        if given.is_file():
            directory, only = given.parent, given.name
            if only.endswith(".safetensors") and only != SINGLE_FILE:
                if (directory / INDEX_FILE).is_file():
                    raise ValueError(
                        f"load_hf: {given} is one shard of the checkpoint in {directory} (its "
                        f"{INDEX_FILE} lists the others): pass the directory {directory}"
                    )
            elif only not in (SINGLE_FILE, INDEX_FILE):
                raise NotADirectoryError(
                    f"load_hf: {given} is a file, not a checkpoint: pass the directory "
                    f"save_pretrained wrote (with {SINGLE_FILE} or {INDEX_FILE})"
                )
        files = cls(directory)
        if only == INDEX_FILE or (only is None and (directory / INDEX_FILE).is_file()):
            files._read_index(directory / INDEX_FILE)
        elif only is not None or (directory / SINGLE_FILE).is_file():
            single = directory / (only or SINGLE_FILE)
            files.where = dict.fromkeys(files._header(single, None).keys(), single)
        else:
            found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else None
            what = "does not exist" if found is None else f"holds {found[:8]}"
            raise FileNotFoundError(
                f"load_hf: {directory} {what}, with neither {SINGLE_FILE} nor {INDEX_FILE}: pass "
                "a directory written by save_pretrained (safetensors; a pytorch_model.bin "
                "checkpoint loads with from_pretrained and saves again as safetensors)"
            )
        return files

    def _read_index(self, index_file: Path) -> None:
        try:
            index = json.loads(index_file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(
                f"load_hf: the index {index_file} is not valid JSON ({err}): it is damaged or "
                "truncated; restore it (or save the checkpoint again)"
            ) from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                f"load_hf: the index {index_file} has no weight_map (a JSON object of tensor "
                "names to file names): restore it (or save the checkpoint again)"
            )
        for key, name in weight_map.items():
            if not isinstance(name, str) or Path(name).name != name:
                raise ValueError(
                    f"load_hf: {index_file} maps {key!r} to {name!r}, which is "
                    "not a file name in the checkpoint's directory"
                )
            self.where[key] = self.directory / name

    def _header(self, path: Path, key: str | None) -> Any:
        """The open safetensors file `path` (which holds `key`), or raises
        naming the file where it is missing or damaged."""
        if path in self._open:
            return self._open[path]
        holds = f" (which holds {key!r})" if key is not None else ""
        if not path.is_file():
            raise FileNotFoundError(f"load_hf: {path}{holds} is missing")
        safe_open = _safetensors("load_hf").safe_open
        try:
            f = self._stack.enter_context(safe_open(str(path), framework="pt"))
        except Exception as err:
            raise CheckpointError(
                f"load_hf: {path}{holds} is not a readable safetensors file ({err}): it is "
                "truncated or damaged (an interrupted download or copy?); restore it (or save "
                "the checkpoint again)"
            ) from None
        self._open[path] = f
        return f

    def _file(self, key: str) -> Any:
        path = self.where[key]
        f = self._header(path, key)
        if path not in self._keys:
            self._keys[path] = set(f.keys())
        if key not in self._keys[path]:
            elsewhere = [
                other.name
                for other in sorted(set(self.where.values()) - {path})
                if other.is_file() and key in self._keys_of(other)
            ]
            found = f": it is in {elsewhere[0]}" if elsewhere else ""
            raise CheckpointError(
                f"load_hf: {self.directory / INDEX_FILE} says {path.name} holds {key!r}, but "
                f"{path} does not{found}. The index does not match the files: restore them (or "
                "save the checkpoint again)"
            )
        return f

    def _keys_of(self, path: Path) -> set[str]:
        if path not in self._keys:
            try:
                self._keys[path] = set(self._header(path, None).keys())
            except CheckpointError:  # damaged too: named when its own keys are read
                return set()
        return self._keys[path]

    def shape(self, key: str) -> list[int]:
        if key in self.stacked:
            return self.stacked[key].shape(self.shape)
        return list(self._file(key).get_slice(key).get_shape())

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `key`, or its part `index` (only that part is read; of
        stacked experts, only the experts `index` selects)."""
        if key in self.stacked:
            return self.stacked[key].read(self.read, index)
        f = self._file(key)
        try:
            value: torch.Tensor = f.get_tensor(key) if index is None else f.get_slice(key)[index]
        except Exception as err:
            raise CheckpointError(
                f"load_hf: cannot read {key!r} from {self.where[key]} ({err}): the file is "
                "damaged; restore it (or save the checkpoint again)"
            ) from None
        self.bytes_read += value.numel() * value.element_size()
        return value

    def close(self) -> None:
        self._stack.close()
        self._open.clear()
        self._keys.clear()


def _safetensors(call: str) -> Any:
    try:
        import safetensors.torch
    except ImportError as err:
        raise ImportError(
            f"checkpoint.{call} reads and writes safetensors files: pip install safetensors "
            "(or torchmpmd[hf]; transformers installs it too)"
        ) from err
    return safetensors
