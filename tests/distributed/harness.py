"""Runs a function on several Gloo ranks (processes) and collects results.

Each rank's return value (or traceback) comes back to the test; a rank that
outlives the deadline is killed and reported, so a hang fails the test
instead of stalling the suite. Each rank is a fresh process, forked from a
fork server that imported torch, torchmpmd and transformers once (a
spawned rank imported them itself: 3-5 s a launch, 11-18 s for 8 ranks on
2 cores; a fork takes a tenth of a second).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None  # the function's return value, or the traceback text
    exitcode: int | None = None


def _entry(fn: Callable, rank: int, world: int, store: str, queue: Any, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    # As pytest.ini's filter does in the test process: a rank that builds a
    # runner the deprecated way fails.
    warnings.filterwarnings("error", r"PipelineRunner\(.*\) is deprecated", DeprecationWarning)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# The modules every rank imports, imported once by the fork server (which
# starts no thread of its own, so forking it is safe).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torchmpmd",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "harness",
    "models",
]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(fn: Callable, world: int, *args: Any, deadline: float = 300.0) -> list[RankResult]:
    """Runs fn(rank, world, *args) on `world` Gloo ranks; returns one result per rank."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, store, queue, args), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline
        received: dict[int, tuple[bool, Any]] = {}
        # Results are read while the ranks run: a result larger than the
        # pipe's buffer blocks its rank in put() until someone reads it.
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            while not queue.empty():
                rank, ok, value = queue.get()
                received[rank] = (ok, value)
            time.sleep(0.02)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
        for p in procs:
            p.join()
        while not queue.empty():
            rank, ok, value = queue.get()
            received[rank] = (ok, value)
        results = {r: RankResult(r, False, "no result", procs[r].exitcode) for r in range(world)}
        for rank, (ok, value) in received.items():
            results[rank] = RankResult(rank, ok, value, procs[rank].exitcode)
    for r in hung:
        results[r] = RankResult(
            r, False, f"rank {r} still running after {deadline} s: killed", None
        )
    return [results[r] for r in range(world)]


def check_all(results: list[RankResult]) -> list[Any]:
    """Fails with every failing rank's traceback; returns the values."""
    failed = [r for r in results if not r.ok]
    if failed:
        raise AssertionError(
            "\n".join(f"--- rank {r.rank} (exit {r.exitcode}):\n{r.value}" for r in failed)
        )
    return [r.value for r in results]


def whole_tensor(t: Any) -> Any:
    """A whole tensor from a DTensor (an FSDP or tensor-parallel shard), or
    the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def to_bytes(tensors: dict[str, Any]) -> bytes:
    """Tensors as bytes (torch.save), exactly, to return from a rank: through
    the result queue a tensor would need shared memory."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> dict[str, Any]:
    """What `to_bytes` wrote."""
    import io

    import torch

    return torch.load(io.BytesIO(data))
