"""`PipelineRunner`: pipelined training and evaluation across processes."""

from __future__ import annotations

import contextlib
import datetime
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from .. import _C
from ..graph.pipe import Pipe, TensorSpec, unique_named_parameters
from ..parallel.fsdp import Parallelize, Shard
from ..parallel.replicate import Replicate, broadcast_from_first
from ..schedule.program import Program
from ..schedule.task import Schedule
from ..schedule.timeline import Timeline, TimelineEvent, from_records
from . import gloo_threads, heap, rank_rng
from .checkin import Call, check_in
from .checks import (
    check_dtypes,
    check_mergeable,
    check_options,
    check_schedule,
    clip_options,
    data_parallel_mode,
    recompute_policy,
    require_pipe,
)
from .compiled import CompiledPipe, Options, signature_of, traced_signature
from .failures import GRADS_NOTE, first_line, original_errors
from .fingerprint import BatchPrint, batch_print, describe
from .materialize import init_weights
from .microbatch import merge
from .stages import Evaluation, LossFn, Step, Training
from .transport import (
    FailureBoard,
    Transport,
    TransportError,
    all_gather,
    broadcast,
    c10d_transport,
    recv,
    send,
)

__all__ = ["PipelineRunner", "StepOutput"]

_T = TypeVar("_T")

