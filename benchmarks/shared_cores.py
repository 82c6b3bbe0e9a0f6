"""Ranks sharing cores, predicted two ways against the same measured steps.

More CPU ranks than cores (4 Gloo ranks on 2 cores): `mpmd.plan` scales its
profile by the slowdown of every rank computing at once (`contention`) and,
since the ranks share the cores, predicts each candidate's chosen split with
each task charged by the ranks computing beside it (`Costs.shared_cores`: a
pipeline's bubbles run faster). This benchmark plans pp = 4 of one of
`mpmd_vs_spmd.py`'s models, records each chosen split's prediction with the
shared cores and with every rank at work throughout (the same profile, the
same split), steps the best six schedules in turns and prints both
predictions against the measured medians, their largest error and their
Spearman rank correlation.

    python benchmarks/shared_cores.py --model pipeline-wins --rounds 7
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from launch import launch
from mpmd_vs_spmd import CASES, case_data, lm_loss, plan_case, spearman

import torchmpmd as mpmd
import torchmpmd.planner.weigh as weigh_module


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="pipeline-wins", choices=[c.name for c in CASES])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--candidates", type=int, default=6)
    p.add_argument("--json", type=Path)
    return p.parse_args()


def _recording() -> dict[tuple[Any, ...], tuple[float, float]]:
    """Wraps the planner's split search so that each chosen split is also
    predicted without the shared cores: {(schedule, stages, split): (shared,
    every rank at work)}."""
    both: dict[tuple[Any, ...], tuple[float, float]] = {}
    search = weigh_module.search  # type: ignore[attr-defined]

    def recorded(prof: Any, stages: int, **kw: Any) -> Any:
        found = search(prof, stages, **kw)
        if kw.get("sharing") is not None:
            busy = search(prof, stages, **{**kw, "sharing": None})
            key = (repr(kw["schedule"]), stages, tuple(found.split_before))
            both[key] = (found.predicted_step, busy.predicted_step)
        return found

    weigh_module.search = recorded  # type: ignore[attr-defined,assignment]
    return both


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    case = next(c for c in CASES if c.name == args.model)
    both = _recording()
    reference, x, y = case_data(case)
    plan = plan_case(case, reference, x, y, world, layouts=[mpmd.Layout(pp=world)])
    box = [both]
    dist.broadcast_object_list(box, src=0)  # rank 0 searched
    both = box[0]
    mine = plan.as_candidate()
    ranked = sorted(
        [mine, *(c for c in plan.alternatives if c.schedule is not None and not c.recompute)],
        key=lambda c: c.predicted_step_time,
    )
    chosen, seen = [], set()
    for c in ranked:
        if (c.name, c.num_stages) not in seen:
            seen.add((c.name, c.num_stages))
            chosen.append(c)
    chosen = chosen[: args.candidates]
    runners = [
        mpmd.build(
            plan if c is mine else plan.choose(c), copy.deepcopy(reference), x, loss_fn=lm_loss
        )
        for c in chosen
    ]
    times: list[list[float]] = [[] for _ in chosen]
    for r in range(args.rounds + 1):  # the first round warms up
        n = len(chosen)
        for i in [*range(r % n, n), *range(r % n)]:
            dist.barrier()
            start = time.perf_counter()
            runners[i].step(x, target=y)
            slowest = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            for p in runners[i].parameters():
                p.grad = None
            if r:
                times[i].append(float(slowest))
    if rank == 0:
        rows_out: list[dict[str, Any]] = []
        print(
            f"== {case.name} ({case.about}), pp {world} on {world} Gloo ranks, medians of "
            f"{args.rounds} rounds in turns"
        )
        for note in plan.notes:
            if "slower together" in note or "share" in note:
                print(f"   note: {note}")
        print(f"   {'schedule':42s} {'measured':>9s} {'shared':>16s} {'every rank busy':>16s}")
        for c, t in zip(chosen, times, strict=True):
            shared, busy = both[(repr(c.schedule), c.num_stages, tuple(c.split_before))]
            median = statistics.median(t)
            rows_out.append(
                {"schedule": c.name, "measured": median, "shared": shared, "busy": busy}
            )
            print(
                f"   {c.name:42s} {median * 1e3:7.1f}ms"
                f" {shared * 1e3:7.1f}ms ({shared / median:.3f})"
                f" {busy * 1e3:7.1f}ms ({busy / median:.3f})"
            )
        measured: list[float] = [r["measured"] for r in rows_out]
        for label in ("shared", "busy"):
            predicted: list[float] = [r[label] for r in rows_out]
            error = max(abs(p / m - 1) for p, m in zip(predicted, measured, strict=True))
            print(
                f"   {label}: largest error {error:.1%}, Spearman {spearman(predicted, measured):.2f}"
            )
        if args.json is not None:
            args.json.write_text(json.dumps({"model": case.name, "rows": rows_out}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    launch(main, nproc=4)
