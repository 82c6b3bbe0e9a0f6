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


def c10d_transport(group: dist.ProcessGroup) -> C10dTransport:
    """A C10dTransport over `group` that tells the group's other ranks when
    this one fails, through the group's c10d store (every rank of the group
    makes its transports in the same order, so the n-th ones share a key)."""
    store = _store_of(group)
    if store is None:
        return C10dTransport(group)
    name = group.group_name
    n = _transports_made.get(name, 0)
    _transports_made[name] = n + 1
    return C10dTransport(group, store=store, key=f"torchmpmd/failed/{n}")


def _store_of(group: dist.ProcessGroup) -> Store | None:
    """The c10d store of `group` (private in torch: None if it moved)."""
    try:
        entry = dist.distributed_c10d._world.pg_map.get(group)
    except AttributeError:
        return None
    return None if entry is None else entry[1]


# Tags of the messages that share a step's results; program messages use
# tags from 0 upwards in each rank pair's sequence.
_RESULT_TAG = 1 << 30


def broadcast(transport: Transport, tensor: torch.Tensor, src: int, timeout: float) -> None:
    """Gives every rank `src`'s `tensor` (received in place elsewhere)."""
    if transport.rank == src:
        for r in range(transport.size):
            if r != src:
                transport.send(tensor, r, _RESULT_TAG, timeout)
    else:
        transport.recv(tensor, src, _RESULT_TAG, timeout)


def all_gather(transport: Transport, rows: torch.Tensor, timeout: float) -> list[torch.Tensor]:
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
                _send_rows(transport, rows, peer, timeout)
                out[peer] = _recv_rows(transport, rows, peer, timeout)
            else:
                out[peer] = _recv_rows(transport, rows, peer, timeout)
                _send_rows(transport, rows, peer, timeout)
    return out


def _send_rows(transport: Transport, rows: torch.Tensor, peer: int, timeout: float) -> None:
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    transport.send(count, peer, _RESULT_TAG + 1, timeout)
    if rows.shape[0]:
        transport.send(rows, peer, _RESULT_TAG + 2, timeout)


def _recv_rows(transport: Transport, like: torch.Tensor, peer: int, timeout: float) -> torch.Tensor:
    count = torch.empty(1, dtype=torch.int64, device=like.device)
    transport.recv(count, peer, _RESULT_TAG + 1, timeout)
    part = like.new_empty((int(count.item()), like.shape[1]))
    if part.shape[0]:
        transport.recv(part, peer, _RESULT_TAG + 2, timeout)
    return part
