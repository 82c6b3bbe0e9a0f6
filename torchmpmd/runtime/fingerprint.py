"""Same job, same step: the runners of a group check in at every call.

Each `step` / `eval_step` starts with one small exchange over the runner's
transport: the call's number and kind, so that a rank that skipped or
repeated a step (an exception caught by the training loop) fails every rank
naming both calls, instead of pairing microbatches of different steps; and,
at the first call, hashes of each part of the configuration (versions, the
traced graph, the split, the schedule and its program, the number of
microbatches, dtypes), so that a difference fails naming the first part that
differs, instead of exchanging tensors of the wrong shape or waiting for
messages that never come.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from .transport import Transport, all_gather

if TYPE_CHECKING:
    from ..graph.pipe import Pipe
    from ..schedule.program import Program

__all__: list[str] = []

FIELDS = (
    "torchmpmd version",
    "torch version",
    "traced graph",
    "split into stages",
    "schedule and its program",
    "number of microbatches",
    "dtypes",
)


def _hash(text: str) -> int:
    # Object addresses (a function's repr in a graph) differ between processes.
    stable = re.sub(r" at 0x[0-9a-f]+", "", text)
    return int.from_bytes(hashlib.sha256(stable.encode()).digest()[:7], "little")


def describe(pipe: Pipe, program: Program, version: str) -> list[str]:
    """The configuration this rank was given, one text per field of FIELDS."""
    graphs = []
    for s in range(pipe.num_stages):
        stage = pipe.stage(s)
        if isinstance(stage, fx.GraphModule):
            # Ops and their wiring, not their keyword arguments: a runner
            # retargets the devices of its own stages' graphs.
            graphs.append(
                repr(
                    [
                        (n.op, str(n.target), [str(a) for a in n.all_input_nodes])
                        for n in stage.graph.nodes
                    ]
                )
            )
        else:
            graphs.append(type(stage).__name__)
    split = [
        (spec.input_names, spec.output_names, spec.num_user_inputs, spec.num_sends)
        for spec in pipe.stage_specs
    ]
    tasks = [[str(t) for t in program.tasks(r)] for r in range(program.num_ranks)]
    dtypes = [str(t.spec) for t in pipe.transfers] + [
        f"{n}:{p.dtype}" for n, p in pipe.named_parameters()
    ]
    return [
        version,
        torch.__version__,
        "\n".join(graphs),
        repr(split),
        f"{program.schedule!r} {program.placement} {tasks}",
        str(program.num_microbatches),
        repr(dtypes),
    ]


_KINDS = ("step", "eval_step")


def check_in(
    transport: Transport,
    timeout: float,
    call: int,
    kind: str,
    texts: list[str] | None,
    device: torch.device | None = None,
) -> None:
    """Every rank is at the same call (`call`-th step or eval_step) and, when
    `texts` is given (the first call), was given the same job. One small
    exchange per call, of tensors on `device` (the one the transport carries:
    CUDA for NCCL); raises on every rank, naming what differs."""
    me = transport.rank
    if texts is None:
        # Later calls: each rank compares with its neighbours in rank order,
        # a connected chain, one fixed-size message each way per pair.
        _check_neighbours(transport, timeout, call, kind, device)
        return
    hashes = [_hash(t) for t in texts]
    mine = torch.tensor([[call, _KINDS.index(kind), *hashes]], dtype=torch.int64, device=device)
    rows = [r.reshape(-1).tolist() for r in all_gather(transport, mine, timeout)]
    for i, field in enumerate(FIELDS):
        differ = [r for r, row in enumerate(rows) if row[2 + i] != rows[0][2 + i]]
        if differ:
            detail = f" (this rank: {texts[i]})" if len(texts[i]) <= 80 else ""
            raise RuntimeError(
                f"torchmpmd: rank {me}: the runners were not given the same job: the "
                f"{field} of rank(s) {differ} differs from rank 0's{detail}. Every rank "
                "must trace the same model with the same split and run the same schedule, "
                "torch and torchmpmd"
            )
    for r, row in enumerate(rows):
        _same_call(me, call, kind, r, row[:2])


def _same_call(me: int, call: int, kind: str, peer: int, theirs: list[int]) -> None:
    if theirs != [call, _KINDS.index(kind)]:
        raise RuntimeError(
            f"torchmpmd: rank {me} is at call {call} ({kind}) but rank {peer} at call "
            f"{theirs[0]} ({_KINDS[theirs[1]]}): a rank skipped or repeated a step (an exception "
            "caught by the training loop, a call made on some ranks only), so their messages "
            "would mix two steps. Every rank must call step and eval_step the same number of "
            "times, in the same order"
        )


_CHECK_TAG = 0x7FFF0100  # outside the tags programs use


def _check_neighbours(
    transport: Transport, timeout: float, call: int, kind: str, device: torch.device | None
) -> None:
    """Exchanges (call, kind) with rank - 1 and rank + 1, in the global pair
    order (0, 1), (1, 2), ...: the first unfinished pair always has both ends
    ready, so blocking sends cannot deadlock."""
    me, size = transport.rank, transport.size
    mine = torch.tensor([call, _KINDS.index(kind)], dtype=torch.int64, device=device)
    theirs = torch.empty(2, dtype=torch.int64, device=device)
    if me > 0:  # the higher end of (me - 1, me): receive, then send
        transport.recv(theirs, me - 1, _CHECK_TAG, timeout)
        transport.send(mine, me - 1, _CHECK_TAG, timeout)
        _same_call(me, call, kind, me - 1, theirs.tolist())
    if me < size - 1:  # the lower end of (me, me + 1): send, then receive
        transport.send(mine, me + 1, _CHECK_TAG, timeout)
        transport.recv(theirs, me + 1, _CHECK_TAG, timeout)
        _same_call(me, call, kind, me + 1, theirs.tolist())
