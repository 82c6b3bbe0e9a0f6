"""The seed's claim, measured: the same model, global batch and ranks under
torch's DDP, FSDP2 and tensor parallelism and under torchmpmd's pipeline
layouts and `mpmd.plan`'s choice, stepped in turns on Gloo (CPU).

    python benchmarks/mpmd_vs_spmd.py --nproc 2          # launches the ranks itself
    python benchmarks/mpmd_vs_spmd.py --nproc 4 --models pipeline --rounds 9 --json out.json

Three models written as torchtitan writes Llama 3 (`tok_embeddings`,
`layers` a ModuleDict of blocks with `attention.wq/wk/wv/wo` and a SwiGLU
`feed_forward.w1/w2/w3`, RMSNorm, rotary embeddings, `output`), one tp plan
each (attention and MLP colwise / rowwise) given to torch's
`parallelize_module` and to torchmpmd alike:

- "spmd-wins": small and wide in tokens (few parameters, many tokens);
- "pipeline-wins": many parameters per token (DDP's gradient all-reduce
  over Gloo outweighs the compute);
- "skip": a U-Net-like transformer, each block of the first half adding
  its output to the input of its mirror in the second half (long skips
  that cross every pipeline boundary).

Per model every rank plans (`mpmd.plan` with `batch_size`: every layout of
the ranks, pp = 1 included; the links calibrated on the job's group, rank 0
profiles). Measured in turns, each round starting one configuration later,
medians over `--rounds` rounds after `--warmup`; a turn is `--untimed`
steps (0) and one timed step (with 1, the timed step runs as in a training
loop, not right after another model's); a step's time is the slowest
rank's:

- torch: DDP (each rank its share of the global batch), FSDP2
  (`fully_shard` per block and the root, on a 1-D mesh), TP
  (`parallelize_module` over every rank, each the whole batch): one forward
  and backward (and gradient sync) of the global batch, no optimizer step;
- torchmpmd (`mpmd.build`, each dp replica its share): the plan's choice,
  the best candidate the plan ranked for each layout the benchmark compares
  (pp = N; pp 2 x dp 2 on 4 ranks; pp 1 x dp N replicated and FSDP, i.e.
  torchmpmd's own DDP and FSDP; tp N), and the plan's five fastest
  candidates (distinct configurations).

Gradients are set to None between steps everywhere (torchmpmd's step does
not step an optimizer either). The first warmup step's loss of every
configuration is compared with DDP's (the same weights and batch: they must
agree). Printed per model: each configuration's median step, its
prediction (torchmpmd), its ratio to the fastest; then the best pipeline /
the best SPMD configuration (DDP, FSDP2, TP, torchmpmd pp = 1), the plan /
the fastest measured (target <= 1.03), the Spearman rank correlation of
predicted and measured steps over the top five (target >= 0.8), the largest
prediction error among them (target 10%), the same two for the measurement
against itself (the top five's medians over the odd rounds against the
even rounds': how far the run's own figures agree, the floor under any
prediction's) and the planning time (target < 60 s). For one model
(`--memory-model`) the plan is made again with `device_memory` = 0.7 x
what its choice holds without a limit (activations plus state, so that the
limit forces another choice), built with `measure_memory=True`, and each
rank's measured activation peak plus the state the plan counted for it is
checked against the limit.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import repo_paths  # noqa: F401  (the repository on the path)
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from launch import launch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

import torchmpmd as mpmd
from torchmpmd.planner import Candidate

# ---- the models, as torchtitan writes Llama 3


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 2048
    multiple_of: int = 32  # the SwiGLU hidden size rounds up to this
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # U-Net-like: block i's output is added to the input of block n - 1 - i.
    long_skips: bool = False


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding's cos and sin, (seq_len, head_dim / 2), in real numbers."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each head's (even, odd) pairs; x: (batch, seq, heads, head_dim)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 heads: under torch's tp a rank holds n_heads / tp of them.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rope(xq, cos, sin), apply_rope(xk, cos, sin)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, multiple_of: int) -> None:
        super().__init__()
        hidden = int(2 * 4 * dim / 3)
        hidden = multiple_of * math.ceil(hidden / multiple_of)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.multiple_of)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        h = self.tok_embeddings(tokens)
        n = len(self.layers)
        skips: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers.values()):
            if self.args.long_skips and i >= n - n // 2:
                h = h + skips.pop()
            h = layer(h, cos, sin)
            if self.args.long_skips and i < n // 2:
                skips.append(h)
        return self.output(self.norm(h))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# One tp plan for torch's parallelize_module and torchmpmd (ParallelStyle
# objects under module-path patterns, `*` one path component).
TP_PLAN = {
    "layers.*.attention.wq": ColwiseParallel(),
    "layers.*.attention.wk": ColwiseParallel(),
    "layers.*.attention.wv": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(),
    "layers.*.feed_forward.w1": ColwiseParallel(),
    "layers.*.feed_forward.w3": ColwiseParallel(),
    "layers.*.feed_forward.w2": RowwiseParallel(),
}


@dataclass(frozen=True)
class Case:
    name: str
    args: ModelArgs
    batch: int  # rows of the global batch
    seq: int
    about: str


CASES = [
    Case(
        "spmd-wins",
        ModelArgs(dim=64, n_layers=4, n_heads=4, vocab_size=2048, max_seq_len=128),
        batch=32,
        seq=128,
        about="4 layers, dim 64, vocab 2k; 32 x 128 tokens",
    ),
    Case(
        "pipeline-wins",
        ModelArgs(dim=384, n_layers=8, n_heads=8, vocab_size=1024, max_seq_len=32),
        batch=8,
        seq=32,
        about="8 layers, dim 384, vocab 1k; 8 x 32 tokens",
    ),
    Case(
        "skip",
        ModelArgs(dim=192, n_layers=6, n_heads=4, vocab_size=2048, max_seq_len=64, long_skips=True),
        batch=16,
        seq=64,
        about="U-Net-like: 6 layers, dim 192, block i -> block 5 - i; 16 x 64 tokens",
    ),
]


# ---- the configurations


@dataclass
class Config:
    """One configuration measured: how to step it, zero its gradients, and
    what torchmpmd predicted for it."""

    label: str
    kind: str  # "torch" or "torchmpmd"
    step: Callable[[], torch.Tensor]  # returns the global batch's mean loss
    params: Callable[[], list[torch.nn.Parameter]]
    spmd: bool  # no pipeline (DDP, FSDP2, TP, torchmpmd pp = 1)
    layout: str = ""
    schedule: str = ""
    microbatches: int = 0
    predicted_s: float = math.nan
    roles: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    # torchmpmd: the runner, whose timeline splits each timed step into
    # (before the first task, the tasks' span, after the last task).
    runner: mpmd.PipelineRunner | None = None
    phases: list[tuple[float, float, float]] = field(default_factory=list)
    loss: float = math.nan


def _share(t: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    rows = t.shape[0] // parts
    return t[part * rows : (part + 1) * rows]


def _global_mean(loss: torch.Tensor, world: int) -> torch.Tensor:
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss / world


def torch_configs(
    reference: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int
) -> list[Config]:
    """DDP, FSDP2 and TP of torch, on copies of `reference`."""
    xs, ys = _share(x, rank, world), _share(y, rank, world)
    ddp = DistributedDataParallel(copy.deepcopy(reference))

    def ddp_step() -> torch.Tensor:
        loss = lm_loss(ddp(xs), ys)
        loss.backward()
        return _global_mean(loss, world)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sharded = copy.deepcopy(reference)
    for block in sharded.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)

    def fsdp_step() -> torch.Tensor:
        loss = lm_loss(sharded(xs), ys)
        loss.backward()
        return _global_mean(loss, world)

    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp = parallelize_module(copy.deepcopy(reference), tp_mesh, TP_PLAN)

    def tp_step() -> torch.Tensor:
        loss = lm_loss(tp(x), y)  # every rank the whole batch
        loss.backward()
        return loss.detach()

    return [
        Config(f"torch DDP (dp {world})", "torch", ddp_step, lambda: list(ddp.parameters()), True),
        Config(
            f"torch FSDP2 (dp {world})",
            "torch",
            fsdp_step,
            lambda: list(sharded.parameters()),
            True,
        ),
        Config(f"torch TP (tp {world})", "torch", tp_step, lambda: list(tp.parameters()), True),
    ]


def _key(c: Candidate | mpmd.Plan) -> tuple[Any, ...]:
    layout = c.layout if isinstance(c, Candidate) else c.mesh_layout
    return (
        str(layout),
        repr(c.schedule),
        tuple(c.split_before),
        c.num_microbatches,
        tuple(sorted(c.recompute.items())),
    )


def wanted_layouts(world: int) -> dict[str, mpmd.Layout]:
    """The layouts the benchmark measures beside the plan's choice."""
    out = {
        f"torchmpmd pp {world}": mpmd.Layout(pp=world),
        f"torchmpmd dp {world} (its DDP)": mpmd.Layout(dp=world),
        f"torchmpmd dp {world} fsdp (its FSDP)": mpmd.Layout(dp=world, data_parallel="fsdp"),
        f"torchmpmd tp {world}": mpmd.Layout(tp=world),
    }
    if world == 4:
        out["torchmpmd pp 2 x dp 2"] = mpmd.Layout(pp=2, dp=2)
        out["torchmpmd pp 2 x dp 2 fsdp"] = mpmd.Layout(pp=2, dp=2, data_parallel="fsdp")
    return out


