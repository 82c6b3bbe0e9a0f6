"""Plain torch.distributed Gloo send/receive times between 2 idle ranks: both
ranks sending to each other at once ("both") against one direction ("one"),
with Gloo's event-loop threads under their normal scheduling policy and
under SCHED_BATCH (what PipelineRunner sets, `torchmpmd.runtime.gloo_threads`),
taken in turns. Under the normal policy a transfer that usually takes a
fraction of a millisecond now and then stalls about 4 ms: the loop thread,
woken on the CPU of a thread that holds its socket's lock, preempts it and
spins on the lock until the next scheduler tick (docs/architecture.md).

    python benchmarks/gloo_exchange.py            # launches 2 ranks itself
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from launch import launch

from torchmpmd.runtime import gloo_threads

POLICIES = ("normal", "batch")


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
            times: dict[str, list[float]] = {policy: [] for policy in POLICIES}
            for i in range(2 * n):
                policy = POLICIES[i % 2]
                hold = gloo_threads.BatchHold() if policy == "batch" else None
                dist.barrier()
                start = time.perf_counter()
                send = dist.isend(out, peer) if sends else None
                if receives:
                    dist.irecv(into, peer).wait()
                if send is not None:
                    send.wait()
                times[policy].append((time.perf_counter() - start) * 1e3)
                if hold is not None:
                    hold.release()
            for policy in POLICIES:
                t = sorted(times[policy])
                if rank == 1:
                    slow = sum(x > 2 for x in t)
                    print(
                        f"{nbytes} B, {mode:4}, {policy:6}: median {t[n // 2]:.2f} ms, p90 "
                        f"{t[9 * n // 10]:.2f} ms, p99 {t[99 * n // 100]:.2f} ms, max "
                        f"{t[-1]:.2f} ms; over 2 ms: {slow} of {n}",
                        flush=True,
                    )
    dist.destroy_process_group()


if __name__ == "__main__":
    launch(main)
