"""Resident memory of a long run that checkpoints: flat after warm-up?

    python benchmarks/checkpoint_memory.py            # 500 steps, a checkpoint every 50
    python benchmarks/checkpoint_memory.py --steps 100 --every 20

Runs the main job (examples/train_gpt.py) on 2 Gloo ranks under torchrun
with --checkpoint-dir / --checkpoint-every, samples each worker's resident
memory (VmRSS) every 0.2 s, and reports: the growth from the end of warm-up
(the first checkpoint) to the end, per rank, and the time of each save.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--every", type=int, default=50)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "losses.log"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(ROOT / "examples" / "train_gpt.py"),
            f"--steps={args.steps}", "--layers=4", "--dim=128", "--seq-len=64",
            "--microbatches=4", "--microbatch-size=4", "--log-every=1000000",
            f"--checkpoint-dir={tmp}/ckpt", f"--checkpoint-every={args.every}",
            f"--loss-log={log}", f"--log-dir={tmp}/logs", "--no-progress",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        job = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert job.stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
        reader.start()
        samples: dict[int, list[tuple[int, int]]] = {}  # rank -> (step, rss KiB)
        while job.poll() is None:
            time.sleep(0.2)
            pids = {
                int(m.group(1)): int(m.group(2))
                for m in re.finditer(r"rank (\d+) pid (\d+)", "".join(lines))
            }
            step = len(log.read_text().splitlines()) if log.exists() else 0
            for rank, pid in pids.items():
                kib = rss_kib(pid)
                if kib is not None:
                    samples.setdefault(rank, []).append((step, kib))
        reader.join(timeout=10)
        out = "".join(lines)
        if job.returncode != 0:
            raise SystemExit(out)
    saves = [float(s) for s in re.findall(r"checkpoint step-\d+ in ([\d.]+) s", out)]
    print(f"{args.steps} steps, a checkpoint every {args.every}: {len(saves)} saves")
    print(f"save time: mean {sum(saves) / len(saves):.3f} s, max {max(saves):.3f} s")
    for rank, rows in sorted(samples.items()):
        warm = [kib for step, kib in rows if step >= args.every]
        if not warm:
            continue
        growth = (warm[-1] - warm[0]) / warm[0]
        print(
            f"rank {rank}: RSS after warm-up {warm[0] / 1024:.1f} MiB, at the end "
            f"{warm[-1] / 1024:.1f} MiB, peak {max(warm) / 1024:.1f} MiB: growth {100 * growth:+.2f}%"
        )


if __name__ == "__main__":
    main()
