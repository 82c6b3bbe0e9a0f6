"""Split backward inside the runtime, without a second rank: both stages of
the bundled GPT on one rank, the last stage's backward run as B, as I then W
back to back, or as I with W one microbatch late (ZB-H1's order on its last
rank), timed from the runtime's own timeline, side by side in one run.

    python benchmarks/split_backward_order.py
    python benchmarks/split_backward_order.py --keep-freed-memory off

With `--keep-freed-memory off` the script does not call `mpmd.tune_cpu()`,
so glibc's adaptive malloc thresholds stay: I + W then pays page faults that B does not
(docs/architecture.md, "Split backward inside the runtime").
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import repo_paths  # noqa: F401  (examples/ on the import path)
import torch
from gpt import GPT, GPTConfig, lm_loss, split_points
from schedules import stage_means

import torchmpmd as mpmd
from torchmpmd.runtime import LocalWorld

T = mpmd.Task


class LastStageOrder(mpmd.Schedule):
    """Two stages on one rank, microbatch after microbatch; the last stage's
    backward as `kind`: "B", "I W" (back to back) or "I, W late"."""

    def __init__(self, num_microbatches: int, kind: str) -> None:
        super().__init__(num_microbatches)
        self.kind = kind

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        return [0] * num_stages

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[T]]:
        order: list[T] = []
        for k in range(num_microbatches):
            order += [T("F", 0, k), T("F", 1, k)]
            if self.kind == "B":
                order.append(T("B", 1, k))
            elif self.kind == "I W":
                order += [T("I", 1, k), T("W", 1, k)]
            else:
                order.append(T("I", 1, k))
                if k:
                    order.append(T("W", 1, k - 1))
            order.append(T("B", 0, k))
        if self.kind == "I, W late":
            order.append(T("W", 1, num_microbatches - 1))
        return [order]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--keep-freed-memory", choices=("on", "off"), default="on")
    args = p.parse_args()
    if args.keep_freed_memory == "on":
        mpmd.tune_cpu(gloo_sched_batch=False)  # one rank: no Gloo threads to tune
    torch.set_num_threads(1)
    cfg = GPTConfig(seq_len=128, dim=192, layers=4)
    m, b = args.microbatches, args.microbatch_size
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (m * b, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (m * b, cfg.seq_len), generator=g)
    example = torch.zeros(b, cfg.seq_len, dtype=torch.long)
    kinds = ["B", "I W", "I, W late"]
    runners = {}
    for kind in kinds:
        torch.manual_seed(0)
        pipe = mpmd.trace(GPT(cfg), (example,), split_before=split_points(cfg, 2))
        runners[kind] = mpmd.PipelineRunner(
            pipe,
            LastStageOrder(m, kind),
            transport=LocalWorld(1).transport(0),
            loss_fn=lm_loss,
        )
    means: dict[tuple[str, str], list[float]] = defaultdict(list)
    for i in range(3 + args.steps):
        for kind, runner in runners.items():  # in turns: the same conditions
            runner.step(x, target=y)
            for param in runner.parameters():
                param.grad = None
            if i < 3:
                continue
            for (stage, task), mean in stage_means([runner.gather_timeline()]).items():
                if stage == 1:
                    means[(kind, task)].append(mean)
    med = {k: statistics.median(v) * 1e3 for k, v in means.items()}
    b_ms = med[("B", "B")]
    print(
        f"GPT 4x192, last stage on one rank, {m} microbatches of {b}x{cfg.seq_len}; "
        f"medians of {args.steps} steps; keep_freed_memory {args.keep_freed_memory}"
    )
    print(f"B               {b_ms:7.2f} ms")
    for kind in kinds[1:]:
        i_ms, w_ms = med[(kind, "I")], med[(kind, "W")]
        print(
            f"{kind:10s} I {i_ms:6.2f} + W {w_ms:6.2f} = {i_ms + w_ms:6.2f} ms: "
            f"{(i_ms + w_ms) / b_ms:.3f} B"
        )


if __name__ == "__main__":
    main()
