"""`RunnerOptions`: the tuning knobs of a `PipelineRunner`, in one frozen,
documented object (`PipelineRunner(pipe, schedule, loss_fn=..., options=
mpmd.RunnerOptions(timeout=60, recompute="selective"))`)."""

from __future__ import annotations

import dataclasses
import datetime
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..parallel.protocol import Parallelize

__all__ = ["RunnerOptions"]

Recompute = bool | str | Iterable[int] | Mapping[int, str]
# fn(rank, stage, forward) -> what runs in place of `forward` (RunnerOptions.wrap_stage).
StageWrapper = Callable[[int, int, Callable[..., Any]], Callable[..., Any]]


@dataclass(kw_only=True, frozen=True, slots=True)
class RunnerOptions:
    """How a `PipelineRunner` runs its schedule; every field has a default."""

    timeout: float | datetime.timedelta = 300.0
    """Seconds (or a timedelta) any wait for a peer may take before the call
    fails on every rank, naming the peer. Set it above the longest gap
    between two messages of one rank (the slowest stage's forward or backward
    of a microbatch, a checkpoint save a peer waits for)."""

    chunk_dims: Mapping[str, int | None] | None = None
    """Per input name (and `"target"`), the dimension a batch is split along
    into microbatches (default 0); None gives every microbatch the whole
    tensor."""

    recompute: Recompute = False
    """Activation memory traded for compute, per stage: `"full"` (or True, or
    stage indices) re-runs a stage's forward right before its backward,
    keeping only its inputs; `"selective"` keeps matmul and attention
    outputs and recomputes the rest; `{stage: "full" | "selective"}` chooses
    per stage."""

    split_backward: bool | str = "auto"
    """Whether stages run their backward as input- and weight-gradient graphs
    (I/W): `"auto"` where the schedule has I/W tasks, True for every local
    stage, False for none (a schedule with I/W tasks then fails)."""

    compile: bool | Mapping[str, Any] = False
    """torch.compile each local stage (True, or a dict of torch.compile
    options)."""

    data_parallel: str | None = None
    """With a mesh that has a "dp" dimension: `"replicate"` (the default
    then: gradients averaged over dp) or `"fsdp"` (each stage sharded with
    FSDP2 over dp)."""

    parallelize: Parallelize | None = None
    """With `data_parallel="fsdp"`: your own `fn(stage, dp_mesh)` applying
    `fully_shard` to a stage, instead of the default one call per stage.
    With a "tp" mesh dimension: `fn(stage, stage_mesh)` on each local stage,
    `stage_mesh` being the mesh's ("dp", "tp") slice (or "tp" alone), after
    the plan has sharded the traced stages: a stage cut by hand
    (`mpmd.from_stages`; `stage` is your module) gets its tensor parallelism
    here (`parallelize_module(stage, stage_mesh["tp"], {...:
    ColwiseParallel(), ...})`); any stage may be `fully_shard`-ed over
    `stage_mesh["dp"]` (else, with `data_parallel="fsdp"`, the runner does)."""

    tp_plan: Mapping[str, Any] | None = None
    """With a mesh that has a "tp" dimension: which module's parameters are
    sharded over tp, as module-path patterns (`*`: one path component) to
    styles, in Hugging Face's format (`{"model.layers.*.self_attn.q_proj":
    "colwise", "model.layers.*.self_attn.o_proj": "rowwise", ...}`; styles
    colwise, rowwise, their `_rep` forms, colwise_gather_output,
    embedding_rowwise, replicate, sequence_parallel), or torch's
    `ParallelStyle` objects as a torchtitan `parallelize.py` writes them
    (`ColwiseParallel()`, `RowwiseParallel(output_layouts=Shard(1))`,
    `SequenceParallel()`, `PrepareModuleInput(...)`). Default: the model's
    own plan (a Hugging Face model's `_tp_plan`)."""

    ep_plan: Mapping[str, Any] | None = None
    """With a mesh that has an "ep" dimension: which experts modules are
    sharded over ep (their experts split evenly, each rank holding
    experts / ep of every layer's) and how they take their tokens, as
    module-path patterns to styles, in Hugging Face's format
    (`{"model.layers.*.mlp.experts": "ep_dispatch_experts"}`: called with
    (tokens, top-k expert ids, top-k weights); `"grouped_experts"`:
    torchtitan's `GroupedExperts`, called with (token rows sorted by expert,
    tokens per expert), also written as torchtitan's `ExpertParallel()`;
    parameter entries `"grouped_gemm"` are accepted). Default: the model's
    own plan (a Hugging Face model's `base_model_ep_plan`), else every
    experts module of the trace (`mpmd.trace(..., experts=...)`), its style
    told by its arguments."""

    bucket_bytes: int = 25 * 2**20
    """Largest data-parallel gradient bucket (bytes): a stage's gradients go
    out in buckets as its last backward of the step makes them final (the
    first bucket at most 1 MiB, as DDP's)."""

    max_early_recvs: int = 64
    """How many receives a rank posts ahead of the task that reads them."""

    overlap: bool = True
    """A fused task of one microbatch's forward and another's backward
    (DualPipeV's, `Task.fused`) runs its two sides at once on CPU, the
    forward on a thread of its own, so that one side's communication
    (expert parallelism's all-to-alls, the pipeline's transfers) runs under
    the other's compute; results are those of its parts run in order, bit
    for bit. They run in order anyway where the sides cannot run at once
    (tensor parallelism's collectives, both sides drawing random numbers,
    `measure_memory`, a GPU, ranks as threads); False always runs them in
    order."""

    measure_memory: bool = False
    """Measure, from the allocator, the bytes every local stage holds for its
    backward (`timeline.peak_activation_bytes`, each task's held and kept
    bytes, for `Costs.from_timeline`). Adds a lock and a map update to every
    allocation."""

    wrap_stage: StageWrapper | None = None
    """For tests (fault injection): `fn(rank, stage, forward)` returns what
    runs in place of local stage `stage`'s forward on rank `rank`, where
    `forward(*inputs)` returns the stage's outputs (its sends, then on the
    last stage the model's outputs). Called once per local stage (and per
    traced input shape) when the runner sets the stage up; the wrapper runs
    at every forward of that stage (F, a recompute's R, evaluation), so it
    can raise, stall, count calls or change outputs inside one stage of one
    rank. Return `forward` itself to leave a stage as it is. A stage split
    into input- and weight-gradient graphs (zero-bubble schedules) runs its
    traced graphs instead, unless built with `mpmd.from_stages`."""


