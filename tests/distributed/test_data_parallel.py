"""Pipeline x data parallelism on a 2 (pp) x 2 (dp) DeviceMesh of 4 Gloo
processes: each data-parallel rank steps on its own shard of the global
batch, and the loss, every gradient and the parameters after AdamW steps
equal the unpipelined model's on the whole global batch (float64, 1e-10),
for every built-in schedule family, tied weights included; the global
gradient norm too. A step under torch.autocast is refused on every rank
before any message, and a loss that fails on one replica is named on the
other, within the timeout (it got Gloo's raw "Connection closed by peer")."""

from __future__ import annotations

import time

import pytest
import torch
from harness import check_all, run_ranks, whole_tensor
from models import CASES, square_loss
from pipeline_check import SPLITS

import torchmpmd as mpmd

M = 4  # microbatches per data-parallel rank
MICROBATCH = 2
PP, DP = 2, 2


def _pipe(num_stages: int) -> mpmd.Pipe:
    case = CASES["gpt"]  # tied embedding and output layer, on different ranks
    (x,), _ = case.inputs(MICROBATCH)
    return mpmd.trace(case.model(torch.float64), (x,), **SPLITS["gpt"](num_stages))


def _own_sharding(stage: torch.nn.Module, dp_mesh) -> None:
    """A user's parallelize: FSDP2 resharding after forward, tied weights left out."""
    from torch.distributed.fsdp import fully_shard

    tied = {p for n, p in stage.named_parameters() if n in ("tok.weight", "head.weight")}
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=True, ignored_params=tied)


