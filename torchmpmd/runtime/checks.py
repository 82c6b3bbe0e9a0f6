"""The runner's checks of what it is given, all local and made before any
message is exchanged (a refused call leaves the runner usable): its options,
the schedule and recompute policy, a batch's dtypes, the
outputs `eval_step` can rebuild, `clip_grad_norm_`'s arguments."""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..graph.pipe import Pipe, TensorSpec
from ..schedule.task import is_index, recomputed_stages, require_schedule

if TYPE_CHECKING:
    from .compiled import CompiledPipe

__all__: list[str] = []


def require_pipe(pipe: object, who: str) -> None:
    """`who` runs an mpmd.Pipe, not a model or anything else."""
    if not isinstance(pipe, Pipe):
        raise TypeError(
            f"{who} needs an mpmd.Pipe, got {type(pipe).__name__}; make one with "
            "mpmd.trace(model, example_args, split_before=[...])"
        )


def check_options(timeout: Any, compile: Any, max_early_recvs: Any) -> float:
    """The runner's options checked; returns the timeout in seconds."""
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if (
        not isinstance(seconds, (int, float))
        or isinstance(seconds, bool)
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        raise ValueError(
            f"PipelineRunner: timeout must be a positive number of seconds (or a timedelta), "
            f"got {timeout!r}"
        )
    if not isinstance(compile, (bool, Mapping)):
        raise TypeError(
            f"PipelineRunner: compile must be True, False or a dict of torch.compile options, "
            f"got {compile!r}"
        )
    if not isinstance(max_early_recvs, int) or max_early_recvs < 0:
        raise ValueError(
            f"PipelineRunner: max_early_recvs must be a non-negative int, got {max_early_recvs!r}"
        )
    return float(seconds)


def recompute_policy(
    recompute: bool | str | Iterable[int] | Mapping[int, str], num_stages: int
) -> tuple[frozenset[int], frozenset[int]]:
    """The stages recomputed in full (R tasks) and selectively. They add to
    what the schedule recomputes itself (`with_recompute`)."""
    every = range(num_stages)
    usage = (
        "use False (the default: none), True or 'full' (every stage), 'selective', stage "
        "indices like [0, 1], or {stage: 'full' | 'selective'}"
    )
    if recompute is False:
        return frozenset(), frozenset()
    if recompute is True or recompute == "full":
        return frozenset(every), frozenset()
    if recompute == "selective":
        return frozenset(), frozenset(every)
    if isinstance(recompute, str):
        raise ValueError(f"recompute={recompute!r}: {usage}")
    if isinstance(recompute, int):
        other = "False for none" if recompute == 0 else "True for every stage"
        raise TypeError(
            f"recompute={recompute!r}: an int is not a collection of stages; pass "
            f"[{recompute}] to recompute stage {recompute} in full, or {other}"
        )
    if not isinstance(recompute, Iterable):  # Mapping is Iterable
        raise TypeError(f"recompute={recompute!r} ({type(recompute).__name__}): {usage}")
    modes = (
        dict(recompute.items())
        if isinstance(recompute, Mapping)
        else dict.fromkeys(recompute, "full")
    )
    for given, mode in modes.items():
        if not is_index(given):
            raise TypeError(
                f"recompute names stage {given!r} ({type(given).__name__}); a stage is an int "
                f"index, 0..{num_stages - 1}"
            )
        stage = int(given)
        if not 0 <= stage < num_stages:
            raise ValueError(
                f"recompute names stage {stage!r}; the pipeline has stages 0..{num_stages - 1}"
            )
        if mode not in ("full", "selective"):
            raise ValueError(
                f"recompute[{stage}] = {mode!r}: a stage is recomputed 'full' or 'selective'"
            )
    return (
        frozenset(int(s) for s, m in modes.items() if m == "full"),
        frozenset(int(s) for s, m in modes.items() if m == "selective"),
    )


def check_schedule(
    schedule: object,
    recompute: bool | str | Iterable[int] | Mapping[int, str],
    num_stages: int,
) -> None:
    """The runner's schedule: an mpmd.Schedule that recomputes no stage both
    in full (its own R tasks) and selectively (`recompute`). Full recompute
    asked twice (`with_recompute` and recompute=True) is one recompute."""
    sched = require_schedule(schedule, "PipelineRunner")
    _, selective = recompute_policy(recompute, num_stages)
    both = sorted(selective & recomputed_stages(sched, num_stages))
    if both:
        raise ValueError(
            f"PipelineRunner: the schedule recomputes stages {both} in full (R tasks, "
            f"{sched!r}) and recompute={recompute!r} asks for them selectively; choose one "
            "per stage: leave them out of with_recompute(...), or out of recompute (e.g. "
            "{stage: 'selective'} for the other stages)"
        )


def check_dtypes(pipe: Pipe, flat: list[Any]) -> None:
    """A batch's tensors keep the dtypes the model was traced with: shapes
    may change from step to step (each traced once), a dtype may not (a
    float64 batch into float32 weights would fail in the middle of a step)."""
    for name, spec, value in zip(pipe.input_names, pipe.input_specs, flat, strict=True):
        if (
            isinstance(spec, TensorSpec)
            and isinstance(value, torch.Tensor)
            and value.dtype != spec.dtype
        ):
            raise TypeError(
                f"input '{name}' has dtype {value.dtype}, but the pipeline was traced with "
                f"{spec.dtype}: pass it as {spec.dtype} (x.to({spec.dtype})), or trace the model "
                f"again with {value.dtype} example inputs"
            )


def refuse_autocast(device: torch.device, call: str, rank: int) -> None:
    """`step` and `eval_step` run the graph `mpmd.trace` recorded, with the
    dtypes of tracing: an autocast around the call is refused before any
    message. (Processes would cast the graph's ops and fail mid-step on the
    plan's dtypes, killing the runner; ranks as threads ignored it.)"""
    for kind in dict.fromkeys(("cpu", device.type)):
        if not (torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)):
            continue
        dtype = torch.get_autocast_dtype(kind)
        raise RuntimeError(
            f"PipelineRunner.{call} (rank {rank}): called inside torch.autocast({kind!r}, "
            f"dtype={dtype}), which a pipeline does not apply: it runs the graph mpmd.trace "
            "recorded, with the dtypes of tracing. For mixed precision, trace inside "
            f"torch.autocast instead (with torch.autocast({kind!r}, dtype={dtype}): pipe = "
            "mpmd.trace(model, ...); the graph records the casts and the parameters keep "
            f"their dtype), and call {call} outside it"
        )


