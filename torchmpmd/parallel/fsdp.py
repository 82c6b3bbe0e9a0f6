"""Data parallelism by sharding: each local stage is an FSDP2 module
(`fully_shard` over the mesh's "dp" dimension).

Between steps a stage's parameters are DTensor shards. Each local stage is
gathered (`unshard`) with gradient sync off at the program's `UNSHARD(s)`,
before the stage's first task of the step, so the microbatches' gradients
accumulate unsharded, in autograd (B) or in the split stages' W graphs alike.
At `REDUCE_grads(s)`, right after the task that finishes the stage's weight
gradients, the stage's gradients are reduce-scattered and its parameters
resharded, while the rank runs the rest of the schedule.
torch.distributed.pipelining drives FSDP2 the same way (its UNSHARD,
RESHARD and REDUCE_GRAD actions); here the lowering places them in the
program, so the simulator charges them too (`Costs.unshard`,
`Costs.reduce_grads`, `Costs.unsharded_bytes`).

Tied parameters are left out of the sharding (`ignored_params`): the
pipeline sums their copies across stages, and they are averaged over dp
like replicated ones (`Replicate`). FSDP2 broadcasts nothing: each rank
keeps its chunk of its own full tensors, so the runner first gives every
replica dp rank 0's (`broadcast_from_first`) and the shards all come from one
model; after `init_weights` / `load_state_dict` the shards, each held once,
stay as written, and the unsharded tensors (tied parameters, buffers) are
broadcast again. `parallelize(stage_module, dp_mesh)`
replaces the default `fully_shard` call, for a user's own sharding,
checkpointing or compile policy per stage (torchtitan's `parallelize_fn`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..graph.pipe import Pipe
from ..schedule.program import StageCollectives
from .protocol import (
    Asked,
    Kind,
    Parallelism,
    Parallelize,
    RankStages,
    dp_dimension_missing,
    not_sharded_over,
    register,
)
from .replicate import Replicas, broadcast_from_first

__all__ = ["FSDP"]


class FSDP(Parallelism):
    """FSDP2 over `dp_mesh` for this rank's stages (see the module
    docstring); over a 2-D mesh ("dp_replicate", "dp_shard"), FSDP's hybrid
    sharding (HSDP: sharded along the second, replicated along the first)."""

    # Each compiled pipe would need sharded modules of its own.
    name = "fsdp"
    allows_new_shapes = False
    splits_batch = True
    collectives = StageCollectives(unshard=True, reduce_grads=True)

    def __init__(
        self,
        dp_mesh: DeviceMesh,
        parallelize: Parallelize | None,
        bucket_bytes: int,
        *,
        dims: tuple[str, ...] | None = None,
        leave_out: Callable[[torch.nn.Parameter], bool] | None = None,
        inner: Callable[[torch.nn.Module], None] | None = None,
    ) -> None:
        # `dims`: the runner's mesh dimensions `dp_mesh` spans (a flattened
        # mesh's names are not theirs); `leave_out`: parameters another
        # parallelism keeps (expert parallelism's experts), left unsharded.
        self.dims = dims if dims is not None else tuple(dp_mesh.mesh_dim_names or ())
        self._leave_out = leave_out
        # Called on each stage before its fully_shard: another parallelism's
        # own FSDP2 units inside it (expert parallelism's experts over dp),
        # which the stage's sharding then leaves to them.
        self._inner = inner
        self._mesh = dp_mesh
        # Every replica's group (HSDP: its two dimensions flattened): the
        # tied parameters and the loss are averaged over it.
        self._group = dp_mesh.get_group() if dp_mesh.ndim == 1 else _flattened(dp_mesh)
        self._parallelize = parallelize
        self._bucket_bytes = bucket_bytes
        self._stages: dict[int, FSDPModule] = {}
        self._tied = Replicas(self._group, self.dims, bucket_bytes)

    def groups(self) -> list[dist.ProcessGroup]:
        return [self._group]

    def start_equal(self, tensors: list[torch.Tensor]) -> None:
        """Before sharding: every replica takes the first's tensors, so that
        the shards all come from one model."""
        broadcast_from_first(self._group, not_sharded_over(tensors, self.dims), self._bucket_bytes)

    def make_equal(self, tensors: list[torch.Tensor]) -> None:
        """The unsharded tensors (tied parameters, buffers) like the first
        replica's; a shard has one holder (HSDP: one per replica of the
        first dimension, which take the first's)."""
        self.start_equal(tensors)
        if self._mesh.ndim > 1:
            first = self.dims[0]
            whole = {id(t) for t in not_sharded_over(tensors, self.dims)}
            shards = [t for t in not_sharded_over(tensors, (first,)) if id(t) not in whole]
            broadcast_from_first(self._mesh[first].get_group(), shards, self._bucket_bytes)

    def attach(self, stages: RankStages) -> None:
        """Shards each local stage (fully_shard, or the user's parallelize)."""
        tied = list(stages.tied)
        tied_ids = {id(p) for p in tied}
        parallelize, dp_mesh = self._parallelize, self._mesh
        # Per stage: the names of the tied parameters it holds, with their ids.
        tied_names = {
            s: {n: id(p) for n, p in m.named_parameters() if id(p) in tied_ids}
            for s, m in stages.modules.items()
        }
        for s, module in sorted(stages.modules.items()):
            if parallelize is not None:
                parallelize(module, dp_mesh)
            elif isinstance(module, FSDPModule):
                pass  # sharded already, by the user's parallelize with tensor parallelism
            else:
                if self._inner is not None:
                    self._inner(module)
                leave_out = self._leave_out
                fully_shard(
                    module,
                    mesh=dp_mesh,
                    reshard_after_forward=False,
                    ignored_params={
                        p
                        for p in module.parameters()
                        if id(p) in tied_ids or (leave_out is not None and leave_out(p))
                    },
                )
            held = {id(p) for p in module.parameters()}
            replaced = sorted(name for name, key in tied_names[s].items() if key not in held)
            if replaced:
                raise ValueError(
                    f"data_parallel='fsdp': parallelize sharded stage {s}'s tied parameters "
                    f"{replaced}; the pipeline sums their copies across stages, so leave them "
                    "out of the sharding: fully_shard(..., ignored_params=...)"
                )
            if not isinstance(module, FSDPModule):
                raise TypeError(
                    f"data_parallel='fsdp': stage {s} is not an FSDP module after "
                    f"{'parallelize' if parallelize is not None else 'fully_shard'}; "
                    "parallelize(stage, dp_mesh) must call fully_shard on the stage module itself"
                )
            self._stages[s] = module
        self._tied.attach(RankStages({}, tied, bucket_bytes=stages.bucket_bytes))

    def start_step(self) -> None:
        """Gradients accumulate unsharded until the stage's last backward of
        the step (its gather is the program's UNSHARD)."""
        for module in self._stages.values():
            # FSDP initialises itself at its root's first forward; split
            # stages never call the module, so do it here (idempotent).
            fully_shard.state(module)._lazy_init()  # type: ignore[attr-defined]
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        self._tied.start_step()

    def unshard(self, stage: int) -> None:
        """Gathers `stage`'s parameters (a no-op when they are gathered)."""
        module = self._stages.get(stage)
        if module is not None:
            # Its own units inside too (expert parallelism's experts over
            # dp): a split stage built now must see their unsharded tensors.
            for unit in _units(module):
                unit.unshard()

    def reduce_grads(self, stage: int) -> None:
        """Reduce-scatters `stage`'s gradients and reshards its parameters."""
        module = self._stages.get(stage)
        if module is None:
            return
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for one in state._state_ctx.all_states:
            for group in one._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()

    def finish(self, tied: Mapping[int, torch.nn.Parameter] | None = None) -> None:
        """Averages the tied (unsharded) parameters over dp."""
        self._tied.finish()

    def reshard(self) -> None:
        """Reshards every local stage (after a step that did not finish)."""
        for module in self._stages.values():
            for unit in _units(module):
                unit.reshard()

    def after_eval(self) -> None:
        """The forward gathered the stages: shards between uses."""
        self.reshard()


