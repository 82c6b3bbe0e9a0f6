"""DCP storage with checksums, that loads without running code from the files.

`ChecksumWriter` is DCP's `FileSystemWriter` that, once a rank has written
its data files, takes the CRC-32 of each stored item (through a memory map
of the file, still in the page cache). The checksums reach the coordinator
with DCP's own write results; it writes them into the checkpoint's manifest
(`.torchmpmd.json`) before DCP writes `.metadata`. The manifest also lists
every file the ranks wrote (an empty one of a rank with nothing to store
too), which marks the directory as one this package wrote (paths.py). A
manifest is read as untrusted data: it is refused unless every file it names
is a plain file name, and every field has its type.

`VerifyingReader` is DCP's `FileSystemReader` that reads `.metadata` with an
unpickler that builds only DCP's own metadata classes, checks that each data
file it reads from lies inside the checkpoint, is there and has the size it
was written with, and checks each item against its checksum before DCP
deserialises it.
`PlainDataPlanner` loads DCP's byte items (everything that is not a tensor:
optimizer hyperparameters, `extra` values) with `torch.load(weights_only=True)`
instead of DCP's `weights_only=False`.

A checkpoint written by plain `dcp.save` has no manifest: it loads with the
same safe unpickling and size checks, and without checksums.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import mmap
import os
import pathlib
import pickle
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, TypeGuard

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .errors import CheckpointError, ours

MANIFEST = ".torchmpmd.json"
METADATA = ".metadata"
_FORMAT = "torchmpmd.checkpoint"
_VERSION = 1


@dataclasses.dataclass(frozen=True)
class _Summed:
    """A `WriteResult.storage_data` of ChecksumWriter until `finish`: DCP's
    own storage info, the item's CRC-32 (None: not summed) and its file's size."""

    info: _StorageInfo
    crc32: int | None
    file_size: int


class ChecksumWriter(FileSystemWriter):
    """DCP's file writer that records a CRC-32 per stored item and writes the
    manifest. Not thread-safe (one save at a time), as DCP's."""

    def __init__(self, path: str | os.PathLike[str], *, checksums: bool = True) -> None:
        super().__init__(path)
        self.checksums = checksums

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner)
        summed: Future[list[WriteResult]] = Future()
        summed.set_result(_sum_items(Path(self.path), written.wait(), self.checksums))
        return summed

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Every rank has written (DCP gathers the results first), into a
        # staging directory only this save writes. A rank whose plan is empty
        # still writes an empty data file, which no result names: it is
        # listed from the directory.
        files: dict[str, dict[str, Any]] = {
            entry.name: {"size": entry.stat(follow_symlinks=False).st_size, "items": []}
            for entry in os.scandir(Path(self.path))
            if entry.is_file(follow_symlinks=False) and not entry.name.startswith(".")
        }
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            row = []
            for result in rank_results:
                summed = result.storage_data
                if isinstance(summed, _Summed):
                    entry = files.setdefault(summed.info.relative_path, {"items": []})
                    entry["size"] = summed.file_size
                    if summed.crc32 is not None:
                        entry["items"].append(
                            [summed.info.offset, summed.info.length, summed.crc32]
                        )
                    result = dataclasses.replace(result, storage_data=summed.info)
                row.append(result)
            plain.append(row)
        manifest = {
            "format": _FORMAT,
            "version": _VERSION,
            "checksum": "crc32" if self.checksums else None,
            "files": files,
        }
        _write_atomically(Path(self.path) / MANIFEST, json.dumps(manifest).encode())
        super().finish(metadata, plain)


