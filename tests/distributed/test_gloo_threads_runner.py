"""`mpmd.tune_cpu()` runs Gloo's event-loop threads under SCHED_BATCH until
its `release()` and gives them their normal policy back then; a runner by
itself changes nothing in the process (it used to, behind its construction:
`gloo_sched_batch`, on by default). Training is unchanged: the losses equal
the unpipelined model's."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from harness import check_all, run_ranks
from models import MLP, square_loss
from pipeline_check import mlp_memory_case

import torchmpmd as mpmd
from torchmpmd.runtime import gloo_threads

M, WIDTH, DEPTH, BATCH = 4, 16, 4, 16


def policies(rank, world):
    pipe, x, y, _ = mlp_memory_case(WIDTH, DEPTH, BATCH, M)
    tids = gloo_threads.loop_threads()
    seen = {}
    seen["before"] = {os.sched_getscheduler(t) for t in tids}
    runner = mpmd.PipelineRunner(pipe, mpmd.schedules.OneFOneB(M), loss_fn=square_loss)
    runner.step(x, target=y)
    seen["runner alone"] = {os.sched_getscheduler(t) for t in tids}
    tuning = mpmd.tune_cpu(keep_freed_memory=False)
    loss = runner.step(x, target=y).loss
    seen["tuned"] = {os.sched_getscheduler(t) for t in tids}
    tuning.release()
    seen["released"] = {os.sched_getscheduler(t) for t in tids}
    del runner
    gc.collect()
    # The unpipelined model (mlp_memory_case's seed) over the same microbatches.
    torch.manual_seed(0)
    model = MLP(WIDTH, DEPTH).double()
    ref = sum(square_loss(model(a), b) for a, b in zip(x.chunk(M), y.chunk(M), strict=True)) / M
    return len(tids), seen, float(loss), float(ref), tuning.gloo_threads


def test_tune_cpu_batches_gloo_loop_threads_until_released():
    for count, seen, loss, ref, said in check_all(run_ranks(policies, 2, deadline=120)):
        assert count >= 1
        assert seen == {
            "before": {os.SCHED_OTHER},
            "runner alone": {os.SCHED_OTHER},
            "tuned": {os.SCHED_BATCH},
            "released": {os.SCHED_OTHER},
        }
        assert abs(loss - ref) <= 1e-12 * abs(ref)
        assert said.startswith("SCHED_BATCH for Gloo's loop threads"), said


def default_backend(rank, world, store):
    # init_process_group() without a backend: get_backend says 'undefined',
    # the backend config 'cpu:gloo'. Still a Gloo group on the CPU.
    dist.destroy_process_group()
    dist.init_process_group(init_method=f"file://{store}", rank=rank, world_size=world)
    pipe, x, y, _ = mlp_memory_case(WIDTH, DEPTH, BATCH, M)
    tuning = mpmd.tune_cpu(keep_freed_memory=False)
    runner = mpmd.PipelineRunner(pipe, mpmd.schedules.OneFOneB(M), loss_fn=square_loss)
    loss = runner.step(x, target=y).loss
    running = {os.sched_getscheduler(t) for t in gloo_threads.loop_threads()}
    tuning.release()
    torch.manual_seed(0)
    model = MLP(WIDTH, DEPTH).double()
    ref = sum(square_loss(model(a), b) for a, b in zip(x.chunk(M), y.chunk(M), strict=True)) / M
    return str(dist.get_backend()), runner.device.type, running, float(loss), float(ref.detach())


def test_runner_on_a_group_made_without_naming_gloo(tmp_path):
    results = check_all(run_ranks(default_backend, 2, str(tmp_path / "store"), deadline=120))
    for backend, device, running, loss, ref in results:
        assert backend == "undefined"  # what made the old check miss it
        assert device == "cpu"
        assert running == {os.SCHED_BATCH}
        assert abs(loss - ref) <= 1e-12 * abs(ref)
