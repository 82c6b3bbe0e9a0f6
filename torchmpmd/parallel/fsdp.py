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

from collections.abc import Callable, Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..schedule.program import StageCollectives
from .replicate import Replicate

__all__ = ["Shard"]

Parallelize = Callable[[torch.nn.Module, DeviceMesh], object]


class Shard:
    """FSDP2 over `dp_mesh` for this rank's stages (see the module docstring)."""

    # Each compiled pipe would need sharded modules of its own.
    name = "fsdp"
    allows_new_shapes = False
    collectives = StageCollectives(unshard=True, reduce_grads=True)

    def __init__(
        self,
        dp_mesh: DeviceMesh,
        stages: dict[int, torch.nn.Module],
        tied: Iterable[torch.nn.Parameter],
        parallelize: Parallelize | None,
        bucket_bytes: int,
    ) -> None:
        tied = list(tied)
        tied_ids = {id(p) for p in tied}
        self._stages: dict[int, FSDPModule] = {}
        # Per stage: the names of the tied parameters it holds, with their ids.
        tied_names = {
            s: {n: id(p) for n, p in m.named_parameters() if id(p) in tied_ids}
            for s, m in stages.items()
        }
        for s, module in sorted(stages.items()):
            if parallelize is not None:
                parallelize(module, dp_mesh)
            elif isinstance(module, FSDPModule):
                pass  # sharded already, by the user's parallelize with tensor parallelism
            else:
                fully_shard(
                    module,
                    mesh=dp_mesh,
                    reshard_after_forward=False,
                    ignored_params={p for p in module.parameters() if id(p) in tied_ids},
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
        self._tied = Replicate(dp_mesh.get_group(), {}, tied, bucket_bytes)

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
            module.unshard()

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

    def finish(self) -> None:
        """Averages the tied (unsharded) parameters over dp."""
        self._tied.finish()

    def reshard(self) -> None:
        """Reshards every local stage (after a step that did not finish)."""
        for module in self._stages.values():
            module.reshard()

    def after_eval(self) -> None:
        """The forward gathered the stages: shards between uses."""
        self.reshard()
