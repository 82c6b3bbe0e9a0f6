"""What a parallelism does to a rank's stages: one interface
(`Parallelism`), which the runtime drives through a `layout.Layout` and
never by name. Data parallelism by replication (`replicate.Replicas`),
FSDP2 (`fsdp.FSDP`) and tensor parallelism (`tensor.TensorParallel`) are
its implementations; each is registered (`register`) with the mesh
dimensions it runs over, so that `Layout.read` finds it in a DeviceMesh.

The hooks, in the order the runner calls them (each has a do-nothing
default, so an implementation writes only what it does):

- build time, per compiled pipe: `transfer_shape` (the part of a value
  crossing stages that this rank sends, for the executor's buffers and the
  simulator's bytes), `shard_meta` (a meta model: allocate local shards
  only), `shard` (the first pipe's allocated stages), `wrap_forward` (what
  a stage's forward runs);
- once the runner's weights exist: `attach` (this rank's stages, ties and
  buckets), `start_equal` (replicas start alike, as DDP's do);
- every collective call: `on_call` (e.g. peers draw the same random numbers);
- every training step, inside the schedule where the program has them
  (`collectives`, which the simulator and the timeline see too): `start_step`,
  `unshard(stage)`, `reduce_grads(stage)`, `finish`, then `step_metrics`
  (what it measured: `StepOutput.metrics`) and `step_events` (its
  collectives inside tasks, for the timeline; `running_task` tells which);
  after a forward-only step, `after_eval`;
- after `init_weights` / `load_state_dict`: `make_equal`.

Its process groups (`groups`) wait at most the runner's timeout during a
call, and a group that splits the batch (`splits_batch`: data parallelism)
averages the loss and checks in the replicas' calls.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..graph.pipe import Pipe, StageSpec, TensorSpec
from ..schedule.program import StageCollectives
from ..schedule.timeline import TimelineEvent

__all__ = [
    "Asked",
    "Kind",
    "Parallelism",
    "Parallelize",
    "RankStages",
    "dp_dimension_missing",
    "kinds",
    "not_sharded_over",
    "register",
    "running_again",
    "running_forward",
    "running_task",
]

# RunnerOptions.parallelize: fn(stage module, mesh) applying the user's own
# sharding to a stage.
Parallelize = Callable[[torch.nn.Module, DeviceMesh], object]


@dataclass(frozen=True, slots=True)
class RankStages:
    """This rank's stages, as a parallelism is given them at `attach`."""

    modules: dict[int, torch.nn.Module]  # by stage index
    # The local copies of tied parameters: the pipeline sums their gradients
    # across stages itself, so a parallelism keeps them whole.
    tied: list[torch.nn.Parameter]
    # (node, the pipeline ranks holding a copy) of each tie spanning ranks.
    ties: Sequence[tuple[int, Sequence[int]]] = ()
    bucket_bytes: int = 25 * 2**20


@dataclass(frozen=True, slots=True)
class Asked:
    """What the runner's options ask of the parallelisms (`RunnerOptions`'
    fields of the same names)."""

    data_parallel: str | None = None
    parallelize: Parallelize | None = None
    tp_plan: Mapping[str, Any] | None = None
    compile: object = False
    bucket_bytes: int = 25 * 2**20
    ep_plan: Mapping[str, Any] | None = None