# Tags of init_weights / load_state_dict's tied-weight copies (one per tie),
# apart from program messages (small), results (1 << 30) and the check-in.
_TIED_TAG = 0x7FFF0200


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What `PipelineRunner.step` returns on every rank."""

    # Mean over microbatches, as gradient accumulation weighs them (with data
    # parallelism: over the microbatches of every shard, the global batch's).
    loss: torch.Tensor
    losses: torch.Tensor  # per microbatch of this rank's batch


class PipelineRunner:
    """Runs a `Pipe` under a `Schedule` on the ranks of a process group.

    Each rank keeps only the stages the schedule places on it (moved to
    `device`); a native executor runs the rank's program with receives posted
    ahead and waited on only when needed. Gradients accumulate into the local
    parameters like a gradient-accumulation loop over the microbatches, and
    the copies of tied parameters receive the same summed gradient, so any
    optimizer keeps them equal.

    `recompute` trades compute for activation memory, per stage, for models
    without checkpointing in their code: `"full"` (or True, or a collection
    of stage indices) re-runs a stage's forward right before its backward
    (`schedule.with_recompute(...)`), keeping only its inputs;
    `"selective"` keeps the outputs of matrix multiplications and attention
    and recomputes everything else (norms, activations, elementwise ops) in
    the backward; a mapping `{stage: "full" | "selective"}` chooses per stage.

    Batch size and sequence length may change between steps: a microbatch
    shape not seen before is traced once more from the model (on every rank
    alike; `num_traces` counts them), a shape seen before costs nothing.

    `measure_memory=True` has each step measure, from the allocator, the
    bytes every local stage holds for its backward (what forward tasks
    allocated and is not yet freed): `timeline.peak_activation_bytes` and each
    task's `held_bytes` / `kept_bytes`, which `Costs.from_timeline` turns into
    the activation sizes the simulator predicts memory with. Off by default:
    it adds a lock and a map update to every allocation.

    On CPU over a Gloo `group`, `gloo_sched_batch=True` runs the process's
    Gloo socket threads (`gloo_tcp_loop`) under SCHED_BATCH until the runner
    is garbage-collected: a normal one, woken while a thread holds its
    socket's lock, preempts that thread and spins until the next scheduler
    tick, a 4 ms stall on a 0.2 ms transfer that ranks sending to each other
    at once meet often (`torchmpmd.runtime.gloo_threads`). False (or a
    `transport=` of your own) leaves their policy alone.

    On CPU, `keep_freed_memory=True` fixes glibc malloc's mmap and trim
    thresholds (32 MiB, 1 GiB) for the process, so the memory a microbatch
    frees stays in the heap for the next instead of going back to the
    kernel and returning as page faults (a split backward's I paid 6% for
    them; `torchmpmd.runtime.heap`). For good, once per process; nothing
    changes where you set malloc's thresholds yourself (`MALLOC_*_`,
    `GLIBC_TUNABLES`) or malloc is not glibc's. False leaves malloc alone.

    The ranks talk over `group` (a torch.distributed process group; default:
    the world) or any `transport` (`torchmpmd.runtime.transport`), e.g. the
    in-process one of `torchmpmd.testing`. Call `step` (and `eval_step`) on
    every rank with the same full batch.
    """

    def __init__(
        self,
        pipe: Pipe,
        schedule: Schedule,
        *,
        group: dist.ProcessGroup | None = None,
        transport: Transport | None = None,
        device: torch.device | str | None = None,
        loss_fn: LossFn | None = None,
        chunk_dims: Mapping[str, int | None] | None = None,
        timeout: float | datetime.timedelta = 300.0,
        max_early_recvs: int = 64,
        split_backward: bool | str = "auto",
        compile: bool | Mapping[str, Any] = False,
        recompute: bool | str | Iterable[int] | Mapping[int, str] = False,
        mesh: DeviceMesh | None = None,
        data_parallel: str | None = None,
        parallelize: Parallelize | None = None,
        bucket_bytes: int = 25 * 2**20,
        measure_memory: bool = False,
        gloo_sched_batch: bool = True,
        keep_freed_memory: bool = True,
    ) -> None:
        require_pipe(pipe, "PipelineRunner")
        check_schedule(schedule, recompute, pipe.num_stages)
        check_options(timeout, compile, max_early_recvs)
        mode = data_parallel_mode(data_parallel, parallelize, mesh)
        dp_group: dist.ProcessGroup | None = None
        if mesh is not None:
            group, dp_group = _mesh_groups(mesh, group, transport)
        self._transport, self._board = _connect(group, transport)
        self.rank: int = self._transport.rank
        self.num_ranks: int = self._transport.size
        full, selective = recompute_policy(recompute, pipe.num_stages)
        if full:
            schedule = schedule.with_recompute(full)
        self._pipe = pipe
        self.num_microbatches = schedule.num_microbatches
        self.device = _pick_device(device, group, c10d=transport is None)
        if self.device.type == "meta":
            raise ValueError(
                "PipelineRunner: device='meta' cannot run a step; the meta device is for tracing "
                "a model and for describing it (the runner allocates its stages on a real device)"
            )
        # Gloo's loop threads under SCHED_BATCH until this runner is collected
        # (see the class docstring); each call covers loop threads made since.
        self._gloo_hold: gloo_threads.BatchHold | None = None
        if (
            gloo_sched_batch
            and self.device.type == "cpu"
            and transport is None
            and "gloo" in _backends(group)
        ):
            self._gloo_hold = gloo_threads.BatchHold()
            weakref.finalize(self, self._gloo_hold.release)
        if keep_freed_memory and self.device.type == "cpu":
            heap.keep_freed_memory()
        self._timeout = (
            timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        )
        self._options = Options(
            schedule=schedule,
            transport=self._transport,
            device=self.device,
            loss_fn=loss_fn,
            chunk_dims=chunk_dims,
            timeout=self._timeout,
            max_early_recvs=max_early_recvs,
            split_backward=split_backward,
            compile_options=None if compile is False else ({} if compile is True else compile),
            selective_recompute=selective,
            measure_memory=bool(measure_memory),
        )
        first = CompiledPipe(pipe, self._options, shared=None)
        self.dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        self._dp_group = dp_group
        # The replicas check in over their own group: they must make the same
        # calls (each steps on its own shard).
        self._dp_transport: Transport | None = None
        self._dp_board: FailureBoard | None = None
        if dp_group is not None:
            self._dp_transport, self._dp_board = c10d_transport(dp_group)
        # This rank in messages: its pipeline rank, and its global rank where
        # that differs (a mesh).
        self._me = f"rank {self.rank}"
        if transport is None and dist.get_rank() != self.rank:
            self._me += f" (global rank {dist.get_rank()})"
        self._bucket_bytes = bucket_bytes
        self._dp: Replicate | Shard | None = None
        if dp_group is not None:
            # Replicas start from dp rank 0's weights, as DDP's do (before FSDP
            # shards them); tensors allocated for a meta model get theirs at
            # init_weights / load_state_dict.
            broadcast_from_first(
                dp_group,
                [t for t in _local_state(first) if not first.stages.allocation.allocated(t)],
                bucket_bytes,
            )
        if mode == "replicate" and dp_group is not None:
            self._dp = Replicate(
                dp_group,
                {s: first.stages.modules[s].parameters() for s in first.local_stages},
                first.tied_parameters.values(),
                bucket_bytes,
            )
        elif mode == "fsdp" and mesh is not None:
            self._dp = Shard(
                mesh["dp"],
                {s: first.stages.modules[s] for s in first.local_stages},
                first.tied_parameters.values(),
                parallelize,
                bucket_bytes,
            )
            # The shards were cut from allocated garbage: still unwritten.
            first.stages.allocation.follow(first.stages.modules)
        self._first = first
        # One compiled pipe per input signature, the traced one first.
        self._compiled = {traced_signature(pipe): first}
        self.program: Program = first.program
        self.local_stages = first.local_stages
        self._stages = first.stages
        self._loss_rank = first.loss_rank
        # How many times a new input signature made this runner trace the model again.
        self.num_traces = 0
        self.timeline: Timeline | None = None
        self._checked_same_job = False
        # Collective calls that reached their check-in.
        self._calls = 0
        # Whether this runner has exchanged messages with its peers (after
        # that, a failure may leave messages in flight).
        self.communicated = False
        # Whether the last failed exchange failed here first (not because a
        # peer's failure aborted it).
        self.failed_first = False

    def _compiled_for(self, row: list[Any]) -> CompiledPipe:
        """The compiled pipe for one microbatch's inputs (traced on first sight)."""
        signature = signature_of(row)
        compiled = self._compiled.get(signature)
        if compiled is None and isinstance(self._dp, Shard):
            raise ValueError(
                "data_parallel='fsdp': microbatches must keep the traced shapes (got "
                f"{[s for s in signature if isinstance(s, TensorSpec)]}); pass batches that "
                "split into microbatches like the traced example"
            )
        if compiled is None:
            compiled = CompiledPipe.retraced(self._pipe, row, self._options, shared=self._first)
            self._compiled[signature] = compiled
            self.num_traces += 1
        return compiled

    def _batch(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, call: str
    ) -> _Batch:
        """The call's microbatches (flat inputs and targets), per microbatch
        the compiled pipe for its signature (a batch that does not divide
        evenly has two), and the batch's fingerprint. Every check here is
        local, before any message: a refused call leaves the runner usable."""
        try:
            flat = self._pipe.flatten_structure(args, kwargs)
        except TypeError as err:
            if call == "step" and target is None and args:
                raise TypeError(
                    f"{err}; if the last positional argument is the target, pass it as "
                    "step(..., target=y)"
                ) from None
            raise
        check_dtypes(self._pipe, flat)
        microbatcher = self._first.microbatcher
        rows = microbatcher.split(flat)
        targets = microbatcher.targets(target, flat)
        per_mb = [self._compiled_for(row) for row in rows]
        shapes: dict[tuple[int, int], list[int]] = {}
        for i, (row, compiled) in enumerate(zip(rows, per_mb, strict=True)):
            compiled.microbatcher.check(i, row)
            if compiled is not per_mb[0]:
                shapes.update(per_mb[0].shapes_of(compiled, i))
        return _Batch(
            inputs=rows,
            targets=targets,
            per_mb=per_mb,
            shapes=shapes,
            fingerprint=batch_print(list(zip(self._pipe.input_names, flat, strict=True)), target),
        )

    # ---- public API

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> StepOutput:
        """One training step over the full batch (split into microbatches).

        Gradients accumulate into the local parameters (`.grad`), as a loop of
        `(loss_fn(model(mb), target_mb) / num_microbatches).backward()` would.
        Returns the mean loss on every rank. Collective: every rank of the
        pipeline passes the same batch (checked: `docs/reliability.md`).
        """
        self._refuse_if_failed()
        self._stages.allocation.check(self._stages.modules, self.rank)
        batch = self._batch(args, kwargs, target, "step")
        with self._exchanging("step", batch=batch.fingerprint):
            return self._step(batch)

    def _step(self, batch: _Batch) -> StepOutput:
        compiled = batch.per_mb[0]
        step = Step(inputs=batch.inputs, targets=batch.targets)
        dp = self._dp
        if dp is not None:
            dp.start_step()  # before split stages are traced: FSDP gathers here
        for mb, c in batch.first_uses():
            c.stages.prepare(step, mb)
        fns = Training([c.stages for c in batch.per_mb], step)
        with original_errors(step, GRADS_NOTE):
            compiled.executor.run(
                fns.forward,
                fns.input_grad,
                fns.weight_grad,
                shapes=batch.shapes,
                stage_done=None if dp is None else dp.stage_done,
                # Ranks as threads replay a recompute's random numbers from
                # their own CPU generator (rank_rng.py), not the shared one.
                replay_rng=not (rank_rng.in_rank_thread() and self.device.type == "cpu"),
            )
        if dp is not None:
            dp.finish()
        self.timeline = from_records(
            self.rank,
            self.num_ranks,
            compiled.executor.records(),
            compiled.executor.step_start_unix_ns,
            compiled.executor.peak_held_bytes,
        )
        # float64 holds a float32 or float64 loss exactly.
        if self.rank == self._loss_rank:
            losses = torch.stack([_done(loss).double() for loss in step.losses]).to(self.device)
        else:
            losses = torch.empty(self.num_microbatches, dtype=torch.float64, device=self.device)
        self._share(losses, "the step's losses")
        loss = losses.mean()
        if self._dp_group is not None:
            # The global batch's loss: the mean over every shard's microbatches.
            dist.all_reduce(loss, group=self._dp_group)
            loss /= self.dp_size
        return StepOutput(loss=loss, losses=losses)

    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, keeping no autograd state; the model's output for the
        whole batch (microbatch outputs concatenated) on every rank.
        Collective, like `step`."""
        self._refuse_if_failed()
        self._stages.allocation.check(self._stages.modules, self.rank)
        batch = self._batch(args, kwargs, None, "eval_step")
        check_mergeable(batch.per_mb, self.num_microbatches, self._options.chunk_dims)
        with self._exchanging("eval_step", batch=batch.fingerprint):
            return self._eval_step(batch)

    def _eval_step(self, batch: _Batch) -> Any:
        step = Step(inputs=batch.inputs, targets=[])
        evaluation = Evaluation([c.stages for c in batch.per_mb], step)
        with original_errors(step):
            batch.per_mb[0].eval_executor().run(evaluation.forward, shapes=batch.shapes)
        if isinstance(self._dp, Shard):
            self._dp.reshard()  # forward gathered the stages; shards between uses
        pipe = batch.per_mb[0].pipe
        flat = self._share_outputs([c.pipe for c in batch.per_mb], step.outputs)
        names = [n for n in pipe.output_names if n is not None]
        return pipe.unflatten_outputs(dict(zip(names, flat, strict=True)))

    def _transports(self) -> list[tuple[Transport, FailureBoard | None]]:
        pairs = [(self._transport, self._board)]
        if self._dp_transport is not None:
            pairs.append((self._dp_transport, self._dp_board))
        return pairs

    @contextlib.contextmanager
    def _exchanging(
        self, call: str, *, options: str = "", batch: BatchPrint | None = None
    ) -> Iterator[None]:
        """Around every collective call: checks in with the peers (the same
        call, options and batch on every rank: `checkin.py`), watches for
        another rank's failure (which then ends this rank's waits at once,
        naming it), and on a failure here tells the peers, so that nobody
        waits out its timeout for a rank that already gave up. A
        KeyboardInterrupt stays one (after telling the peers)."""
        self._refuse_if_failed()
        self._calls += 1
        self.communicated = True
        for t, _ in self._transports():
            t.arm()
        try:
            first = not self._checked_same_job
            self._check_in(Call(self._calls, call, options, batch))
            if first and call not in ("init_weights", "load_state_dict"):
                # Copies of a tied weight built apart (each rank's model from
                # its own seed) start equal, as replicas do at construction
                # (init_weights and load_state_dict make them equal anyway).
                with self._stages.allocation.copies_only():
                    self._send_ties()
            yield
        except BaseException as err:
            reason = self._abort_reason()
            if reason is None and isinstance(err, (TransportError, PipelineError)):
                # A peer may have posted its failure before this rank's watch
                # saw it (and then exited, closing its connections): its
                # reason is the cause.
                reason = next((b.peek() for _, b in self._transports() if b is not None), None)
                if reason is not None and type(err) is PipelineError:
                    self.failed_first = False
                    failed = PipelineError(f"{err}. The cause, posted before: {reason}")
                    self._fail(f"{self._me} failed in {call}: {failed}")
                    raise failed from err
            # First to fail, or failing because a peer did?
            self.failed_first = reason is None
            if not isinstance(err, TransportError):
                self._fail(f"{self._me} failed in {call}: {first_line(err)}")
                raise
            failed = PipelineError(self._outside_executor(call, err, reason))
            self._fail(f"{self._me} failed in {call}: {failed}")
            raise failed from err
        finally:
            for t, _ in self._transports():
                t.disarm()

    def _abort_reason(self) -> str | None:
        return next((r for t, _ in self._transports() if (r := t.abort_reason) is not None), None)

    def _fail(self, reason: str) -> None:
        """Tells every group this rank talks to that it failed."""
        for t, _ in self._transports():
            t.fail(reason)

    def _outside_executor(self, call: str, err: Exception, reason: str | None) -> str:
        """A failed exchange outside the executor (the check-in, results
        shared at the end of a step, a collective), with this rank's context,
        as the executor gives."""
        if reason is not None:
            hint = (
                f" (this rank came to {call} after a peer had stopped waiting for it: if it was "
                f"busy between calls (evaluation, a checkpoint), raise the timeout, "
                f"{self._timeout:g} s)"
                if self._waited_for_here(reason)
                else ""
            )
            return f"torchmpmd: {self._me} stopped {call}, because {reason}{hint}"
        return f"torchmpmd: {self._me} failed in {call}: {err}"

    def _waited_for_here(self, reason: str) -> bool:
        """Whether a peer's failure `reason` is that it gave up waiting for this rank."""
        names = [f"(?<!global )rank {self.rank}"]
        if self._dp_group is not None:
            names.append(f"global rank {dist.get_rank()}")
        return re.search(f"(?:{'|'.join(names)}) did not answer within", reason) is not None

    def _refuse_if_failed(self) -> None:
        """A runner whose exchange failed (here or on a peer) is not reused."""
        reason = self._abort_reason()
        if reason is None:
            return
        raise PipelineError(
            f"torchmpmd: rank {self.rank}: this runner cannot run another step after a failed "
            f"one ({reason}). Messages of the failed step may still be in flight on its process "
            "group. Build a new PipelineRunner on a new process group on every rank "
            "(torch.distributed.new_group) and load the last checkpoint (mpmd.checkpoint.load), "
            "or let torchrun (--max-restarts) restart the job and resume from "
            "mpmd.checkpoint.latest(dir)"
        )

    def _check_in(self, call: Call) -> None:
        """Every rank makes the same call, with the same options and batch,
        and at the first call was given the same job (checkin.py)."""
        from .. import __version__

        if self._gloo_hold is not None:
            self._gloo_hold.cover()
        job = None if self._checked_same_job else describe(self._pipe, self.program, __version__)
        check_in(self._transport, self._timeout, call, self.device, job=job)
        if self._dp_transport is not None and self._dp_group is not None:
            group = self._dp_group
            check_in(
                self._dp_transport,
                self._timeout,
                call,
                self.device,
                replicas=True,
                name=lambda r: f"global rank {dist.get_global_rank(group, r)}",
            )
        self._checked_same_job = True

    def init_weights(self, fn: Callable[[torch.nn.Module], object] | None = None) -> None:
        """Initialises this rank's stages (collective: call on every rank).

        `init_weights(fn)` calls `fn(m)` on each of the model's submodules
        that owns a parameter or buffer of a local stage, with this rank's
        tensors in place of its own while `fn` runs (the model keeps its
        own): the model's `reset_parameters` / `_init_weights` work as `fn`.
        `init_weights()` calls the model's own root `init_weights()` (or
        `reset_parameters()`) once, as torchtitan's models initialise, with
        every local tensor swapped in and the others left on the meta device,
        where writes cost nothing. Either must also compute the
        non-persistent buffers (RoPE tables) of a model built on the meta
        device, which no state dict holds. A tensor the init replaces rather
        than writes must keep the stage's shape, dtype and device.

        Then the copies of each tied weight take the value of the rank that
        holds the tie's first stage, and data-parallel replicas take dp rank
        0's values, so every rank must call it.
        """
        self._refuse_if_failed()
        if fn is not None and not callable(fn):
            raise TypeError(
                "init_weights: fn must be a function of one module (e.g. the model's "
                "_init_weights), or nothing to call the model's own init_weights(); got "
                f"{type(fn).__name__}"
            )
        modules = {s: self._stages.modules[s] for s in self.local_stages}
        # Ranks as threads draw from their own generators (rank_rng.py).
        with rank_rng.own_generator():
            called = init_weights(
                fn, modules, self._pipe.source, self._pipe.parameter_aliases, self.rank
            )
        # Stages without parameters or buffers have nothing to initialise.
        holds = any([*m.parameters(), *m.buffers()] for m in modules.values())
        if not called and holds:
            raise ValueError(
                f"init_weights: rank {self.rank} found no module of the model owning a tensor of "
                f"its stages {self.local_stages}"
            )
        self._sync_tied("init_weights")

    def _sync_tied(self, call: str) -> None:
        """Makes the copies of each tied weight equal, then the replicas:
        the rank holding a tie's first stage (its owner, as
        `_counted_parameters` counts it) sends its copy to every other rank
        holding one; then dp rank 0 broadcasts this rank's parameters and
        buffers to its replicas. Collective whenever a tie spans ranks or
        there are replicas (the same on every rank), so every rank checks in.
        """
        if not self._ties_across_ranks() and self._dp_group is None:
            return
        with self._exchanging(call), torch.no_grad():
            self._send_ties()
            if self._dp_group is not None:
                # FSDP shards have one holder each: nothing to make equal.
                tensors = [t for t in _local_state(self._first) if not isinstance(t, DTensor)]
                # A tensor dp rank 0 left unwritten is garbage on every replica alike.
                with self._stages.allocation.copies_only():
                    broadcast_from_first(self._dp_group, tensors, self._bucket_bytes)

    def _ties_across_ranks(self) -> list[tuple[int, int, list[int]]]:
        """(index, owner rank, holder ranks) of each tie whose copies live on
        more than one rank, in the plan's order (the same on every rank)."""
        placement = self.program.placement
        out = []
        for i, tie in enumerate(self._pipe.plan.tied):
            holders = sorted({placement[s] for s in tie.stages})
            if len(holders) > 1:
                out.append((i, placement[min(tie.stages)], holders))
        return out

    @torch.no_grad()
    def _send_ties(self) -> None:
        """The owner of each tie sends its copy to the tie's other holders
        (inside an exchange). Blocking sends cannot deadlock: every rank walks
        the ties in the plan's order and, per tie, the owner sends to the
        holders in rank order, so the first unfinished pair always has both
        ends ready."""
        names = {id(p): n for n, p in self.named_parameters()}
        for i, owner, holders in self._ties_across_ranks():
            if self.rank not in holders:
                continue
            param = self._first.tied_parameters[self._pipe.plan.tied[i].node]
            tag = _TIED_TAG + i
            what = f"the tied weight '{names.get(id(param), '?')}'"
            if self.rank == owner:
                for peer in holders:
                    if peer != owner:
                        send(self._transport, param.detach(), peer, tag, self._timeout, what)
            else:
                value = torch.empty_like(param)
                recv(self._transport, value, owner, tag, self._timeout, what)
                param.copy_(value)

    @property
    def timeout(self) -> float:
        """Seconds any wait for a peer may take before the step fails."""
        return self._timeout

    def local_modules(self) -> list[torch.nn.Module]:
        """This rank's stage modules (parameters and buffers under the model's names)."""
        return [self._stages.modules[s] for s in self.local_stages]

    def parameter_aliases(self) -> dict[str, list[str]]:
        """Every name the model gives each parameter and buffer, keyed by each name."""
        return self._pipe.parameter_aliases

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters, once each, under their names in the model."""
        return unique_named_parameters(self._stages.modules[s] for s in self.local_stages)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers under the model's names.

        A tied parameter appears on every rank that holds it, each under the
        name its stage uses; merged over ranks the keys are the model's.
        """
        out: dict[str, torch.Tensor] = {}
        for s in self.local_stages:
            for name, t in self._stages.modules[s].state_dict(keep_vars=False).items():
                out.setdefault(name, t)
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Loads this rank's entries from a (full or per-rank) state dict
        (collective: call on every rank).

        Keys of other ranks' stages are ignored. With `strict`, every local
        entry must be present under one of its names. Then, as after
        `init_weights`, the copies of each tied weight take the value of the
        rank holding the tie's first stage, and data-parallel replicas take
        dp rank 0's values.
        """
        self._refuse_if_failed()
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"load_state_dict takes a mapping of names to tensors, got "
                f"{type(state_dict).__name__}"
            )
        not_tensors = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
        if not_tensors:
            raise TypeError(
                f"load_state_dict: '{not_tensors[0]}' is a {type(state_dict[not_tensors[0]]).__name__}, "
                "not a tensor"
            )
        if strict:
            known = set(self._pipe.parameter_aliases)
            unknown = sorted(k for k in state_dict if k not in known)
            if unknown:
                raise KeyError(
                    f"load_state_dict: {unknown[:5]} are not parameters or buffers of the model; "
                    "pass strict=False to ignore them"
                )
        missing = []
        for s in self.local_stages:
            for name, t in self._stages.modules[s].state_dict(keep_vars=True).items():
                aliases = self._pipe.parameter_aliases.get(name, [name])
                key = next((a for a in [name, *aliases] if a in state_dict), None)
                if key is None:
                    missing.append(name)
                    continue
                value = state_dict[key]
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                if tuple(value.shape) != tuple(t.shape):
                    raise ValueError(
                        f"load_state_dict: '{key}' has shape {tuple(value.shape)}, but stage {s} on "
                        f"rank {self.rank} holds it with shape {tuple(t.shape)}"
                    )
                if isinstance(t, DTensor):  # an FSDP shard: this rank's part of the value
                    value = distribute_tensor(
                        value.to(t.device_mesh.device_type), t.device_mesh, t.placements
                    )
                t.copy_(value)
        if strict and missing:
            raise KeyError(f"load_state_dict: rank {self.rank} found no entry for {missing}")
        self._sync_tied("load_state_dict")

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clips the gradients of the whole pipeline by their global norm, as
        `torch.nn.utils.clip_grad_norm_` on the unpipelined model would
        (collective: call on every rank).

        The norm is taken over every rank's gradients, each parameter once (a
        tied parameter counts on the rank of its first stage only); every
        local gradient, tied copies included, is scaled by
        `min(1, max_norm / (norm + 1e-6))`. Returns the total norm on every rank.
        """
        max_norm, norm_type = clip_options(max_norm, norm_type)
        options = f"max_norm={max_norm!r}, norm_type={norm_type!r}"
        counted = self._counted_parameters()
        grads = [p.grad for p in counted if p.grad is not None]
        inf = norm_type == float("inf")

        def reduce(tensors: list[torch.Tensor]) -> torch.Tensor:
            norms = torch.stack(
                [torch.linalg.vector_norm(t.double(), norm_type) for t in tensors]
                or [torch.zeros((), dtype=torch.float64, device=self.device)]
            )
            return norms.max() if inf else norms.pow(norm_type).sum()

        # FSDP shards (DTensor) are disjoint over dp: their part is reduced
        # over dp too; replicated gradients are equal on every replica.
        shards = [g.to_local() for g in grads if isinstance(g, DTensor)]
        local = reduce([g for g in grads if not isinstance(g, DTensor)])
        with self._exchanging("clip_grad_norm_", options=options):
            # After the check-in: a replica that does not clip fails the
            # check-in instead of leaving this all-reduce waiting.
            if shards and self._dp_group is not None:
                sharded = reduce(shards).to(self.device)
                op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
                dist.all_reduce(sharded, op=op, group=self._dp_group)
                local = torch.maximum(local, sharded) if inf else local + sharded
            parts = all_gather(
                self._transport,
                local.reshape(1, 1).to(self.device),
                self._timeout,
                "the gradients' norms",
            )
        gathered = torch.cat([part.reshape(-1) for part in parts])
        total = gathered.max() if inf else gathered.sum().pow(1.0 / norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                f"{float(total)}; pass error_if_nonfinite=False to clip anyway"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        dtype = grads[0].dtype if grads else torch.float32
        return total.to(dtype)

    def _counted_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters that a global reduction counts: each once,
        a tied one only on the rank that holds its first stage."""
        not_here = set()
        for node, param in self._first.tied_parameters.items():
            first = min(self._pipe.plan.tied_stages(node))
            if first not in self.local_stages:
                not_here.add(id(param))
        return [p for p in self.parameters() if id(p) not in not_here]

    def gather_timeline(self) -> Timeline:
        """The last step's measured timeline of every rank (collective: call on all ranks)."""
        if self.timeline is None:
            raise RuntimeError("gather_timeline: run a step first")
        kinds = list(_C.schedule.TaskKind.__members__)  # measured events are tasks
        peak = self.timeline.peak_activation_bytes[self.rank]
        # float64 holds nanosecond times and byte counts (< 2**53) exactly;
        # the first row carries the rank's peak.
        rows = torch.tensor(
            [[peak, 0, 0, 0, 0, 0, 0]]
            + [
                [
                    kinds.index(e.kind),
                    e.stage,
                    e.microbatch,
                    e.start,
                    e.end,
                    e.held_bytes,
                    e.kept_bytes,
                ]
                for e in self.timeline.events
            ],
            dtype=torch.float64,
            device=self.device,
        )
        with self._exchanging("gather_timeline"):
            gathered = all_gather(self._transport, rows, self._timeout, "the timelines")
            parts = [p.cpu().tolist() for p in gathered]
        events = [
            TimelineEvent(rank, kinds[int(k)], int(s), int(mb), start, end, "", int(h), int(b))
            for rank, part in enumerate(parts)
            for k, s, mb, start, end, h, b in part[1:]
        ]
        peaks = [int(part[0][0]) for part in parts]
        return Timeline(self.num_ranks, events, "measured", "s", peaks)

    # ---- results shared from the last stage's rank

    def _share(self, tensor: torch.Tensor, what: str) -> None:
        broadcast(self._transport, tensor, self._loss_rank, self._timeout, what)

    def _share_outputs(
        self, pipes: list[Pipe], outputs: list[list[Any] | None]
    ) -> list[torch.Tensor]:
        """The loss rank's merged outputs, on every rank (shapes come from the
        plans of the microbatches' pipes; `check_mergeable` passed them)."""
        specs = [p.stage_specs[p.num_stages - 1] for p in pipes]
        spec = specs[0]
        out = []
        for i, one in enumerate(spec.output_specs[spec.num_sends :]):
            if one is None:  # refused by check_mergeable before the call
                raise RuntimeError("torchmpmd: eval_step reached a model output of no tensor")
            if self.rank == self._loss_rank:
                t = merge([_done(o)[i] for o in outputs]).contiguous()
            else:
                pieces = [s.output_specs[s.num_sends + i] for s in specs]
                rows = sum(p.shape[0] if p is not None and p.shape else 1 for p in pieces)
                shape = (rows, *one.shape[1:]) if one.shape else (rows,)
                t = torch.empty(shape, dtype=one.dtype, device=self.device)
            self._share(t, f"the model output '{spec.output_names[spec.num_sends + i]}'")
            out.append(t)
        return out


@dataclass(frozen=True, slots=True)
class _Batch:
    """One call's microbatches: flat inputs and targets, compiled pipe,
    transfer shapes, and the batch's fingerprint for the check-in."""

    inputs: list[list[Any]]
    targets: list[Any]  # per microbatch (None without a target)
    per_mb: list[CompiledPipe]
    # (value, microbatch) -> shape, where a microbatch's differ from the first's
    shapes: dict[tuple[int, int], list[int]]
    fingerprint: BatchPrint

    def first_uses(self) -> list[tuple[int, CompiledPipe]]:
        """Each distinct compiled pipe with the first microbatch it runs."""
        seen: dict[int, tuple[int, CompiledPipe]] = {}
        for mb, c in enumerate(self.per_mb):
            seen.setdefault(id(c), (mb, c))
        return list(seen.values())


PipelineError = _C.runtime.PipelineError


def _mesh_groups(
    mesh: DeviceMesh, group: dist.ProcessGroup | None, transport: Transport | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """The pipeline and data-parallel groups of a ("pp"[, "dp"]) DeviceMesh."""
    if group is not None or transport is not None:
        raise ValueError("PipelineRunner: pass mesh, or group / transport, not both")
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in ("pp", "dp")]
    if "pp" not in names or unknown:
        raise ValueError(
            f"PipelineRunner: the mesh's dimensions are named {names}; name them 'pp' "
            "(pipeline) and 'dp' (data parallel), e.g. init_device_mesh('cpu', (2, 2), "
            "mesh_dim_names=('pp', 'dp'))"
        )
    pp = mesh.get_group("pp")
    dp = mesh.get_group("dp") if "dp" in names else None
    return pp, dp


def _local_state(compiled: CompiledPipe) -> list[torch.Tensor]:
    """This rank's parameters and buffers, once each, in stage order (the
    same order on every replica)."""
    seen: set[int] = set()
    out = []
    for s in compiled.local_stages:
        module = compiled.stages.modules[s]
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _connect(
    group: dist.ProcessGroup | None, transport: Transport | None
) -> tuple[Transport, FailureBoard | None]:
    """The transport of this runner: the one given, or c10d over `group`
    (default: world) with the board its ranks post failures on."""
    if transport is not None:
        if group is not None:
            raise ValueError("PipelineRunner: pass group or transport, not both")
        if not isinstance(transport, Transport):
            raise TypeError(
                f"PipelineRunner: transport must be a torchmpmd transport, got "
                f"{type(transport).__name__}; wrap a process group with group=..."
            )
        return transport, None
    if not dist.is_initialized():
        raise RuntimeError(
            "PipelineRunner: torch.distributed is not initialized; call "
            "dist.init_process_group() first (torchrun sets up the environment)"
        )
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("PipelineRunner: torch.distributed has no default process group")
    return c10d_transport(group)


def _pick_device(
    device: torch.device | str | None, group: dist.ProcessGroup | None, *, c10d: bool
) -> torch.device:
    if device is not None:
        device = torch.device(device)
        if device == torch.device("cuda"):  # no index: this process's current GPU
            return torch.device("cuda", torch.cuda.current_device())
        return device
    if c10d and "nccl" in _backends(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _backends(group: dist.ProcessGroup | None) -> str:
    """The group's backends by device, e.g. 'cpu:gloo,cuda:nccl': a group made
    without naming a backend reports 'undefined' from get_backend."""
    try:
        return str(dist.get_backend_config(group)).lower()
    except (AttributeError, ValueError, RuntimeError):
        return str(dist.get_backend(group)).lower()


def _done(value: _T | None) -> _T:
    """A per-microbatch result the executor must have filled in."""
    if value is None:
        raise RuntimeError("torchmpmd: a microbatch finished without its result")
    return value
