"""How much slower a rank computes while every rank of the job computes at
once than alone (`contention`): the factor the planner scales its profile by.

The profile runs on rank 0 while the other ranks wait. In the job every
rank computes at the same time, and where ranks share cores, caches or the
memory bus (CPU ranks on one host, or more ranks than cores) each runs
slower than it did alone: on 2 cores with 4 Gloo ranks, every measured step
was about 2x its prediction, with 2 ranks about 1.1x. So the planner counts
how many pieces of fixed work (matmuls and elementwise ops, a few ms each)
rank 0 finishes in a window alone, then every rank in the same window at
once, and scales the profile's times by the ratio of rank 0's fastest rate
alone to the fastest of the ranks' mean rates together (`slowdown`; every
rank gets the same factor). On GPUs,
one per rank, the ratio is 1 and nothing changes.

Fastest over fastest: what else runs on the machine (another tenant's work,
in episodes of up to a second here) only ever slows a window, alone or
together. With the median of the windows together, a slow episode in one
of the three raised the factor: 2 ranks on 2 cores, eight measurements in
a row on a quiet machine gave 1.012-1.083 (median together) against
1.003-1.019 (fastest together), and one taken while planning in the
benchmark gave 1.13, which put every prediction of that model 10-17% over
its step (`benchmarks/mpmd_vs_spmd.py --nproc 2`, the U-Net-like model).

A rate over a window, averaged over the ranks, rather than one piece timed
on rank 0: where ranks outnumber cores the kernel shares the cores fairly
over tens of milliseconds but not over one piece, and ranks leave a barrier
at different times. Timing three 40 ms pieces on rank 0 gave 1.7-3.4 for
the same 4 ranks on 2 cores, and 1.26-1.29 in the benchmark's later
launches (their pipelines then predicted 0.6-0.75x of their measured
steps); the rates give 2.0-2.3.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .layouts import LinkPrices

__all__ = ["Slowed", "contention", "cores", "in_compute_cost", "share_a_host", "slowdown"]


def _piece() -> Callable[[], None]:
    # Its own generator: planning leaves the user's random state alone.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(192, 192, generator=g)
    b = torch.randn(192, 192, generator=g)

    def run() -> None:
        x = a
        for _ in range(20):
            x = torch.tanh(x @ b) + a

    return run


def _rate(piece: Callable[[], None], window: float) -> float:
    """Pieces per second over at least `window` seconds."""
    done = 0
    start = time.perf_counter()
    while True:
        piece()
        done += 1
        elapsed = time.perf_counter() - start
        if elapsed >= window:
            return done / elapsed


def contention(
    group: dist.ProcessGroup | None = None, repeats: int = 3, window: float = 0.25
) -> float:
    """The slowdown of a rank's compute with every rank of `group`
    computing at once (>= 1; 1.0 without several ranks): `slowdown` of rank
    0's rates alone and the ranks' mean rates together, over `repeats`
    windows of `window` seconds each. A collective: every rank calls it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 1.0
    piece = _piece()
    piece()  # warm
    size = dist.get_world_size(group)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    me = dist.get_rank()
    alone: list[float] = []
    together: list[float] = []
    for _ in range(repeats):
        # Rank 0 alone while the others sleep (a rank waiting in a
        # collective may spin on its core: it would not be alone).
        dist.barrier(group)
        if me == first:
            alone.append(_rate(piece, window))
        else:
            time.sleep(window + 0.1)
        dist.barrier(group)
        rates = torch.tensor([_rate(piece, window)], dtype=torch.float64)
        dist.all_reduce(rates, group=group)
        together.append(float(rates.item()) / size)
    box = [slowdown(alone, together) if me == first else 0.0]
    dist.broadcast_object_list(box, src=first, group=group)
    return float(box[0])


def slowdown(alone: list[float], together: list[float]) -> float:
    """The fastest rate alone over the fastest rate together (pieces per
    second, each a window's), at least 1: what else runs on the machine
    only slows a window (see the module docstring)."""
    return max(1.0, max(alone) / max(together))


def _usable_cores() -> float:
    """The cores this process may run on: its affinity, capped by a cgroup
    quota where one is set (a container's `--cpus`)."""
    try:
        count = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        count = float(os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            count = min(count, max(1.0, float(quota) / float(period)))
    except (OSError, ValueError):
        pass
    return count


def cores(group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """The cores the ranks of `group` compute on (each host's usable cores,
    summed over the hosts) and the threads a rank computes with (the most of
    any rank). A collective: every rank calls it."""
    mine = (socket.gethostname(), _usable_cores(), torch.get_num_threads())
    if not (dist.is_available() and dist.is_initialized()):
        return mine[1], float(mine[2])
    every: list[tuple[str, float, int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    hosts = {host: count for host, count, _ in filter(None, every)}
    return sum(hosts.values()), float(max(t for _, _, t in filter(None, every)))


def share_a_host(group: dist.ProcessGroup | None = None) -> bool:
    """Whether two or more ranks of `group` run on one host (False without
    several ranks). A collective: every rank calls it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return False
    every: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, socket.gethostname(), group=group)
    return len(set(every)) < len(every)


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
    a = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
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


@dataclasses.dataclass(frozen=True, slots=True)
class Slowed:
    """Links whose collectives run `factor` x slower: the backend's threads
    share the cores the ranks compute on (`contention`)."""

    links: LinkPrices
    factor: float

    @property
    def send(self) -> Any:
        return getattr(self.links, "send", None)

    def time(self, kind: str, nbytes: float, *, group_size: int | None = None) -> float:
        return self.factor * self.links.time(kind, nbytes, group_size=group_size)
