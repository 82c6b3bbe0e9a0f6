"""What the per-call check-in costs (`torchmpmd/runtime/checkin.py`): on 2
Gloo ranks, the check-in alone (one fixed-size message each way, with and
without the batch's fingerprint), the fingerprint of the bundled GPT's
batch, and both as a share of a 1F1B step of the bundled GPT, measured in
turns in one run.

    python benchmarks/check_in.py            # launches 2 ranks itself
"""

from __future__ import annotations

import argparse
import statistics
import time

import repo_paths
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, lm_loss, split_points
from launch import launch

import torchmpmd as mpmd
from torchmpmd.runtime.fingerprint import batch_print

ROOT = repo_paths.ROOT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200, help="check-ins timed per round")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = GPTConfig(seq_len=128, dim=192, layers=4, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    pipe = mpmd.trace(model, (ids,), split_before=split_points(cfg, 2))
    runner = mpmd.PipelineRunner(pipe, mpmd.schedules.OneFOneB(8), loss_fn=lm_loss)
    batch = torch.randint(0, cfg.vocab_size, (32, cfg.seq_len))
    target = batch.roll(-1, dims=1)
    fingerprint = batch_print([("idx", batch)], target)

    def checkins(with_batch: bool) -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            with runner._collective.call("eval_step", batch=fingerprint if with_batch else None):
                pass
        return (time.perf_counter() - start) / args.calls

    def prints() -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            batch_print([("idx", batch)], target)
        return (time.perf_counter() - start) / args.calls

    def step() -> float:
        start = time.perf_counter()
        runner.step(batch, target=target)
        return time.perf_counter() - start

    step()  # traces the split graphs, warms the allocator
    samples: dict[str, list[float]] = {"bare": [], "batch": [], "print": [], "step": []}
    for _ in range(args.rounds):
        samples["bare"].append(checkins(False))
        samples["batch"].append(checkins(True))
        samples["print"].append(prints())
        samples["step"].append(step())
    med = {k: statistics.median(v) for k, v in samples.items()}
    if rank == 0:
        per_step = med["batch"] + med["print"]
        print(f"check-in, no batch:          {med['bare'] * 1e6:8.1f} us")
        print(f"check-in, with a batch:      {med['batch'] * 1e6:8.1f} us")
        print(f"batch fingerprint (32x128):  {med['print'] * 1e6:8.1f} us")
        print(f"1F1B step of the bundled GPT: {med['step'] * 1e3:7.2f} ms")
        print(f"check-in + fingerprint / step: {per_step / med['step']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    launch(main)
