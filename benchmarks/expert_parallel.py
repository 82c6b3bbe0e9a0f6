"""Expert parallelism against replicated experts, on the same 4 Gloo ranks:
the bundled GPT with a mixture of experts in every block, pp 2 x ep 2 (each
rank holds half of every block's experts; tokens travel by all-to-all)
against pp 2 x dp 2 (every rank holds every expert), the same global batch,
stepped in turns. Prints the parameter memory per rank of each, the step
time of each and their ratio, the share of the ep step spent in dispatch and
combine (from the timeline), and the simulator's prediction of the ep step
from costs profiled on the same steps (its all-to-alls inside the tasks)
against the measured executor span.

    python benchmarks/expert_parallel.py [--rounds 9] [--experts 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import repo_paths  # noqa: F401  (examples/ and the repository on the path)
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, lm_loss, split_points
from launch import launch, measure_link
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import torchmpmd as mpmd


def _param_bytes(runner: mpmd.PipelineRunner) -> int:
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in runner.parameters()
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = GPTConfig(
        seq_len=args.seq, dim=args.dim, heads=4, layers=args.layers, experts=args.experts
    )
    m, rows = args.microbatches, args.microbatch_size
    meshes = {
        "replicated experts (pp 2 x dp 2)": init_device_mesh(
            "cpu", (2, 2), mesh_dim_names=("pp", "dp")
        ),
        "expert parallel (pp 2 x ep 2)": init_device_mesh(
            "cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "ep")
        ),
    }
    runners = {}
    for name, mesh in meshes.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        example = torch.zeros(rows, args.seq, dtype=torch.long)
        pipe = mpmd.trace(model, (example,), split_before=split_points(cfg, 2))
        runners[name] = mpmd.PipelineRunner(
            pipe, mpmd.schedules.OneFOneB(m), mesh=mesh, loss_fn=lm_loss
        )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2 * m * rows, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    times: dict[str, list[float]] = {n: [] for n in runners}
    timelines: list[mpmd.Timeline] = []
    exchange: list[float] = []
    ep_name = "expert parallel (pp 2 x ep 2)"
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, runner in runners.items():
            shard = dist.get_rank(runner.dp_group)
            part = slice(shard * m * rows, (shard + 1) * m * rows)
            dist.barrier()
            start = time.perf_counter()
            runner.step(x[part], target=y[part])
            slowest = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            elapsed = float(slowest)
            if round_ == 0:
                continue
            times[name].append(elapsed)
            if name == ep_name:
                tl = runner.gather_timeline()
                timelines.append(tl)
                mine = runner.timeline
                assert mine is not None
                spent = sum(e.duration for e in mine.events if e.kind in ("dispatch", "combine"))
                exchange.append(spent / max(mine.step_time, 1e-9))
    latency, bandwidth = measure_link(rank, pair=(0, 1) if world == 2 else (0, 2))
    ep = runners[ep_name]
    costs = mpmd.Costs.from_timeline(
        mpmd.Timeline.merge(timelines), ep.program.num_stages, latency=latency, bandwidth=bandwidth
    )
    simulated = ep.program.simulate(costs).step_time
    span = statistics.median(tl.step_time for tl in timelines)
    memory = {}
    for name, runner in runners.items():
        mine = [_param_bytes(runner)]
        everyone: list[list[int] | None] = [None] * world
        dist.all_gather_object(everyone, mine)
        memory[name] = [e[0] for e in everyone if e is not None]
    if rank != 0:
        dist.destroy_process_group()
        return
    medians = {n: statistics.median(t) for n, t in times.items()}
    replicated = "replicated experts (pp 2 x dp 2)"
    result = {
        "model": f"GPT {args.layers} x {args.dim}, {args.experts} experts top-2, seq {args.seq}",
        "step_s": medians,
        "ep_over_replicated": medians[ep_name] / medians[replicated],
        "param_mib_per_rank": {n: [b / 2**20 for b in v] for n, v in memory.items()},
        "ep_memory_over_replicated": max(memory[ep_name]) / max(memory[replicated]),
        "dispatch_combine_share_of_ep_step": statistics.median(exchange),
        "ep_executor_span_s": span,
        "ep_simulated_s": simulated,
        "ep_measured_over_simulated": span / simulated,
    }
    for name in runners:
        print(
            f"{name}: step {medians[name] * 1e3:.1f} ms, parameters per rank "
            + ", ".join(f"{b / 2**20:.2f}" for b in memory[name])
            + " MiB"
        )
    print(
        f"ep / replicated: step {result['ep_over_replicated']:.3f}, memory "
        f"{result['ep_memory_over_replicated']:.3f}; dispatch + combine "
        f"{result['dispatch_combine_share_of_ep_step']:.1%} of the ep step; ep executor span "
        f"{span * 1e3:.1f} ms, simulated {simulated * 1e3:.1f} ms "
        f"(measured / simulated {result['ep_measured_over_simulated']:.3f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    launch(main, nproc=4)
