"""The CPU heap keeps what a step frees, for the next microbatch.

glibc's malloc gives freed memory back to the kernel: a free top of the heap
over its trim threshold is trimmed, a block over its mmap threshold is
unmapped, and both thresholds follow the sizes it sees freed. A pipeline
step allocates and frees the same large tensors microbatch after microbatch,
so the memory goes back and forth and every page returns as a page fault
that zeroes it. A split backward meets it most: I allocates the gradients W
reads and they live until W, so the heap's top moves up and down around
them (on the bundled GPT, stage 1's I took 14.7 ms under glibc's adaptive
thresholds and 13.8 ms with these fixed; B the same either way).

`keep_freed_memory()` fixes both thresholds high, once per process: blocks
up to 32 MiB come from the heap and up to 1 GiB free at its top stays in the
process, as a GPU caching allocator keeps its blocks. It is for good (glibc
has no way back to its adaptive thresholds) and changes nothing where the
user chose malloc's thresholds (`MALLOC_*_THRESHOLD_`, `GLIBC_TUNABLES`
malloc settings), where malloc is not glibc's, or when already applied.
"""

from __future__ import annotations

import os
import threading

from .. import _C

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "applied", "keep_freed_memory", "user_tuned"]

MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit systems
TRIM_THRESHOLD = 2**30

_lock = threading.Lock()
_tried = False  # keep_freed_memory ran in this process
_applied = False  # and set the thresholds


def user_tuned() -> str | None:
    """The environment setting with which the user chose malloc's
    thresholds, or None."""
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"):
        if name in os.environ:
            return name
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for setting in ("glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold"):
        if setting in tunables:
            return f"GLIBC_TUNABLES={tunables}"
    return None


def keep_freed_memory() -> bool:
    """Fixes glibc malloc's thresholds (see the module docstring); True if
    they are this module's now (this call or an earlier one)."""
    global _tried, _applied
    with _lock:
        if not _tried:
            _tried = True
            _applied = user_tuned() is None and _C.runtime.keep_freed_memory(
                MMAP_THRESHOLD, TRIM_THRESHOLD
            )
        return _applied


def applied() -> bool:
    """Whether this process's malloc thresholds are this module's."""
    return _applied
