"""What tensor parallelism does to a step's gradients (`ShardedGrads`): each
DTensor gradient placed as its parameter, and the shards of a weight tied
across pipeline ranks summed over its holders."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .replicate import local_shard

__all__ = ["ShardedGrads", "place_grads"]


class ShardedGrads:
    """What tensor parallelism does to a step's gradients.

    1. Each DTensor gradient is placed as its parameter (autograd leaves a
       replicated weight's gradient as partial sums where the activations
       it met were sharded, which an optimizer, a norm or a data-parallel
       average of local shards would misread): a stage's right before its
       data-parallel reduction (`place`), every one after the schedule.
    2. A tied weight's copies' gradients are summed over its holders: the
       copies are DTensors placed alike, so each tp rank adds up its shards
       with the same tp coordinate's on the other holder ranks (the executor
       exchanges plain tensors only). One process group per tie and (dp,
       tp) coordinate, of the tie's holder ranks, made by its members in the
       same order.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        stages: Mapping[int, torch.nn.Module],
        ties: Sequence[tuple[int, Sequence[int]]],
    ) -> None:
        """`ties`: (node, the pipeline ranks holding a copy) of each tie
        whose copies live on more than one pipeline rank."""
        self._stages = dict(stages)
        names = tuple(mesh.mesh_dim_names or ())
        grid = mesh.mesh.movedim(names.index("pp"), 0)
        per_pp = grid.reshape(grid.shape[0], -1)  # pp coordinate x the others
        me = dist.get_rank()
        self._groups: dict[int, dist.ProcessGroup] = {}
        for node, holders in ties:
            for column in range(per_pp.shape[1]):
                ranks = [int(per_pp[h, column]) for h in sorted(holders)]
                if me in ranks:
                    group = dist.new_group(ranks, use_local_synchronization=True)
                    self._groups[node] = group

    def place(self, stage: int) -> None:
        """`stage`'s gradients placed as their parameters (before a data
        parallelism reduces them)."""
        module = self._stages.get(stage)
        if module is not None:
            place_grads(module.parameters())

    @torch.no_grad()
    def finish(self, tied: Mapping[int, torch.nn.Parameter]) -> None:
        """After the schedule, before data parallelism's average of the tied
        weights (the sums commute)."""
        for module in self._stages.values():
            place_grads(module.parameters())
        for node, group in self._groups.items():
            param = tied[node]
            if param.grad is None:  # a copy the step did not reach adds zeros
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local_shard(param.grad), group=group)


@torch.no_grad()
def place_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Each DTensor gradient placed as its parameter (the parameters a stage
    holds now: FSDP swaps in unsharded ones while a stage is gathered)."""
    for param in params:
        grad = param.grad
        if (
            isinstance(grad, DTensor)
            and isinstance(param, DTensor)
            and grad.placements != param.placements
        ):
            param.grad = grad.redistribute(param.device_mesh, param.placements)
