"""Same job, same call, same batch: the runners of a group check in before
every collective call.

Every call of a runner that exchanges messages (`step`, `eval_step`,
`clip_grad_norm_`, `gather_timeline`, `init_weights`, `load_state_dict`)
starts with one small exchange of a fixed size, whatever the call, with the
neighbouring ranks: the call's number and kind, a hash of its options (the
clipping norm), and for a step the batch's fingerprint (`BatchPrint`: the
inputs' and target's shapes and a sample of their values). A rank that
skipped or repeated a call, called another one (`clip_grad_norm_` on one rank
while the other gathers its timeline) or was given another batch therefore
fails every rank before any message of the call itself is exchanged: never
two calls' messages paired (wrong gradients reported as success), never a
receive of the wrong size (which Gloo answers with SIGABRT). When a pair
differs, both ends exchange a description of their call, so the error names
both sides.

At the first call, the runners also compare hashes of what they were given
(`fingerprint.describe`: versions, graph, split, schedule, dtypes), naming
the first part that differs.

Over a data-parallel group the check-in compares calls and options only: the
replicas step on their own shards of the batch.

A checkpoint's save or load checks in otherwise (`checkpoint/agree.py`):
every rank of the job, entries of any size, over the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _C
from .fingerprint import FIELDS, BatchPrint, stable_hash
from .transport import Transport, all_gather, recv, send

__all__: list[str] = []

KINDS = (
    "step",
    "eval_step",
    "clip_grad_norm_",
    "gather_timeline",
    "init_weights",
    "load_state_dict",
)

PipelineError = _C.runtime.PipelineError
_CHECK_TAG = 0x7FFF0100
# Header fields (`Call.header`) of the target (its structure, its values: 0
# when not given), and of the inputs' values.
_TARGET, _INPUT_VALUES, _TARGET_VALUES = 5, 6, 7  # outside the tags programs, results and ties use
_MAGIC = 0x6D706D64  # "mpmd": a message that is not a check-in is not read as one


@dataclass(frozen=True, slots=True)
class Call:
    """One collective call of a runner, as its check-in describes it."""

    number: int  # the runner's collective calls so far, this one included
    kind: str  # one of KINDS
    options: str = ""  # what every rank must pass alike (clip_grad_norm_'s norm)
    batch: BatchPrint | None = None  # step / eval_step
    # Given no target, the rank whose target this rank passes on.
    target_from: str | None = None

    def __str__(self) -> str:
        return f"call {self.number} ({self.kind})"

    def header(self, device: torch.device | None) -> torch.Tensor:
        """The fixed-size message: int64 [magic, number, kind, options,
        inputs, target, values of the inputs, values of the target]."""
        batch = self.batch
        fields = [
            _MAGIC,
            self.number,
            KINDS.index(self.kind),
            stable_hash(self.options),
            0 if batch is None else stable_hash(batch.inputs),
            0 if batch is None or batch.target is None else stable_hash(batch.target),
            *((0, 0) if batch is None else batch.values),
        ]
        return torch.tensor(fields, dtype=torch.int64, device=device)

    def describe(self) -> str:
        """What a peer's error says this rank was doing: its options or its batch."""
        if self.batch is not None:
            target = self.batch.target
            if self.target_from is not None:
                given = f"no target (passing on {self.target_from}'s)"
            else:
                given = "no target" if target is None else f"target {target}"
            return f"inputs {self.batch.inputs}, {given}"
        return f"{self.kind}({self.options})"


def check_in(
    transport: Transport,
    timeout: float,
    call: Call,
    device: torch.device | None,
    *,
    job: list[str] | None = None,
    replicas: bool = False,
    name: Callable[[int], str] = lambda r: f"rank {r}",
) -> None:
    """Checks that every rank of `transport`'s group makes the same `call`
    (with `replicas`, a data-parallel group: the same call and options,
    batches apart) and, given `job` (the first call), was given the same
    job. Raises on the ranks that see a difference, naming both sides; the
    runner then tells the others."""
    if job is not None:
        _same_job(transport, timeout, call, job, device)
    _check_neighbours(transport, timeout, call, device, replicas, name)


def _same_job(
    transport: Transport,
    timeout: float,
    call: Call,
    texts: list[str],
    device: torch.device | None,
) -> None:
    me = transport.rank
    hashes = [stable_hash(t) for t in texts]
    mine = torch.tensor([hashes], dtype=torch.int64, device=device)
    what = f"the job's fingerprint at {call}"
    rows = [r.reshape(-1).tolist() for r in all_gather(transport, mine, timeout, what)]
    for i, field in enumerate(FIELDS):
        differ = [r for r, row in enumerate(rows) if row[i] != rows[0][i]]
        if differ:
            detail = f" (this rank: {texts[i]})" if len(texts[i]) <= 80 else ""
            raise PipelineError(
                f"torchmpmd: rank {me}: the runners were not given the same job: the "
                f"{field} of rank(s) {differ} differs from rank 0's{detail}. Every rank "
                "must trace the same model with the same split and run the same schedule, "
                "torch and torchmpmd"
            )