# PipelineRunner's keyword arguments before RunnerOptions, still accepted:
# every field but tp_plan and ep_plan, which came after them and are
# RunnerOptions fields only.
_RENAMED = {f.name for f in dataclasses.fields(RunnerOptions)} - {"tp_plan", "ep_plan"}
# Process-wide CPU policies the runner used to set: now `mpmd.tune_cpu()`.
_TUNING = ("gloo_sched_batch", "keep_freed_memory")


def resolve(options: RunnerOptions | None, legacy: dict[str, Any]) -> RunnerOptions:
    """`options`, with the runner's former keyword arguments folded in (each
    with a DeprecationWarning saying what to write instead)."""
    if options is not None and not isinstance(options, RunnerOptions):
        raise TypeError(
            f"PipelineRunner: options must be an mpmd.RunnerOptions, got "
            f"{type(options).__name__}; e.g. options=mpmd.RunnerOptions(timeout=60)"
        )
    unknown = sorted(set(legacy) - _RENAMED - set(_TUNING))
    if unknown:
        raise TypeError(
            f"PipelineRunner got unexpected keyword arguments {unknown}; its arguments are the "
            "pipe, the schedule, loss_fn, mesh or group / transport, device and options "
            f"(mpmd.RunnerOptions: {sorted(f.name for f in dataclasses.fields(RunnerOptions))})"
        )
    tuning = {k: legacy.pop(k) for k in _TUNING if k in legacy}
    for name, value in tuning.items():
        warnings.warn(
            f"PipelineRunner({name}=...) is deprecated: the runner no longer changes "
            "process-wide policies; call mpmd.tune_cpu() once at start-up instead "
            f"({name}={value!r} {'applies it now' if value else 'is the default now'})",
            DeprecationWarning,
            stacklevel=3,
        )
    if tuning.get("keep_freed_memory") or tuning.get("gloo_sched_batch"):
        from .tune import tune_cpu

        tune_cpu(
            keep_freed_memory=bool(tuning.get("keep_freed_memory")),
            gloo_sched_batch=bool(tuning.get("gloo_sched_batch")),
        )
    if not legacy:
        return options or RunnerOptions()
    if options is not None:
        raise TypeError(
            f"PipelineRunner: pass the tuning knobs in options or as keywords, not both "
            f"(got options= and {sorted(legacy)})"
        )
    warnings.warn(
        f"PipelineRunner({', '.join(f'{k}=...' for k in sorted(legacy))}) is deprecated: pass "
        f"options=mpmd.RunnerOptions({', '.join(f'{k}=...' for k in sorted(legacy))})",
        DeprecationWarning,
        stacklevel=3,
    )
    return RunnerOptions(**legacy)
