"""One process of the two-"node" test (tests/distributed/test_multinode.py),
launched by torchrun: a 2 (pp) x 2 (dp) mesh built from torchrun's
environment trains the test GPT for two AdamW steps and checks loss,
gradients and parameters against the unpipelined model. Exits non-zero on a
mismatch."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from models import CASES  # tests/ and examples/ are on PYTHONPATH (test_multinode.py)
from pipeline_check import SPLITS
from torch.distributed.device_mesh import init_device_mesh

import torchmpmd as mpmd

M, MICROBATCH, PP, DP = 4, 2, 2, 2


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == PP * DP, world
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh.get_local_rank("dp")
    case = CASES["gpt"]
    (example,), _ = case.inputs(MICROBATCH)
    pipe = mpmd.trace(case.model(torch.float64), (example,), **SPLITS["gpt"](PP))
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(M),
        mesh=mesh,
        loss_fn=case.loss,
        options=mpmd.RunnerOptions(timeout=60),
    )
    reference = case.model(torch.float64)
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        (x,), _ = case.inputs(MICROBATCH * M * DP)
        x = (x + step) % 64
        y = case.target(MICROBATCH * M * DP)
        ref_opt.zero_grad()
        losses = []
        for xb, yb in zip(x.chunk(M * DP), y.chunk(M * DP), strict=True):
            loss = case.loss(reference(xb), yb)
            (loss / (M * DP)).backward()
            losses.append(loss.detach().double())
        ref_opt.step()
        opt.zero_grad()
        shard = slice(dp_rank * MICROBATCH * M, (dp_rank + 1) * MICROBATCH * M)
        out = runner.step(x[shard], target=y[shard])
        torch.testing.assert_close(out.loss, torch.stack(losses).mean(), rtol=1e-12, atol=1e-12)
        for fqn, p in runner.named_parameters():
            torch.testing.assert_close(
                p.grad, reference.get_parameter(fqn).grad, rtol=1e-10, atol=1e-10, msg=fqn
            )
        opt.step()
        for fqn, p in runner.named_parameters():
            torch.testing.assert_close(
                p.detach(), reference.get_parameter(fqn).detach(), rtol=1e-10, atol=1e-10
            )
    print(
        f"ok: rank {rank} (node {os.environ.get('GROUP_RANK')}, local rank "
        f"{os.environ.get('LOCAL_RANK')}), stages {runner.local_stages}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
