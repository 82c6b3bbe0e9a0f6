"""Peak memory per rank of a model built on the meta device: a rank never
pays for the whole model.

    python benchmarks/meta_memory.py            # about 1 GiB of float32 parameters
    python benchmarks/meta_memory.py --layers 4 --dim 256   # a quick run

Spawns 4 Gloo processes (4 stages, one each). Each measures its resident
memory after imports, the process group and a first small trace; resets the
kernel's peak counter (/proc/self/clear_refs); then builds the GPT on the meta
device, traces it, makes a PipelineRunner (which allocates the local stages),
initialises them with the model's own init, and runs AdamW steps. It reports
the peak (VmHWM) minus that baseline, against the bytes its local stages need
for parameters, gradients and AdamW's two moments (4x the parameter bytes).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import tempfile
from pathlib import Path

import repo_paths  # noqa: F401  (examples/ on the import path)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from gpt import GPT, GPTConfig, lm_loss, split_points

    import torchmpmd as mpmd

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    # Warm up: a first small trace and step, so that lazily loaded code is
    # counted in the baseline, not in the model's bytes.
    small = GPTConfig(vocab_size=64, seq_len=8, dim=16, heads=2, layers=world)
    ids = torch.zeros(1, 8, dtype=torch.long)
    warm = mpmd.PipelineRunner(
        mpmd.trace(GPT(small), (ids,), split_before=split_points(small, world)),
        mpmd.schedules.OneFOneB(2),
        loss_fn=lm_loss,
    )
    warm.step(torch.zeros(2, 8, dtype=torch.long), target=torch.zeros(2, 8, dtype=torch.long))
    del warm
    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS

    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, dim=args.dim, heads=args.heads, layers=args.layers
    )
    with torch.device("meta"):
        model = GPT(cfg)
    ids = torch.zeros(1, args.seq, dtype=torch.long)
    pipe = mpmd.trace(model, (ids,), split_before=split_points(cfg, world))
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(2),
        loss_fn=lm_loss,
        options=mpmd.RunnerOptions(timeout=600),
    )
    torch.manual_seed(rank)
    runner.init_weights(GPT.init_weights)
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-4)
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (2, args.seq))
        opt.zero_grad(set_to_none=True)
        runner.step(x, target=x)
        opt.step()
    peak = _status_kib("VmHWM")
    local = sum(p.numel() * p.element_size() for p in runner.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    queue.put((rank, (peak - baseline) * 1024, local, total))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    world = 4
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, world, store, args, queue)) for r in range(world)
        ]
        for proc in procs:
            proc.start()
        results = sorted(queue.get(timeout=1800) for _ in procs)
        for proc in procs:
            proc.join()
    total = results[0][3]
    print(f"model: {total / 2**30:.2f} GiB of float32 parameters, 4 stages on 4 ranks, AdamW")
    print("rank  peak - baseline  local params  params+grads+AdamW  ratio")
    for rank, grown, local, _ in results:
        need = 4 * local
        print(
            f"{rank:4d}  {grown / 2**20:12.0f} MiB  {local / 2**20:9.0f} MiB"
            f"  {need / 2**20:15.0f} MiB  {grown / need:5.2f}"
        )


if __name__ == "__main__":
    main()
