"""Input-gradient (I) plus weight-gradient (W) against one full backward (B) on
the same stage, timed side by side in one run.

    python benchmarks/split_backward.py [--compile]

The stage is two GPT blocks. B is autograd's backward of the traced stage;
I and W are the graphs torchmpmd cuts from one traced forward+backward. If I
redid work W needs (or W redid I's), I + W would cost well over one B.
"""

from __future__ import annotations

import argparse
import statistics
import time

import repo_paths  # noqa: F401  (examples/ on the import path)
import torch
from gpt import GPT, GPTConfig
from models import PreNormLM

import torchmpmd as mpmd
from torchmpmd.graph.split import SplitStage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile the F/I/W graphs")
    p.add_argument(
        "--model",
        choices=["gpt", "prenorm"],
        default="gpt",
        help="the bundled GPT's blocks, or nn.TransformerEncoderLayer(norm_first=True) blocks",
    )
    p.add_argument("--profile", action="store_true", help="torch.profiler's op table of B, I, W")
    args = p.parse_args()
    torch.manual_seed(0)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    if args.model == "gpt":
        model: torch.nn.Module = GPT(GPTConfig(dim=args.dim, layers=4, seq_len=args.seq, heads=4))
    else:
        model = PreNormLM(dim=args.dim, layers=4)
    pipe = mpmd.trace(model, (ids,), split_before=["blocks.1", "blocks.3"])
    stage = pipe.stage(1)  # blocks 1 and 2: input and output are activations
    spec = pipe.stage_specs[1]
    x = torch.randn(spec.input_specs[0].shape)
    grad_out = torch.randn(spec.output_specs[0].shape)

    def fn(params, buffers, xs):
        state = dict(zip([n for n, _ in stage.named_parameters()], params, strict=True))
        return list(torch.func.functional_call(stage, state, tuple(xs)))

    split = SplitStage(stage, fn, [x], [0], {} if args.compile else None)

    def full_backward() -> float:
        leaf = x.detach().requires_grad_()
        (out,) = stage(leaf)
        start = time.perf_counter()
        torch.autograd.backward([out], [grad_out])
        return time.perf_counter() - start

    def split_backward() -> tuple[float, float]:
        saved = split.forward([x])[1:]
        start = time.perf_counter()
        _, for_w = split.input_grad(saved, [grad_out])
        mid = time.perf_counter()
        split.weight_grad(for_w)
        return mid - start, time.perf_counter() - mid

    for _ in range(3):  # warm-up (and compilation)
        full_backward()
        split_backward()
    b, i, w = [], [], []
    for _ in range(args.repeats):
        b.append(full_backward())
        ti, tw = split_backward()
        i.append(ti)
        w.append(tw)
        for param in stage.parameters():
            param.grad = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("B", full_backward), ("I + W", split_backward)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    fn()
            print(f"--- {name}, 10 runs")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    mb, mi, mw = (statistics.median(v) * 1e3 for v in (b, i, w))
    print(
        f"stage: 2 {args.model} blocks, dim {args.dim}, {args.batch}x{args.seq} tokens"
        f"{', compiled' if args.compile else ''}; median of {args.repeats}"
    )
    print(f"B (autograd)   {mb:8.2f} ms")
    print(f"I              {mi:8.2f} ms  ({mi / mb:.2f} B)")
    print(f"W              {mw:8.2f} ms  ({mw / mb:.2f} B)")
    print(f"I + W          {mi + mw:8.2f} ms  ({(mi + mw) / mb:.2f} B)")


if __name__ == "__main__":
    main()
