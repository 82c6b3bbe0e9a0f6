"""Two torchrun launchers on this machine stand in for two nodes
(`--nnodes=2 --node-rank=0/1`, c10d rendezvous on 127.0.0.1), 2 processes
each, as a 2 (pp) x 2 (dp) job: nothing may assume one host, and the result
must equal the unpipelined model's (multinode_worker.py checks it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("multinode_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_nodes_two_processes_each():
    port = _free_port()
    # The worker imports the zoo (tests/) and its loss (examples/), as pytest does.
    path = [str(ROOT / "tests"), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, path))}
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=2",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=torchmpmd-multinode-test",
                str(WORKER),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for launcher in launchers:
            out, _ = launcher.communicate(timeout=240)
            outputs.append(out)
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    for node, (launcher, out) in enumerate(zip(launchers, outputs, strict=True)):
        assert launcher.returncode == 0, f"node {node} failed:\n{out}"
    text = "\n".join(outputs)
    for rank in range(4):
        assert f"ok: rank {rank} " in text, text
    # Each launcher ran two local ranks of its own node.
    assert "(node 0, local rank 0)" in text and "(node 1, local rank 1)" in text, text