def _sum_items(directory: Path, results: list[WriteResult], checksums: bool) -> list[WriteResult]:
    """`results` with each item's CRC-32 and its file's size. The files were
    just written (in the page cache, in this save's own staging directory):
    they are summed through a memory map, without copying them again."""
    by_file: dict[str, list[WriteResult]] = {}
    for result in results:
        by_file.setdefault(result.storage_data.relative_path, []).append(result)
    out = []
    for name, items in by_file.items():
        with open(directory / name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            end = max(r.storage_data.offset + r.storage_data.length for r in items)
            if end > size:
                raise ours(
                    CheckpointError(
                        f"checkpoint.save: {directory / name} has {size} bytes after writing, "
                        f"fewer than its items need ({end}); is the disk full?"
                    )
                )
            mapped = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if checksums and size else None
            )
            with memoryview(mapped if mapped is not None else b"") as view:
                for result in items:
                    info = result.storage_data
                    crc = None
                    if checksums:
                        crc = zlib.crc32(view[info.offset : info.offset + info.length])
                    out.append(dataclasses.replace(result, storage_data=_Summed(info, crc, size)))
            if mapped is not None:
                mapped.close()
    return out


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def plain_name(name: object) -> bool:
    """Whether `name` names a file directly inside a directory: no directory
    part, not absolute, not '', '.' or '..'."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "\0" not in name
        and not any(sep in name for sep in ("/", os.sep, os.altsep) if sep)
        and not os.path.isabs(name)
        and pathlib.PurePath(name).name == name  # no drive ("C:x" on Windows)
    )


class ManifestError(ValueError):
    """What is wrong with a manifest's content (without the file's name)."""


class _NewerManifest(ManifestError):
    pass


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_manifest(raw: bytes) -> dict[str, Any]:
    """A manifest's content, checked field by field (it may be damaged or
    crafted: nothing in it is used unchecked); raises ManifestError saying
    what is wrong."""
    try:
        manifest = json.loads(raw)
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise ManifestError("is not a torchmpmd manifest")
    version = manifest.get("version")
    if not _int(version):
        raise ManifestError(f"has version {version!r}, not a version number")
    if version > _VERSION:
        raise _NewerManifest(
            f"has version {version}, newer than this torchmpmd reads ({_VERSION}); upgrade "
            "torchmpmd"
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ManifestError(f"has files {_show(files)}, not a table of files")
    for name, entry in files.items():
        if not plain_name(name):
            raise ManifestError(
                f"names {name!r} as a file of the checkpoint, which is not a plain file name "
                "inside it"
            )
        if not isinstance(entry, dict):
            raise ManifestError(f"has {_show(entry)} for {name!r}, not a table")
        if "size" in entry and not _int(entry["size"]):
            raise ManifestError(f"has the size of {name!r} as {_show(entry['size'])}")
        items = entry.get("items", [])
        if not isinstance(items, list) or not all(
            isinstance(i, list) and len(i) == 3 and all(_int(x) for x in i) for i in items
        ):
            raise ManifestError(
                f"has the items of {name!r} as {_show(items)}, not [offset, length, crc32] triples"
            )
    return manifest


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The checkpoint's manifest, or None where there is none (plain DCP);
    raises CheckpointError naming the file where it is malformed."""
    path = directory / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return parse_manifest(raw)
    except _NewerManifest as err:
        raise ours(CheckpointError(f"checkpoint {directory}: {path} {err}")) from None
    except ManifestError as err:
        raise ours(
            CheckpointError(
                f"checkpoint {directory}: {path} {err} (damaged, or not written by torchmpmd); "
                "load an earlier checkpoint, or delete the file to load the checkpoint without "
                "checksums"
            )
        ) from None


# What `.metadata` may refer to: DCP's metadata classes and the torch and
# pathlib values their fields hold. Nothing else is looked up, so nothing
# else can be called while unpickling. Keys are the names a pickle uses,
# which are those of the Python that wrote it.
@functools.cache
def _metadata_globals() -> dict[str, Any]:
    allowed: list[Any] = [
        dcp_metadata.Metadata,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata.MetadataIndex,
        _StorageInfo,
        torch.Size,
    ]
    # Present in the torch versions we support, looked up so that one that
    # drops them still loads what it can.
    for name in ("StorageMeta", "_MEM_FORMAT_ENCODING"):
        if hasattr(dcp_metadata, name):
            allowed.append(getattr(dcp_metadata, name))
    table = {f"{c.__module__}.{c.__qualname__}": c for c in allowed}
    # DCP stores the checkpoint's path (StorageMeta.checkpoint_id). Python
    # 3.13 moved pathlib's classes to pathlib._local (the name its pickles
    # use): both spellings load, on any version. A path saved on Windows
    # (WindowsPath), which cannot be built elsewhere, loads as its pure form.
    for module in ("pathlib", "pathlib._local"):
        table[f"{module}.PosixPath"] = pathlib.PosixPath
        table[f"{module}.PurePosixPath"] = pathlib.PurePosixPath
        table[f"{module}.WindowsPath"] = pathlib.PureWindowsPath
        table[f"{module}.PureWindowsPath"] = pathlib.PureWindowsPath
    table["torch.serialization._get_layout"] = torch.serialization._get_layout
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            table[f"torch.{name}"] = value
    return table