def _check_neighbours(
    transport: Transport,
    timeout: float,
    call: Call,
    device: torch.device | None,
    replicas: bool,
    name: Callable[[int], str],
) -> None:
    """Exchanges the header with rank - 1 and rank + 1, in the global pair
    order (0, 1), (1, 2), ...: the first unfinished pair always has both ends
    ready, so blocking sends cannot deadlock. Equal neighbours make the whole
    chain equal. A rank given no target passes on the target of the rank
    below it, so that ranks given targets on either side of it are compared
    too."""
    me, size = transport.rank, transport.size
    mine = call.header(device)
    theirs = torch.empty_like(mine)
    what = f"the check-in of {call}, a collective call every rank must make"
    if me > 0:  # the higher end of (me - 1, me): receive, then send
        recv(transport, theirs, me - 1, _CHECK_TAG, timeout, what, name(me - 1))
        send(transport, mine, me - 1, _CHECK_TAG, timeout, what, name(me - 1))
        _compare(transport, timeout, call, me - 1, mine, theirs, replicas, name, first=False)
        if not replicas and int(mine[_TARGET]) == 0 and int(theirs[_TARGET]) != 0:
            mine = mine.clone()
            mine[_TARGET] = theirs[_TARGET]
            mine[_TARGET_VALUES] = theirs[_TARGET_VALUES]
            call = dataclasses.replace(call, target_from=name(me - 1))
    if me < size - 1:  # the lower end of (me, me + 1): send, then receive
        send(transport, mine, me + 1, _CHECK_TAG, timeout, what, name(me + 1))
        recv(transport, theirs, me + 1, _CHECK_TAG, timeout, what, name(me + 1))
        _compare(transport, timeout, call, me + 1, mine, theirs, replicas, name, first=True)


def _compare(
    transport: Transport,
    timeout: float,
    call: Call,
    peer: int,
    mine_t: torch.Tensor,
    theirs_t: torch.Tensor,
    replicas: bool,
    name: Callable[[int], str],
    first: bool,
) -> None:
    """Raises if the peer's header differs (in what this group compares).
    Both ends see the same two headers, so both raise, after exchanging
    their descriptions (`first`: this rank is the pair's lower end)."""
    mine, theirs = mine_t.tolist(), theirs_t.tolist()
    if theirs[0] != _MAGIC:
        raise PipelineError(
            f"torchmpmd: {name(transport.rank)} received from {name(peer)} a message that is "
            f"not a call check-in while starting {call}: the ranks are out of step (a rank "
            "skipped or repeated a call); every rank must make the runner's collective calls "
            "in the same order"
        )
    compared = 4 if replicas else len(mine)
    if mine[:compared] == theirs[:compared] or _only_target_missing(mine, theirs, replicas):
        return
    text = call.describe()
    what = f"the descriptions of {call}"
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=mine_t.device)
    if first:
        _send_text(transport, data, peer, timeout, what, name(peer))
        other = _recv_text(transport, peer, mine_t.device, timeout, what, name(peer))
    else:
        other = _recv_text(transport, peer, mine_t.device, timeout, what, name(peer))
        _send_text(transport, data, peer, timeout, what, name(peer))
    raise PipelineError(_difference(call, mine, theirs, name(transport.rank), name(peer), other))


def _only_target_missing(mine: list[int], theirs: list[int], replicas: bool) -> bool:
    """The batches match, but one rank passed no target (only the last
    stage's rank reads it): not a difference."""
    if replicas or mine[:_TARGET] != theirs[:_TARGET]:
        return False
    if mine[_INPUT_VALUES] != theirs[_INPUT_VALUES]:
        return False
    return mine[_TARGET] == 0 or theirs[_TARGET] == 0


def _difference(
    call: Call, mine: list[int], theirs: list[int], me: str, peer: str, other: str
) -> str:
    if mine[1] != theirs[1]:
        return (
            f"torchmpmd: {me} is at {call} but {peer} at call {theirs[1]} "
            f"({KINDS[theirs[2]]}): a rank skipped or repeated a call (an exception caught by "
            "the training loop, a call made on some ranks only), so their messages would mix "
            f"two calls. Every rank must make the runner's collective calls ({', '.join(KINDS)}) "
            "the same number of times, in the same order"
        )
    if mine[2] != theirs[2]:
        return (
            f"torchmpmd: {me} is at {call} but {peer} at call {theirs[1]} "
            f"({KINDS[theirs[2]]}): {call.kind} and {KINDS[theirs[2]]} are collective calls: "
            "every rank must call them, in the same order"
        )
    if mine[3] != theirs[3]:
        return (
            f"torchmpmd: {me} and {peer} made {call} with other arguments ({me}: "
            f"{call.describe()}; {peer}: {other}): pass the same on every rank"
        )
    if mine[4:6] != theirs[4:6]:
        return (
            f"torchmpmd: {me} and {peer} were given different batches for {call} ({me}: "
            f"{call.describe()}; {peer}: {other}): every rank of the pipeline must pass the same "
            "full batch (and target) to each step"
        )
    return (
        f"torchmpmd: {me} and {peer} were given different batches for {call}: the same shapes "
        f"but other values (a sample of them differs; {me}: {call.describe()}; {peer}: "
        f"{other}). A rank skipped "
        "or repeated a batch (a loader error caught on one rank?) or reads another part of "
        "the data; every rank of the pipeline must pass the same batch to each step"
    )


def _send_text(
    transport: Transport, data: torch.Tensor, peer: int, timeout: float, what: str, who: str
) -> None:
    count = torch.tensor([data.numel()], dtype=torch.int64, device=data.device)
    send(transport, count, peer, _CHECK_TAG + 1, timeout, what, who)
    if data.numel():
        send(transport, data, peer, _CHECK_TAG + 2, timeout, what, who)


def _recv_text(
    transport: Transport, peer: int, device: torch.device, timeout: float, what: str, who: str
) -> str:
    count = torch.empty(1, dtype=torch.int64, device=device)
    recv(transport, count, peer, _CHECK_TAG + 1, timeout, what, who)
    data = torch.empty(int(count.item()), dtype=torch.uint8, device=device)
    if data.numel():
        recv(transport, data, peer, _CHECK_TAG + 2, timeout, what, who)
    return bytes(data.cpu().tolist()).decode(errors="replace")
