"""`mpmd.plan` against every built-in schedule, measured: four models on 2
Gloo ranks (an LM with a heavy head, an encoder-decoder, a U-Net and a
pre-norm transformer of `nn.TransformerEncoderLayer` blocks).

    python benchmarks/planner.py            # launches 2 ranks itself
    python benchmarks/planner.py --models pre-norm --rounds 9 --json out.json

For each model, rank 0 plans (every rank gets the plan) and keeps, for each
built-in schedule, the split the planner found best for it: those are the
built-ins "with their own balanced split". Every built-in, 1F1B with the
even split, and the plan then take turns, one step each per round, each
round starting one row later; a row's step is its median over `--rounds`
rounds after `--warmup`. The plan refined by measurement (`mpmd.refine`,
3 rounds of its close candidates) is a row too. The plan is one of the
built-ins: the two rows
run the same configuration in two runners, and their gap is the
measurement's own spread. Each row also
gives its step over the fastest built-in's two ways: the ratio of medians,
and "paired", the median over rounds of the two steps' ratio in the same
round (host drifts slower than a round cancel); its measured step over
the planner's prediction, and over the
simulator given the task costs measured in those same steps; the I + W of
ZB-H1 against 1F1B's B per stage on the same split, inside the runtime; and the planner's own
I + W / B, profiled. Then the model is planned again with `memory_limit`
= 0.6 x 1F1B's measured peak activation bytes, and the plan's measured peak
is read from the allocator (`measure_memory=True`); that plan is given the
global batch (`batch_size`), so it may take smaller microbatches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import repo_paths  # noqa: F401
import torch
import torch.distributed as dist
from launch import launch, measure_link
from models import Case, cases, prenorm_case

import torchmpmd as mpmd

S = mpmd.schedules
NAMES = {
    "OneFOneB": "1F1B",
    "GPipe": "GPipe",
    "Eager1F1B": "Eager1F1B",
    "ZeroBubbleH1": "ZB-H1",
    "Interleaved1F1B": "Interleaved1F1B",
    "ZBV": "ZBV",
    "DualPipeV": "DualPipeV",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--models", default="", help="comma-separated prefixes; default: all")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def _stage_means(timelines: list[mpmd.Timeline]) -> dict[str, float]:
    sums: dict[str, list[float]] = defaultdict(list)
    for tl in timelines:
        for e in tl.tasks:
            if e.is_fused:  # F and B as one: not a time of its first part's kind
                continue
            sums[f"{e.kind}{e.stage}"].append(e.duration)
    return {k: statistics.fmean(v) for k, v in sums.items()}


def _runner(
    case: Case,
    example: tuple[torch.Tensor, ...],
    schedule: mpmd.Schedule,
    split: list[str],
    **kw: Any,
) -> mpmd.PipelineRunner:
    pipe = mpmd.trace(case.model, example, split_before=split)
    return mpmd.PipelineRunner(pipe, schedule, loss_fn=case.loss, options=mpmd.RunnerOptions(**kw))


def _even(units: tuple[str, ...]) -> list[str]:
    """1F1B's even split on 2 stages: equal numbers of units (the first stage
    gets the odd one), as `mpmd.balance` counts them."""
    return [units[(len(units) + 1) // 2]]


def run_case(
    case: Case, args: argparse.Namespace, rank: int, link: tuple[float, float]
) -> dict[str, Any]:
    m, b = args.microbatches, args.microbatch_size
    example = tuple(t[:b] for t in case.batch)
    target = case.target[:b]
    start = time.perf_counter()
    plan = mpmd.plan(
        case.model,
        example,
        2,
        num_microbatches=m,
        loss_fn=case.loss,
        example_target=target,
        latency=link[0],
        bandwidth=link[1],
    )
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    refined = mpmd.refine(
        plan, case.model, *case.batch, target=case.target, loss_fn=case.loss, rounds=3
    )
    refine_s = time.perf_counter() - start
    found = plan.balance
    assert found is not None
    profile = found.profile
    # Each built-in with its own best split: the planner's candidate for it.
    rows: dict[str, tuple[mpmd.Schedule, list[str], float]] = {}
    for c in plan.alternatives:
        if c.schedule is not None and not c.recompute:
            rows.setdefault(
                NAMES.get(type(c.schedule).__name__, c.name),
                (c.schedule, c.split_before, c.predicted_step_time),
            )
    plan_name = NAMES.get(type(plan.schedule).__name__, repr(plan.schedule))
    rows.setdefault(plan_name, (plan.schedule, plan.split_before, plan.predicted_step_time))
    units = profile.units
    rows["1F1B even"] = (S.OneFOneB(m), _even(units), float("nan"))
    if "ZB-H1" in rows and "1F1B" in rows and rows["ZB-H1"][1] != rows["1F1B"][1]:
        # I + W against B on the same stages: 1F1B on ZB-H1's split too.
        rows["1F1B @ ZB-H1 split"] = (S.OneFOneB(m), rows["ZB-H1"][1], float("nan"))
    rows["plan"] = (plan.schedule, plan.split_before, plan.predicted_step_time)
    rows["plan + refine"] = (refined.schedule, refined.split_before, refined.predicted_step_time)
    recompute = {"plan": plan.recompute, "plan + refine": refined.recompute}
    names = list(rows)
    runners = {
        n: _runner(case, example, s, split, recompute=recompute.get(n) or False)
        for n, (s, split, _) in rows.items()
    }
    times: dict[str, list[float]] = defaultdict(list)
    timelines: dict[str, list[mpmd.Timeline]] = defaultdict(list)
    for r in range(args.warmup + args.rounds):
        # Each round starts one row later: no row always follows the same one.
        for n in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            runners[n].step(*case.batch, target=case.target)
            elapsed = time.perf_counter() - t0
            for p in runners[n].parameters():
                p.grad = None
            if r >= args.warmup:
                times[n].append(elapsed)
                timelines[n].append(runners[n].gather_timeline())
    box: list[Any] = [dict(times)]
    dist.broadcast_object_list(box, src=0)
    steps: dict[str, list[float]] = box[0]
    medians = {n: statistics.median(t) for n, t in steps.items()}
    out_rows = []
    for n in names:
        program = runners[n].program
        costs = mpmd.Costs.from_timeline(
            mpmd.Timeline.merge(timelines[n]),
            program.num_stages,
            latency=link[0],
            bandwidth=link[1],
        )
        span = statistics.median(tl.step_time for tl in timelines[n])
        out_rows.append(
            {
                "row": n,
                "schedule": repr(rows[n][0]),
                "stages": program.num_stages,
                "split_before": rows[n][1],
                "step_s": medians[n],
                "steps_s": steps[n],
                "span_s": span,
                "predicted_s": rows[n][2],
                "simulated_s": program.simulate(costs).step_time,
                "task_means_s": _stage_means(timelines[n]),
            }
        )
    builtins = [r for r in out_rows if r["row"] in NAMES.values()]
    fastest = min(builtins, key=lambda r: r["step_s"])
    for r in out_rows:
        r["over_fastest_builtin"] = r["step_s"] / fastest["step_s"]
        # Paired: the median over rounds of this row's step over the fastest
        # built-in's in the same round (drifts slower than a round cancel).
        r["paired_over_fastest"] = statistics.median(
            a / b for a, b in zip(r["steps_s"], fastest["steps_s"], strict=True)
        )
        r["measured_over_predicted"] = r["span_s"] / r["predicted_s"]
        r["measured_over_simulated"] = r["span_s"] / r["simulated_s"]
    split = []
    means = {r["row"]: r["task_means_s"] for r in out_rows}
    same = "1F1B @ ZB-H1 split" if "1F1B @ ZB-H1 split" in means else "1F1B"
    if "ZB-H1" in means and same in means:
        for s in range(2):
            zb, one = means["ZB-H1"], means[same]
            if f"W{s}" in zb and f"B{s}" in one:
                split.append((zb.get(f"I{s}", 0.0) + zb[f"W{s}"]) / one[f"B{s}"])
    profiled = []
    if profile.input_grad is not None and profile.weight_grad is not None:
        total_b = sum(profile.backward)
        profiled.append((sum(profile.input_grad) + sum(profile.weight_grad)) / total_b)

    # Memory: 0.6 x 1F1B's measured peak as the limit.
    one = runners["1F1B"]
    sched, split_1f1b, _ = rows["1F1B"]
    measuring = _runner(case, example, sched, split_1f1b, measure_memory=True)
    for _ in range(2):
        measuring.step(*case.batch, target=case.target)
    peak_1f1b = max(measuring.gather_timeline().peak_activation_bytes)
    limit = 0.6 * peak_1f1b
    memory: dict[str, Any] = {"peak_1f1b": peak_1f1b, "limit": limit}
    try:
        # The global batch is given, not the microbatch count: under a
        # memory limit the planner may take smaller microbatches.
        capped = mpmd.plan(
            case.model,
            example,
            2,
            batch_size=m * b,
            memory_limit=limit,
            loss_fn=case.loss,
            example_target=target,
            latency=link[0],
            bandwidth=link[1],
        )
    except ValueError as err:
        memory["error"] = str(err)
    else:
        rows_capped = m * b // capped.num_microbatches
        runner = _runner(
            case,
            tuple(t[:rows_capped] for t in case.batch),
            capped.schedule,
            capped.split_before,
            measure_memory=True,
            recompute=capped.recompute,
        )
        for _ in range(2):
            runner.step(*case.batch, target=case.target)
        memory.update(
            schedule=repr(capped.schedule),
            microbatches=capped.num_microbatches,
            recompute=capped.recompute,
            predicted=capped.predicted_peak_bytes,
            measured=runner.gather_timeline().peak_activation_bytes,
        )
    del one
    return {
        "model": case.name,
        "plan": repr(plan.schedule),
        "plan_split": plan.split_before,
        "plan_s": plan_s,
        "refined": repr(refined.schedule),
        "refined_split": refined.split_before,
        "refine_s": refine_s,
        "refine_table": repr(refined),
        "rows": out_rows,
        "split_backward_runtime": split,
        "split_backward_profiled": profiled,
        "memory": memory,
        "plan_table": repr(plan),
    }


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n{r['model']}: plan {r['plan']} split_before={r['plan_split']} "
        f"(planned in {r['plan_s']:.1f} s); refined {r['refined']} "
        f"split_before={r['refined_split']} (in {r['refine_s']:.1f} s); "
        f"{args.microbatches} microbatches of "
        f"{args.microbatch_size}, medians of {args.rounds} rounds taken in turns"
    )
    print(
        f"  {'row':<20}{'stages':>7}{'step':>10}{'/fastest':>9}{'paired':>8}{'meas/pred':>10}"
        f"{'meas/sim':>9}  split_before"
    )
    for row in r["rows"]:
        print(
            f"  {row['row']:<20}{row['stages']:>7}{row['step_s'] * 1e3:8.1f}ms"
            f"{row['over_fastest_builtin']:9.3f}{row['paired_over_fastest']:8.3f}"
            f"{row['measured_over_predicted']:10.3f}"
            f"{row['measured_over_simulated']:9.3f}  {row['split_before']}"
        )
    if r["split_backward_runtime"]:
        print(
            "  I + W (ZB-H1) / B (1F1B) per stage, runtime: "
            + ", ".join(f"{x:.3f}" for x in r["split_backward_runtime"])
            + "; profiled by the planner (whole model): "
            + ", ".join(f"{x:.3f}" for x in r["split_backward_profiled"])
        )
    mem = r["memory"]
    if "error" in mem:
        print(f"  memory_limit {mem['limit'] / 2**20:.1f} MiB: {mem['error']}")
    else:
        peak = max(mem["measured"])
        print(
            f"  memory_limit = 0.6 x 1F1B's peak ({mem['peak_1f1b'] / 2**20:.1f} MiB) = "
            f"{mem['limit'] / 2**20:.1f} MiB: plan {mem['schedule']} recompute {mem['recompute']}, "
            f"predicted peak {max(mem['predicted']) / 2**20:.2f} MiB, "
            f"measured peak {peak / 2**20:.1f} MiB = {peak / mem['limit']:.3f} x the limit"
        )


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    link = measure_link(rank)
    results = []
    all_cases = [
        *cases(args.microbatches, args.microbatch_size),
        prenorm_case(args.microbatches, args.microbatch_size),
    ]
    for case in all_cases:
        if args.models and not any(case.name.startswith(p) for p in args.models.split(",")):
            continue
        result = run_case(case, args, rank, link)
        if rank == 0:
            report(result, args)
            results.append(result)
    if rank == 0 and args.json is not None:
        args.json.write_text(
            json.dumps({"config": vars(args), "models": results}, indent=1, default=str)
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    launch(main)
