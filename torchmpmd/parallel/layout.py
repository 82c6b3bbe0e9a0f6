"""A runner's mesh, read once (`Layout.read`): the pipeline's group (the
mesh's "pp" dimension) and, over its other dimensions, the parallelisms
inside each stage (`protocol.Parallelism`), found by the dimensions each
registered kind claims: "dp" (replicas, or FSDP with
`data_parallel="fsdp"`), torchtitan's "dp_replicate" and "dp_shard"
(replicas; FSDP; both: FSDP's hybrid sharding, HSDP), "tp" (tensor
parallelism); a parallelism of your own registers its own
(`protocol.register`).

The layout presents the whole set as one `Parallelism` to the runtime, in
order (tensor parallelism's hooks before data parallelism's: a gradient is
placed as its parameter before replicas average it), so that the runtime
names none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..graph.pipe import Pipe, StageSpec, TensorSpec
from ..schedule.program import StageCollectives
from ..schedule.timeline import TimelineEvent
from .protocol import Asked, Kind, Parallelism, RankStages, kinds

__all__ = ["Asked", "Layout"]

PIPELINE = "pp"  # the mesh dimension the pipeline's stages are spread over


class Layout(Parallelism):
    """The parallelisms inside a rank's stages, over a mesh's dimensions
    other than "pp", as one (each hook calls theirs in order)."""

    def __init__(
        self,
        mesh: DeviceMesh | None,
        pipeline_group: dist.ProcessGroup | None,
        members: list[Parallelism],
    ) -> None:
        self.mesh = mesh
        self.pipeline_group = pipeline_group
        self.members = members
        self.name = "+".join(m.name for m in members)
        self.dims = tuple(d for m in members for d in m.dims)
        self.allows_new_shapes = all(m.allows_new_shapes for m in members)
        self.sums_ties = any(m.sums_ties for m in members)
        self.rewrites_stages = any(m.rewrites_stages for m in members)
        self.splits_batch = any(m.splits_batch for m in members)
        self.overlaps_sides = all(m.overlaps_sides for m in members)
        wanted = [m.collectives for m in members if m.collectives is not None]
        self.collectives = (
            StageCollectives(
                unshard=any(c.unshard for c in wanted),
                reduce_grads=any(c.reduce_grads for c in wanted),
            )
            if wanted
            else None
        )

    @staticmethod
    def read(mesh: DeviceMesh | None, asked: Asked, pipe: Pipe) -> Layout:
        """The layout of `mesh` (None: no parallelism inside the stages),
        checked before anything is compiled or exchanged."""
        _check_data_parallel(asked)
        names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else None
        known = [PIPELINE, *dict.fromkeys(d for k in kinds() for d in k.dims)]
        if names is not None:
            unknown = [n for n in names if n not in known]
            if PIPELINE not in names or unknown:
                raise ValueError(
                    f"PipelineRunner: the mesh's dimensions are named {names}; name them after "
                    f"what runs over them: 'pp' (the pipeline, required), and any of "
                    f"{', '.join(repr(d) for d in known[1:])} (data, hybrid-sharded data, expert and "
                    "tensor parallelism), e.g. init_device_mesh('cpu', (2, 2, 2), "
                    "mesh_dim_names=('pp', 'dp', 'tp'))"
                )
        left = tuple(n for n in names or () if n != PIPELINE)
        claimed: list[tuple[Kind, tuple[str, ...]]] = []
        for kind in kinds():
            # A kind the options ask for and the mesh lacks refuses here.
            dims = kind.claim(names, left, asked)
            if dims:
                claimed.append((kind, dims))
                left = tuple(n for n in left if n not in dims)
        if left:
            raise ValueError(
                f"PipelineRunner: no parallelism runs over the mesh's dimensions {left} with "
                f"these options (data_parallel={asked.data_parallel!r}); e.g. 'dp_replicate' "
                "with 'dp_shard' is FSDP's hybrid sharding: leave data_parallel unset or 'fsdp'"
            )
        if asked.parallelize is not None and not any(
            "parallelize" in k.options for k, _ in claimed
        ):
            raise ValueError(_parallelize_unused(names))
        if mesh is None:
            return Layout(None, None, [])
        # `parallelize` goes to the first that reads it (tensor parallelism's
        # stage mesh holds the data-parallel dimensions too).
        first = next((k for k, _ in claimed if "parallelize" in k.options), None)
        members = [
            kind.make(
                mesh,
                dims,
                pipe,
                asked if kind is first else dataclasses.replace(asked, parallelize=None),
            )
            for kind, dims in claimed
        ]
        return Layout(mesh, mesh.get_group(PIPELINE), members)

    # ---- what the runtime asks of the set

    def groups(self) -> list[dist.ProcessGroup]:
        return [g for m in self.members for g in m.groups()]

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks each run their own part of the batch (data
        parallelism), or None."""
        return next((m.group for m in self.members if m.splits_batch), None)

    def new_shapes_refused(self) -> str | None:
        """Why new microbatch shapes cannot run (None: they can)."""
        refusing = [m.name for m in self.members if not m.allows_new_shapes]
        if not refusing:
            return None
        return (
            f"{' and '.join(repr(n) for n in refusing)} keeps the stages it was built with: "
            "microbatches must keep the traced shapes"
        )

    def transfer_shape(self, spec: TensorSpec, shape: list[int] | None = None) -> list[int]:
        out = list(spec.shape) if shape is None else shape
        for m in self.members:
            out = m.transfer_shape(spec, out)
        return out

    def shard_meta(self, stages: Mapping[int, torch.nn.Module], pipe: Pipe) -> None:
        for m in self.members:
            m.shard_meta(stages, pipe)

    def shard(self, stages: Mapping[int, torch.nn.Module], pipe: Pipe) -> None:
        for m in self.members:
            m.shard(stages, pipe)

    def wrap_forward(
        self,
        stage: torch.nn.Module,
        call: Callable[..., Any],
        spec: StageSpec,
        transfers: Mapping[int, TensorSpec],
    ) -> Callable[..., Any]:
        for m in self.members:
            call = m.wrap_forward(stage, call, spec, transfers)
        return call

    def attach(self, stages: RankStages) -> None:
        for m in self.members:
            m.attach(stages)

    def start_equal(self, tensors: list[torch.Tensor]) -> None:
        for m in self.members:
            m.start_equal(tensors)

    def make_equal(self, tensors: list[torch.Tensor]) -> None:
        for m in self.members:
            m.make_equal(tensors)

    def on_call(self, kind: str, device: torch.device) -> None:
        for m in self.members:
            m.on_call(kind, device)

    def start_step(self) -> None:
        for m in self.members:
            m.start_step()

    def unshard(self, stage: int) -> None:
        for m in self.members:
            m.unshard(stage)

    def grads_start(self, stage: int) -> None:
        # A member that changes the gradients in its reduce_grads (tp places
        # them) must see them before any is reduced: none early then.
        if any(m.rewrites_grads for m in self.members):
            return
        for m in self.members:
            m.grads_start(stage)

    def reduce_grads(self, stage: int) -> None:
        for m in self.members:
            m.reduce_grads(stage)

    def finish(self, tied: Mapping[int, torch.nn.Parameter]) -> None:
        for m in self.members:
            m.finish(tied)

    def after_eval(self) -> None:
        for m in self.members:
            m.after_eval()

    def step_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for m in self.members:
            out.update(m.step_metrics())
        return out

    def step_events(self, rank: int) -> list[TimelineEvent]:
        return [e for m in self.members for e in m.step_events(rank)]


def _check_data_parallel(asked: Asked) -> None:
    names = [k.name for k in kinds() if "data_parallel" in k.options]
    mode = asked.data_parallel
    if mode is not None and mode not in names:
        raise ValueError(f"data_parallel={mode!r}: use {' or '.join(repr(n) for n in names)}")


def _parallelize_unused(names: tuple[str, ...] | None) -> str:
    given = "no mesh" if names is None else f"a mesh of dimensions {names}"
    return (
        "parallelize= applies to data_parallel='fsdp' and to meshes with a 'tp' dimension "
        f"(got {given})"
    )
