"""Where a save may write, and how it puts the checkpoint in place.

A save writes into a staging directory beside its target and renames it into
place once every rank has written. It replaces only what it can prove it
wrote: an existing directory that is a complete checkpoint of this package
(DCP's `.metadata` and our manifest, and nothing the manifest does not list)
or an empty directory. Anything else at the path (another directory, a file,
a symbolic link, the working directory or one above it) is refused before a
byte is written. The old checkpoint is renamed aside, the new one renamed
into place, and the old one removed last: the regular files found in it that
its manifest lists, and nothing else. At any moment the path is absent (for
an instant between the two renames), the old complete checkpoint, or the new
complete one.

A manifest is not trusted to name paths: one that names anything but a plain
file name is refused (storage.parse_manifest), and a manifest's names are
only ever compared with the names a directory listing found, never joined
onto a path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

from .storage import MANIFEST, METADATA, ManifestError, parse_manifest


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """Where rank 0 decided a save writes."""

    path: Path  # the checkpoint directory, resolved
    staging: Path  # the directory DCP writes into, beside `path`
    created: tuple[Path, ...]  # missing parents the save creates, outermost first


_MOVE_IT = (
    "save replaces only a checkpoint it wrote: save to a new path inside it (e.g. "
    "'ckpt/step-100'), or move what it holds yourself"
)


def _written_by_us(directory: Path) -> tuple[str, str] | None:
    """None where `directory` may be replaced (a complete checkpoint of ours,
    or empty); else why not (what it holds that a save did not write) and
    what to do instead."""
    entries = sorted(os.scandir(directory), key=lambda e: e.name)
    if not entries:
        return None
    names = {e.name for e in entries}
    if METADATA in names and MANIFEST not in names:
        return (
            f"it is a DCP checkpoint without a torchmpmd manifest ({MANIFEST}): written by an "
            "older torchmpmd or by dcp.save, it does not say which files are its own",
            "save does not replace it: delete it yourself if it is no longer needed, or save "
            "to a new path",
        )
    if METADATA not in names or MANIFEST not in names:
        shown = [e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries]
        listing = ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
        return f"it is not a torchmpmd checkpoint (it holds {listing})", _MOVE_IT
    try:
        manifest = parse_manifest((directory / MANIFEST).read_bytes())
    except (OSError, ManifestError) as err:
        return (
            f"its manifest {directory / MANIFEST} cannot be trusted to say what the checkpoint "
            f"wrote ({err})",
            "save does not replace it: delete the checkpoint yourself if it is no longer "
            "needed, or save to a new path",
        )
    ours = {METADATA, MANIFEST, *manifest["files"]}
    foreign = [
        e.name + ("/" if e.is_dir(follow_symlinks=False) else "")
        for e in entries
        if e.name not in ours or not e.is_file(follow_symlinks=False)
    ]
    if foreign:
        return f"it holds {', '.join(foreign[:5])}, which the checkpoint did not write", _MOVE_IT
    return None


def plan(path: str | os.PathLike[str]) -> Target:
    """Decides where a save of `path` writes, or raises (before anything is
    written) naming the path and what to do instead."""
    given = os.fspath(path)
    if not given:
        raise ValueError("checkpoint.save: the path is empty; name a checkpoint directory")
    if os.path.basename(given.rstrip("/" + os.sep)) in (".", ".."):
        raise ValueError(
            f"checkpoint.save: {given!r} ends in '.' or '..': name the checkpoint directory "
            "itself, e.g. 'ckpt/step-100'"
        )
    if Path(given).is_symlink():
        raise FileExistsError(
            f"checkpoint.save: {given!r} is a symbolic link; save refuses to replace it. Save "
            "to a new path (e.g. 'ckpt/step-100'), or remove the link yourself"
        )
    target = Path(given).resolve()
    shown = given if given == str(target) else f"{given!r} ({target})"
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise ValueError(
            f"checkpoint.save: {shown} is the working directory or a directory above it; save "
            "into a directory of its own, e.g. 'ckpt/step-100'"
        )
    if os.path.lexists(target):
        if not target.is_dir():
            raise FileExistsError(
                f"checkpoint.save: {shown} exists and is not a directory; save refuses to "
                "replace it. Save to a new path (e.g. 'ckpt/step-100'), or remove it yourself"
            )
        if os.path.ismount(target):
            raise ValueError(
                f"checkpoint.save: {shown} is a mount point; save into a directory inside it"
            )
        refused = _written_by_us(target)
        if refused is not None:
            why, instead = refused
            raise FileExistsError(f"checkpoint.save: {shown} exists and {why}. {instead}")
    missing: list[Path] = []
    parent = target.parent
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(
            f"checkpoint.save: cannot create {shown}: {parent} is not a directory"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"checkpoint.save: cannot write {shown}: the directory {parent} is not writable "
            "by this process; save to a directory you can write to"
        )
    staging = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    return Target(path=target, staging=staging, created=tuple(reversed(missing)))


def commit(target: Target) -> None:
    """Puts the written staging directory in place of `target.path` (rank
    0, after every rank wrote). An existing checkpoint is renamed aside
    first and removed last; raises, leaving it in place, if it is no longer
    one this package may replace. Once the new checkpoint is in place, a
    failure to remove the old one is a warning, not an error."""
    path, staging = target.path, target.staging
    if not os.path.lexists(path):
        # rename(2) replaces at most an empty directory made meanwhile.
        os.rename(staging, path)
        _sync_dir(path.parent)
        return
    refused = (
        _written_by_us(path)
        if path.is_dir() and not path.is_symlink()
        else ("it is not a directory", "")
    )
    if refused is not None:
        raise FileExistsError(
            f"checkpoint.save: {path} changed while saving and {refused[0]}; the new "
            f"checkpoint is left in {staging}"
        )
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(path, old)
    try:
        os.rename(staging, path)
    except BaseException:
        os.rename(old, path)
        raise
    _sync_dir(path.parent)
    try:
        _remove_checkpoint(old)
    except Exception as err:  # the new checkpoint is complete and in place
        warnings.warn(
            f"checkpoint.save: the replaced checkpoint, renamed to {old}, could not be removed "
            f"({type(err).__name__}: {err}); the new one is in place at {path}. Remove {old} "
            "yourself",
            stacklevel=3,
        )


def abandon(target: Target) -> None:
    """Removes what a failed save wrote: its staging directory (which only
    this save writes into) and the parents it created, if still empty."""
    shutil.rmtree(target.staging, ignore_errors=True)
    for parent in reversed(target.created):
        try:
            parent.rmdir()
        except OSError:
            break


def _remove_checkpoint(directory: Path) -> None:
    """Deletes a checkpoint this package wrote: the regular files (not links,
    not directories) found in it that its manifest lists, the manifest last.
    Anything else is left, with a warning; a manifest that cannot be read
    leaves everything. Raises OSError where a listed file cannot be deleted."""
    try:
        listed = {*parse_manifest((directory / MANIFEST).read_bytes())["files"], METADATA}
    except (OSError, ManifestError) as err:
        warnings.warn(
            f"checkpoint.save: the replaced checkpoint, renamed to {directory}, was left there: "
            f"its manifest cannot be read now ({err})",
            stacklevel=4,
        )
        return
    found = [
        entry
        for entry in os.scandir(directory)
        if entry.is_file(follow_symlinks=False) and entry.name in {*listed, MANIFEST}
    ]
    for entry in sorted(found, key=lambda e: e.name == MANIFEST):
        # entry.path joins the name the listing found, not the manifest's.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
    try:
        directory.rmdir()
    except OSError:
        left = sorted(os.listdir(directory))
        warnings.warn(
            f"checkpoint.save: the replaced checkpoint, renamed to {directory}, holds files it "
            f"did not write ({', '.join(left[:5])}); they were left there",
            stacklevel=4,
        )


def _sync_dir(directory: Path) -> None:
    """Makes a rename in `directory` durable (where the platform allows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
