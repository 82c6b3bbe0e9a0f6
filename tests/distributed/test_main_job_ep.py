"""The main job with expert parallelism: `examples/train_gpt.py --moe --ep 2`
under torchrun (pp 2 x ep 2, 4 processes: every block's experts split over
the two ep ranks, the tokens dispatched to them by all-to-all) trains the
same model as the job with the experts replicated (`--moe --dp 2`, pp 2 x
dp 2 on the same 4 processes, the same global batch): the same losses step
by step, to float32's rounding of sums added in another order, each rank
holding fewer parameters, and the log showing the experts' balance."""

from __future__ import annotations

import json
import re

import pytest
from test_main_job_tp import _run


def _param_mib(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"rank \d: ([\d.]+) MiB of parameters", out)]


@pytest.mark.slow
def test_train_gpt_with_ep_2_trains_as_the_job_with_replicated_experts(tmp_path):
    args = ("--moe", "--dim=64")
    replicated, replicated_out = _run(tmp_path / "dp", 4, *args, "--dp=2", output=True)
    sharded, sharded_out = _run(tmp_path / "ep", 4, *args, "--ep=2", output=True)
    assert len(sharded) == len(replicated) > 1
    assert sharded == pytest.approx(replicated, rel=1e-4), (sharded, replicated)
    assert sharded[-1] < sharded[0], sharded  # it learns
    # Half of every block's experts per rank: less memory than replicas.
    assert max(_param_mib(sharded_out)) < min(_param_mib(replicated_out)), sharded_out
    logged = [json.loads(line) for line in (tmp_path / "ep" / "logs-4" / "metrics.jsonl").open()]
    steps = [r for r in logged if r.get("step") is not None]
    assert all(r["busiest_expert_over_mean"] >= 1.0 for r in steps), steps
    assert all(r["all_to_all_bytes"] > 0 for r in steps), steps
