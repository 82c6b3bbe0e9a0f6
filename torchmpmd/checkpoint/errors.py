"""Checkpoint errors: our own, the ranks' agreed ones, and DCP's unwrapped.

DCP reports any failure of a save or load as one `CheckpointException`
("CheckpointException ranks:dict_keys([0])" with the cause on its last line).
`unwrap` turns it into the failing rank's own exception, whose first line says
what is wrong with which file or entry.
"""

from __future__ import annotations

import pickle
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

# Set on exceptions raised by this package (their message is complete); kept
# in the exception's __dict__, so it survives the pickling between ranks.
_MARK = "_torchmpmd_checkpoint"

# The types an error agreed between ranks is raised as, by name.
_TYPES: dict[str, type[Exception]] = {
    t.__name__: t
    for t in (
        ValueError,
        TypeError,
        KeyError,
        RuntimeError,
        TimeoutError,
        OSError,
        FileNotFoundError,
        FileExistsError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,
        pickle.UnpicklingError,
    )
}


class CheckpointError(RuntimeError):
    """A checkpoint's files are damaged: a checksum, size or metadata that
    does not match what was written."""


_TYPES["CheckpointError"] = CheckpointError


def ours(err: Exception) -> Exception:
    """Marks `err` as complete in itself: `unwrap` re-raises it as it is."""
    setattr(err, _MARK, True)
    return err


def describe(err: BaseException | None) -> list[str] | None:
    """`err` as [type name, message], to send to the other ranks."""
    if err is None:
        return None
    name = type(err).__name__ if type(err).__name__ in _TYPES else "RuntimeError"
    return [name, err.args[0] if isinstance(err, KeyError) and err.args else str(err)]


def own_rank() -> int:
    """This rank in the checkpoint call's world: the process's rank (0
    without torch.distributed), or its runner's where the runner has a
    transport of its own (world.py)."""
    from .world import own_rank as rank

    return rank()


def raise_agreed(problems: list[list[str] | None], mine: BaseException | None) -> None:
    """Raises the lowest failing rank's error on every rank: this rank's own
    exception where it failed first, else the same type and message."""
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if not failed:
        return
    rank, (name, message) = failed[0]
    me = own_rank()
    if rank == me and mine is not None:
        raise mine
    others = f"rank {rank}: " if rank != me else ""
    raise _TYPES.get(name, RuntimeError)(f"{others}{message}")


def unwrap(err: CheckpointException, call: str, path: object) -> Exception:
    """The first failure (lowest rank) inside DCP's `CheckpointException`."""
    failures: dict[int, Any] = err.failures
    rank = min(failures)
    inner, trace = failures[rank]
    if getattr(inner, _MARK, False) and isinstance(inner, Exception):
        return inner
    lines = str(inner).splitlines() or [""]
    where = ""
    if trace:
        frame = trace[-1]
        where = f" (raised at {frame.filename}:{frame.lineno})"
    message = (
        f"checkpoint.{call}: {path}: rank {rank} failed: {type(inner).__name__}: {lines[0]}"
        + "".join(f"\n{line}" for line in lines[1:])
        + where
    )
    try:
        new: object = type(inner)(message)
    except Exception:
        new = None
    return new if isinstance(new, Exception) else CheckpointError(message)