class Parallelism:
    """One parallelism inside a rank's stages, over its mesh dimensions
    (`dims`). Subclass it and override what the parallelism does."""

    name: str = ""  # as messages and RunnerOptions.data_parallel name it
    dims: tuple[str, ...] = ()  # the mesh dimensions it runs over
    # Whether new microbatch shapes (traced again, stages of their own) work.
    allows_new_shapes: bool = True
    # What it puts in every stage's training program (None: nothing).
    collectives: StageCollectives | None = None
    # Whether its ranks each run their own part of the batch (data
    # parallelism): the loss is averaged over its group, whose ranks check
    # in each call alike.
    splits_batch: bool = False
    # Whether it sums the tied weights' gradients over their holders itself
    # (the executor then exchanges none).
    sums_ties: bool = False
    # Whether the stages it runs must split their backward through autograd
    # (its stage graphs are not the traced ones).
    rewrites_stages: bool = False
    # Whether its `reduce_grads` changes the gradients before the data
    # parallelism reduces them (tensor parallelism places them): then none
    # is reduced early, during the task that makes it (`grads_start`).
    rewrites_grads: bool = False
    # Whether the two sides of a fused task (a forward and a backward, as
    # DualPipeV pairs them) may run at once on a rank: its collectives
    # inside tasks, if any, pick their process group by the side that runs
    # them (`_C.runtime.current_lane()`), so that each group sees one side's
    # collectives in program order on every rank.
    overlaps_sides: bool = True

    def groups(self) -> list[dist.ProcessGroup]:
        """Its process groups (their waits are bounded by the runner's timeout)."""
        return []

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group its ranks of one coordinate form (the replicas' with `splits_batch`)."""
        found = self.groups()
        return found[0] if found else None

    # ---- build time

    def transfer_shape(self, spec: TensorSpec, shape: list[int]) -> list[int]:
        """The shape of this rank's part of a value crossing stages (`shape`:
        what the parallelisms before it left of `spec.shape`)."""
        return shape

    def shard_meta(self, stages: Mapping[int, torch.nn.Module], pipe: Pipe) -> None:
        """A model on the meta device: places the stages' parameters before
        they are allocated, so each rank allocates only its part."""

    def shard(self, stages: Mapping[int, torch.nn.Module], pipe: Pipe) -> None:
        """The first compiled pipe's allocated stages, before anything runs."""

    def wrap_forward(
        self,
        stage: torch.nn.Module,
        call: Callable[..., Any],
        spec: StageSpec,
        transfers: Mapping[int, TensorSpec],
    ) -> Callable[..., Any]:
        """What runs in place of the stage's forward `call`."""
        return call

    # ---- weights

    def attach(self, stages: RankStages) -> None:
        """This rank's stages, once the runner holds its weights."""

    def start_equal(self, tensors: list[torch.Tensor]) -> None:
        """At construction: the copies of this rank's tensors that the
        parallelism's peers hold start alike (collective over its groups)."""

    def make_equal(self, tensors: list[torch.Tensor]) -> None:
        """After `init_weights` / `load_state_dict` (inside a collective call)."""

    # ---- calls and steps

    def on_call(self, kind: str, device: torch.device) -> None:
        """At the start of each collective call `kind`, after the check-in."""

    def start_step(self) -> None:
        """Before the schedule."""

    def unshard(self, stage: int) -> None:
        """Before `stage`'s first task of the step (with `collectives.unshard`),
        and before split stages are first traced; gathering twice is a no-op."""

    def grads_start(self, stage: int) -> None:
        """Right before the task that finishes `stage`'s weight gradients for
        the step (with `collectives.reduce_grads`): a parallelism may reduce
        each gradient as that task makes it final (DDP's overlap with the
        backward), as long as every rank of its group issues its collectives
        in the same order. `reduce_grads(stage)` follows the task, whether
        or not the task reached every parameter."""

    def reduce_grads(self, stage: int) -> None:
        """Right after the task that finishes `stage`'s weight gradients for
        the step (its last B or W), while the rank runs the rest (with
        `collectives.reduce_grads`)."""

    def finish(self, tied: Mapping[int, torch.nn.Parameter]) -> None:
        """After the schedule: every gradient is final when the last
        parallelism's returns (`tied`: this rank's tied copies by node)."""

    def after_eval(self) -> None:
        """After a forward-only step."""

    def step_metrics(self) -> dict[str, Any]:
        """What it measured in the last step (`StepOutput.metrics`), after `finish`."""
        return {}

    def step_events(self, rank: int) -> list[TimelineEvent]:
        """Its collectives inside the last step's tasks, for the timeline
        (seconds since the Unix epoch, as the executor's records)."""
        return []


@dataclass(frozen=True, slots=True)
class Kind:
    """A registered parallelism: the mesh dimensions it may run over, and
    what makes it from the mesh and the runner's options."""

    name: str
    # The dimension names it may take (for the message that refuses others).
    dims: tuple[str, ...]
    # claim(the mesh's dimension names or None for no mesh, those not taken
    # yet, the options): the ones it runs over (() if none); raises if the
    # options ask for it and the mesh lacks them.
    claim: Callable[[tuple[str, ...] | None, tuple[str, ...], Asked], tuple[str, ...]]
    # Makes it over the claimed dimensions.
    make: Callable[[DeviceMesh, tuple[str, ...], Pipe, Asked], Parallelism]
    # Inside the stages' computation (tensor parallelism) before across
    # replicas (data parallelism): its hooks run in this order.
    order: int = 0
    # Options only it reads (checked unset when no dimension is its).
    options: tuple[str, ...] = field(default=())


_KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> None:
    """Makes `layout.Layout.read` find `kind` in a mesh: a parallelism of
    your own runs inside every stage once registered."""
    _KINDS[kind.name] = kind


def kinds() -> list[Kind]:
    """The registered parallelisms, in the order their hooks run."""
    return sorted(_KINDS.values(), key=lambda k: k.order)


def dp_dimension_missing(
    data_parallel: str | None, names: tuple[str, ...] | None, also: str = ""
) -> ValueError:
    """The refusal of a `data_parallel` option on a mesh without a data
    dimension (`names`: the mesh's, None for no mesh; `also`: the other
    names the option accepts, in words)."""
    given = "none" if names is None else f"dimensions {names}"
    return ValueError(
        f"PipelineRunner: data_parallel={data_parallel!r} needs a mesh with a 'dp' "
        f"dimension (mesh=, got {given}), e.g. init_device_mesh('cpu', (pp, dp), "
        f"mesh_dim_names=('pp', 'dp')){also}; without data parallelism leave data_parallel "
        "unset"
    )


def not_sharded_over(tensors: list[torch.Tensor], dims: tuple[str, ...]) -> list[torch.Tensor]:
    """The tensors every rank along mesh dimensions `dims` holds a whole
    copy of: plain ones, and DTensors replicated along each of `dims`
    their mesh has."""
    out = []
    for t in tensors:
        if isinstance(t, DTensor):
            names = t.device_mesh.mesh_dim_names or ()
            if any(d in names and not t.placements[names.index(d)].is_replicate() for d in dims):
                continue
        out.append(t)
    return out


_running = threading.local()


@contextlib.contextmanager
def running_forward(stage: int, microbatch: int, again: bool = False) -> Iterator[None]:
    """Set by the runtime around a stage's forward: what a parallelism's
    collectives inside it are part of (`running_task`); `again`: the
    forward recomputed for its backward (R: `running_again`)."""
    before = getattr(_running, "task", None), getattr(_running, "again", False)
    _running.task, _running.again = (stage, microbatch), again
    try:
        yield
    finally:
        _running.task, _running.again = before


def running_again() -> bool:
    """Whether the forward this thread runs is a recomputation (R)."""
    return bool(getattr(_running, "again", False))


def running_task() -> tuple[int, int] | None:
    """The (stage, microbatch) whose forward this thread runs, or None."""
    task: tuple[int, int] | None = getattr(_running, "task", None)
    return task
