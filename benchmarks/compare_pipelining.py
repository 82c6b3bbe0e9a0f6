"""torchmpmd vs torch.distributed.pipelining: same model, split, schedule and
microbatches on 2 Gloo ranks, timed side by side in one run.

    python benchmarks/compare_pipelining.py            # launches 2 ranks itself
    torchrun --standalone --nproc_per_node=2 benchmarks/compare_pipelining.py

The GPT's embeddings are untied here: torch.distributed.pipelining does not
synchronise the gradients of weights shared across stages, so with tied
weights the two would not train the same model.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import repo_paths
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, lm_loss, split_points
from launch import launch

import torchmpmd as mpmd

ROOT = repo_paths.ROOT


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="also write the table here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    cfg = GPTConfig(seq_len=args.seq_len, dim=args.dim, layers=args.layers, tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    theirs_model = copy.deepcopy(model)
    m, b = args.microbatches, args.microbatch_size
    example = torch.zeros(b, args.seq_len, dtype=torch.long)
    points = split_points(cfg, world)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (m * b, args.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (m * b, args.seq_len), generator=g)

    pipe = mpmd.trace(model, (example,), split_before=points)
    their_pipe = pipeline(
        theirs_model, mb_args=(example,), split_spec={p: SplitPoint.BEGINNING for p in points}
    )
    their_stage = their_pipe.build_stage(rank, torch.device("cpu"))

    rows = []
    for name in args.schedules.split(","):
        ours_cls, theirs_cls = {
            "gpipe": (mpmd.schedules.GPipe, ScheduleGPipe),
            "1f1b": (mpmd.schedules.OneFOneB, Schedule1F1B),
        }[name]
        runner = mpmd.PipelineRunner(pipe, ours_cls(m), loss_fn=lm_loss)
        theirs = theirs_cls(their_stage, n_microbatches=m, loss_fn=lm_loss)

        def ours_step(runner: mpmd.PipelineRunner = runner) -> float:
            return runner.step(x, target=y).loss.item()

        def their_step(theirs=theirs) -> float:
            losses: list[torch.Tensor] = []
            if rank == 0:
                theirs.step(x)
            else:
                theirs.step(target=y, losses=losses)
            loss = torch.tensor(
                [torch.stack(losses).mean().item() if losses else 0.0], dtype=torch.float64
            )
            dist.broadcast(loss, src=world - 1)
            return loss.item()

        times: dict[str, list[float]] = {"torchmpmd": [], "pipelining": []}
        losses: dict[str, float] = {}
        for i in range(args.warmup + args.steps):
            # Interleaved, so both see the same machine conditions.
            for label, fn in (("torchmpmd", ours_step), ("pipelining", their_step)):
                dist.barrier()
                start = time.perf_counter()
                losses[label] = fn()
                elapsed = time.perf_counter() - start
                if i >= args.warmup:
                    times[label].append(elapsed)
            for p in list(runner.parameters()) + list(their_stage.submod.parameters()):
                p.grad = None
        ours_t = statistics.median(times["torchmpmd"])
        theirs_t = statistics.median(times["pipelining"])
        rows.append((name, ours_t, theirs_t, losses["torchmpmd"], losses["pipelining"]))

    if rank == 0:
        print(
            f"GPT {args.layers}x{args.dim}, {world} stages on {world} Gloo ranks, "
            f"{m} microbatches of {b}x{args.seq_len}; median of {args.steps} steps "
            f"after {args.warmup} warm-up"
        )
        print(
            f"{'schedule':9} {'torchmpmd':>11} {'pipelining':>11} {'ratio':>7}  loss (ours / theirs)"
        )
        for name, ours_t, theirs_t, lo, lt in rows:
            print(
                f"{name:9} {ours_t * 1e3:9.1f}ms {theirs_t * 1e3:9.1f}ms "
                f"{theirs_t / ours_t:6.2f}x  {lo:.5f} / {lt:.5f}"
            )
        print("ratio = pipelining time / torchmpmd time (above 1: torchmpmd is faster)")
        if args.json is not None:
            args.json.write_text(
                json.dumps(
                    [
                        {
                            "schedule": name,
                            "torchmpmd_s": ours_t,
                            "pipelining_s": theirs_t,
                            "torchmpmd_over_pipelining": ours_t / theirs_t,
                        }
                        for name, ours_t, theirs_t, _lo, _lt in rows
                    ],
                    indent=1,
                )
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    launch(main)
