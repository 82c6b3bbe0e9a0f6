"""`mpmd.balance` against the even split and against every split: three uneven
models, 2 stages on 2 Gloo ranks, real step times.

    python benchmarks/balance.py            # launches 2 ranks itself
    torchrun --standalone --nproc_per_node=2 benchmarks/balance.py

For each model, `mpmd.balance` profiles it (on rank 0, which broadcasts the
result) and picks a split twice: with its defaults ("defaults": no loss, free
transfers) and told what the runner will do ("balanced": the loss function,
and the Gloo link's bandwidth and latency, measured here by ping-pong). Then
every split at a unit boundary (the units balance itself considers, so the
balanced and even splits are among them) is traced, run and timed. Splits take
turns, one step each per round, so all of them see the same machine conditions
(which drift on a shared machine); a split's time is the median of its
`--rounds` steps after `--warmup` rounds. The fastest of many noisy medians is
biased low (the winner's curse), so the balanced, even, default and fastest
splits then run again head to head for `--confirm-rounds` rounds, and the
ratios come from that second run. Each rank runs one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import repo_paths
import torch
import torch.distributed as dist
from launch import idle_time, launch, measure_link
from models import Case, cases

import torchmpmd as mpmd
from torchmpmd.planner import simulate

ROOT = repo_paths.ROOT

# --------------------------------------------------------------------------- measuring


def predicted(found: mpmd.Balance, split: list[str], link: tuple[float, float]) -> float:
    """The simulator's step for one split of the profile balance measured."""
    timeline = simulate(
        found.profile,
        split,
        schedule=found.schedule,
        num_ranks=found.num_ranks,
        latency=link[0],
        bandwidth=link[1],
    )
    return timeline.step_time


