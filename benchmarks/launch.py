"""Shared by the 2-rank benchmarks: `launch` runs `main` under torchrun when
started as a plain script (python benchmarks/x.py), or directly when torchrun
started it; `measure_link` measures the Gloo link the simulator charges;
`idle_time` reads a rank's idle time off a timeline."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def launch(main: Callable[[], None], nproc: int = 2) -> None:
    """Runs `main` on `nproc` ranks (under torchrun), each with torchmpmd's CPU
    policies set (`mpmd.tune_cpu()`: the README's figures are taken with it)."""
    if "RANK" in os.environ:
        import torchmpmd as mpmd

        mpmd.tune_cpu()
        main()
        return
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", f"--nproc_per_node={nproc}", sys.argv[0], *sys.argv[1:]])


def measure_link(
    rank: int, repeats: int = 20, pair: tuple[int, int] = (0, 1)
) -> tuple[float, float]:
    """Latency (s) and bandwidth (bytes/s) between ranks `pair` (every rank
    calls; the others only wait), by ping-pong; shared by all ranks."""
    a, b = pair
    one_way = []
    for numel in (64, 1 << 20):
        buf = torch.zeros(numel)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == a:
                dist.send(buf, b)
                dist.recv(buf, b)
            elif rank == b:
                dist.recv(buf, a)
                dist.send(buf, a)
            samples.append((time.perf_counter() - t0) / 2)
        one_way.append(statistics.median(samples))
    box: list[Any] = [one_way]
    dist.broadcast_object_list(box, src=0)
    small, big = box[0]
    return small, 4 * (1 << 20) / max(big - small, 1e-9)


def idle_time(timeline: Any, rank: int) -> float:
    """Time `rank` spent between its first and last task without running one
    (`timeline`: an mpmd.Timeline, measured or simulated)."""
    tasks = [e for e in timeline.tasks if e.rank == rank]
    if not tasks:
        return 0.0
    span = max(e.end for e in tasks) - min(e.start for e in tasks)
    return float(span - sum(e.duration for e in tasks))
