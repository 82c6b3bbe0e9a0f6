"""`examples/finetune_hf.py` under torchrun: a Llama saved with
`save_pretrained` goes into a meta-device pipeline with `load_hf` (each rank
reading only its own stages' bytes), trains, comes out with `save_hf`, and
`from_pretrained` gives bitwise the pipeline's parameters and its loss; with
plain pipelining (2 processes) and with FSDP (pp 2 x dp 2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("procs, extra", [(2, []), (4, ["--dp=2", "--data-parallel=fsdp"])])
def test_finetune_hf_round_trips(tmp_path, procs, extra):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={procs}",
            str(ROOT / "examples" / "finetune_hf.py"),
            "--steps=3",
            f"--out={tmp_path / 'out'}",
            *extra,
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all bitwise equal after save_hf -> from_pretrained" in done.stdout, done.stdout
    reads = re.findall(r"load_hf read ([\d.]+) KiB for its ([\d.]+) KiB", done.stdout)
    assert len(reads) == procs, done.stdout
    assert all(float(read) <= 1.1 * float(own) for read, own in reads), reads
    assert (tmp_path / "out" / "config.json").is_file()
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert losses[2] < losses[0], losses  # it learns