def diagnose(
    runner: mpmd.PipelineRunner, timelines: list[mpmd.Timeline], link: tuple[float, float]
) -> dict[str, Any]:
    """A split's measured steps against the simulator given the costs measured
    in those same steps: what the split's profile cannot explain (the
    executor span over that simulation, and idle time per rank)."""
    program = runner.program
    costs = mpmd.Costs.from_timeline(
        mpmd.Timeline.merge(timelines), program.num_stages, latency=link[0], bandwidth=link[1]
    )
    simulated = program.simulate(costs)
    spans = sorted(tl.step_time for tl in timelines)
    ranks = range(program.num_ranks)
    return {
        "span_s": statistics.median(spans),
        "span_quartiles_s": (spans[len(spans) // 4], spans[3 * len(spans) // 4]),
        "simulated_s": simulated.step_time,
        "idle_s": [statistics.median(idle_time(tl, r) for tl in timelines) for r in ranks],
        "idle_simulated_s": [idle_time(simulated, r) for r in ranks],
    }


def run_case(
    case: Case, args: argparse.Namespace, rank: int, link: tuple[float, float]
) -> dict[str, Any]:
    m = args.microbatches
    example = tuple(t[: args.microbatch_size] for t in case.batch)
    schedule = mpmd.schedules.OneFOneB(m)
    start = time.perf_counter()
    found = mpmd.balance(
        case.model,
        example,
        2,
        schedule=schedule,
        num_ranks=2,
        loss_fn=case.loss,
        example_target=case.target[: args.microbatch_size],
        latency=link[0],
        bandwidth=link[1],
    )
    balance_s = time.perf_counter() - start
    defaults = mpmd.balance(case.model, example, 2, schedule=schedule, num_ranks=2)
    splits = [[u] for u in found.profile.units[1:]]
    runners = []
    for split in splits:
        pipe = mpmd.trace(case.model, example, split_before=split)
        runners.append(mpmd.PipelineRunner(pipe, mpmd.schedules.OneFOneB(m), loss_fn=case.loss))

    def timed(
        indices: list[int], rounds: int, timelines: list[list[mpmd.Timeline]] | None = None
    ) -> list[float]:
        """Median step of each split in `indices`, taking turns (and, given
        `timelines`, each step's measured timeline of every rank)."""
        times: list[list[float]] = [[] for _ in indices]
        for r in range(args.warmup + rounds):
            for k, i in enumerate(indices):
                dist.barrier()
                t0 = time.perf_counter()
                runners[i].step(*case.batch, target=case.target)
                elapsed = time.perf_counter() - t0
                if r >= args.warmup:
                    times[k].append(elapsed)
                    if timelines is not None:
                        timelines[k].append(runners[i].gather_timeline())
                for p in case.model.parameters():
                    p.grad = None
        # Rank 0's clock decides: both ranks end a step together (the loss crosses).
        box: list[Any] = [[statistics.median(t) for t in times]]
        dist.broadcast_object_list(box, src=0)
        medians: list[float] = box[0]
        return medians

    def unpipelined() -> None:
        # The same step on one rank: gradient accumulation over the microbatches.
        for *mb, y in zip(*(t.chunk(m) for t in (*case.batch, case.target)), strict=True):
            (case.loss(case.model(*mb), y) / m).backward()

    serial: list[float] = []
    if rank == 0:
        for r in range(args.warmup + args.rounds):
            t0 = time.perf_counter()
            unpipelined()
            if r >= args.warmup:
                serial.append(time.perf_counter() - t0)
            for p in case.model.parameters():
                p.grad = None
    measured = timed(list(range(len(splits))), args.rounds)
    serial_s = statistics.median(serial) if serial else 0.0
    names = [s[0] for s in splits]
    fastest = min(range(len(names)), key=lambda i: measured[i])
    picks = {
        "balanced": names.index(found.split_before[0]),
        "defaults": names.index(defaults.split_before[0]),
        "even": names.index(found.even_split_before[0]),
        "best": fastest,
    }
    again = sorted(set(picks.values()))
    measured_timelines: list[list[mpmd.Timeline]] = [[] for _ in again]
    confirmed = dict(zip(again, timed(again, args.confirm_rounds, measured_timelines), strict=True))
    return {
        "picks": picks,
        "confirmed": confirmed,
        "diagnosis": {
            i: diagnose(runners[i], tls, link)
            for i, tls in zip(again, measured_timelines, strict=True)
        },
        "found": found,
        "defaults": defaults,
        "balance_s": balance_s,
        "serial": serial_s,
        "names": names,
        "measured": measured,
        "predicted": [predicted(found, s, link) for s in splits],
        "rank": rank,
    }


def report(case: Case, r: dict[str, Any], args: argparse.Namespace) -> tuple[Any, ...]:
    names, measured, pred = r["names"], r["measured"], r["predicted"]
    picks, confirmed = r["picks"], r["confirmed"]
    print(
        f"\n{case.name}: {len(names)} cuts, balance took {r['balance_s']:.1f} s; "
        f"unpipelined on one rank: {r['serial'] * 1e3:.1f} ms"
    )
    print(f"  {'split_before':<16}{'measured':>10}{'predicted':>11}")
    for i, name in enumerate(names):
        marks = "".join(f" <- {w}" for w, j in picks.items() if i == j)
        print(f"  {name:<16}{measured[i] * 1e3:8.1f}ms{pred[i] * 1e3:9.1f}ms{marks}")
    print(
        f"  head to head ({args.confirm_rounds} rounds): "
        + ", ".join(f"{names[i]} {t * 1e3:.1f}ms" for i, t in confirmed.items())
    )
    print("  the same steps against the simulator given their own measured costs:")
    for i, d in r["diagnosis"].items():
        q1, q3 = d["span_quartiles_s"]
        print(
            f"    {names[i]:<14} span {d['span_s'] * 1e3:.1f} ms (quartiles {q1 * 1e3:.1f}-"
            f"{q3 * 1e3:.1f}), simulated {d['simulated_s'] * 1e3:.1f} ms: "
            f"{d['span_s'] / d['simulated_s']:.3f}; idle per rank "
            + ", ".join(
                f"{a * 1e3:.1f} ({b * 1e3:.1f})"
                for a, b in zip(d["idle_s"], d["idle_simulated_s"], strict=True)
            )
            + " ms, measured (simulated)"
        )
    # The best of the head-to-head run (the balanced split may win it).
    best = min(confirmed, key=lambda i: confirmed[i])
    return (
        case.name,
        *((names[picks[w]], confirmed[picks[w]]) for w in ("balanced", "defaults", "even")),
        (names[best], confirmed[best]),
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--confirm-rounds", type=int, default=30)
    p.add_argument("--models", default="", help="comma-separated prefixes; default: all")
    p.add_argument("--json", type=Path, default=None, help="also write the table here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    rows = []
    link = measure_link(rank)
    if rank == 0:
        print(f"Gloo link: {link[0] * 1e6:.0f} us latency, {link[1] / 1e9:.2f} GB/s")
    for case in cases(args.microbatches, args.microbatch_size):
        if args.models and not any(case.name.startswith(p) for p in args.models.split(",")):
            continue
        result = run_case(case, args, rank, link)
        if rank == 0:
            rows.append(report(case, result, args))
    if rank == 0:
        print(
            f"\n2 stages on 2 Gloo ranks (1 thread each), OneFOneB, {args.microbatches} "
            f"microbatches of {args.microbatch_size}; every split: median of {args.rounds} steps, "
            f"taken in turns; the ratios: the named splits again, {args.confirm_rounds} rounds"
        )
        header = (
            f"{'model':<17}{'balanced':<17}{'defaults':<17}{'even':<17}{'best':<17}"
            f"{'bal/best':>9}{'bal/even':>9}{'def/best':>9}{'def/even':>9}"
        )
        print(header)
        print("-" * len(header))
        for name, bal, default, even, best in rows:
            cells = "".join(f"{n:<10}{t * 1e3:5.0f}ms" + " " for n, t in (bal, default, even, best))
            ratios = (
                bal[1] / best[1],
                bal[1] / even[1],
                default[1] / best[1],
                default[1] / even[1],
            )
            print(f"{name:<17}{cells}" + "".join(f"{x:9.3f}" for x in ratios))
        if args.json is not None:
            args.json.write_text(
                json.dumps(
                    [
                        {
                            "model": name,
                            "balanced": bal[0],
                            "balanced_s": bal[1],
                            "even": even[0],
                            "even_s": even[1],
                            "best": best[0],
                            "best_s": best[1],
                            "balanced_over_best": bal[1] / best[1],
                            "balanced_over_even": bal[1] / even[1],
                        }
                        for name, bal, _default, even, best in rows
                    ],
                    indent=1,
                )
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    launch(main)