def chosen_candidates(plan: mpmd.Plan, world: int) -> list[tuple[str, Candidate, bool]]:
    """(role, candidate, is the plan's own) for every torchmpmd row: the
    plan, the best of each wanted layout, the top five distinct."""
    mine = plan.as_candidate()
    ran = [c for c in plan.alternatives if c.schedule is not None]
    ranked = sorted([mine, *ran], key=lambda c: c.predicted_step_time)
    out: list[tuple[str, Candidate, bool]] = [("plan's choice", mine, True)]
    for role, layout in wanted_layouts(world).items():
        best = next((c for c in ranked if c.layout == layout), None)
        if best is not None:
            out.append((role, best, best is mine))
    seen: set[tuple[Any, ...]] = set()
    for c in ranked:
        if _key(c) in seen:
            continue
        seen.add(_key(c))
        out.append((f"top {len(seen)}", c, c is mine))
        if len(seen) == 5:
            break
    return out


def _options(layout: mpmd.Layout, **kw: Any) -> mpmd.RunnerOptions:
    """The runner's options, the tp plan only on a layout with tp: `mpmd.build`
    passes `options.tp_plan` on to a runner whose mesh has no "tp"
    dimension, which refuses it ("tp_plan needs a mesh with a 'tp'
    dimension"), though the plan weighed every layout with that tp plan."""
    return mpmd.RunnerOptions(tp_plan=TP_PLAN if layout.tp > 1 else None, **kw)