class _NotMetadata(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what `_metadata_globals` lists (the standard library's
    restricted-globals pattern: every class or function a pickle uses is
    looked up here, so one not listed can never be called)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_globals().get(f"{module}.{name}")
        if found is None:
            raise _NotMetadata(f"{module}.{name}")
        return found


def read_metadata(directory: Path, *, weights_only: bool) -> Metadata:
    """DCP's `.metadata` of `directory`: with `weights_only`, built from DCP's
    own classes only; raises naming the file where it is empty, damaged or
    refers to anything else."""
    path = directory / METADATA
    raw = path.read_bytes()
    if not raw:
        raise ours(
            CheckpointError(
                f"checkpoint {directory}: {path} is empty (the save that wrote it did not "
                "finish, or the file was cut short when copied); load an earlier checkpoint"
            )
        )
    try:
        unpickler = _MetadataUnpickler if weights_only else pickle.Unpickler
        metadata = unpickler(io.BytesIO(raw)).load()
    except _NotMetadata as err:
        raise ours(
            pickle.UnpicklingError(
                f"checkpoint {directory}: {path} refers to {err}, which is not one of DCP's "
                "metadata classes: loading it could run code named in the file, so it was not "
                "loaded. Load it with weights_only=False only if you trust where the file "
                "came from"
            )
        ) from None
    except Exception as err:
        raise ours(
            CheckpointError(
                f"checkpoint {directory}: {path} is not readable DCP metadata "
                f"({type(err).__name__}: {err}); the file is damaged or was not written by "
                "torch.distributed.checkpoint; load an earlier checkpoint"
            )
        ) from None
    if not isinstance(metadata, Metadata):
        raise ours(
            CheckpointError(
                f"checkpoint {directory}: {path} holds a {type(metadata).__name__}, not DCP "
                "metadata; the file was not written by torch.distributed.checkpoint"
            )
        )
    return metadata


def load_plain(value: IO[bytes], what: str) -> Any:
    """`torch.load(weights_only=True)` of a stored object, naming `what` when
    it holds anything else than tensors and plain data."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        text = str(err)
        reason = text.split("WeightsUnpickler error: ", 1)[-1].split(" Please use", 1)[0]
        raise ours(
            pickle.UnpicklingError(
                f"{what} is not tensors and plain Python data ({reason.strip()}): loading it "
                "could run code named in the file, so it was not loaded. Load it with "
                "weights_only=False only if you trust where the file came from"
            )
        ) from None
    except Exception as err:
        raise ours(
            CheckpointError(f"{what} cannot be read ({type(err).__name__}: {err}); it is damaged")
        ) from None


class PlainDataPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading byte items weights-only (unless
    `weights_only=False`), and putting each under the key it was saved with:
    DCP's entry names hold str(key), which DCP's own planner puts back as a
    str."""

    def __init__(self, source: Path, *, weights_only: bool = True) -> None:
        super().__init__()
        self.source = source
        self.weights_only = weights_only

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if self.weights_only:
            loaded = load_plain(value, f"checkpoint {self.source}: entry {fqn!r}")
        else:
            loaded = torch.load(value, weights_only=False)
        if self.flatten_state_dict:
            _set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _set_element(root: Any, path: Sequence[str | int], value: Any) -> None:
    """Puts `value` at `path` in `root`, whose containers the load built
    (the template): a str in `path` stands for the key whose str it is."""
    node = root
    for i, part in enumerate(path):
        key: Any = part
        if isinstance(node, dict) and part not in node:
            key = next((k for k in node if str(k) == part), part)
        if i == len(path) - 1:
            if isinstance(node, list) and isinstance(key, int):
                node.extend([None] * (key + 1 - len(node)))
            node[key] = value
        else:
            node = node[key]


class VerifyingReader(FileSystemReader):
    """DCP's file reader with safe metadata, size and checksum checks (see
    the module docstring). Reads `.metadata` once (cached)."""

    def __init__(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> None:
        super().__init__(path)
        self.directory = Path(path)
        self.weights_only = weights_only
        self._metadata: Metadata | None = None
        self._manifest: dict[str, Any] | None = None
        self._sums: dict[tuple[str, int], tuple[int, int]] = {}
        self._names: dict[tuple[str, int], str] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP's fallback to per-rank metadata, which save never writes.
            raise FileNotFoundError(f"checkpoint {self.directory} has no per-rank metadata")
        if self._metadata is None:
            metadata = read_metadata(self.directory, weights_only=self.weights_only)
            self._check_paths(metadata)
            self._manifest = read_manifest(self.directory)
            self._metadata = metadata
        storage_meta = getattr(self._metadata, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        return self._metadata

    @property
    def manifest(self) -> dict[str, Any] | None:
        """The checkpoint's manifest (after `read_metadata`), None for plain DCP."""
        return self._manifest

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._check_paths(metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self._metadata is None:
            self.read_metadata()
        self._index(metadata)

    def _index(self, metadata: Metadata) -> None:
        """Each stored item's entry name and checksum, by file and offset."""
        self._names = {
            (info.relative_path, info.offset): index.fqn
            for index, info in metadata.storage_data.items()
        }
        files = self._manifest["files"] if self._manifest is not None else {}
        self._sums = {
            (name, int(offset)): (int(length), int(crc))
            for name, entry in files.items()
            for offset, length, crc in entry.get("items", [])
        }

    def _check_paths(self, metadata: Metadata) -> None:
        """Every data file `metadata` names lies directly in the checkpoint
        (DCP joins the name to the directory as it is: '../x' or an absolute
        name would read a file elsewhere)."""
        for index, info in (metadata.storage_data or {}).items():
            name = getattr(info, "relative_path", None)
            if not plain_name(name):
                fqn = getattr(index, "fqn", index)
                raise ours(
                    CheckpointError(
                        f"checkpoint {self.directory}: {self.directory / METADATA} places "
                        f"{fqn!r} in {name!r}, which is not a file inside the checkpoint: it "
                        "would be read from outside it, so nothing was read. The metadata is "
                        "damaged or was crafted; load an earlier checkpoint"
                    )
                )

    def read_object(self, fqn: str) -> Any:
        """The object stored as the entry `fqn`, checked as `read_data` checks
        it and read weights-only (whatever this reader's `weights_only`).
        Local (no collective): for a small entry needed before DCP's load."""
        metadata = self.read_metadata()
        self._index(metadata)
        info = metadata.storage_data.get(MetadataIndex(fqn))
        if info is None:
            raise ours(
                CheckpointError(
                    f"checkpoint {self.directory}: {self.directory / METADATA} lists the entry "
                    f"{fqn!r} but not where it is stored; the metadata is damaged"
                )
            )
        self._check_file(info.relative_path, [info])
        with open(self.directory / info.relative_path, "rb") as f:
            data = self._slice_file(f, info).read()
        return load_plain(io.BytesIO(data), f"checkpoint {self.directory}: entry {fqn!r}")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._check_files(plan.items)
        return super().read_data(plan, planner)

    def _check_files(self, items: Sequence[ReadItem]) -> None:
        """Each data file `items` read from exists and has its written size."""
        needed: dict[str, list[_StorageInfo]] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            needed.setdefault(info.relative_path, []).append(info)
        for name, infos in needed.items():
            self._check_file(name, infos)

    def _check_file(self, name: str, infos: Sequence[_StorageInfo]) -> None:
        """The data file `name` exists and has its written size, at least
        enough for `infos`."""
        files = self._manifest["files"] if self._manifest is not None else {}
        path = self.directory / name
        holds = self._holds(name, infos)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ours(
                FileNotFoundError(
                    f"checkpoint {self.directory}: data file {path} is missing (it holds "
                    f"{holds}); the checkpoint is damaged: restore the file or load an "
                    "earlier checkpoint"
                )
            ) from None
        written = files.get(name, {}).get("size")
        end = max(i.offset + i.length for i in infos)
        if (written is not None and size != written) or size < end:
            expected = (
                f"{written} bytes when written"
                if written is not None
                else (f"at least {end} bytes")
            )
            raise ours(
                CheckpointError(
                    f"checkpoint {self.directory}: data file {path} has {size} bytes, it "
                    f"had {expected} (it holds {holds}); the file was truncated or "
                    "overwritten: restore it or load an earlier checkpoint"
                )
            )

    def _holds(self, name: str, infos: Sequence[_StorageInfo]) -> str:
        fqns = sorted({self._names.get((name, i.offset), "?") for i in infos})
        return ", ".join(fqns[:4]) + (f" and {len(fqns) - 4} more" if len(fqns) > 4 else "")

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> IO[bytes]:
        expected = self._sums.get((sinfo.relative_path, sinfo.offset))
        if expected is None:
            return super()._slice_file(file, sinfo)
        length, crc = expected
        path = self.directory / sinfo.relative_path
        fqn = self._names.get((sinfo.relative_path, sinfo.offset), "?")
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if length != sinfo.length or len(data) != sinfo.length or zlib.crc32(data) != crc:
            raise ours(
                CheckpointError(
                    f"checkpoint {self.directory}: data file {path} fails its checksum for "
                    f"{fqn!r} (bytes {sinfo.offset}-{sinfo.offset + sinfo.length} differ from "
                    "what was written): the file is corrupted; restore it or load an earlier "
                    "checkpoint"
                )
            )
        return io.BytesIO(data)
