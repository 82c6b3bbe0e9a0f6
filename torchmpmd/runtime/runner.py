"""`PipelineRunner`: pipelined training and evaluation across processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..graph.pipe import Pipe
from ..parallel import Asked, Layout, RankStages
from ..schedule.program import Program
from ..schedule.task import Schedule
from ..schedule.timeline import Timeline
from ..version import __version__
from . import rank_rng, results
from .batches import Batch, Batches
from .checks import (
    check_mergeable,
    check_options,
    check_schedule,
    recompute_policy,
    refuse_autocast,
    require_pipe,
)
from .collective import Collective, connect, pick_device
from .compiled import CompiledPipe, PipeSettings
from .failures import GRADS_NOTE, original_errors
from .fingerprint import describe
from .options import RunnerOptions, resolve
from .stages import Evaluation, LossFn, Step, Training
from .transport import Transport
from .weights import Weights

__all__ = ["PipelineRunner", "StepOutput"]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What `PipelineRunner.step` returns on every rank."""

    # Mean over microbatches, as gradient accumulation weighs them (with data
    # parallelism: over the microbatches of every shard, the global batch's).
    loss: torch.Tensor
    losses: torch.Tensor  # per microbatch of this rank's batch
    # What the parallelisms inside the stages measured in the step, by name
    # (expert parallelism: "all_to_all_sent_bytes", "all_to_all_received_bytes",
    # "tokens_per_expert" {experts module path: tokens each expert ran}).
    metrics: dict[str, Any] = field(default_factory=dict)


