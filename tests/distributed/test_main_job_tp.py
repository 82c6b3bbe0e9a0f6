"""The main job with tensor parallelism: `examples/train_gpt.py --tp 2`
under torchrun (pp 2 x tp 2, 4 processes, the plan in the example's model
file) trains the same model as the job without it (pp 2, 2 processes): the
same losses step by step, to float32's rounding of sums added in another
order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
ARGS = [
    "--layers=2",
    "--dim=32",
    "--seq-len=32",
    "--microbatches=4",
    "--microbatch-size=2",
    "--log-every=100",
    f"--steps={STEPS}",
    "--timeout=60",
]


def _run(tmp_path: Path, procs: int, *extra: str, output: bool = False) -> Any:
    """The job's losses per step (with `output`: and what it printed)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / f"losses-{procs}.log"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={procs}",
            str(ROOT / "examples" / "train_gpt.py"),
            *ARGS,
            *extra,
            f"--loss-log={log}",
            f"--log-dir={tmp_path / f'logs-{procs}'}",
            "--no-progress",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(line.split()[1]) for line in log.read_text().splitlines()]
    return (losses, done.stdout) if output else losses


def test_train_gpt_with_tp_2_trains_as_the_job_without_it(tmp_path):
    plain = _run(tmp_path, 2)
    sharded = _run(tmp_path, 4, "--tp=2")
    assert len(plain) == len(sharded) == STEPS
    assert sharded == pytest.approx(plain, rel=1e-4), (sharded, plain)
    assert sharded[-1] < sharded[0], sharded  # it learns
