"""What checksums cost a checkpoint: save and load time with and without
them, side by side in one run.

    python benchmarks/checkpoint_checksums.py                 # 32 MiB model, 7 rounds
    python benchmarks/checkpoint_checksums.py --mib 64 --rounds 9 --optimizer
    python benchmarks/checkpoint_checksums.py --dir /path/on/real/disk

One process (a Gloo world of one rank) holds a pipeline of an MLP of about
`--mib` MiB of float32 parameters. Each round saves it with
`mpmd.checkpoint.save(checksums=True)`, with `checksums=False`, and with plain
`dcp.save` (DCP alone, for reference), in an order that alternates between
rounds, then loads each (`mpmd.checkpoint.load` verifies the checksummed one
item by item; the others load unchecked). Reported: the median time of each
and the median of the per-round ratios to the run without checksums.
Saving sums each item by reading it back from the page cache (CRC-32);
loading sums each item before DCP deserialises it. The files sit in the
page cache in every variant, so the figures are the CPU cost, not the disk's;
the CRC-32 of the parameters' bytes alone is timed for comparison.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import torchmpmd as mpmd

VARIANTS = ("checksums", "no checksums", "plain dcp")


def _runner(mib: int) -> mpmd.PipelineRunner:
    width = 1024
    layers = max(1, round(mib * 2**20 / (4 * width * (width + 1))))
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    pipe = mpmd.trace(model, (torch.randn(2, width),))
    return mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.GPipe(1),
        loss_fn=lambda out, y: out.square().mean(),
        options=mpmd.RunnerOptions(timeout=60),
    )


def _timed(fn: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=32, help="parameter megabytes (float32)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--optimizer", action="store_true", help="save AdamW state too (3x bytes)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{root / 'store'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        runner = _runner(args.mib)
        opt = torch.optim.AdamW(runner.parameters()) if args.optimizer else None
        view = mpmd.checkpoint.local_model(runner)
        nbytes = sum(p.numel() * p.element_size() for p in runner.parameters())
        print(
            f"{nbytes / 2**20:.1f} MiB of parameters{' + AdamW state' if opt else ''}, "
            f"{args.rounds} rounds, files in {root} "
            f"(torch {torch.__version__}, {os.cpu_count()} CPUs)"
        )

        def plain_state() -> dict[str, object]:
            msd, osd = get_state_dict(view, [opt] if opt else [])
            return {"model": msd, **({"optim": osd} if opt else {})}

        def save(variant: str, path: Path) -> None:
            if variant == "plain dcp":
                dcp.save(plain_state(), checkpoint_id=str(path))
            else:
                mpmd.checkpoint.save(path, runner, opt, checksums=variant == "checksums")

        def load(variant: str, path: Path) -> None:
            if variant == "plain dcp":
                state = plain_state()
                dcp.load(state, checkpoint_id=str(path))
                set_state_dict(
                    view,
                    [opt] if opt else [],
                    model_state_dict=state["model"],
                    optim_state_dict=state.get("optim", {}),
                )
            else:
                mpmd.checkpoint.load(path, runner, opt)

        times: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds + 1):  # round 0 warms up and is not counted
            order = VARIANTS if r % 2 else tuple(reversed(VARIANTS))
            paths = {v: root / f"round-{r}-{v.replace(' ', '-')}" for v in order}
            for v in order:
                t = _timed(save, v, paths[v])
                if r:
                    times.setdefault(("save", v), []).append(t)
            for v in order:
                t = _timed(load, v, paths[v])
                if r:
                    times.setdefault(("load", v), []).append(t)
            for path in paths.values():
                shutil.rmtree(path)

        blob = b"".join(bytes(p.detach().clone().untyped_storage()) for p in runner.parameters())
        crc = statistics.median(_timed(zlib.crc32, blob) for _ in range(args.rounds))
        print(
            f"CRC-32 of the parameters' bytes alone: {crc * 1e3:.1f} ms "
            f"({len(blob) / crc / 1e9:.2f} GB/s)"
        )
        for op in ("save", "load"):
            base = times[(op, "no checksums")]
            print(f"\n{op}:")
            for v in VARIANTS:
                ts = times[(op, v)]
                ratio = statistics.median(t / b for t, b in zip(ts, base, strict=True))
                print(
                    f"  {v:13s} median {statistics.median(ts) * 1e3:8.1f} ms "
                    f"(min {min(ts) * 1e3:7.1f}, max {max(ts) * 1e3:7.1f})  "
                    f"x{ratio:.3f} of no checksums"
                )
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
