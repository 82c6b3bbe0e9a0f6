"""Every built-in schedule on the bundled GPT, side by side in one run on 2 Gloo
ranks: median step time, each schedule's ratio to 1F1B, measured / simulated
step (costs profiled from the same run), I + W against B per stage, and each
rank's peak activation memory, measured from the allocator against the
simulator's prediction.

    python benchmarks/schedules.py                 # launches 2 ranks itself
    python benchmarks/schedules.py --json out.json

Schedules take turns step by step (round robin), so every schedule sees the
same machine conditions; the figures are medians over `--steps` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import repo_paths
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, lm_loss, split_points
from launch import idle_time, launch, measure_link

import torchmpmd as mpmd

ROOT = repo_paths.ROOT

S = mpmd.schedules
# name -> (schedule class, stages per rank)
SCHEDULES: dict[str, tuple[type[mpmd.Schedule], int]] = {
    "GPipe": (S.GPipe, 1),
    "1F1B": (S.OneFOneB, 1),
    "Eager1F1B": (S.Eager1F1B, 1),
    "ZB-H1": (S.ZeroBubbleH1, 1),
    "Interleaved1F1B": (S.Interleaved1F1B, 2),
    "ZBV": (S.ZBV, 2),
    "DualPipeV": (S.DualPipeV, 2),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="a PNG of the last measured step of --plot-schedule over its prediction",
    )
    p.add_argument("--plot-schedule", default="1F1B")
    return p.parse_args()


def stage_means(timelines: list[mpmd.Timeline]) -> dict[tuple[int, str], float]:
    """Mean duration of each (stage, task kind) over the timelines' simple tasks."""
    sums: dict[tuple[int, str], list[float]] = defaultdict(list)
    for tl in timelines:
        for e in tl.tasks:
            if e.is_fused:  # F and B as one: not a time of its first part's kind
                continue
            sums[(e.stage, e.kind)].append(e.duration)
    return {k: statistics.fmean(v) for k, v in sums.items()}