def _shard_everything(stage: torch.nn.Module, dp_mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(stage, mesh=dp_mesh)


# Meshes named torchtitan's way: (shape, dimension names, how many ranks
# share one shard). The runner finds the data parallelism by the names.
TORCHTITAN_MESHES = {
    "dp_shard": ((PP, DP), ("pp", "dp_shard"), DP),
    "dp_replicate": ((PP, DP), ("pp", "dp_replicate"), 1),
    # FSDP's hybrid sharding: sharded over dp_shard, replicated over
    # dp_replicate, on one pipeline rank holding both stages.
    "hsdp": ((1, 2, 2), ("pp", "dp_replicate", "dp_shard"), 2),
}


def train_on_mesh(rank: int, world: int, combos: list[tuple[str, int, str, int]]) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {}
    case = CASES["gpt"]
    done = []
    for schedule_name, num_stages, mode, m in combos:
        shape, names, shards = TORCHTITAN_MESHES.get(mode, ((PP, DP), ("pp", "dp"), DP))
        if names not in meshes:
            meshes[names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        mesh = meshes[names]
        sharded = mode.startswith("fsdp") or (mode in TORCHTITAN_MESHES and shards > 1)
        reference = case.model(torch.float64)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
        runner = mpmd.PipelineRunner(
            _pipe(num_stages),
            getattr(mpmd.schedules, schedule_name)(m),
            mesh=mesh,
            loss_fn=case.loss,
            options=mpmd.RunnerOptions(
                data_parallel=(
                    None
                    if mode in TORCHTITAN_MESHES
                    else "fsdp"
                    if mode == "fsdp+parallelize"
                    else mode
                ),
                parallelize=_own_sharding if mode == "fsdp+parallelize" else None,
                timeout=60,
                bucket_bytes=4096,  # several buckets per stage
            ),
        )
        opt = torch.optim.AdamW(runner.parameters(), lr=1e-2, weight_decay=0.01)
        local = dict(runner.named_parameters())
        dp, dp_rank = runner.dp_size, dist.get_rank(runner.dp_group)
        for step in range(3):
            (x,), _ = case.inputs(MICROBATCH * m * dp)
            x = (x + step) % 64
            y = case.target(MICROBATCH * m * dp).roll(step)
            # Reference: every microbatch of every shard, in one process.
            ref_opt.zero_grad(set_to_none=True)
            losses = []
            for xb, yb in zip(x.chunk(m * dp), y.chunk(m * dp), strict=True):
                loss = case.loss(reference(xb), yb)
                (loss / (m * dp)).backward()
                losses.append(loss.detach().double())
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()

            opt.zero_grad(set_to_none=True)
            shard = slice(dp_rank * MICROBATCH * m, (dp_rank + 1) * MICROBATCH * m)
            out = runner.step(x[shard], target=y[shard])
            what = f"{mode} {schedule_name} step {step} rank {rank}"
            _check_collectives(runner, sharded, what)
            if mode == "replicate" and schedule_name in OVERLAPPED:
                # Gradients leave during the backward that makes them (DDP's overlap).
                early = out.metrics["grad_bytes_averaged_in_backward"]
                assert 0 < early <= out.metrics["grad_bytes_averaged"], (what, out.metrics)
            torch.testing.assert_close(
                out.loss, torch.stack(losses).mean(), rtol=1e-12, atol=1e-12, msg=what
            )
            grads = {fqn: reference.get_parameter(fqn).grad for fqn in local}
            norm = runner.clip_grad_norm_(1.0)
            torch.testing.assert_close(norm, ref_norm, rtol=1e-12, atol=1e-12, msg=what)
            for fqn, p in local.items():
                torch.testing.assert_close(
                    whole_tensor(p.grad), grads[fqn], rtol=1e-10, atol=1e-10, msg=f"{what}: {fqn}"
                )
            opt.step()
            for fqn, p in local.items():
                torch.testing.assert_close(
                    whole_tensor(p.detach()),
                    reference.get_parameter(fqn).detach(),
                    rtol=1e-10,
                    atol=1e-10,
                    msg=f"{what}: {fqn} after AdamW",
                )
        if sharded:
            # Between steps a rank holds its shard: about 1/shards of its stages.
            from torch.distributed.tensor import DTensor

            held = sum(
                (p.to_local() if isinstance(p, DTensor) else p).numel() for p in local.values()
            )
            whole = sum(p.numel() for p in local.values())
            assert held <= 1.1 * whole / shards, (held, whole)
            assert any(isinstance(p, DTensor) for p in local.values())
        done.append(f"{schedule_name}: stages {runner.local_stages}, dp {runner.dp_size}")
    return done


def _check_collectives(runner, sharded: bool, what: str) -> None:
    """The step ran its program's collectives, as the simulator sees them:
    FSDP gathered each local stage before its first task; every local
    stage's gradient reduction started once, the first of them while the
    rank still had tasks to run (it overlaps them)."""
    program = "\n".join(runner.program.instructions(runner.rank))
    tl = runner.timeline
    reduced = [e for e in tl.events if e.kind == "reduce_grads"]
    gathered = [e for e in tl.events if e.kind == "unshard"]
    assert sorted(e.stage for e in reduced) == sorted(runner.local_stages), (what, reduced)
    for s in runner.local_stages:
        assert f"REDUCE_grads(s{s})" in program, (what, program)
        assert (f"UNSHARD(s{s})" in program) == sharded, (what, program)
    if sharded:
        assert sorted(e.stage for e in gathered) == sorted(runner.local_stages), (what, gathered)
        for e in gathered:
            first = min(t.start for t in tl.tasks if t.stage == e.stage)
            assert e.end <= first, (what, e, first)
    else:
        assert not gathered, (what, gathered)
    for e in reduced:
        last = max(t.end for t in tl.tasks if t.stage == e.stage)
        assert e.start >= last, (what, e, last)
    if len(runner.local_stages) > 1:
        assert min(e.start for e in reduced) < max(t.end for t in tl.tasks), (what, reduced)
    # Every pipeline rank's reductions travel in the gathered timeline too.
    gathered = runner.gather_timeline()
    ranks = {e.rank for e in gathered.events if e.kind == "reduce_grads"}
    assert ranks == set(range(runner.num_ranks)), (what, ranks)


# (schedule, stages on the 2 pipeline ranks, microbatches per replica):
# every built-in schedule.
SCHEDULES = [
    ("GPipe", 2, 4),
    ("OneFOneB", 2, 4),
    ("Eager1F1B", 2, 4),
    ("ZeroBubbleH1", 2, 4),
    ("Interleaved1F1B", 4, 4),
    ("ZBV", 4, 4),
    ("DualPipeV", 4, 8),
]


# Schedules whose stages finish their weight gradients in one autograd
# backward (B, or W without a split into branches): each gradient bucket
# goes out as soon as that backward has made it (grads_start).
OVERLAPPED = ("GPipe", "OneFOneB", "Eager1F1B", "Interleaved1F1B")


def test_pipeline_times_data_parallel_replicate():
    combos = [(name, stages, "replicate", m) for name, stages, m in SCHEDULES]
    reports = check_all(run_ranks(train_on_mesh, PP * DP, combos))
    assert all(len(r) == len(combos) for r in reports)


def test_pipeline_times_data_parallel_fsdp():
    combos = [(name, stages, "fsdp", m) for name, stages, m in SCHEDULES]
    combos.append(("ZeroBubbleH1", 2, "fsdp+parallelize", 4))
    reports = check_all(run_ranks(train_on_mesh, PP * DP, combos))
    assert all(len(r) == len(combos) for r in reports)


def test_torchtitan_mesh_names_find_the_data_parallelism():
    """("pp", "dp_shard"): FSDP; ("pp", "dp_replicate"): replicas; both:
    FSDP's hybrid sharding. Each trains like the unpipelined model."""
    combos = [
        ("OneFOneB", 2, "dp_shard", 4),
        ("ZeroBubbleH1", 2, "dp_replicate", 4),
        ("OneFOneB", 2, "hsdp", 4),
    ]
    reports = check_all(run_ranks(train_on_mesh, PP * DP, combos))
    assert all(len(r) == len(combos) for r in reports)
    assert all("dp 4" in r[2] and "stages [0, 1]" in r[2] for r in reports), reports


def refuse_sharded_tied_weights(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    try:
        mpmd.PipelineRunner(
            _pipe(2),
            mpmd.schedules.OneFOneB(M),
            mesh=mesh,
            loss_fn=CASES["gpt"].loss,
            options=mpmd.RunnerOptions(data_parallel="fsdp", parallelize=_shard_everything),
        )
    except ValueError as err:
        return str(err)
    return "no error"


def test_parallelize_must_leave_tied_weights_unsharded():
    for message in check_all(run_ranks(refuse_sharded_tied_weights, PP * DP)):
        assert "parallelize sharded stage" in message and "tied parameters" in message, message
        assert "ignored_params" in message, message


TIMEOUT = 3.0


def _outcome(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except BaseException as err:
        return {"error": f"{type(err).__name__}: {err}", "after": time.monotonic() - start}
    return {"error": None, "after": time.monotonic() - start}


def autocast_then_one_replica_fails(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    steps = []

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if steps and dist.get_rank() == 3:  # replica 1's last stage, at the second step
            raise KeyError("bad label")
        return square_loss(out, target)

    runner = mpmd.PipelineRunner(
        mpmd.trace(model, (torch.randn(2, 4),), split_before=["2"]),
        mpmd.schedules.OneFOneB(2),
        mesh=mesh,
        loss_fn=loss,
        options=mpmd.RunnerOptions(data_parallel="replicate", timeout=TIMEOUT),
    )
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _outcome(lambda: runner.step(x, target=x))
    steps.append(_outcome(lambda: runner.step(x, target=x)))
    steps.append(_outcome(lambda: runner.step(x, target=x)))
    if mesh.get_local_rank("dp") == 1:
        time.sleep(TIMEOUT + 1)  # the failed replica lives on (its loop caught the error)
    return {"autocast": autocast, "step": steps[0], "failed": steps[1]}


@pytest.fixture(scope="module")
def one_replica_fails() -> list[dict]:
    return check_all(run_ranks(autocast_then_one_replica_fails, PP * DP, deadline=120))


@pytest.mark.slow
def test_a_step_under_autocast_is_refused_on_every_rank_before_any_message(one_replica_fails):
    # Before: processes ran the traced graph's ops cast to bfloat16 and
    # failed mid-step ("produced 'tanh' with shape (2, 4) BFloat16 but the
    # stage plan expects (2, 4) Float"), leaving the runner unusable.
    for r, result in enumerate(one_replica_fails):
        err = result["autocast"]["error"]
        assert err is not None and err.startswith("RuntimeError: PipelineRunner.step (rank "), err
        assert "called inside torch.autocast('cpu', dtype=torch.bfloat16)" in err, err
        assert "trace inside torch.autocast instead" in err, err
        assert result["step"]["error"] is None, (r, result)  # the runner stays usable


@pytest.mark.slow
def test_a_loss_that_fails_on_one_replica_is_named_on_the_other(one_replica_fails):
    # Before: the other replica (global ranks 0 and 2) got Gloo's raw
    # "Connection closed by peer" from the gradient all-reduce once the
    # failed replica exited, or waited for the process group's timeout.
    failed = one_replica_fails[3]["failed"]["error"]
    assert failed.startswith("PipelineError[KeyError]: torchmpmd: rank 1: F(stage=1, mb=0) failed")
    assert "bad label" in failed, failed
    cause = "because rank 1 (global rank 3) failed in step: torchmpmd: rank 1: F(stage=1, mb=0)"
    for r, name in ((0, "rank 0"), (2, "rank 1 (global rank 2)")):
        result = one_replica_fails[r]["failed"]
        err = result["error"]
        assert err is not None and err.startswith(
            f"PipelineError: torchmpmd: {name} stopped step"
        ), err
        assert cause in err and "KeyError: 'bad label'" in err, err
        assert "Connection closed" not in err and "Timed out" not in err, err
        assert result["after"] < TIMEOUT + 1.5, result
    assert "because rank 1 (global rank 3) failed" in one_replica_fails[1]["failed"]["error"]
