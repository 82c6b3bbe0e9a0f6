"""This rank's side of a runner's collective calls, and what happens when
one fails.

Every call of a `PipelineRunner` that exchanges messages runs inside
`Collective.call`: the transports are armed (watching for another rank's
failure, which then ends this rank's waits at once, naming it), the call
checks in with its neighbours (`checkin.py`: the same call, options and
batch on every rank of the pipeline, the same call on every data-parallel
replica), and a failure here is posted to every group this rank talks to,
so nobody waits out its timeout for a rank that already gave up. The
collectives outside the transport (those of the parallelisms inside the
stages, over the groups their layout names, torch.distributed's) wait at
most `timeout` during a call on Gloo, and a raw error of theirs after a posted failure (Gloo's "Connection
closed by peer", a timeout) is reported as that failure. A runner
whose call failed (here or on a peer) refuses every later call
(`refuse_if_failed`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import re
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import _C
from ..parallel.layout import Layout
from . import gloo_threads
from .checkin import Call, check_in
from .failures import first_line
from .fingerprint import BatchPrint
from .transport import (
    C10dTransport,
    FailureBoard,
    Transport,
    TransportError,
    _store_of,
    c10d_transport,
)

__all__: list[str] = []

PipelineError = _C.runtime.PipelineError


class Collective:
    """The transports of one runner (the pipeline group's, and the replicas'
    group's if any: the layout's `replica_group`) and the state of its
    collective calls. Not thread-safe: one runner, one thread."""

    def __init__(
        self,
        transport: Transport,
        board: FailureBoard | None,
        *,
        layout: Layout,
        own_transport: bool,
        timeout: float,
        device: torch.device,
        describe_job: Callable[[], list[str]],
    ) -> None:
        self.transport = transport
        # A transport of the runner's own (no process group): checkpoints
        # coordinate over it (checkpoint/world.py).
        self.own_transport = own_transport
        self.rank: int = transport.rank
        self.timeout = timeout
        self._board = board
        self._device = device
        self._describe_job = describe_job
        # The parallelisms inside the stages: their groups' collectives wait
        # for a peer at most `timeout` during a call.
        self._layout = layout
        self.replica_group = layout.replica_group
        # The replicas check in over their own group: they must make the
        # same calls (each steps on its own shard).
        self._replica_transport: Transport | None = None
        self._replica_board: FailureBoard | None = None
        if self.replica_group is not None:
            self._replica_transport, self._replica_board = c10d_transport(self.replica_group)
        # This rank in messages: its pipeline rank, and its global rank where
        # that differs (a mesh).
        self.name = f"rank {self.rank}"
        if not own_transport and dist.get_rank() != self.rank:
            self.name += f" (global rank {dist.get_rank()})"
        self.first_done = False  # the first call (the same-job check) is done
        # Run right after the check-in of the first call other than
        # init_weights / load_state_dict (which make the ties equal anyway).
        self.first_call_hook: Callable[[], None] | None = None
        # Collective calls that reached their check-in.
        self.calls = 0
        # Whether the last call exchanged messages with the peers (after that,
        # a failure may leave messages in flight); testing.LocalPipeline reads it.
        self.communicated = False
        # Whether the last failed call failed here first (not because a
        # peer's failure aborted it).
        self.failed_first = False

    def _transports(self) -> list[tuple[Transport, FailureBoard | None]]:
        pairs = [(self.transport, self._board)]
        if self._replica_transport is not None:
            pairs.append((self._replica_transport, self._replica_board))
        return pairs

    @contextlib.contextmanager
    def call(
        self, kind: str, *, options: str = "", batch: BatchPrint | None = None
    ) -> Iterator[None]:
        """Runs the block as collective call `kind`: checks in, watches for
        a peer's failure, tells the peers of one here (a KeyboardInterrupt
        stays one)."""
        self.refuse_if_failed()
        self.calls += 1
        self.communicated = True
        for t, _ in self._transports():
            t.arm()
        restore = [self._bound_waits(g) for g in self._layout.groups()]
        try:
            was_first = not self.first_done
            self._check_in(Call(self.calls, kind, options, batch))
            hook = self.first_call_hook
            if was_first and hook is not None and kind not in ("init_weights", "load_state_dict"):
                hook()
            self._layout.on_call(kind, self._device)
            yield
        except BaseException as err:
            self._failed(kind, err)
            raise
        finally:
            for undo in restore:
                undo()
            for t, _ in self._transports():
                t.disarm()

    def _bound_waits(self, group: dist.ProcessGroup) -> Callable[[], None]:
        """Gives a parallelism's group's Gloo collectives the runner's timeout
        for the call (a mesh's groups have torch's default, 30 minutes): a
        peer that failed and lives on fails a DTensor collective or a gradient
        average waiting for it within `timeout`. Returns what restores the
        group's own timeout."""
        if self._device.type != "cpu":
            # NCCL's timeout aborts the process: not changed here.
            return lambda: None
        try:
            backend = group._get_backend(torch.device("cpu"))
            before = backend.options._timeout
        except (AttributeError, RuntimeError):
            return lambda: None
        bound = datetime.timedelta(seconds=self.timeout)
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if bound >= before or set_timeout is None:
            return lambda: None
        set_timeout(bound, group)
        return lambda: set_timeout(before, group)

    def _failed(self, kind: str, err: BaseException) -> None:
        """Posts this rank's failure in call `kind`; raises what the caller
        is to see instead of `err`, if anything (returns to re-raise `err`)."""
        reason = self.abort_reason()
        raw = _raw_collective_error(err)
        if reason is None and (raw or isinstance(err, (TransportError, PipelineError))):
            # A peer may have posted its failure before this rank's watch saw
            # it (and then exited, closing its connections): its reason is
            # the cause.
            reason = next((b.peek() for _, b in self._transports() if b is not None), None)
        if reason is not None and isinstance(err, PipelineError) and reason not in str(err):
            # A task of this rank failed after a peer had: a tp peer's DTensor
            # collective inside a stage fails (a Gloo timeout, a closed
            # connection) where the executor's own waits stop naming the
            # peer. The peer's failure is the cause.
            self.failed_first = False
            # After the first line (the executor's, before the traceback).
            head, sep, rest = str(err).partition("\n")
            failed = _same_kind(err, f"{head}. The cause, posted before: {reason}{sep}{rest}")
            self._fail(f"{self.name} failed in {kind}: {first_line(failed)}")
            raise failed from err
        # First to fail, or failing because a peer did?
        self.failed_first = reason is None
        if isinstance(err, TransportError) or (raw and reason is not None):
            # A raw error of a collective outside the transport (the
            # replicas' gradient average, the loss's mean over them) after a
            # posted failure: that failure is the cause, named as the
            # transport's own errors name it.
            failed = PipelineError(self._outside_executor(kind, err, reason))
            self._fail(f"{self.name} failed in {kind}: {failed}")
            raise failed from err
        self._fail(f"{self.name} failed in {kind}: {first_line(err)}")

    def abort_reason(self) -> str | None:
        return next((r for t, _ in self._transports() if (r := t.abort_reason) is not None), None)

    def _fail(self, reason: str) -> None:
        """Tells every group this rank talks to that it failed."""
        for t, _ in self._transports():
            t.fail(reason)

    def _outside_executor(self, kind: str, err: BaseException, reason: str | None) -> str:
        """A failed exchange outside the executor (the check-in, results
        shared at the end of a step, a collective), with this rank's context,
        as the executor gives."""
        if reason is not None:
            hint = (
                f" (this rank came to {kind} after a peer had stopped waiting for it: if it was "
                f"busy between calls (evaluation, a checkpoint), raise the timeout, "
                f"{self.timeout:g} s)"
                if self._waited_for_here(reason)
                else ""
            )
            return f"torchmpmd: {self.name} stopped {kind}, because {reason}{hint}"
        return f"torchmpmd: {self.name} failed in {kind}: {err}"

    def _waited_for_here(self, reason: str) -> bool:
        """Whether a peer's failure `reason` is that it gave up waiting for this rank."""
        names = [f"(?<!global )rank {self.rank}"]
        if self.replica_group is not None:
            names.append(f"global rank {dist.get_rank()}")
        return re.search(f"(?:{'|'.join(names)}) did not answer within", reason) is not None

    def refuse_if_failed(self) -> None:
        """A runner whose call failed (here or on a peer) is not reused."""
        reason = self.abort_reason()
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
        gloo_threads.cover()  # loop threads made since (mpmd.tune_cpu)
        job = None if self.first_done else self._describe_job()
        check_in(self.transport, self.timeout, call, self._device, job=job)
        if self._replica_transport is not None and self.replica_group is not None:
            group = self.replica_group
            check_in(
                self._replica_transport,
                self.timeout,
                call,
                self._device,
                replicas=True,
                name=lambda r: f"global rank {dist.get_global_rank(group, r)}",
            )
        self.first_done = True


