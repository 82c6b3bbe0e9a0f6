"""How much slower a rank computes while every rank of the job computes at
once than alone (`contention`): the factor the planner scales its profile by.

The profile runs on rank 0 while the other ranks wait. In the job every
rank computes at the same time, and where ranks share cores, caches or the
memory bus (CPU ranks on one host, or more ranks than cores) each runs
slower than it did alone: on 2 cores with 4 Gloo ranks, every measured step
was about 2x its prediction, with 2 ranks about 1.1x. So the planner times
one fixed piece of work (matmuls and elementwise ops, about 40 ms) on rank 0
alone, then on every rank at once, and scales the profile's times by the
ratio (rank 0's medians; every rank gets the same factor). On GPUs, one per
rank, the ratio is 1 and nothing changes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["contention", "in_compute_cost"]


def _work() -> Callable[[], float]:
    a = torch.randn(192, 192)
    b = torch.randn(192, 192)

    def run() -> float:
        start = time.perf_counter()
        x = a
        for _ in range(160):
            x = torch.tanh(x @ b) + a
        return time.perf_counter() - start

    return run


_ALONE_SECONDS = 0.5  # the others' sleep, long enough for rank 0's repeats


def contention(group: dist.ProcessGroup | None = None, repeats: int = 3) -> float:
    """The slowdown of rank 0's compute with every rank of `group` computing
    at once (>= 1; 1.0 without several ranks). A collective: every rank
    calls it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 1.0
    run = _work()
    run()  # warm
    first = dist.get_global_rank(group, 0) if group is not None else 0
    me = dist.get_rank()
    # Rank 0 alone while the others sleep (a rank waiting in a collective
    # may spin on its core: it would not be alone); on a slow machine it
    # times fewer runs, to stay inside their sleep. Every rank takes part in
    # the same number of barriers below, whatever rank 0 does here.
    dist.barrier(group)
    alone: list[float] = []
    if me == first:
        alone = [run()]
        while len(alone) < repeats and sum(alone) * 2 < _ALONE_SECONDS:
            alone.append(run())
    else:
        time.sleep(_ALONE_SECONDS)
    together: list[float] = []
    for _ in range(repeats):
        dist.barrier(group)
        together.append(run())
    box = [statistics.median(together) / statistics.median(alone) if me == first else 0.0]
    dist.broadcast_object_list(box, src=first, group=group)
    return max(1.0, float(box[0]))


def in_compute_cost(group: dist.ProcessGroup | None = None, repeats: int = 3) -> float:
    """Seconds one small all-reduce costs inside compute beyond its own
    time on idle ranks (0.0 without several ranks). Tensor parallelism
    and expert parallelism issue their collectives between a stage's ops:
    each one waits for the slowest rank's share of the work before it, so
    the ranks' jitter (and, where ranks share cores, the backend's threads
    taking a core from the compute) adds to every one of them. Measured as
    a loop of 32 (work piece + all-reduce of 64 KiB) against the same work
    and the same all-reduces timed apart. A collective: every rank calls it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 0.0
    a = torch.randn(128, 128)
    x = torch.zeros(16384)
    steps = 32

    def piece() -> None:
        y = a
        for _ in range(4):
            y = torch.tanh(y @ a)

    def loop(work: bool, reduce: bool) -> float:
        dist.barrier(group)
        start = time.perf_counter()
        for _ in range(steps):
            if work:
                piece()
            if reduce:
                dist.all_reduce(x, group=group)
        return time.perf_counter() - start

    loop(True, True)  # warm
    both = statistics.median(loop(True, True) for _ in range(repeats))
    work = statistics.median(loop(True, False) for _ in range(repeats))
    reduce = statistics.median(loop(False, True) for _ in range(repeats))
    extra = torch.tensor([max(0.0, (both - work - reduce) / steps)], dtype=torch.float64)
    dist.all_reduce(extra, op=dist.ReduceOp.MAX, group=group)
    return float(extra.item())
