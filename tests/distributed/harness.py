"""Runs a function on several Gloo ranks (processes) and collects results.

Each rank's return value (or traceback) comes back to the test; a rank that
outlives the deadline without a result is killed and reported with its
threads' stacks (faulthandler), so a hang fails the test instead of stalling
the suite, and says where. A rank that delivered its result but does not
exit within `_EXIT_GRACE` seconds (its teardown, `destroy_process_group`,
waiting on a failed step's pending Gloo receives) is killed too; its result
stands and `hung_at_exit` says so. Each rank is a fresh process, forked from a
fork server that imported torch, torchmpmd and transformers once (a
spawned rank imported them itself: 3-5 s a launch, 11-18 s for 8 ranks on
2 cores; a fork takes a tenth of a second).
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
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
    hung_at_exit: bool = False  # delivered its result, then did not exit


# Seconds a rank that delivered its result may take to exit.
_EXIT_GRACE = 10.0


def _entry(fn: Callable, rank: int, world: int, store: str, queue: Any, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # SIGUSR1 (from run_ranks, at the deadline) prints every thread's stack.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    # Ctrl-C raises KeyboardInterrupt, as in a rank torchrun starts, even when
    # the test run itself was started in the background of a shell without
    # job control (which starts it with SIGINT ignored, passed on to the fork
    # server and its ranks: a test's Ctrl-C then did nothing).
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
        all_in: float | None = None  # when the last result arrived
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            while not queue.empty():
                rank, ok, value = queue.get()
                received[rank] = (ok, value)
            if all_in is None and len(received) == world:
                all_in = time.monotonic()
            if all_in is not None and time.monotonic() > all_in + _EXIT_GRACE:
                break
            time.sleep(0.02)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        hung = [r for r in alive if r not in received]
        for r in hung:  # where it hangs, on the test's output
            os.kill(procs[r].pid, signal.SIGUSR1)
        if hung:
            time.sleep(1.0)
        for r in alive:
            procs[r].kill()
        for p in procs:
            p.join()
        while not queue.empty():
            rank, ok, value = queue.get()
            received[rank] = (ok, value)
        results = {r: RankResult(r, False, "no result", procs[r].exitcode) for r in range(world)}
        for rank, (ok, value) in received.items():
            results[rank] = RankResult(rank, ok, value, procs[rank].exitcode, rank in alive)
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
