"""Replicas and tied copies that start apart are made equal, on a 2 (pp) x 2
(dp) DeviceMesh of 4 Gloo processes, each rank seeding torch with its own
rank: a real model's replicas take dp rank 0's weights at construction (as
DDP's do; before FSDP shards them), and a meta model initialised per rank
by `init_weights` ends with every tied weight's copies equal to its first
stage's and every replica equal to dp rank 0's. The steps then equal the
unpipelined model holding dp rank 0's weights (float64, 1e-10)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from harness import check_all, run_ranks
from models import CASES, TinyGPT

import torchmpmd as mpmd

M = 2  # microbatches per replica
MICROBATCH = 2
PP, DP = 2, 2


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _weights(runner: mpmd.PipelineRunner) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers, whole (collective under FSDP)."""
    out = {n: _full(p) for n, p in runner.named_parameters()}
    for module in runner.local_modules():
        for n, b in module.named_buffers():
            out.setdefault(n, b.detach().clone())
    return out


def _everyone(value: object) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _global_rank(pp: int, dp: int) -> int:
    return pp * DP + dp  # init_device_mesh lays ranks out row-major


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.MultiheadAttention):
        m._reset_parameters()
    elif hasattr(m, "reset_parameters"):
        m.reset_parameters()


def _check_replicas(everyone: list[dict[str, torch.Tensor]], pp: int, what: str) -> None:
    mine, first = everyone[_global_rank(pp, 1)], everyone[_global_rank(pp, 0)]
    assert mine.keys() == first.keys(), what
    for name, t in mine.items():
        assert torch.equal(t, first[name]), f"{what}: replicas differ at {name}"


def _train_and_compare(runner, reference, case, dp_rank: int, what: str) -> None:
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(2):
        (x,), _ = case.inputs(MICROBATCH * M * DP)
        x = x + step if x.is_floating_point() else (x + step) % 64
        y = case.target(MICROBATCH * M * DP).roll(step)
        x, y = (v.double() if v.is_floating_point() else v for v in (x, y))
        ref_opt.zero_grad(set_to_none=True)
        losses = []
        for xb, yb in zip(x.chunk(M * DP), y.chunk(M * DP), strict=True):
            loss = case.loss(reference(xb), yb)
            (loss / (M * DP)).backward()
            losses.append(loss.detach().double())
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        shard = slice(dp_rank * MICROBATCH * M, (dp_rank + 1) * MICROBATCH * M)
        out = runner.step(x[shard], target=y[shard])
        torch.testing.assert_close(
            out.loss, torch.stack(losses).mean(), rtol=1e-10, atol=1e-10, msg=what
        )
        opt.step()
        for fqn, p in runner.named_parameters():
            torch.testing.assert_close(
                _full(p),
                reference.get_parameter(fqn).detach(),
                rtol=1e-10,
                atol=1e-10,
                msg=f"{what} step {step}: {fqn}",
            )