def torchmpmd_configs(
    plan: mpmd.Plan,
    reference: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    rank: int,
    world: int,
) -> tuple[list[Config], dict[str, str]]:
    """One runner per distinct configuration the rows ask for; the roles
    each plays; the builds that failed (label: the error)."""
    by_key: dict[tuple[Any, ...], Config] = {}
    failed: dict[str, str] = {}
    for role, cand, is_plan in chosen_candidates(plan, world):
        key = _key(cand)
        if key in by_key:
            by_key[key].roles.append(role)
            continue
        layout = cand.layout or plan.mesh_layout
        chosen = plan if is_plan else plan.choose(cand)
        dp_rank = (rank // layout.tp) % layout.dp
        xs, ys = _share(x, dp_rank, layout.dp), _share(y, dp_rank, layout.dp)
        try:
            runner = mpmd.build(
                chosen,
                copy.deepcopy(reference),
                xs,
                loss_fn=lm_loss,
                options=_options(layout),
            )
        except Exception as err:  # reported in the table (a refusal: on every rank alike)
            failed[f"{role}: {layout} {cand.name}"] = f"{type(err).__name__}: {err}"
            continue

        def step(runner: mpmd.PipelineRunner = runner, xs=xs, ys=ys) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return runner.step(xs, target=ys).loss.detach()

        label = f"{layout} {cand.name}"
        if cand.recompute:
            label += f" recompute {cand.recompute}"
        by_key[key] = Config(
            label,
            "torchmpmd",
            step,
            lambda runner=runner: list(runner.parameters()),  # type: ignore[misc]
            layout.pp == 1,
            layout=str(layout),
            schedule=cand.name,
            microbatches=cand.num_microbatches,
            predicted_s=cand.predicted_step_time,
            roles=[role],
            runner=runner,
        )
    return list(by_key.values()), failed


def measure(configs: list[Config], rounds: int, warmup: int, untimed: int = 0) -> None:
    """Steps the configurations in turns, each round starting one later; in
    each turn `untimed` steps, then one timed: a training loop steps one
    model after another, while a turn's first step finds another model's
    weights and activations in the caches. A step's time is the slowest
    rank's."""
    n = len(configs)
    for r in range(warmup + rounds):
        for c in configs[r % n :] + configs[: r % n]:
            for _ in range(untimed if r >= warmup else 0):
                dist.barrier()
                c.step()
                for p in c.params():
                    p.grad = None
            dist.barrier()
            t0, t0_unix = time.perf_counter(), time.time()
            loss = c.step()
            t1_unix = time.time()
            slowest = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            for p in c.params():
                p.grad = None
            if r == 0:
                c.loss = float(loss)
            if r >= warmup:
                c.times.append(float(slowest))
                if c.runner is not None:
                    c.phases.append(_phases(c.runner, t0_unix, t1_unix))


def _phases(runner: mpmd.PipelineRunner, t0: float, t1: float) -> tuple[float, float, float]:
    """The step from the first rank's call to the last rank's return, in
    three: until any rank's first task starts, the tasks' span over every
    rank (gradient collectives included), after the last task ends (Unix
    seconds, as the runner's timeline keeps them)."""
    tl = runner.timeline
    assert tl is not None
    mine = [e for e in tl.events if e.rank == runner.rank] or tl.events
    first = min((e.start for e in mine), default=t0)
    last = max((e.end for e in mine), default=t1)
    low = torch.tensor([t0, first], dtype=torch.float64)
    high = torch.tensor([last, t1], dtype=torch.float64)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    (start, first), (last, end) = low.tolist(), high.tolist()
    return first - start, last - first, end - last


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((p - ma) * (q - mb) for p, q in zip(ra, rb, strict=True))
    var = math.sqrt(sum((p - ma) ** 2 for p in ra) * sum((q - mb) ** 2 for q in rb))
    return cov / var if var else math.nan


def _local_bytes(params: list[torch.nn.Parameter]) -> int:
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params
    )


