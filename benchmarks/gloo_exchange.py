"""Plain torch.distributed Gloo send/receive times between 2 idle ranks, no
torchmpmd: both ranks sending to each other at once ("both") against one
direction ("one"). Shows the occasional multi-millisecond stall of a
transfer that usually takes a fraction of a millisecond, the delay that
hurts a pipeline split whose ranks exchange messages at the same moments
(docs/architecture.md, "Known limit").

    python benchmarks/gloo_exchange.py            # launches 2 ranks itself
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from launch import launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="300000,600000", help="bytes per message")
    p.add_argument("--repeats", type=int, default=300)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    n = args.repeats
    for nbytes in (int(s) for s in args.sizes.split(",")):
        for mode in ("both", "one"):
            out, into = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
            sends = mode == "both" or rank == 0
            receives = mode == "both" or rank == 1
            times = []
            for _ in range(n):
                dist.barrier()
                start = time.perf_counter()
                send = dist.isend(out, peer) if sends else None
                if receives:
                    dist.irecv(into, peer).wait()
                if send is not None:
                    send.wait()
                times.append((time.perf_counter() - start) * 1e3)
            times.sort()
            if rank == 1:
                slow = sum(t > 2 for t in times)
                print(
                    f"{nbytes} B, {mode:4}: median {times[n // 2]:.2f} ms, p90 "
                    f"{times[9 * n // 10]:.2f} ms, p99 {times[99 * n // 100]:.2f} ms, max "
                    f"{times[-1]:.2f} ms; over 2 ms: {slow} of {n}",
                    flush=True,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    launch(main)
