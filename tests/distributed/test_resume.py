"""Kill and resume: the main job (examples/train_gpt.py) under torchrun
--max-restarts=1 saves a checkpoint every 4 steps; a SIGKILL of one rank
mid-run makes every rank of that attempt exit within the runner's timeout
(+ 5 s), torchrun restarts the group, the run resumes from the newest
complete checkpoint, and its losses from there on equal an uninterrupted
run's bitwise. No process is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 60
TIMEOUT = 10.0
ARGS = [
    "--layers=2",
    "--dim=32",
    "--seq-len=32",
    "--microbatches=4",
    "--microbatch-size=2",
    "--log-every=100",
    "--no-progress",
    f"--steps={STEPS}",
    f"--timeout={TIMEOUT}",
]


def _torchrun(*extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        *extra,
        str(ROOT / "examples" / "train_gpt.py"),
        *ARGS,
    ]


def _losses(path: Path) -> dict[int, str]:
    """step -> loss (exact text); a resumed step overwrites the first attempt's."""
    out = {}
    for line in path.read_text().splitlines():
        step, loss = line.split()
        out[int(step)] = loss
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) is gone for our purposes; so is one
    # reaped since os.kill (its /proc entry vanishes as it is read).
    try:
        # "pid (comm) state ...": the name may hold spaces.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_kill_a_rank_and_resume_bitwise(tmp_path):
    # torchrun's restarts reuse the rendezvous store unless told not to; a
    # restarted Gloo group may then read the previous attempt's addresses
    # (pytorch/pytorch#135712).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    reference = tmp_path / "reference.log"
    done = subprocess.run(
        [*_torchrun(), f"--loss-log={reference}", f"--log-dir={tmp_path / 'logs-reference'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    expected = _losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))

    log = tmp_path / "losses.log"
    job = subprocess.Popen(
        [
            *_torchrun("--max-restarts=1"),
            f"--loss-log={log}",
            f"--log-dir={tmp_path / 'logs'}",
            f"--checkpoint-dir={tmp_path / 'ckpt'}",
            "--checkpoint-every=4",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the whole job can be killed if it hangs
    )
    assert job.stdout is not None
    text: list[str] = []
    reader = threading.Thread(target=lambda: text.extend(job.stdout), daemon=True)
    reader.start()
    pids: dict[int, int] = {}
    killed_at = None
    first_attempt: dict[int, int] = {}
    deadline = time.monotonic() + 240
    try:
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
            for found in re.finditer(r"rank (\d+) pid (\d+)", "".join(text)):
                pids.setdefault(int(found.group(1)), int(found.group(2)))
            ready = len(pids) == 2 and log.exists() and len(log.read_text().splitlines()) >= 6
            if killed_at is None and ready:
                first_attempt = dict(pids)
                os.kill(first_attempt[1], signal.SIGKILL)
                killed_at = time.monotonic()
                # Every rank of the first attempt must be gone within the timeout (+ 5 s).
                while _alive(first_attempt[0]) and time.monotonic() - killed_at < TIMEOUT + 10:
                    time.sleep(0.05)
                exited_after = time.monotonic() - killed_at
                assert not _alive(first_attempt[0]), "rank 0 outlived its peer by far"
                assert exited_after <= TIMEOUT + 5, exited_after
                print(f"first attempt gone {exited_after:.2f} s after the kill")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
        reader.join(timeout=10)
    second = {
        int(m.group(1)): int(m.group(2))
        for m in re.finditer(r"rank (\d+) pid (\d+)", "".join(text))
        if int(m.group(2)) not in first_attempt.values()
    }
    output = "".join(text)
    assert killed_at is not None, output
    assert job.returncode == 0, output
    assert "resumed from" in output, output
    losses = _losses(log)
    assert losses == expected, (losses, expected)
    # No process of either attempt is left behind.
    for pid in [*first_attempt.values(), *second.values()]:
        assert not _alive(pid), pid