def _units(stage: FSDPModule) -> list[FSDPModule]:
    """The stage's FSDP2 units: itself, and any inside it."""
    assert isinstance(stage, torch.nn.Module)
    return [m for m in stage.modules() if isinstance(m, FSDPModule)]


def _flattened(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One group of every rank of `mesh` (a slice of the runner's mesh)."""
    flatten = getattr(mesh, "_flatten", None)
    group: dist.ProcessGroup
    if flatten is not None:
        group = flatten().get_group()
    else:
        ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
        group = dist.new_group(ranks, use_local_synchronization=True)
    return group


def _claim(names: tuple[str, ...] | None, left: tuple[str, ...], asked: Asked) -> tuple[str, ...]:
    """ "dp" with data_parallel="fsdp"; torchtitan's "dp_shard" (with
    "dp_replicate": HSDP)."""
    if "dp_shard" in left:
        if asked.data_parallel not in (None, FSDP.name):
            raise ValueError(
                f"PipelineRunner: the mesh's 'dp_shard' dimension shards the stages (FSDP), "
                f"but data_parallel={asked.data_parallel!r}; leave data_parallel unset (or "
                "'fsdp'), or name the dimension 'dp' (or 'dp_replicate') for replicas"
            )
        return ("dp_replicate", "dp_shard") if "dp_replicate" in left else ("dp_shard",)
    if asked.data_parallel != FSDP.name:
        return ()
    if names is not None and "ep" in names and "dp" not in left:
        return ()  # expert parallelism runs the data parallelism over its ranks
    if "dp" in left:
        return ("dp",)
    raise dp_dimension_missing(asked.data_parallel, names, " (or torchtitan's 'dp_shard')")


def _make(mesh: DeviceMesh, dims: tuple[str, ...], pipe: Pipe, asked: Asked) -> FSDP:
    return FSDP(mesh[dims], asked.parallelize, asked.bucket_bytes)


register(
    Kind(
        FSDP.name,
        ("dp", "dp_replicate", "dp_shard"),
        _claim,
        _make,
        order=10,
        options=("data_parallel", "parallelize"),
    )
)
