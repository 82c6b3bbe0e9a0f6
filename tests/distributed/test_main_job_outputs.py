"""What the main job (`examples/train_gpt.py`) leaves behind: a progress bar
with the loss and tokens/s, every step's metrics as JSON lines (loss,
learning rate after warm-up and decay, gradient norm, tokens/s), how long
it trained and the held-out loss, and the last step's timeline (measured
under predicted) as a PNG next to the checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def test_train_gpt_writes_metrics_progress_and_the_timeline_png(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(ROOT / "examples" / "train_gpt.py"),
            "--layers=2",
            "--dim=32",
            "--seq-len=32",
            "--microbatches=4",
            "--microbatch-size=2",
            f"--steps={STEPS}",
            "--warmup=3",
            "--lr=1e-3",
            "--timeout=60",
            f"--log-dir={tmp_path / 'logs'}",
            f"--checkpoint-dir={tmp_path / 'ckpt'}",
            f"--checkpoint-every={STEPS}",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps, final = lines[:-1], lines[-1]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:
        assert m["loss"] > 0 and m["tokens_per_s"] > 0 and m["grad_norm"] > 0, m
    lrs = [m["lr"] for m in steps]
    # Warm-up over 3 steps to 1e-3, then cosine decay.
    assert lrs[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])
    assert lrs[2] > lrs[3] > lrs[4] > lrs[5] >= 1e-4
    assert final["step"] is None and final["held_out_loss"] > 0 and final["train_seconds"] > 0
    assert f"trained {STEPS} steps in" in done.stdout, done.stdout
    assert "step/s" in done.stderr and "loss=" in done.stderr  # tqdm's bar, on rank 0
    png = tmp_path / "ckpt" / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"-> {png}" in done.stdout