def connect(
    layout: Layout, group: dist.ProcessGroup | None, transport: Transport | None
) -> tuple[Transport, FailureBoard | None, dist.ProcessGroup | None]:
    """The runner's transport (the one given, or c10d over the layout's
    pipeline group, `group` or the world), the board its ranks post failures
    on and the process group it runs over (None for a transport of the
    user's own)."""
    mesh = layout.mesh
    if mesh is not None:
        if group is not None or transport is not None:
            raise ValueError("PipelineRunner: pass mesh, or group / transport, not both")
        group = layout.pipeline_group
    if transport is not None:
        if group is not None:
            raise ValueError("PipelineRunner: pass group or transport, not both")
        if not isinstance(transport, Transport):
            raise TypeError(
                f"PipelineRunner: transport must be a torchmpmd transport, got "
                f"{type(transport).__name__}; wrap a process group with group=..."
            )
        return transport, None, None
    if not dist.is_initialized():
        raise RuntimeError(
            "PipelineRunner: torch.distributed is not initialized; call "
            "dist.init_process_group() first (torchrun sets up the environment)"
        )
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("PipelineRunner: torch.distributed has no default process group")
    made, board = _mesh_transport(group, mesh) if mesh is not None else c10d_transport(group)
    return made, board, group


# How many transports this process made per mesh (by its ranks), per default
# process group: every rank builds its runners in the same order, so the
# n-th has the same board key (a group made again counts afresh).
_mesh_transports_made: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, int]] = (
    weakref.WeakKeyDictionary()
)


