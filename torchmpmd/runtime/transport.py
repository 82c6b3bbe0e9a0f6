"""Transports: how the ranks of a pipeline exchange tensors.

A `Transport` is the native point-to-point interface the executor runs on
(tag-matched, non-blocking sends and receives with timeouts). Two are built
in: `C10dTransport` over a torch.distributed process group (Gloo, NCCL) and
`LocalWorld(n).transport(rank)` for ranks as threads of one process. Pass one
to `PipelineRunner(..., transport=...)`; `group=` is shorthand for
`transport=C10dTransport(group)`. Besides the step's own messages, the runner
shares results (the loss, evaluation outputs, timelines) over the same
transport, so every transport gives the same behaviour.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from .. import _C

__all__ = ["C10dTransport", "LocalWorld", "Transport", "TransportError"]

Transport = _C.runtime.Transport
TransportError = _C.runtime.TransportError
C10dTransport = _C.runtime.C10dTransport
LocalWorld = _C.runtime.LocalWorld

_transports_made: dict[str, int] = {}


@dataclass(frozen=True, slots=True)
class FailureBoard:
    """Where the ranks of a group post the first failure (a key of the
    group's c10d store, which `C10dTransport` watches while armed)."""

    store: Store
    key: str

    def peek(self, wait_s: float = 2.0) -> str | None:
        """The failure posted so far, if any; a store that does not answer
        within `wait_s` (its host died) counts as none."""
        found: list[str | None] = [None]

        def read() -> None:
            try:
                if self.store.check([self.key]):
                    found[0] = self.store.get(self.key).decode(errors="replace")
            except Exception:  # an unreachable store: the transport's error stands
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(wait_s)
        return found[0]


def c10d_transport(group: dist.ProcessGroup) -> tuple[C10dTransport, FailureBoard | None]:
    """A C10dTransport over `group` that tells the group's other ranks when
    this one fails, through the group's c10d store (every rank of the group
    makes its transports in the same order, so the n-th ones share a key),
    and that board."""
    store = _store_of(group)
    if store is None:
        return C10dTransport(group), None
    name = group.group_name
    n = _transports_made.get(name, 0)
    _transports_made[name] = n + 1
    key = f"torchmpmd/failed/{n}"
    return C10dTransport(group, store=store, key=key), FailureBoard(store, key)


def _store_of(group: dist.ProcessGroup) -> Store | None:
    """The c10d store of `group` (private in torch: None if it moved)."""
    try:
        entry = dist.distributed_c10d._world.pg_map.get(group)
    except AttributeError:
        return None
    return None if entry is None else entry[1]


# ---- blocking exchanges that name the peer when they fail


def send(
    transport: Transport,
    tensor: torch.Tensor,
    peer: int,
    tag: int,
    timeout: float,
    what: str,
    peer_name: str | None = None,
) -> None:
    """`transport.send`, failing with an error that names the peer (as
    `peer_name`, default "rank <peer>") and `what` was being exchanged (e.g.
    "the check-in of call 3 (step)")."""
    _naming(transport.send, transport, tensor, peer, tag, timeout, what, peer_name)


def recv(
    transport: Transport,
    tensor: torch.Tensor,
    peer: int,
    tag: int,
    timeout: float,
    what: str,
    peer_name: str | None = None,
) -> None:
    """`transport.recv`, failing like `send`."""
    _naming(transport.recv, transport, tensor, peer, tag, timeout, what, peer_name)


def _naming(
    op: Callable[[torch.Tensor, int, int, float], None],
    transport: Transport,
    tensor: torch.Tensor,
    peer: int,
    tag: int,
    timeout: float,
    what: str,
    peer_name: str | None,
) -> None:
    try:
        op(tensor, peer, tag, timeout)
    except TransportError as err:
        raise naming_peer(transport, err, peer_name or f"rank {peer}", what, timeout) from None


_TIMED_OUT = re.compile(r"(?i)timed out|before the timeout")


def naming_peer(
    transport: Transport, err: BaseException, peer: str, what: str, timeout: float
) -> BaseException:
    """`err`, a failed exchange with `peer` ("rank 1"), as an error that says
    which rank did not answer or went away, and what to do. An abort (another
    rank's failure, whose reason the transport carries) is passed on unchanged."""
    text = str(err)
    if not isinstance(err, TransportError) or text == transport.abort_reason:
        return err
    # Gloo's "[.../pair.cc:553] Connection closed by peer [addr]:port. This is
    # typically caused by ...": the cause without the source line and advice.
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", text.strip())
    text = re.sub(r"(closed by peer \S+?)\. This is typically caused.*", r"\1", text, flags=re.S)
    if _TIMED_OUT.search(text):
        return TransportError(
            f"{peer} did not answer within {timeout:g} s while exchanging {what}: it is "
            "stuck, busy for longer than the timeout, or not making this call (every rank must "
            "make the runner's collective calls, in the same order); if it is only slow, raise "
            f"the timeout ({timeout:g} s)"
        )
    return TransportError(
        f"lost {peer} while exchanging {what}: {text}. {peer[0].upper()}{peer[1:]} may have "
        "died (check its log)"
    )


# Tags of the messages that share a step's results; program messages use
# tags from 0 upwards in each rank pair's sequence.
_RESULT_TAG = 1 << 30


def broadcast(
    transport: Transport, tensor: torch.Tensor, src: int, timeout: float, what: str
) -> None:
    """Gives every rank `src`'s `tensor` (received in place elsewhere)."""
    if transport.rank == src:
        for r in range(transport.size):
            if r != src:
                send(transport, tensor, r, _RESULT_TAG, timeout, what)
    else:
        recv(transport, tensor, src, _RESULT_TAG, timeout, what)


def all_gather(
    transport: Transport, rows: torch.Tensor, timeout: float, what: str
) -> list[torch.Tensor]:
    """Every rank's `rows` (a 2-D tensor: any number of rows, one width), by rank."""
    me = transport.rank
    out: list[torch.Tensor] = [rows] * transport.size
    rows = rows.contiguous()
    # Pairs in one global order, each rank taking its own in that order: the
    # first unfinished pair always has both ends ready, so blocking sends
    # (NCCL, or a Gloo send that waits for its receive) cannot deadlock.
    for a in range(transport.size):
        for b in range(a + 1, transport.size):
            if me not in (a, b):
                continue
            peer = b if me == a else a
            if me == a:
                _send_rows(transport, rows, peer, timeout, what)
                out[peer] = _recv_rows(transport, rows, peer, timeout, what)
            else:
                out[peer] = _recv_rows(transport, rows, peer, timeout, what)
                _send_rows(transport, rows, peer, timeout, what)
    return out


def _send_rows(
    transport: Transport, rows: torch.Tensor, peer: int, timeout: float, what: str
) -> None:
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    send(transport, count, peer, _RESULT_TAG + 1, timeout, what)
    if rows.shape[0]:
        send(transport, rows, peer, _RESULT_TAG + 2, timeout, what)


def _recv_rows(
    transport: Transport, like: torch.Tensor, peer: int, timeout: float, what: str
) -> torch.Tensor:
    count = torch.empty(1, dtype=torch.int64, device=like.device)
    recv(transport, count, peer, _RESULT_TAG + 1, timeout, what)
    part = like.new_empty((int(count.item()), like.shape[1]))
    if part.shape[0]:
        recv(transport, part, peer, _RESULT_TAG + 2, timeout, what)
    return part