class PipelineRunner:
    """Runs a `Pipe` under a `Schedule` on the ranks of a process group.

    Each rank keeps only the stages the schedule places on it (moved to
    `device`); a native executor runs the rank's program with receives posted
    ahead and waited on only when needed. Gradients accumulate into the local
    parameters like a gradient-accumulation loop over the microbatches, and
    the copies of tied parameters receive the same summed gradient, so any
    optimizer keeps them equal. Batch size and sequence length may change
    between steps: a new microbatch shape is traced once more from the
    model, on every rank alike (`num_traces` counts them).

    The ranks talk over `mesh` (a DeviceMesh with a "pp" dimension and
    optionally those of the parallelisms inside each stage: "dp", or
    torchtitan's "dp_replicate" / "dp_shard", and "tp"; `parallel.layout`),
    `group` (default: the world) or any `transport`
    (`torchmpmd.runtime.transport`, e.g. `torchmpmd.testing`'s in-process
    one). `options` (`mpmd.RunnerOptions`) holds the tuning knobs: timeout,
    recompute, data and tensor parallelism, split backward, compile, memory
    measurement. Every call that exchanges messages (`step`,
    `eval_step`, `clip_grad_norm_`, `gather_timeline`, `init_weights`,
    `load_state_dict`) is a collective: call it on every rank, `step` and
    `eval_step` with the same full batch (checked: docs/reliability.md).
    """

    def __init__(
        self,
        pipe: Pipe,
        schedule: Schedule,
        *,
        loss_fn: LossFn | None = None,
        mesh: DeviceMesh | None = None,
        group: dist.ProcessGroup | None = None,
        transport: Transport | None = None,
        device: torch.device | str | None = None,
        options: RunnerOptions | None = None,
        **deprecated: Any,
    ) -> None:
        require_pipe(pipe, "PipelineRunner")
        opts = resolve(options, deprecated)
        check_schedule(schedule, opts.recompute, pipe.num_stages)
        timeout = check_options(opts.timeout, opts.compile, opts.max_early_recvs)
        # The mesh, read once: the pipeline's group and the parallelisms
        # inside each stage, driven below as one (parallel/protocol.py).
        asked = Asked(
            opts.data_parallel,
            opts.parallelize,
            opts.tp_plan,
            opts.compile,
            opts.bucket_bytes,
            opts.ep_plan,
        )
        layout = Layout.read(mesh, asked, pipe)
        pipeline_transport, failure_board, group = connect(layout, group, transport)
        full, selective = recompute_policy(opts.recompute, pipe.num_stages)
        if full:
            schedule = schedule.with_recompute(full)
        self._pipe = pipe
        self.options = opts
        self.num_microbatches = schedule.num_microbatches
        self.device = pick_device(device, pipeline_transport)
        self._settings = PipeSettings.of(
            opts, schedule, pipeline_transport, self.device, loss_fn, timeout, selective, layout
        )
        # The pipe compiled for the traced shapes (others are compiled when a
        # batch brings new ones: Batches), whose stages hold this rank's state.
        traced = CompiledPipe(pipe, self._settings, shared=None)
        self._traced = traced
        self.program: Program = traced.program
        self.rank: int = pipeline_transport.rank
        self.num_ranks: int = pipeline_transport.size
        self.local_stages = traced.local_stages
        replicas = layout.replica_group
        self.dp_size = 1 if replicas is None else dist.get_world_size(replicas)
        self._layout = layout
        self._collective = Collective(
            pipeline_transport,
            failure_board,
            layout=layout,
            own_transport=transport is not None,
            timeout=timeout,
            device=self.device,
            describe_job=lambda: describe(pipe, self.program, __version__),
        )
        self._weights = Weights(pipe, traced, self._collective, layout)
        self._weights.start_equal()
        self._collective.first_call_hook = self._weights.first_call
        modules = {s: traced.stages.modules[s] for s in traced.local_stages}
        ties = self._weights.tie_holders()
        layout.attach(
            RankStages(modules, list(traced.tied_parameters.values()), ties, opts.bucket_bytes)
        )
        # Shards cut from allocated garbage (FSDP's) are still unwritten.
        traced.stages.allocation.follow(traced.stages.modules)
        self._batches = Batches(pipe, traced, self._settings, layout)
        self.timeline: Timeline | None = None

    def _batch(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, call: str
    ) -> Batch:
        """The call's microbatches, checked here before any message (a refused
        call leaves the runner usable)."""
        self._collective.refuse_if_failed()
        refuse_autocast(self.device, call, self.rank)
        self._traced.stages.allocation.check(self._traced.stages.modules, self.rank)
        return self._batches.split(args, kwargs, target, call)

    # ---- steps

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> StepOutput:
        """One training step over the full batch (split into microbatches).

        Gradients accumulate into the local parameters (`.grad`), as a loop of
        `(loss_fn(model(mb), target_mb) / num_microbatches).backward()` would.
        Returns the mean loss on every rank.
        """
        batch = self._batch(args, kwargs, target, "step")
        with self._collective.call("step", batch=batch.fingerprint):
            compiled, layout = batch.per_mb[0], self._layout
            wanted = layout.collectives
            step = Step(inputs=batch.inputs, targets=batch.targets)
            batch.prepare(step, layout, self.local_stages)
            fns = Training([c.stages for c in batch.per_mb], step)
            with original_errors(step, GRADS_NOTE):
                compiled.executor.run(
                    fns.forward,
                    fns.input_grad,
                    fns.weight_grad,
                    shapes=batch.shapes,
                    stage_done=layout.reduce_grads if wanted and wanted.reduce_grads else None,
                    grads_start=layout.grads_start if wanted and wanted.reduce_grads else None,
                    unshard=layout.unshard if wanted and wanted.unshard else None,
                    # Ranks as threads replay a recompute's random numbers
                    # from their own CPU generator (rank_rng.py).
                    replay_rng=not (rank_rng.in_rank_thread() and self.device.type == "cpu"),
                    overlap=bool(self.options.overlap) and layout.overlaps_sides,
                    # Selective recompute's checkpoint replays the generator
                    # in the backward.
                    backward_rng=set(self._settings.selective_recompute),
                )
            src = compiled.loss_rank
            started = results.start_loss_mean(
                self._collective, src, step.losses, self.device, layout.replica_group
            )
            try:
                layout.finish(self._traced.tied_parameters)
            except BaseException:
                results.settle(started)
                raise
            self.timeline = compiled.measured_timeline(self.num_ranks)
            self.timeline.events.extend(layout.step_events(self.rank))
            loss, losses = results.share_losses(
                self._collective, src, len(step.losses), self.device, started
            )
        return StepOutput(loss=loss, losses=losses, metrics=layout.step_metrics())

    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, keeping no autograd state; the model's output for the
        whole batch (microbatch outputs concatenated) on every rank."""
        batch = self._batch(args, kwargs, None, "eval_step")
        check_mergeable(batch.per_mb, self.num_microbatches, self._settings.chunk_dims)
        with self._collective.call("eval_step", batch=batch.fingerprint):
            step = Step(inputs=batch.inputs, targets=[])
            evaluation = Evaluation([c.stages for c in batch.per_mb], step)
            with original_errors(step):
                batch.per_mb[0].eval_executor().run(evaluation.forward, shapes=batch.shapes)
            self._layout.after_eval()
            pipe = batch.per_mb[0].pipe
            flat = results.share_outputs(
                self._collective,
                batch.per_mb[0].loss_rank,
                [c.pipe for c in batch.per_mb],
                step.outputs,
                self.device,
            )
        names = [n for n in pipe.output_names if n is not None]
        return pipe.unflatten_outputs(dict(zip(names, flat, strict=True)))

    # ---- weights (runtime/weights.py)

    def init_weights(self, fn: Callable[[torch.nn.Module], object] | None = None) -> None:
        """Initialises this rank's stages (collective: call on every rank).

        `init_weights(fn)` calls `fn(m)` on each of the model's submodules
        that owns a parameter or buffer of a local stage, with this rank's
        tensors in place of its own while `fn` runs: the model's
        `reset_parameters` / `_init_weights` work as `fn`. `init_weights()`
        calls the model's own root `init_weights()` (or `reset_parameters()`)
        once, as torchtitan's models initialise, with every local tensor
        swapped in and the others left on the meta device. Either must also
        compute the non-persistent buffers (RoPE tables) of a meta model. A
        tensor the init assigns (rather than writes) must keep the stage's
        shape, dtype and device. Then the copies of each tied weight take the
        value of the rank holding the tie's first stage, and data-parallel
        replicas take dp rank 0's values.
        """
        self._weights.init_weights(fn)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Loads this rank's entries from a (full or per-rank) state dict
        (collective: call on every rank). Keys of other ranks' stages are
        ignored; with `strict`, every local entry must be present under one
        of its names. Ties and replicas are then made equal, as after
        `init_weights`."""
        self._weights.load_state_dict(state_dict, strict)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers under the model's
        names (a tied parameter on every rank that holds it); merged over
        ranks the keys are the model's."""
        return self._weights.state_dict()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters, once each, under their names in the model."""
        return self._weights.named_parameters()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    @property
    def pipe(self) -> Pipe:
        """The traced pipeline this runner runs."""
        return self._pipe

    def local_modules(self) -> list[torch.nn.Module]:
        """This rank's stage modules (parameters and buffers under the model's names)."""
        return [self._traced.stages.modules[s] for s in self.local_stages]

    def parameter_aliases(self) -> dict[str, list[str]]:
        """Every name the model gives each parameter and buffer, keyed by each name."""
        return self._pipe.parameter_aliases

    # ---- collectives on gradients and timelines (runtime/results.py)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clips the gradients of the whole pipeline by their global norm, as
        `torch.nn.utils.clip_grad_norm_` on the unpipelined model would
        (collective). The norm counts each parameter once (a tied one on the
        rank of its first stage); every local gradient, tied copies included,
        is scaled by `min(1, max_norm / (norm + 1e-6))`. Returns the norm."""
        return results.clip_grad_norm(
            self._collective,
            self._weights.counted_parameters(),
            list(self.parameters()),
            self.device,
            max_norm,
            norm_type,
            error_if_nonfinite,
        )

    def gather_timeline(self) -> Timeline:
        """The last step's measured timeline of every rank (collective)."""
        return results.gather_timeline(self._collective, self.timeline, self.num_ranks, self.device)

    # ---- state read by torchmpmd.testing and the docs' examples

    @property
    def num_traces(self) -> int:
        """How many microbatch shapes were traced after the first."""
        return self._batches.num_traces

    @property
    def timeout(self) -> float:
        """Seconds any wait for a peer may take before the step fails."""
        return self._collective.timeout

    @property
    def own_transport(self) -> Transport | None:
        """The transport of a runner built on one of its own (`transport=`,
        as `testing.LocalPipeline`'s ranks are), over which its checkpoints
        coordinate; None for a runner on a process group."""
        collective = self._collective
        return collective.transport if collective.own_transport else None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group (its replicas each run their own
        part of the batch: the mesh's "dp", or "dp_replicate" and "dp_shard"
        together), if any."""
        return self._layout.replica_group

    @property
    def communicated(self) -> bool:
        """Whether the last call exchanged messages with the peers."""
        return self._collective.communicated

    @communicated.setter
    def communicated(self, value: bool) -> None:
        self._collective.communicated = value

    @property
    def failed_first(self) -> bool:
        """Whether the last failed call failed here first (not because a
        peer's failure ended it)."""
        return self._collective.failed_first

    @property
    def _calls(self) -> int:
        return self._collective.calls

    @_calls.setter
    def _calls(self, value: int) -> None:
        self._collective.calls = value

    @property
    def _stages(self) -> Any:
        return self._traced.stages
