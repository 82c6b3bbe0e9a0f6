"""One process holding every stage of a bf16 GPT on one GPU: torchmpmd's step
against a plain gradient-accumulation loop over the same model and
microbatches (and torch.distributed.pipelining where it runs that way), for
several microbatch sizes. Step times are medians, synchronised on the device.

    python benchmarks/gpu_step.py                      # on a GPU (scripts/gpu_check.sh)
    python benchmarks/gpu_step.py --device cpu --dim 64 --layers 2 --seq-len 32 --vocab 256

A ratio near 1 means the executor keeps the device as busy as the plain
loop does: its host work (task order, transfers, bookkeeping) hides behind
the device's, because receives are stream waits and nothing blocks the host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import Any

import repo_paths
import torch
from gpt import GPT, GPTConfig, lm_loss, split_points

import torchmpmd as mpmd
from torchmpmd.runtime import LocalWorld

ROOT = repo_paths.ROOT


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--sizes", default="1,2,4,8", help="microbatch sizes")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def timed(fn: Callable[[], object], device: torch.device, warmup: int, steps: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def pipelining_step(
    model: torch.nn.Module,
    points: list[str],
    example: torch.Tensor,
    m: int,
    device: torch.device,
) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """torch.distributed.pipelining with every stage on this one rank
    (Interleaved1F1B over a world of 1)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, SplitPoint, pipeline

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    pipe = pipeline(model, mb_args=(example,), split_spec={p: SplitPoint.BEGINNING for p in points})
    stages = [pipe.build_stage(i, device) for i in range(pipe.num_stages)]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=lm_loss)

    def step(x: torch.Tensor, y: torch.Tensor) -> object:
        schedule.step(x, target=y)
        return None

    return step


def batch(
    cfg: GPTConfig, b: int, m: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets of `m` microbatches of size `b` (the same for every
    runner measured at that size)."""
    g = torch.Generator().manual_seed(b)
    x = torch.randint(0, cfg.vocab_size, (m * b, cfg.seq_len), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (m * b, cfg.seq_len), generator=g).to(device)
    return x, y


def measure(
    model: torch.nn.Module,
    cfg: GPTConfig,
    points: list[str],
    b: int,
    m: int,
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One microbatch size: plain loop, torchmpmd, pipelining (if it runs)."""
    x, y = batch(cfg, b, m, device)

    def plain() -> None:
        for xm, ym in zip(x.chunk(m), y.chunk(m), strict=True):
            (lm_loss(model(xm), ym) / m).backward()
        model.zero_grad(set_to_none=True)

    pipe = mpmd.trace(model, (x[:b],), split_before=points)
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(m),
        transport=LocalWorld(1).transport(0),  # every stage on this one rank
        device=device,
        loss_fn=lm_loss,
    )

    def ours() -> None:
        runner.step(x, target=y)
        for p in runner.parameters():
            p.grad = None

    row: dict[str, Any] = {"microbatch_size": b}
    row["plain_s"] = timed(plain, device, args.warmup, args.steps)
    row["torchmpmd_s"] = timed(ours, device, args.warmup, args.steps)
    row["torchmpmd_over_plain"] = row["torchmpmd_s"] / row["plain_s"]
    return row


def measure_pipelining(
    model: torch.nn.Module,
    cfg: GPTConfig,
    points: list[str],
    row: dict[str, Any],
    m: int,
    device: torch.device,
    args: argparse.Namespace,
) -> None:
    """Adds torch.distributed.pipelining's step to `row` (or why it cannot run).
    It gets a copy of the model: pipeline() rewrites the forward of the split
    modules in place, which would change the model the other rows trace."""
    b = row["microbatch_size"]
    x, y = batch(cfg, b, m, device)
    copy = deepcopy(model)
    try:
        theirs = pipelining_step(copy, points, x[:b], m, device)
        row["pipelining_s"] = timed(lambda: theirs(x, y), device, args.warmup, args.steps)
        row["pipelining_over_plain"] = row["pipelining_s"] / row["plain_s"]
    except Exception as err:  # reported in the table: it cannot run this way
        row["pipelining_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    finally:
        del copy
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # set_device wants an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        dim=args.dim,
        heads=args.heads,
        layers=args.layers,
    )
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    m = args.microbatches
    points = split_points(cfg, args.stages)
    rows: list[dict[str, Any]] = []

    def save() -> None:  # after every figure: a later hang or timeout keeps the rest
        if args.json is not None:
            args.json.write_text(
                json.dumps({"config": vars(args), "rows": rows}, indent=1, default=str)
            )

    for b in [int(s) for s in args.sizes.split(",")]:
        row = measure(model, cfg, points, b, m, device, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()
    for row in rows:  # last: a hang inside pipelining loses none of torchmpmd's figures
        measure_pipelining(model, cfg, points, row, m, device, args)
        print(json.dumps(row), flush=True)
        save()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"\nGPT {args.layers}x{args.dim}, {params / 1e6:.0f}M parameters, bf16, seq {cfg.seq_len}, "
        f"{args.stages} stages on one rank ({name}), {m} microbatches; medians of "
        f"{args.steps} steps"
    )
    print(
        f"{'mb size':>7} {'plain':>9} {'torchmpmd':>10} {'ratio':>6} {'pipelining':>11} {'ratio':>6}"
    )
    for r in rows:
        theirs = (
            f"{r['pipelining_s'] * 1e3:9.1f}ms {r['pipelining_over_plain']:6.3f}"
            if "pipelining_s" in r
            else "        n/a"
        )
        print(
            f"{r['microbatch_size']:7d} {r['plain_s'] * 1e3:7.1f}ms {r['torchmpmd_s'] * 1e3:8.1f}ms "
            f"{r['torchmpmd_over_plain']:6.3f} {theirs}"
        )


if __name__ == "__main__":
    main()