def clip_options(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    """clip_grad_norm_'s arguments as floats, checked before any exchange."""
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"clip_grad_norm_: {name} must be a number, got {value!r} "
                f"({type(value).__name__}); e.g. runner.clip_grad_norm_(1.0)"
            )
    max_f, norm_f = float(max_norm), float(norm_type)
    if math.isnan(max_f) or max_f < 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_f}")
    if math.isnan(norm_f) or norm_f <= 0:
        raise ValueError(
            f"clip_grad_norm_: norm_type must be positive (2.0, or float('inf')), got {norm_f}"
        )
    return max_f, norm_f


def check_mergeable(
    per_mb: list[CompiledPipe], num_microbatches: int, chunk_dims: Mapping[str, int | None] | None
) -> None:
    """eval_step returns the whole batch's outputs rebuilt from the
    microbatches': each tensor output is concatenated along dim 0. Refuses,
    before anything runs, an output that cannot be rebuilt that way (a value
    reduced over the microbatch, a number computed from it), instead of
    returning what one microbatch gave. With one microbatch every output
    is the model's own."""
    for compiled in {id(c): c for c in per_mb}.values():
        pipe = compiled.pipe
        rows = _microbatch_rows(pipe, chunk_dims)
        spec = pipe.stage_specs[pipe.num_stages - 1]
        names = iter(spec.output_names[spec.num_sends :])
        specs = iter(spec.output_specs[spec.num_sends :])
        for i, name in enumerate(pipe.output_names):
            if name is None:
                value = pipe.constant_outputs[i]
                if (
                    num_microbatches > 1
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    raise ValueError(
                        f"eval_step: model output {i} is the number {value!r}, computed when the "
                        "model was traced on one microbatch: it may depend on the batch (a "
                        "shape, a count), and eval_step cannot rebuild it for the whole batch "
                        "from microbatches; return it as a tensor with one row per example, "
                        "compute it outside the model, or use a schedule of one microbatch"
                    )
                continue
            out_name, one = next(names), next(specs)
            if one is None:
                raise TypeError(
                    f"eval_step: model output '{out_name}' is not a tensor; pipelines return "
                    "tensors (and constants) only"
                )
            if num_microbatches == 1:
                continue
            if not one.shape:
                raise ValueError(
                    f"eval_step: model output '{out_name}' is a 0-d tensor per microbatch (a "
                    "value reduced over it, such as a loss or a sum): eval_step concatenates "
                    "the microbatches' outputs along dim 0, and a reduced value cannot be "
                    "rebuilt for the whole batch from them; return per-example values and "
                    "reduce after eval_step (a loss: compute it from the outputs eval_step "
                    "returns, or take step()'s), or use a schedule of one microbatch"
                )
            if rows is not None and one.shape[0] != rows:
                raise ValueError(
                    f"eval_step: model output '{out_name}' has shape {one.shape} per "
                    f"microbatch of {rows} rows: its dim 0 is not the batch, so concatenating "
                    "the microbatches' outputs along it would not give the whole batch's "
                    "output; return outputs with the batch first, or use a schedule of one "
                    "microbatch"
                )


def _microbatch_rows(pipe: Pipe, chunk_dims: Mapping[str, int | None] | None) -> int | None:
    """The rows of one microbatch: the size of the first input split along
    dim 0 (None if no input is)."""
    dims = dict(chunk_dims or {})
    for name, spec in zip(pipe.input_names, pipe.input_specs, strict=True):
        if isinstance(spec, TensorSpec) and dims.get(name, 0) == 0 and spec.shape:
            return spec.shape[0]
    return None