def memory_check(
    case: Case,
    reference: nn.Module,
    plan: mpmd.Plan,
    x: torch.Tensor,
    y: torch.Tensor,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """Plans again under `device_memory` = 0.7 (else 0.8, 0.9) x what the
    unlimited plan's choice holds (activations + state) and checks each
    rank's measured activation peak + the state the plan counted against
    it."""
    held = [a + s for a, s in zip(plan.predicted_peak_bytes, plan.state_bytes, strict=False)]
    unlimited = max(held) if held else 0
    out: dict[str, Any] = {"unlimited_held": unlimited, "refused": {}}
    example = (x[: _example_rows(case, world)],)
    capped = None
    for factor in MEMORY_FACTORS:
        limit = factor * unlimited
        out.update(factor=factor, limit=limit)
        try:
            capped = mpmd.plan(
                reference,
                example,
                world,
                batch_size=case.batch,
                device_memory=limit,
                loss_fn=lm_loss,
                example_target=y[: example[0].shape[0]],
                tp_plan=TP_PLAN,
            )
            break
        except ValueError as err:
            out["refused"][f"{factor} x"] = str(err)
    if capped is None:
        out["error"] = "no limit planned"
        return out
    layout = capped.mesh_layout
    dp_rank = (rank // layout.tp) % layout.dp
    xs, ys = _share(x, dp_rank, layout.dp), _share(y, dp_rank, layout.dp)
    runner = mpmd.build(
        capped,
        copy.deepcopy(reference),
        xs,
        loss_fn=lm_loss,
        options=_options(layout, measure_memory=True),
    )
    peaks = []
    for _ in range(2):
        runner.step(xs, target=ys)
        assert runner.timeline is not None
        peaks.append(runner.timeline.peak_activation_bytes[runner.rank])
        for p in runner.parameters():
            p.grad = None
    pp_rank = runner.rank
    mine = [
        rank,
        pp_rank,
        max(peaks),
        capped.state_bytes[pp_rank] if capped.state_bytes else 0,
        capped.predicted_peak_bytes[pp_rank],
        _local_bytes(list(runner.parameters())),
    ]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    out.update(
        layout=str(layout),
        schedule=repr(capped.schedule),
        microbatches=capped.num_microbatches,
        recompute=capped.recompute,
        ranks=[
            {
                "rank": r,
                "pp_rank": p,
                "measured_activations": a,
                "state_counted": s,
                "predicted_peak": pred,
                "parameter_bytes": pb,
                "measured_plus_state": a + s,
            }
            for r, p, a, s, pred, pb in everyone
        ],
    )
    worst = max(r["measured_plus_state"] for r in out["ranks"])
    out["worst_over_limit"] = worst / limit
    return out


# device_memory = these x what the unlimited plan's choice holds, the first
# that any candidate fits (a limit below it forces another choice).
MEMORY_FACTORS = (0.7, 0.8, 0.9)


def _example_rows(case: Case, world: int) -> int:
    """The profile's microbatch: half of a replica's share at dp = world
    (at least 2 rows, so the planner can profile its first half)."""
    return max(2, case.batch // (2 * world))


def case_data(case: Case) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The case's model (seeded) and its global batch of inputs and targets."""
    torch.manual_seed(0)
    reference = Transformer(case.args)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, case.args.vocab_size, (case.batch, case.seq + 1), generator=g)
    return reference, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def plan_case(
    case: Case, reference: nn.Module, x: torch.Tensor, y: torch.Tensor, world: int, **kw: Any
) -> mpmd.Plan:
    """`mpmd.plan` of the case on `world` ranks, from its example microbatch."""
    rows = _example_rows(case, world)
    return mpmd.plan(
        reference,
        (x[:rows],),
        world,
        batch_size=case.batch,
        loss_fn=lm_loss,
        example_target=y[:rows],
        **kw,
    )


def run_case(case: Case, args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    reference, x, y = case_data(case)
    dist.barrier()
    start = time.perf_counter()
    plan = plan_case(case, reference, x, y, world, tp_plan=TP_PLAN)
    plan_s = time.perf_counter() - start
    configs = torch_configs(reference, x, y, rank, world)
    ours, failed = torchmpmd_configs(plan, reference, x, y, rank, world)
    configs += ours
    measure(configs, args.rounds, args.warmup, args.untimed)
    memory = (
        memory_check(case, reference, plan, x, y, rank, world)
        if args.memory_model and case.name.startswith(args.memory_model)
        else None
    )
    rows_out = []
    for c in configs:
        rows_out.append(
            {
                "label": c.label,
                "kind": c.kind,
                "roles": c.roles,
                "spmd": c.spmd,
                "layout": c.layout,
                "schedule": c.schedule,
                "microbatches": c.microbatches,
                "step_s": statistics.median(c.times),
                "steps_s": c.times,
                "predicted_s": c.predicted_s,
                # Medians of (before the first task, tasks' span, after the last).
                "phases_s": [statistics.median(p) for p in zip(*c.phases, strict=True)]
                if c.phases
                else [],
                "first_loss": c.loss,
            }
        )
    fastest = min(r["step_s"] for r in rows_out)
    ddp_loss = rows_out[0]["first_loss"]
    for r in rows_out:
        r["over_fastest"] = r["step_s"] / fastest
        r["predicted_over_measured"] = r["predicted_s"] / r["step_s"]
        r["loss_gap"] = abs(r["first_loss"] - ddp_loss)
    pipes = [r for r in rows_out if not r["spmd"]]
    spmds = [r for r in rows_out if r["spmd"]]
    plan_row = next((r for r in rows_out if "plan's choice" in r["roles"]), None)
    top = sorted(
        (r for r in rows_out if any(role.startswith("top ") for role in r["roles"])),
        key=lambda r: r["predicted_s"],
    )
    summary = {
        "best_pipeline": min(pipes, key=lambda r: r["step_s"])["label"] if pipes else None,
        "best_spmd": min(spmds, key=lambda r: r["step_s"])["label"],
        "best_pipeline_over_best_spmd": (
            min(r["step_s"] for r in pipes) / min(r["step_s"] for r in spmds) if pipes else math.nan
        ),
        "plan_over_fastest": plan_row["step_s"] / fastest if plan_row else math.nan,
        "fastest": min(rows_out, key=lambda r: r["step_s"])["label"],
        "spearman_top5": spearman([r["predicted_s"] for r in top], [r["step_s"] for r in top])
        if len(top) >= 2
        else math.nan,
        "max_error_top5": max(
            (abs(r["predicted_over_measured"] - 1) for r in top), default=math.nan
        ),
        "max_error_torchmpmd": max(
            (abs(r["predicted_over_measured"] - 1) for r in rows_out if r["kind"] == "torchmpmd"),
            default=math.nan,
        ),
        # The measurement against itself: the top five's medians over the
        # odd rounds against the even rounds' (the agreement any prediction
        # can be checked to on this machine in this run).
        **_halves(top),
        "plan_s": plan_s,
        "plan_reported_s": plan.seconds_planning,
        "max_loss_gap": max(r["loss_gap"] for r in rows_out),
    }
    return {
        "model": case.name,
        "about": case.about,
        "parameters": sum(p.numel() for p in reference.parameters()),
        "global_batch": [case.batch, case.seq],
        "plan": f"{plan.mesh_layout} {plan.schedule!r}",
        "plan_table": repr(plan),
        "notes": list(plan.notes),
        "rows": rows_out,
        "build_failures": failed,
        "summary": summary,
        "memory": memory,
        # The machine's 1-minute load average before and after (the ranks
        # themselves add about min(nproc, cores)): other work beside the run.
        "load": [load_before, os.getloadavg()[0]],
    }


def _halves(top: list[dict[str, Any]]) -> dict[str, float]:
    """Spearman of the rows' medians over odd rounds against even rounds,
    and the largest gap between a row's two (nan under 2 rows or rounds)."""
    if len(top) < 2 or min(len(r["steps_s"]) for r in top) < 2:
        return {"spearman_halves_top5": math.nan, "max_gap_halves_top5": math.nan}
    odd = [statistics.median(r["steps_s"][0::2]) for r in top]
    even = [statistics.median(r["steps_s"][1::2]) for r in top]
    return {
        "spearman_halves_top5": spearman(odd, even),
        "max_gap_halves_top5": max(abs(a / b - 1) for a, b in zip(odd, even, strict=True)),
    }


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(r: dict[str, Any], world: int, args: argparse.Namespace) -> None:
    s = r["summary"]
    print(
        f"\n== {r['model']} ({r['about']}; {r['parameters'] / 1e6:.2f} M parameters) on {world} "
        f"Gloo ranks, medians of {args.rounds} rounds in turns; load average "
        f"{r['load'][0]:.1f} before, {r['load'][1]:.1f} after\n"
        f"   plan: {r['plan']} (planned in {s['plan_s']:.1f} s)"
    )
    for note in r["notes"]:
        print(f"   note: {note}")
    cores = os.cpu_count() or 1
    if world > cores:
        print(
            f"   note: {world} ranks share {cores} cores: every rank computes at about "
            f"{cores}/{world} of the speed the planner profiled (rank 0 alone)"
        )
    print(
        f"   {'configuration':<50}{'step':>10}{'predicted':>11}{'pred/meas':>10}"
        f"{'before/span/after':>22}{'/fastest':>9}{'loss gap':>9}  roles"
    )
    for row in sorted(r["rows"], key=lambda row: row["step_s"]):
        pred = row["predicted_s"]
        print(
            f"   {row['label'][:49]:<50}{row['step_s'] * 1e3:8.1f}ms"
            + (
                f"{pred * 1e3:9.1f}ms{pred / row['step_s']:10.3f}"
                + "{:>20}ms".format("/".join(f"{t * 1e3:.0f}" for t in row["phases_s"]))
                if pred == pred
                else " " * 41
            )
            + f"{row['over_fastest']:9.3f}{row['loss_gap']:9.0e}  {', '.join(row['roles'])}"
        )
    for what, err in r["build_failures"].items():
        print(f"   BUILD FAILED {what}: {err}")
    print(
        f"   best pipeline / best SPMD: {s['best_pipeline_over_best_spmd']:.3f} "
        f"({s['best_pipeline']} / {s['best_spmd']})\n"
        f"   plan / fastest measured: {s['plan_over_fastest']:.3f} (fastest: {s['fastest']}) "
        f"[<= 1.03: {_mark(s['plan_over_fastest'] <= 1.03)}]\n"
        f"   Spearman, predicted vs measured, top five: {s['spearman_top5']:.3f} "
        f"[>= 0.8: {_mark(s['spearman_top5'] >= 0.8)}]\n"
        f"   largest prediction error, top five: {s['max_error_top5']:.1%} "
        f"[<= 10%: {_mark(s['max_error_top5'] <= 0.1)}]; any torchmpmd row: "
        f"{s['max_error_torchmpmd']:.1%}\n"
        f"   the measurement against itself, top five, odd rounds vs even rounds: Spearman "
        f"{s['spearman_halves_top5']:.3f}, largest gap {s['max_gap_halves_top5']:.1%}\n"
        f"   planning: {s['plan_s']:.1f} s [< 60 s: {_mark(s['plan_s'] < 60)}]; first-step "
        f"losses within {s['max_loss_gap']:.1e} of DDP's"
    )
    mem = r["memory"]
    if mem is None:
        return
    if "error" in mem:
        for factor, err in mem["refused"].items():
            print(f"   device_memory = {factor} the unlimited choice's: {err}")
        return
    for factor, err in mem["refused"].items():
        print(f"   device_memory = {factor} the unlimited choice's: {err}")
    print(
        f"   device_memory = {mem['factor']} x the unlimited choice's "
        f"{mem['unlimited_held'] / 2**20:.1f} MiB "
        f"= {mem['limit'] / 2**20:.1f} MiB: plan {mem['layout']} {mem['schedule']}, "
        f"recompute {mem['recompute'] or '-'}; worst rank's measured activations + counted "
        f"state = {mem['worst_over_limit']:.3f} x the limit [<= 1: "
        f"{_mark(mem['worst_over_limit'] <= 1)}]"
    )
    for q in mem["ranks"]:
        print(
            f"     rank {q['rank']} (pp {q['pp_rank']}): activations measured "
            f"{q['measured_activations'] / 2**20:.2f} MiB + state counted "
            f"{q['state_counted'] / 2**20:.2f} MiB = {q['measured_plus_state'] / 2**20:.2f} MiB; "
            f"predicted (activations + state) {q['predicted_peak'] / 2**20:.2f} MiB; parameters "
            f"held {q['parameter_bytes'] / 2**20:.2f} MiB"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, choices=(2, 4))
    p.add_argument("--models", default="", help="comma-separated name prefixes; default: all")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--untimed",
        type=int,
        default=0,
        help="untimed steps at the start of each configuration's turn (default 0: time its first)",
    )
    p.add_argument(
        "--memory-model", default="pipeline", help="the model (prefix) of the memory check"
    )
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = []
    for case in CASES:
        if args.models and not any(case.name.startswith(m) for m in args.models.split(",")):
            continue
        result = run_case(case, args, rank, world)
        if rank == 0:
            report(result, world, args)
            results.append(result)
    if rank == 0 and args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "config": {**vars(args), "json": str(args.json)},
                    "nproc": world,
                    "cores": os.cpu_count(),
                    "models": results,
                },
                indent=1,
                default=str,
            )
        )
    dist.destroy_process_group()


def _without_nproc(argv: list[str]) -> list[str]:
    """argv less `--nproc N` (torchrun would take it for its own
    --nproc-per-node; the ranks read their number from torchrun)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


if __name__ == "__main__":
    nproc = int(os.environ.get("WORLD_SIZE") or parse_args().nproc)
    sys.argv = _without_nproc(sys.argv)
    launch(main, nproc=nproc)
