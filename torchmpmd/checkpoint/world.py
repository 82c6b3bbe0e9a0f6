"""Who takes part in a checkpoint call, when the runner has no process group.

A runner on a process group saves and loads with its processes: every rank
checks in through the group's store (agree.py) and DCP runs its collectives
over a group of its own (`checkpoint_group`). A runner built on a transport
of its own (`testing.LocalPipeline`'s ranks, threads of one process; a
`transport=` of the user's) has no process group: there every rank would
take itself for rank 0 of a world of one, and the ranks would write over one
another's files. Inside a checkpoint call such a rank joins its runner's
world (`joined`): its rank is the runner's, the check-ins and agreements go
over the runner's transport, and `save` hands every rank's state to rank 0,
which writes the one checkpoint (gathered.py: the files a job of processes
writes, keyed alike, loadable into any layout).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..runtime.transport import Transport, TransportError, all_gather, recv, send

if TYPE_CHECKING:
    from ..runtime.runner import PipelineRunner

__all__: list[str] = []

_local = threading.local()
# The tags of checkpoint messages, apart from the runner's own (a call of
# the runner is never in flight during a checkpoint call of the same rank).
_TAG = (1 << 30) + 16


@dataclass(frozen=True, slots=True)
class TransportWorld:
    """A runner's ranks over its own transport, for one checkpoint call."""

    transport: Transport

    @property
    def rank(self) -> int:
        return int(self.transport.rank)

    @property
    def size(self) -> int:
        return int(self.transport.size)

    def exchange(self, value: Any, timeout: float, what: str) -> list[Any]:
        """Every rank's `value` (plain data or tensors), by rank."""
        rows = all_gather(self.transport, _encode(value).view(-1, 1), timeout, what)
        return [value if r == self.rank else _decode(row.view(-1)) for r, row in enumerate(rows)]

    def gather(self, value: Any, timeout: float, what: str) -> list[Any] | None:
        """Every rank's `value` on rank 0 (by rank); None elsewhere."""
        if self.rank != 0:
            self._send(_encode(value), 0, timeout, what)
            return None
        return [value] + [self._recv(r, timeout, what) for r in range(1, self.size)]

    def _send(self, payload: torch.Tensor, peer: int, timeout: float, what: str) -> None:
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        send(self.transport, size, peer, _TAG, timeout, what)
        if payload.numel():
            send(self.transport, payload, peer, _TAG + 1, timeout, what)

    def _recv(self, peer: int, timeout: float, what: str) -> Any:
        size = torch.empty(1, dtype=torch.int64)
        recv(self.transport, size, peer, _TAG, timeout, what)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        if payload.numel():
            recv(self.transport, payload, peer, _TAG + 1, timeout, what)
        return _decode(payload)


# DCP warns at every call without a process group that it assumes one
# process: true of these calls, made on purpose; one at a time (the warning
# filters are the process's).
_quiet_lock = threading.Lock()


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """Runs a DCP call made without a process group on purpose (`no_dist`),
    without DCP's warning that it assumes a single process."""
    with _quiet_lock, warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _encode(value: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> Any:
    # The runner's own ranks, in this job: their state, not a file.
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


@contextlib.contextmanager
def joined(runner: PipelineRunner) -> Iterator[TransportWorld | None]:
    """Runs a checkpoint call of `runner`'s rank in its runner's world: a
    `TransportWorld` for a runner on a transport of its own, else None (the
    processes of torch.distributed)."""
    transport = runner.own_transport
    if transport is None:
        yield None
        return
    outer = getattr(_local, "world", None)
    _local.world = TransportWorld(transport)
    try:
        yield _local.world
    finally:
        _local.world = outer


def current() -> TransportWorld | None:
    """The world of the checkpoint call running on this thread, if it is a
    runner's own (`joined`)."""
    return getattr(_local, "world", None)


def own_rank() -> int:
    """This rank in the checkpoint call's world (0 without torch.distributed)."""
    world = current()
    if world is not None:
        return world.rank
    return dist.get_rank() if dist.is_initialized() else 0


def exchange(value: Any, timeout: float, what: str) -> list[Any]:
    """Every rank's `value`, by rank: over the runner's transport, or
    torch.distributed's world (a bounded group), or just this one."""
    world = current()
    if world is not None:
        return world.exchange(value, timeout, what)
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=checkpoint_group(timeout))
    return values


def timed_out(call: str, err: TransportError) -> TimeoutError:
    """A checkpoint call's failed exchange over a runner's own transport."""
    return TimeoutError(
        f"checkpoint.{call} is a collective: every rank must call it (with "
        f"testing.LocalPipeline: lp.on_all_ranks(lambda r: ...)). {err}"
    )


# One Gloo group for the checkpoints of this process's job (of its default
# group), made at the first save or load that needs it: a collective, which
# every rank reaches at the same call. Its timeout is set to each call's.
# (the default group it was made in, the group): the default group held, so
# that a later one is never taken for it.
_made: list[tuple[Any, dist.ProcessGroup]] = []
_made_lock = threading.Lock()


def checkpoint_group(timeout: float) -> dist.ProcessGroup:
    """The process group DCP's collectives and the agreements of a save or
    load run on: Gloo (CPU objects, as torchtitan's async checkpoints use),
    whose waits end after `timeout` seconds, whatever the default group's
    timeout (torch's: 30 minutes)."""
    world = dist.group.WORLD
    bound = datetime.timedelta(seconds=timeout)
    with _made_lock:
        if not _made or _made[0][0] is not world:
            _made[:] = [(world, dist.new_group(backend="gloo", timeout=bound))]
        group = _made[0][1]
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None:
        with contextlib.suppress(RuntimeError, AttributeError, ValueError):
            set_timeout(bound, group)
    return group