def split_backward_ratios(rows: list[dict[str, Any]], num_stages: int) -> list[dict[str, Any]]:
    """Per stage, ZB-H1's I + W against 1F1B's B from the rows' mean task
    times, and F + I + W against F + B (the split F builds no autograd graph)."""
    means = {r["schedule"]: r["task_means_s"] for r in rows}
    if "1F1B" not in means or "ZB-H1" not in means:
        return []
    zb, plain = means["ZB-H1"], means["1F1B"]
    out = []
    for s in range(num_stages):
        if f"B{s}" not in plain or f"W{s}" not in zb:
            continue
        i, w, b = zb.get(f"I{s}", 0.0), zb[f"W{s}"], plain[f"B{s}"]
        f_zb, f_plain = zb[f"F{s}"], plain[f"F{s}"]
        out.append(
            {
                "stage": s,
                "i_s": i,
                "w_s": w,
                "b_s": b,
                "i_plus_w_over_b": (i + w) / b,
                "f_over_f": f_zb / f_plain,
                "f_i_w_over_f_b": (f_zb + i + w) / (f_plain + b),
            }
        )
    return out


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = GPTConfig(seq_len=args.seq_len, dim=args.dim, layers=args.layers)
    m, b = args.microbatches, args.microbatch_size
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (m * b, args.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (m * b, args.seq_len), generator=g)
    example = torch.zeros(b, args.seq_len, dtype=torch.long)

    # The simulator charges each message this link's latency and bandwidth.
    latency, bandwidth = measure_link(rank)
    names = args.schedules.split(",")

    def runner_for(name: str, **options: Any) -> mpmd.PipelineRunner:
        cls, per_rank = SCHEDULES[name]
        torch.manual_seed(0)
        model = GPT(cfg)
        pipe = mpmd.trace(model, (example,), split_before=split_points(cfg, world * per_rank))
        return mpmd.PipelineRunner(
            pipe, cls(m), loss_fn=lm_loss, options=mpmd.RunnerOptions(**options)
        )

    runners = {name: runner_for(name) for name in names}

    times: dict[str, list[float]] = defaultdict(list)
    timelines: dict[str, list[mpmd.Timeline]] = defaultdict(list)
    losses: dict[str, float] = {}
    for i in range(args.warmup + args.steps):
        for name in names:
            runner = runners[name]
            dist.barrier()
            start = time.perf_counter()
            losses[name] = runner.step(x, target=y).loss.item()
            elapsed = time.perf_counter() - start
            for p in runner.parameters():
                p.grad = None
            if i >= args.warmup:
                times[name].append(elapsed)
                timelines[name].append(runner.gather_timeline())

    # Memory, apart from the timed runners (measuring costs a lock per
    # allocation): one measured step after a warm-up, per schedule.
    memory: dict[str, tuple[list[int], list[int]]] = {}
    for name in names:
        runner = runner_for(name, measure_memory=True)
        for _ in range(2):
            runner.step(x, target=y)
        tl = runner.gather_timeline()
        costs = mpmd.Costs.from_timeline(tl, runner.program.num_stages)
        memory[name] = (
            tl.peak_activation_bytes,
            runner.program.simulate(costs).peak_activation_bytes,
        )

    rows: list[dict[str, Any]] = []
    for name in names:
        runner = runners[name]
        num_stages = runner.program.num_stages
        measured = statistics.median(times[name])
        # The executor's own span (no Python set-up around it), and the
        # simulator's prediction with costs profiled from the same steps.
        span = statistics.median(tl.step_time for tl in timelines[name])
        costs = mpmd.Costs.from_timeline(
            mpmd.Timeline.merge(timelines[name]), num_stages, latency=latency, bandwidth=bandwidth
        )
        predicted = runner.program.simulate(costs)
        simulated = predicted.step_time
        means = stage_means(timelines[name])
        # Where a step's time goes, per rank: busy (task spans) and idle
        # (gaps between them), measured (median step) against simulated.
        # Equal busy and more idle points at waits the costs do not model.
        middle = sorted(timelines[name], key=lambda tl: tl.step_time)[len(timelines[name]) // 2]
        idle = [idle_time(middle, r) for r in range(world)]
        idle_sim = [idle_time(predicted, r) for r in range(world)]
        rows.append(
            {
                "schedule": name,
                "stages": num_stages,
                "step_s": measured,
                "executor_span_s": span,
                "simulated_s": simulated,
                "measured_over_simulated": span / simulated,
                "loss": losses[name],
                "link_latency_s": latency,
                "link_bandwidth_bytes_per_s": bandwidth,
                "task_means_s": {f"{k}{s}": v for (s, k), v in sorted(means.items())},
                "idle_s": idle,
                "idle_simulated_s": idle_sim,
                "peak_bytes": memory[name][0],
                "peak_simulated_bytes": memory[name][1],
                "peak_measured_over_simulated": [
                    a / b for a, b in zip(memory[name][0], memory[name][1], strict=True)
                ],
            }
        )
    base = next((r["step_s"] for r in rows if r["schedule"] == "1F1B"), rows[0]["step_s"])
    for r in rows:
        r["over_1f1b"] = r["step_s"] / base
    split_backward = split_backward_ratios(rows, world)
    if rank == 0:
        print(
            f"GPT {args.layers}x{args.dim}, {world} Gloo ranks, {m} microbatches of "
            f"{b}x{args.seq_len}; medians of {args.steps} rounds after {args.warmup} warm-up; "
            f"simulated with the measured costs and link ({latency * 1e6:.0f} us, "
            f"{bandwidth / 1e9:.2f} GB/s)"
        )
        print(
            f"{'schedule':16} {'stages':>6} {'step':>9} {'/1F1B':>6} {'span':>9} "
            f"{'simulated':>9} {'meas/sim':>8}  idle per rank, measured (simulated)"
        )
        for r in rows:
            print(
                f"{r['schedule']:16} {r['stages']:6d} {r['step_s'] * 1e3:7.1f}ms "
                f"{r['over_1f1b']:6.3f} {r['executor_span_s'] * 1e3:7.1f}ms "
                f"{r['simulated_s'] * 1e3:7.1f}ms {r['measured_over_simulated']:8.3f}  "
                + ", ".join(
                    f"{a * 1e3:.1f} ({b * 1e3:.1f}) ms"
                    for a, b in zip(r["idle_s"], r["idle_simulated_s"], strict=True)
                )
            )
        print("peak activation memory per rank, measured (simulated): measured / simulated")
        for r in rows:
            print(
                f"  {r['schedule']:16} "
                + ", ".join(
                    f"{a / 2**20:.1f} ({b / 2**20:.1f}) MiB: {a / b:.3f}"
                    for a, b in zip(r["peak_bytes"], r["peak_simulated_bytes"], strict=True)
                )
            )
        if split_backward:
            print("per stage, inside the runtime: I + W (ZB-H1) / B (1F1B)")
        for sb in split_backward:
            print(
                f"  stage {sb['stage']}: I {sb['i_s'] * 1e3:.2f} + W {sb['w_s'] * 1e3:.2f} = "
                f"{(sb['i_s'] + sb['w_s']) * 1e3:.2f} ms vs B {sb['b_s'] * 1e3:.2f} ms: "
                f"{sb['i_plus_w_over_b']:.3f}"
            )
            print(f"  stage {sb['stage']}: F (ZB-H1) / F (1F1B) = {sb['f_over_f']:.3f}")
        if args.plot is not None and args.plot_schedule in runners:
            name = args.plot_schedule
            program = runners[name].program
            costs = mpmd.Costs.from_timeline(
                mpmd.Timeline.merge(timelines[name]),
                program.num_stages,
                latency=latency,
                bandwidth=bandwidth,
            )
            mpmd.viz.plot(
                [timelines[name][-1], program.simulate(costs)],
                args.plot,
                titles=[
                    f"{name}, measured (2 Gloo ranks)",
                    f"{name}, simulated with the costs measured in the same run",
                ],
            )
        if args.json is not None:
            args.json.write_text(
                json.dumps(
                    {"config": vars(args), "rows": rows, "split_backward": split_backward},
                    indent=1,
                    default=str,
                )
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    launch(main)
