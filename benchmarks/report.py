"""Gathers the JSON that benchmarks/run.sh's benchmarks wrote into one table
(markdown, printed and saved as table.md) and one results.json, with each
issue target marked met or missed.

    python benchmarks/report.py out/benchmarks
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _mark(ok: bool) -> str:
    return "met" if ok else "missed"


def schedule_tables(data: dict[str, Any]) -> list[str]:
    rows = {r["schedule"]: r for r in data["rows"]}
    cfg = data["config"]
    out = [
        f"### Schedules (GPT {cfg['layers']}x{cfg['dim']}, 2 Gloo ranks, {cfg['microbatches']} "
        f"microbatches of {cfg['microbatch_size']}x{cfg['seq_len']}, medians of {cfg['steps']} rounds)",
        "",
        "| schedule | stages | step | / 1F1B | measured / simulated | peak activations per rank "
        "| measured / simulated |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        peaks = ", ".join(f"{b / 2**20:.1f}" for b in r["peak_bytes"])
        ratios = ", ".join(f"{q:.3f}" for q in r["peak_measured_over_simulated"])
        out.append(
            f"| {r['schedule']} | {r['stages']} | {r['step_s'] * 1e3:.1f} ms | "
            f"{r['over_1f1b']:.3f} | {r['measured_over_simulated']:.3f} | {peaks} MiB | {ratios} |"
        )

    def step(name: str) -> float | None:
        return rows[name]["step_s"] if name in rows else None

    targets = [
        ("1F1B <= 1.03 x GPipe", "1F1B", "GPipe", 1.03),
        ("ZB-H1 <= 1F1B", "ZB-H1", "1F1B", 1.0),
        ("ZBV <= Interleaved1F1B", "ZBV", "Interleaved1F1B", 1.0),
        ("DualPipeV <= Interleaved1F1B", "DualPipeV", "Interleaved1F1B", 1.0),
        ("Interleaved1F1B <= 1.05 x 1F1B", "Interleaved1F1B", "1F1B", 1.05),
    ]
    out += ["", "| target | ratio | |", "| --- | ---: | --- |"]
    for label, a, b, limit in targets:
        sa, sb = step(a), step(b)
        if sa is not None and sb is not None:
            out.append(f"| {label} | {sa / sb:.3f} | {_mark(sa / sb <= limit)} |")
    worst = max(data["rows"], key=lambda r: r["measured_over_simulated"])
    out.append(
        f"| measured / simulated <= 1.05, every schedule | {worst['measured_over_simulated']:.3f} "
        f"({worst['schedule']}) | {_mark(worst['measured_over_simulated'] <= 1.05)} |"
    )
    memory = [
        (abs(q - 1), q, r["schedule"], rank)
        for r in data["rows"]
        for rank, q in enumerate(r["peak_measured_over_simulated"])
    ]
    _, q, name, rank = max(memory)
    out.append(
        f"| peak activation memory, measured / simulated within 10%, every schedule and rank "
        f"| {q:.3f} ({name}, rank {rank}) | {_mark(0.9 <= q <= 1.1)} |"
    )
    split = data.get("split_backward", [])
    if split:
        worst = max(split, key=lambda sb: sb["i_plus_w_over_b"])
        ratio = worst["i_plus_w_over_b"]
        out.append(
            f"| I + W <= 1.05 x B inside the runtime (ZB-H1 against 1F1B), every stage "
            f"| {ratio:.3f} (stage {worst['stage']}; F + I + W against F + B: "
            f"{worst['f_i_w_over_f_b']:.3f}) | {_mark(ratio <= 1.05)} |"
        )
    return out


def pipelining_table(parts: list[tuple[str, Any]]) -> list[str]:
    out = [
        "### torchmpmd vs torch.distributed.pipelining (same model, split, schedule)",
        "",
        "| model | schedule | torchmpmd | pipelining | torchmpmd / pipelining |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for label, rows in parts:
        for r in rows or []:
            out.append(
                f"| {label} | {r['schedule']} | {r['torchmpmd_s'] * 1e3:.1f} ms | "
                f"{r['pipelining_s'] * 1e3:.1f} ms | {r['torchmpmd_over_pipelining']:.2f} |"
            )
    return out


def balance_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "### Automatic balancing (2 stages, 1F1B): the chosen split against every split",
        "",
        "| model | balanced | even | best measured | balanced / best | balanced / even |",
        "| --- | --- | --- | --- | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['balanced']} | {r['even']} | {r['best']} | "
            f"{r['balanced_over_best']:.3f} ({_mark(r['balanced_over_best'] <= 1.05)}) | "
            f"{r['balanced_over_even']:.3f} ({_mark(r['balanced_over_even'] <= 1.0)}) |"
        )
    return out


def planner_tables(data: dict[str, Any]) -> list[str]:
    """Per model: the plan against every built-in with its own balanced
    split (and 1F1B's even split), measured in turns, with the targets."""
    cfg = data["config"]
    out = [
        f"### The planner against every built-in (2 Gloo ranks, {cfg['microbatches']} "
        f"microbatches of {cfg['microbatch_size']}, medians of {cfg['rounds']} rounds in turns)",
    ]
    for model in data["models"]:
        out += [
            "",
            f"{model['model']}: plan {model['plan']}, split_before={model['plan_split']}, "
            f"planned in {model['plan_s']:.1f} s; refined by measurement "
            f"{model.get('refined', '-')}, split_before={model.get('refined_split', '-')}, "
            f"in {model.get('refine_s', 0.0):.1f} s",
            "",
            "| row | stages | step | / fastest built-in | paired | measured / planned | "
            "measured / simulated (own costs) | split_before |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in model["rows"]:
            out.append(
                f"| {r['row']} | {r['stages']} | {r['step_s'] * 1e3:.1f} ms | "
                f"{r['over_fastest_builtin']:.3f} | {r.get('paired_over_fastest', float('nan')):.3f} | "
                f"{r['measured_over_predicted']:.3f} | "
                f"{r['measured_over_simulated']:.3f} | {', '.join(r['split_before'])} |"
            )
        rows = {r["row"]: r for r in model["rows"]}
        plan = rows["plan"]
        even = rows["1F1B even"]
        out += [
            "",
            "| target | ratio | |",
            "| --- | ---: | --- |",
            f"| plan <= 1.03 x the fastest built-in | {plan['over_fastest_builtin']:.3f} | "
            f"{_mark(plan['over_fastest_builtin'] <= 1.03)} |",
        ]
        if "plan + refine" in rows:
            refined = rows["plan + refine"]["over_fastest_builtin"]
            out.append(
                f"| plan + refine <= 1.03 x the fastest built-in | {refined:.3f} | "
                f"{_mark(refined <= 1.03)} |"
            )
        out += [
            f"| plan <= 1F1B with the even split | {plan['step_s'] / even['step_s']:.3f} | "
            f"{_mark(plan['step_s'] <= even['step_s'])} |",
        ]
        split = model["split_backward_runtime"]
        if split:
            out.append(
                "| I + W <= 1.02 x B inside the runtime (ZB-H1 against 1F1B), every stage | "
                + ", ".join(f"{x:.3f}" for x in split)
                + f" | {_mark(max(split) <= 1.02)} |"
            )
        mem = model["memory"]
        if "measured" in mem:
            q = max(mem["measured"]) / mem["limit"]
            out.append(
                f"| memory_limit = 0.6 x 1F1B's peak: measured peak <= 1.1 x the limit | "
                f"{q:.3f} ({mem['schedule']}, recompute {mem['recompute'] or '-'}) | "
                f"{_mark(q <= 1.1)} |"
            )
        else:
            out.append(f"| memory_limit = 0.6 x 1F1B's peak | {mem.get('error', '')} | missed |")
    return out


def expert_table(data: dict[str, Any]) -> list[str]:
    out = [
        f"### Expert parallelism against replicated experts ({data['model']}, 4 ranks)",
        "",
        "| layout | step (ms) | parameters per rank (MiB) |",
        "| --- | ---: | ---: |",
    ]
    for name, step in data["step_s"].items():
        mib = max(data["param_mib_per_rank"][name])
        out.append(f"| {name} | {step * 1e3:.1f} | {mib:.2f} |")
    out += [
        "",
        f"ep / replicated: step {data['ep_over_replicated']:.3f}, memory "
        f"{data['ep_memory_over_replicated']:.3f}; dispatch + combine "
        f"{data['dispatch_combine_share_of_ep_step']:.1%} of the ep step; measured / simulated "
        f"ep step {data['ep_measured_over_simulated']:.3f} "
        f"{_mark(abs(data['ep_measured_over_simulated'] - 1) <= 0.1)}",
    ]
    return out


def mpmd_vs_spmd_tables(data: dict[str, Any]) -> list[str]:
    """Per model: torch's DDP, FSDP2 and TP against torchmpmd's layouts and
    the plan's choice, measured in turns, with the targets."""
    cfg = data["config"]
    world = data["nproc"]
    out = [
        f"### torchmpmd against torch's SPMD ({world} Gloo ranks, the same global batch, "
        f"medians of {cfg['rounds']} rounds in turns)",
    ]
    for model in data["models"]:
        s = model["summary"]
        out += [
            "",
            f"{model['model']} ({model['about']}; {model['parameters'] / 1e6:.2f} M parameters): "
            f"plan {model['plan']}, planned in {s['plan_s']:.1f} s",
            "",
            "| configuration | step | predicted | predicted / measured | before / tasks / after "
            "(ms) | / fastest | roles |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in sorted(model["rows"], key=lambda r: r["step_s"]):
            pred = r["predicted_s"]
            known = pred == pred  # not NaN: a torchmpmd row
            phases = " / ".join(f"{t * 1e3:.0f}" for t in r.get("phases_s", [])) or "-"
            out.append(
                f"| {r['label']} | {r['step_s'] * 1e3:.1f} ms | "
                + (f"{pred * 1e3:.1f} ms | {pred / r['step_s']:.3f}" if known else "- | -")
                + f" | {phases} | {r['over_fastest']:.3f} | {', '.join(r['roles'])} |"
            )
        for what, err in model.get("build_failures", {}).items():
            out.append(f"| {what} | build failed: {err} | | | | | |")
        out += [
            "",
            "| target | value | |",
            "| --- | ---: | --- |",
            f"| best pipeline / best SPMD ({s['best_pipeline']} / {s['best_spmd']}) | "
            f"{s['best_pipeline_over_best_spmd']:.3f} | |",
            f"| plan <= 1.03 x the fastest measured ({s['fastest']}) | "
            f"{s['plan_over_fastest']:.3f} | {_mark(s['plan_over_fastest'] <= 1.03)} |",
            f"| Spearman, predicted vs measured, top five >= 0.8 | {s['spearman_top5']:.3f} | "
            f"{_mark(s['spearman_top5'] >= 0.8)} |",
            f"| largest prediction error, top five, <= 10% | {s['max_error_top5']:.1%} | "
            f"{_mark(s['max_error_top5'] <= 0.1)} |",
            f"| planning < 60 s | {s['plan_s']:.1f} s | {_mark(s['plan_s'] < 60)} |",
        ]
        mem = model.get("memory")
        if mem and "worst_over_limit" in mem:
            q = mem["worst_over_limit"]
            out.append(
                f"| device_memory = {mem['factor']} x the unlimited choice's "
                f"({mem['limit'] / 2**20:.1f} MiB, plan {mem['layout']} {mem['schedule']}): "
                f"measured activations + counted state <= the limit | {q:.3f} | {_mark(q <= 1)} |"
            )
        elif mem:
            out.append(f"| device_memory | {mem.get('error', '')} | missed |")
    return out


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "out/benchmarks")
    schedules = _load(out_dir / "schedules.json")
    pipelining = _load(out_dir / "pipelining.json")
    pipelining_gpt = _load(out_dir / "pipelining_gpt.json")
    balance = _load(out_dir / "balance.json")
    planner = _load(out_dir / "planner.json")
    expert = _load(out_dir / "expert_parallel.json")
    versus = [_load(out_dir / f"mpmd_vs_spmd_{n}.json") for n in (2, 4)]
    split = out_dir / "split_backward.txt"
    lines = [
        f"Machine: {platform.processor() or platform.machine()}, "
        f"{__import__('os').cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {__import__('torch').__version__}",
        "",
    ]
    if schedules:
        lines += [*schedule_tables(schedules), ""]
    if pipelining or pipelining_gpt:
        lines += [*pipelining_table([("GPT 8x128", pipelining), ("GPT 4x192", pipelining_gpt)]), ""]
    if balance:
        lines += [*balance_table(balance), ""]
    if planner:
        lines += [*planner_tables(planner), ""]
    if expert:
        lines += [*expert_table(expert), ""]
    for data in versus:
        if data:
            lines += [*mpmd_vs_spmd_tables(data), ""]
    if split.exists():
        lines += ["### I + W against B (one split stage, isolated)", "", "```"]
        lines += [*split.read_text().strip().splitlines(), "```", ""]
    text = "\n".join(lines)
    (out_dir / "table.md").write_text(text)
    (out_dir / "results.json").write_text(
        json.dumps(
            {
                "schedules": schedules,
                "pipelining": pipelining,
                "pipelining_gpt": pipelining_gpt,
                "balance": balance,
                "planner": planner,
                "expert_parallel": expert,
                "mpmd_vs_spmd": [d for d in versus if d],
            },
            indent=1,
        )
    )
    print(text)


if __name__ == "__main__":
    main()