def replicas_start_equal(rank: int, world: int, modes: list[str]) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    done = []
    for mode in modes:
        # A real model, built by each rank from its own seed.
        case = CASES["mlp"]
        model = case.model(torch.float64, seed=rank)
        (x,), _ = case.inputs(MICROBATCH)
        pipe = mpmd.trace(model, (x.double(),), split_before=["layers.2"])
        runner = mpmd.PipelineRunner(
            pipe,
            mpmd.schedules.OneFOneB(M),
            mesh=mesh,
            loss_fn=case.loss,
            options=mpmd.RunnerOptions(data_parallel=mode, timeout=60),
        )
        everyone = _everyone(_weights(runner))
        _check_replicas(everyone, pp, f"{mode}: real model after construction")
        # dp rank 0's weights: its pipeline ranks' own models, stage by stage.
        reference = case.model(torch.float64)
        reference.load_state_dict(
            {**everyone[_global_rank(0, 0)], **everyone[_global_rank(1, 0)]}, strict=True
        )
        # Not what this rank built, unless it is dp rank 0.
        built = case.model(torch.float64, seed=rank).layers[2 * pp].weight
        assert torch.equal(built, reference.layers[2 * pp].weight) == (dp == 0)
        _train_and_compare(runner, reference, case, dp, f"{mode} real")
        _check_replicas(_everyone(_weights(runner)), pp, f"{mode}: real model after steps")

        # A meta model with tied weights, initialised by each rank from its own seed.
        case = CASES["gpt"]
        with torch.device("meta"):
            model = TinyGPT().double()
        (ids,), _ = case.inputs(MICROBATCH)
        pipe = mpmd.trace(model, (ids.to("meta"),), split_before=["blocks.2"])
        runner = mpmd.PipelineRunner(
            pipe,
            mpmd.schedules.OneFOneB(M),
            mesh=mesh,
            loss_fn=case.loss,
            options=mpmd.RunnerOptions(data_parallel=mode, timeout=60),
        )
        torch.manual_seed(100 + rank)
        runner.init_weights(_init)
        everyone = _everyone(_weights(runner))
        _check_replicas(everyone, pp, f"{mode}: meta model after init_weights")
        first, last = everyone[_global_rank(0, dp)], everyone[_global_rank(1, dp)]
        assert torch.equal(first["tok.weight"], last["head.weight"]), f"{mode}: tie apart"
        reference = TinyGPT().double()
        state = {**everyone[_global_rank(1, 0)], **everyone[_global_rank(0, 0)]}
        reference.load_state_dict(state, strict=True)
        _train_and_compare(runner, reference, case, dp, f"{mode} meta")

        # Only the embeddings written (the tied one is never sharded): the
        # rest, FSDP's shards of allocated garbage included, is refused.
        pipe = mpmd.trace(model, (ids.to("meta"),), split_before=["blocks.2"])
        runner = mpmd.PipelineRunner(
            pipe,
            mpmd.schedules.OneFOneB(M),
            mesh=mesh,
            loss_fn=case.loss,
            options=mpmd.RunnerOptions(data_parallel=mode),
        )
        runner.init_weights(lambda m: m.reset_parameters() if isinstance(m, nn.Embedding) else None)
        try:
            runner.step(ids.repeat(M, 1), target=case.target(MICROBATCH * M))
        except RuntimeError as err:
            unwritten = "'blocks.0.attn.in_proj_bias' (stage 0)" if pp == 0 else "(stage 1)"
            assert "allocated but never written" in str(err) and unwritten in str(err), err
            assert "'tok.weight'" not in str(err) and "'pos.weight'" not in str(err), err
        else:
            raise AssertionError(f"{mode}: a step on unwritten weights ran")
        done.append(mode)
    return done


def test_replicas_and_tied_copies_start_equal():
    results = check_all(run_ranks(replicas_start_equal, PP * DP, ["replicate", "fsdp"]))
    assert results == [["replicate", "fsdp"]] * (PP * DP)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)}) for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["down"](torch.tanh(block["up"](x)))
        return x


def tensor_parallel_replicas_start_equal(rank: int, world: int) -> list[str]:
    """1 (pp) x 2 (dp) x 2 (tp): a meta model initialised per rank (each its
    own seed) ends with both replicas holding the same tp shards."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    with torch.device("meta"):
        model = _Mlp().double()
    pipe = mpmd.trace(model, (torch.empty(2, 8, device="meta"),), split_before=["blocks.1.up"])
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.GPipe(M),
        mesh=mesh,
        loss_fn=lambda out, y: ((out - y) ** 2).mean(),
        options=mpmd.RunnerOptions(
            timeout=60, tp_plan={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
        ),
    )
    torch.manual_seed(100 + rank)
    runner.init_weights(_init)
    local = {n: p.to_local().clone() for n, p in runner.named_parameters()}
    everyone = _everyone(local)
    tp = mesh.get_local_rank("tp")
    other = everyone[2 + tp] if mesh.get_local_rank("dp") == 0 else everyone[tp]
    differ = [n for n, t in local.items() if not torch.equal(t, other[n])]
    assert not differ, f"rank {rank}: replicas hold other shards of {differ}"
    # The tp peers' shards of a sharded weight are parts of one init, not copies.
    peer = everyone[rank ^ 1]
    assert not torch.equal(local["blocks.0.up.weight"], peer["blocks.0.up.weight"])
    return sorted(local)


def test_tensor_parallel_replicas_start_equal_after_init_weights():
    results = check_all(run_ranks(tensor_parallel_replicas_start_equal, 4))
    assert all("blocks.0.up.weight" in r for r in results), results