def _mesh_transport(
    group: dist.ProcessGroup, mesh: DeviceMesh
) -> tuple[C10dTransport, FailureBoard | None]:
    """A transport over the mesh's pipeline `group` whose failure board is the
    whole mesh's (a key of the world's store that every rank of the mesh
    watches): a failure on one rank ends the waits of every rank of the
    job at once, not only those of its pipeline group, and names it; its tp
    peers and their pipelines included, which share no pipeline group
    with it."""
    world = dist.group.WORLD
    store = _store_of(world) if world is not None else None
    if store is None or world is None:
        return c10d_transport(group)
    ranks = ",".join(str(r) for r in mesh.mesh.flatten().tolist())
    name = hashlib.sha1(ranks.encode()).hexdigest()[:16]
    made = _mesh_transports_made.setdefault(world, {})
    n = made.get(name, 0)
    made[name] = n + 1
    key = f"torchmpmd/failed/mesh-{name}/{n}"
    return C10dTransport(group, store=store, key=key), FailureBoard(store, key)


# Gloo's errors: "[.../pair.cc:553] Connection closed by peer ...".
_GLOO_ERROR = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ")


def _raw_collective_error(err: BaseException) -> bool:
    """Whether `err` is a torch.distributed collective's own (Gloo raises a
    plain RuntimeError: "Connection closed by peer", "Timed out waiting"),
    not one of torchmpmd's or a stage's."""
    return isinstance(err, dist.DistError) or (
        type(err) is RuntimeError and _GLOO_ERROR.match(str(err)) is not None
    )


def _same_kind(err: BaseException, message: str) -> PipelineError:
    """A PipelineError of `err`'s type (PipelineError[ValueError], ...) with `message`."""
    try:
        out = type(err)(message)
    except TypeError:
        out = PipelineError(message)
    return out if isinstance(out, PipelineError) else PipelineError(message)


def pick_device(device: torch.device | str | None, transport: Transport) -> torch.device:
    """The runner's device: the one given (a bare "cuda": this process's
    current GPU), else the one whose tensors the transport exchanges (its
    own answer: the current GPU for an NCCL group, else the CPU)."""
    if device is None:
        device = transport.device_type
    device = torch.device(device)
    if device == torch.device("cuda"):  # no index: this process's current GPU
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "meta":
        raise ValueError(
            "PipelineRunner: device='meta' cannot run a step; the meta device is for tracing "
            "a model and for describing it (the runner allocates its stages on a real device)"
        )
    return device
