"""Fused forward + backward tasks whose two sides run at once, against the
same tasks run part by part, on 4 Gloo ranks: the bundled GPT with a
mixture of experts in every block, pp 2 x ep 2 (tokens travel by
all-to-all), DualPipeV over 4 stages, the same global batch, stepped in
turns. Prints how busy the ranks kept the machine's cores (their process
CPU time over the step's wall time: overlap gains only where cores idle),
the share of the unfused step spent in dispatch and combine,
how much of the fused tasks' all-to-all time ran under the other side's
compute (from the timeline), the step times and their ratio, and whether
the two give the same loss and gradients bit for bit. The simulator
predicts both steps from the costs of the unfused steps (each task's time,
the all-to-alls inside them): part by part, and with the sides at once
(where the ranks share the cores, as 4 ranks on 2 do, it charges each task
by the ranks computing beside it and a fused task's sides one after the
other: every core is busy either way).

    python benchmarks/overlap.py [--rounds 9] [--recompute] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from torchmpmd.planner import contention
from torchmpmd.schedule.hidden import hidden_by_lane
from torchmpmd.schedule.timeline import EXCHANGES

UNFUSED, FUSED = "DualPipeV, parts in order", "DualPipeV, sides at once"


def _grads(runner: mpmd.PipelineRunner) -> list[torch.Tensor]:
    out = []
    for p in runner.parameters():
        g = p.grad
        out.append((g.to_local() if isinstance(g, DTensor) else g).clone())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--recompute", action="store_true", help="full recomputation")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG of one step, parts in order and sides at once")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    cfg = GPTConfig(
        seq_len=args.seq, dim=args.dim, heads=4, layers=args.layers, experts=args.experts
    )
    m, rows = args.microbatches, args.microbatch_size
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    runners = {}
    for name, overlap in ((UNFUSED, False), (FUSED, True)):
        torch.manual_seed(0)
        model = GPT(cfg)
        example = torch.zeros(rows, args.seq, dtype=torch.long)
        pipe = mpmd.trace(model, (example,), split_before=split_points(cfg, 4))
        runners[name] = mpmd.PipelineRunner(
            pipe,
            mpmd.schedules.DualPipeV(m),
            mesh=mesh,
            loss_fn=lm_loss,
            options=mpmd.RunnerOptions(overlap=overlap, recompute=args.recompute),
        )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2 * m * rows, args.seq + 1), generator=g)
    ep_rank = dist.get_rank(mesh.get_group("ep"))
    part = slice(ep_rank * m * rows, (ep_rank + 1) * m * rows)
    x, y = tokens[part, :-1], tokens[part, 1:]
    times: dict[str, list[float]] = {n: [] for n in runners}
    busy: dict[str, list[float]] = {n: [] for n in runners}  # CPU s / (step s x cores)
    share: list[float] = []  # dispatch + combine / step, unfused, this rank
    hidden = [0.0, 0.0]
    # Per side of the fused tasks (backward 0, forward 1): seconds of its
    # all-to-alls under the other side's compute, all, beside the other's.
    sides = [0.0] * 6
    timelines: dict[str, list[mpmd.Timeline]] = {n: [] for n in runners}
    first: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for round_ in range(args.rounds + 1):  # the first round warms up
        order = list(runners.items())
        for name, runner in order[round_ % 2 :] + order[: round_ % 2]:
            dist.barrier()
            start, cpu0 = time.perf_counter(), time.process_time()
            out = runner.step(x, target=y)
            slowest = torch.tensor([time.perf_counter() - start])
            cpu = torch.tensor([time.process_time() - cpu0])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu)
            if round_ == 0:
                first[name] = (out.loss.detach().clone(), _grads(runner))
            for q in runner.parameters():
                q.grad = None
            if round_ == 0:
                continue
            times[name].append(float(slowest))
            busy[name].append(float(cpu) / (float(slowest) * (os.cpu_count() or 1)))
            timelines[name].append(runner.gather_timeline())
            mine = runner.timeline
            assert mine is not None
            if name == UNFUSED:
                spent = sum(e.duration for e in mine.events if e.kind in ("dispatch", "combine"))
                share.append(spent / max(mine.step_time, 1e-9))
            else:
                h, t = mine.hidden_communication()
                hidden[0] += h
                hidden[1] += t
                for lane, sums in hidden_by_lane(mine.events, EXCHANGES).items():
                    for k, v in enumerate(sums):
                        sides[3 * min(lane, 1) + k] += v
    # The simulator, from the unfused steps' task times (a fused task's
    # measured time left out: it is what is predicted).
    latency, bandwidth = measure_link(rank, pair=(0, 2))
    program = runners[FUSED].program
    costs = dataclasses.replace(
        mpmd.Costs.from_timeline(
            mpmd.Timeline.merge(timelines[UNFUSED]),
            program.num_stages,
            latency=latency,
            bandwidth=bandwidth,
        ),
        fused=None,
    )
    # The cores the ranks compute on, each program rank standing for its ep
    # group's ranks: where they share them (4 ranks on 2 here) the simulator
    # charges the tasks by the ranks computing beside them, and a fused
    # task's sides one after the other (Costs.shared_cores).
    cores, threads = contention.cores()
    costs = dataclasses.replace(
        costs,
        shared_cores=cores,
        demand_per_rank=threads * dist.get_world_size() / program.num_ranks,
    )
    predicted = {
        UNFUSED: program.simulate(dataclasses.replace(costs, overlap_sides=False)).step_time,
        FUSED: program.simulate(costs).step_time,
    }
    spans = {n: statistics.median(t.step_time for t in tls) for n, tls in timelines.items()}
    (l0, g0), (l1, g1) = first[UNFUSED], first[FUSED]
    same = torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    summary = torch.tensor(
        [statistics.median(share), hidden[0], hidden[1], float(same), *sides], dtype=torch.float64
    )
    gathered = [torch.zeros_like(summary) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, summary)
    if rank != 0:
        dist.destroy_process_group()
        return
    medians = {n: statistics.median(t) for n, t in times.items()}
    hidden_s = sum(float(t[1]) for t in gathered)
    exchange_s = sum(float(t[2]) for t in gathered)
    side_sums = [sum(float(t[4 + k]) for t in gathered) for k in range(6)]

    def side(k: int) -> dict[str, float]:
        under, total, beside = side_sums[3 * k : 3 * k + 3]
        return {
            "under_compute": under / total if total else 0.0,
            "beside_other_exchange": beside / total if total else 0.0,
            "all_to_all_s": total,
        }

    result = {
        "model": f"GPT {args.layers} x {args.dim}, {args.experts} experts top-2, seq {args.seq}, "
        f"{m} microbatches of {rows} per ep rank"
        + (", full recomputation" if args.recompute else ""),
        "step_s": medians,
        "fused_over_unfused": medians[FUSED] / medians[UNFUSED],
        "exchange_share_of_unfused_step": [float(t[0]) for t in gathered],
        "hidden_fraction": hidden_s / exchange_s if exchange_s else 0.0,
        "bitwise_equal": all(bool(t[3]) for t in gathered),
        "by_side": {"backward": side(0), "forward": side(1)},
        "cpu_busy": {n: statistics.median(b) for n, b in busy.items()},
        "executor_span_s": spans,
        "simulated_s": predicted,
        "measured_over_simulated": {n: spans[n] / predicted[n] for n in spans},
    }
    for name in runners:
        print(
            f"{name}: step {medians[name] * 1e3:.1f} ms; executor span {spans[name] * 1e3:.1f} "
            f"ms, simulated {predicted[name] * 1e3:.1f} ms "
            f"(measured / simulated {spans[name] / predicted[name]:.3f}); the ranks kept "
            f"{os.cpu_count()} cores {result['cpu_busy'][name]:.0%} busy"
        )
    print(
        f"fused / unfused step: {result['fused_over_unfused']:.3f}; dispatch + combine "
        + ", ".join(f"{s:.0%}" for s in result["exchange_share_of_unfused_step"])
        + " of the unfused step per rank; all-to-all inside fused tasks under compute: "
        f"{result['hidden_fraction']:.0%}; loss and gradients bitwise equal: "
        f"{result['bitwise_equal']}"
    )
    print(
        "by side of the fused tasks: "
        + "; ".join(
            f"the {name} side's all-to-alls ({v['all_to_all_s'] * 1e3:.0f} ms) "
            f"{v['under_compute']:.0%} under the other's compute, "
            f"{v['beside_other_exchange']:.0%} while the other exchanged too"
            for name, v in result["by_side"].items()
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        mpmd.viz.plot(
            [timelines[UNFUSED][-1], timelines[FUSED][-1]],
            args.plot,
            titles=[
                f"{UNFUSED}: step {spans[UNFUSED] * 1e3:.0f} ms (executor span, median)",
                f"{FUSED}: step {spans[FUSED] * 1e3:.0f} ms; fused parts where they ran, "
                f"all-to-alls dark; {result['hidden_fraction']:.0%} of the fused tasks' "
                "all-to-all time under the other side's compute",
            ],
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch(main, nproc=4)
