"""`mpmd.build`: the runner a plan chose, on its mesh, in one call.

`mpmd.plan` returns a layout (pp x dp x tp over the devices), a schedule, a
split, a microbatch count and a recompute policy; `build` traces the model
at the plan's split with one microbatch of this rank's batch, makes the
device mesh of the layout (`init_device_mesh`, dimensions named "pp", "dp",
"tp" as the runner reads them) and returns the `PipelineRunner`. A layout
without a pipeline (pp = 1) is the same runner with one stage: gradient
accumulation over the plan's microbatches, its gradients reduced over dp
(replicated, as DDP, or FSDP2-sharded) and its matrices over tp, so every
layout trains, checkpoints and reports alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .planner import trace
from .planner.candidates import Candidate, Plan
from .planner.layouts import Layout
from .planner.rows import first_rows
from .planner.weigh import batch_rows
from .runtime import PipelineRunner, RunnerOptions

__all__ = ["build", "layout_mesh"]


def build(
    plan: Plan,
    model: torch.nn.Module,
    *batch_args: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    options: RunnerOptions | None = None,
    device_type: str | None = None,
) -> PipelineRunner:
    """The `PipelineRunner` of `plan` for `model`, on every rank of the job.

    `batch_args`: this rank's batch as `runner.step` will take it (its
    replica's `plan.batch_size / dp` rows); one microbatch of it is traced.
    `options` are the runner's; the plan sets their `recompute` and
    `data_parallel` (and the tp plan the planner weighed is the model's own
    unless `options.tp_plan` gives it). `device_type`: the mesh's ("cuda"
    under NCCL, else "cpu", by default)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"mpmd.build: plan must be what mpmd.plan returned, got {plan!r}")
    if options is not None and not isinstance(options, RunnerOptions):
        raise TypeError(
            f"mpmd.build: options must be an mpmd.RunnerOptions, got {type(options).__name__}"
        )
    layout = plan.mesh_layout
    rows = batch_rows(batch_args)
    if rows == 0:
        raise ValueError(
            "mpmd.build: pass this rank's batch (tensors, rows in dim 0) as runner.step takes "
            "it, e.g. mpmd.build(plan, model, input_ids)"
        )
    if plan.batch_size is not None and rows * layout.replicas != plan.batch_size:
        raise ValueError(
            f"mpmd.build: the plan is for a global batch of {plan.batch_size} rows over "
            f"{layout.replicas} replicas ({plan.batch_size // layout.replicas} rows each: dp x ep "
            f"of {layout}); this rank was "
            f"given {rows}; pass its replica's share of the batch"
        )
    mesh = layout_mesh(layout, device_type)
    return runner_of(
        plan.as_candidate(), model, batch_args, rows, loss_fn, options or RunnerOptions(), mesh
    )


def layout_mesh(layout: Layout, device_type: str | None = None) -> DeviceMesh | None:
    """The device mesh of `layout` over the default group (None: a pipeline
    alone, which runs on the group itself)."""
    if layout.num_devices > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"mpmd.build: the plan's layout ({layout}) takes {layout.num_devices} devices; "
            "launch with torchrun and call it on every rank after "
            "torch.distributed.init_process_group"
        )
    if layout.num_devices > 1 and dist.get_world_size() != layout.num_devices:
        raise ValueError(
            f"mpmd.build: the plan's layout ({layout}) takes {layout.num_devices} devices but "
            f"the job has {dist.get_world_size()}; plan for num_ranks={dist.get_world_size()}"
        )
    if layout.num_devices == layout.pp:
        return None
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=layout.mesh_dim_names)


def runner_of(
    c: Candidate,
    model: torch.nn.Module,
    batch_args: tuple[Any, ...],
    rows: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    base: RunnerOptions,
    mesh: DeviceMesh | None,
    group: dist.ProcessGroup | None = None,
    batch_kwargs: dict[str, Any] | None = None,
) -> PipelineRunner:
    """The runner of candidate `c` for a batch of `rows` rows per rank
    (`batch_kwargs`: the keyword inputs `runner.step` takes beside it)."""
    assert c.schedule is not None
    if rows % c.num_microbatches:
        raise ValueError(
            f"mpmd.build: this rank's batch has {rows} rows, which do not divide into the "
            f"plan's {c.num_microbatches} microbatches"
        )
    example, kwargs = first_rows((batch_args, batch_kwargs), rows, rows // c.num_microbatches)
    pipe = trace(model, example, kwargs or None, split_before=c.split_before)
    opts = dataclasses.replace(base, recompute=dict(c.recompute) or False)
    layout = c.layout
    if layout is not None and layout.replicas > 1:
        opts = dataclasses.replace(opts, data_parallel=layout.data_parallel)
    if (layout is None or layout.tp == 1) and opts.tp_plan is not None:
        # The plan weighed tp with this plan; a layout without tp has no
        # mesh dimension for it (the runner refuses a tp_plan without one).
        opts = dataclasses.replace(opts, tp_plan=None)
    if mesh is not None:
        return PipelineRunner(pipe, c.schedule, loss_fn=loss_fn, options=opts, mesh=mesh)
    return PipelineRunner(pipe, c.schedule, loss_fn=loss_fn, options=opts, group=group)
