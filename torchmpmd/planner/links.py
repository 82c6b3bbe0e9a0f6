"""The costs of communication, measured on the machine at hand (`calibrate`)
or taken from a machine's description (`Links.from_machine`), in one object
the simulator prices point-to-point sends and the data- and tensor-parallel
collectives from.

A `Link` is `time(nbytes) = latency + nbytes / bandwidth`: `latency` in
seconds per call, `bandwidth` in bytes/s. `Links` holds one per kind of
communication, with the group size they hold for. What `nbytes` counts, per
kind, is the whole tensor as the caller holds it:

- `send`: one message of nbytes from one rank to another;
- `all_reduce`: a tensor of nbytes, reduced in place on every rank;
- `all_gather`: nbytes gathered in all (each rank gives nbytes / g);
- `reduce_scatter`: an input of nbytes (each rank keeps nbytes / g of the sum);
- `all_to_all`: nbytes sent in all from each rank (its input, split g ways,
  one part kept).

So a `Link` of a collective is the collective's own, on its group size:
the time of one call, whatever algorithm the backend chose, as a user
calling it sees it. To price the same collective on another group size
(`Links.scaled_to`, `Links.time(..., group_size=)`), the links assume the
ring algorithm on links that do not change with the group: a step sends a
g-th of the tensor to the next rank over the same link (latency a, bandwidth
b), an all-gather, reduce-scatter or all-to-all takes g - 1 steps,
`(g - 1) * a + (g - 1) / g * nbytes / b`, and an all-reduce twice that.
Measured on 2 ranks of a machine, that prices 4 or 8 of the same machine as
far as its links are alike (one node's shared memory, NVLink through a
switch); it does not hold across a change of link (a group that spans
nodes: `Links.from_machine` with the link between nodes, or calibrate on
the real group), nor for tree algorithms whose latency grows with log g.

`calibrate` is a collective over a process group: every rank calls it,
each kind is timed on a few message sizes and fitted, and every rank gets
rank 0's `Links`, in about a second (its docstring says how it measures).
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..graph.format import table
from .check_in import check_in
from .cluster import Machine

__all__ = ["DEFAULT_SIZES", "KINDS", "Link", "Links", "calibrate"]

# The kinds of communication a `Links` prices, its fields' names.
KINDS = ("send", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# Message sizes (bytes) `calibrate` times by default: latency-bound,
# between, and bandwidth-bound on a CPU or GPU link.
DEFAULT_SIZES = (4 << 10, 256 << 10, 4 << 20)
# Seconds of timed calls per (kind, size) past which `calibrate` times fewer
# repeats, and larger sizes of that kind not at all (a slow link).
_BUDGET = 0.25


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of communication: `latency` seconds per call, `bandwidth`
    bytes/s (`math.inf`: nothing per byte)."""

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        lat, bw = self.latency, self.bandwidth
        if not (_is_number(lat) and math.isfinite(lat) and lat >= 0):
            raise ValueError(f"Link.latency must be a non-negative number of seconds, got {lat!r}")
        if not (_is_number(bw) and bw > 0):
            raise ValueError(
                f"Link.bandwidth must be a positive number of bytes/s (math.inf for a link "
                f"that costs nothing per byte), got {bw!r}"
            )

    def time(self, nbytes: float) -> float:
        """Seconds to move `nbytes` (0 for nothing to move: no call made)."""
        if not (_is_number(nbytes) and math.isfinite(nbytes) and nbytes >= 0):
            raise ValueError(f"Link.time: nbytes must be a non-negative number, got {nbytes!r}")
        if nbytes == 0:
            return 0.0
        return self.latency + nbytes / self.bandwidth

    @property
    def free(self) -> bool:
        """Whether the link costs nothing (no latency, infinite bandwidth)."""
        return self.latency == 0 and self.bandwidth == math.inf


_FREE = Link(0.0, math.inf)


@dataclass(frozen=True, kw_only=True, slots=True)
class Links:
    """One `Link` per kind of communication (`KINDS`), each the time of one
    call on a group of `group_size` ranks, with `nbytes` the whole tensor
    as the caller holds it (see the module docstring). From `calibrate`
    (measured), `Links.from_machine` (described) or `Links.free()`."""

    send: Link
    all_reduce: Link
    all_gather: Link
    reduce_scatter: Link
    all_to_all: Link
    group_size: int

    def __post_init__(self) -> None:
        for kind in KINDS:
            if not isinstance(getattr(self, kind), Link):
                raise TypeError(f"Links.{kind} must be an mpmd.Link, got {getattr(self, kind)!r}")
        size = self.group_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"Links.group_size must be a positive int, got {size!r}")

    @staticmethod
    def free() -> Links:
        """Communication that costs nothing: one device, or a simulation
        that leaves communication out. Scales to any group size as free."""
        return Links(**{kind: _FREE for kind in KINDS}, group_size=1)

    @staticmethod
    def from_machine(
        machine: Machine, group_size: int, *, within_node: bool | None = None
    ) -> Links:
        """The ring model (module docstring) of a group of `group_size`
        devices on `machine`'s link inside a node (`within_node=True`) or
        between nodes (False); by default inside a node while the group fits
        in one (`machine.devices_per_node`), as `mpmd.project` prices tensor
        parallelism. `send` is one message over that link."""
        if not isinstance(machine, Machine):
            raise TypeError(f"Links.from_machine: machine must be an mpmd.Machine, got {machine!r}")
        _check_group_size("Links.from_machine", group_size)
        if within_node is None:
            within_node = group_size <= machine.devices_per_node
        if within_node and group_size > machine.devices_per_node:
            raise ValueError(
                f"Links.from_machine: a group of {group_size} does not fit in a node of "
                f"{machine.devices_per_node} devices; pass within_node=False (the link between "
                "nodes) or leave it out"
            )
        if within_node:
            step = Link(machine.intra_node_latency, machine.intra_node_bandwidth)
        else:
            step = Link(machine.inter_node_latency, machine.inter_node_bandwidth)
        return Links(
            **{kind: _on_group(step, kind, group_size) for kind in KINDS}, group_size=group_size
        )

    def link(self, kind: str) -> Link:
        """The `Link` of `kind` (one of `KINDS`)."""
        if kind not in KINDS:
            raise ValueError(f"Links: unknown kind {kind!r}; pick one of {', '.join(KINDS)}")
        link: Link = getattr(self, kind)
        return link

    def time(self, kind: str, nbytes: float, *, group_size: int | None = None) -> float:
        """Seconds of one `kind` call on `nbytes` (the whole tensor, module
        docstring), on `group_size` ranks (default: the links' own; another
        is priced by the ring model, `scaled_to`)."""
        links = self if group_size is None else self.scaled_to(group_size)
        return links.link(kind).time(nbytes)

    def scaled_to(self, group_size: int) -> Links:
        """These links on a group of `group_size` ranks of the same machine,
        by the ring model (module docstring): a collective measured at
        latency L, bandwidth B on g ranks is, on g' ranks, latency
        L (g' - 1) / (g - 1) and bandwidth B ((g - 1) / g) / ((g' - 1) / g')
        (from 2 ranks to 4: 3 L and 2 B / 3); `send` does not change. On
        one rank the collectives are free.
        Links of one rank cannot be scaled up (there was no collective to
        measure), except `Links.free()`, which stays free."""
        _check_group_size("Links.scaled_to", group_size)
        if group_size == self.group_size:
            return self
        if self.group_size == 1 and not all(self.link(kind).free for kind in KINDS):
            raise ValueError(
                "Links.scaled_to: these links are for a group of 1 rank, where collectives "
                f"cost nothing, so they say nothing of a group of {group_size}; calibrate on "
                "2 or more ranks, or use Links.from_machine(machine, group_size)"
            )
        return Links(
            **{
                kind: _on_group(_per_step(self.link(kind), kind, self.group_size), kind, group_size)
                for kind in KINDS
            },
            group_size=group_size,
        )

    def __repr__(self) -> str:
        rows = [
            (kind, _shown(self.link(kind).latency * 1e6), _shown(self.link(kind).bandwidth / 1e9))
            for kind in KINDS
        ]
        return table(
            f"Links on a group of {self.group_size} (time = latency + nbytes / bandwidth, "
            "nbytes the whole tensor):",
            ["kind", "latency (us)", "bandwidth (GB/s)"],
            rows,
        )


def _shown(value: float) -> float | int:
    """A table cell: whole from 100 up (1,770 rather than 1.77e+03)."""
    return round(value) if 100 <= value < math.inf else value


def _check_group_size(what: str, size: Any) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{what}: group_size must be a positive int, got {size!r}")


def _ring_factors(kind: str, group_size: int) -> tuple[float, float]:
    """(calls' latencies paid, share of nbytes through one link) of one
    `kind` call on `group_size` ranks by the ring algorithm (0, 0 on one
    rank: nothing to do)."""
    if kind == "send":
        return 1.0, 1.0
    g = group_size
    steps = 2 if kind == "all_reduce" else 1  # a reduce-scatter, then an all-gather
    return steps * (g - 1.0), steps * (g - 1.0) / g


def _on_group(step: Link, kind: str, group_size: int) -> Link:
    """One `kind` call on `group_size` ranks, each ring step over `step`."""
    calls, share = _ring_factors(kind, group_size)
    if share == 0 or step.free:
        return _FREE
    return Link(step.latency * calls, step.bandwidth / share)


def _per_step(link: Link, kind: str, group_size: int) -> Link:
    """The ring step of `link`, one `kind` call on `group_size` ranks (> 1
    unless the link is free)."""
    if link.free:
        return link
    calls, share = _ring_factors(kind, group_size)
    return Link(link.latency / calls, link.bandwidth * share)


def calibrate(
    group: dist.ProcessGroup | None = None,
    *,
    sizes: Sequence[int] | None = None,
    repeats: int = 10,
    timeout: float | datetime.timedelta = 60.0,
) -> Links:
    """The `Links` of `group` (default: the whole job), measured. A
    collective: call it on every rank of the group, under torchrun, with the
    same arguments; every rank gets the same `Links` (rank 0's fit).

    Each kind is timed on messages of `sizes` bytes (default
    `DEFAULT_SIZES`: 4 KiB, 256 KiB, 4 MiB; at least 2 distinct), on
    float32 tensors of the group's device (CUDA for NCCL, the CPU for
    Gloo): one warm-up call, then `repeats` calls, each after a barrier. A
    rank keeps its fastest call, and a size's time is the slowest rank's
    (a collective ends when its last rank does). The fastest rather than
    the median, as timeit does: a slower call is other work getting in the
    way, not the link. (On 2 Gloo ranks sharing the 2 cores of a VM a call
    takes 1x to 10x its fastest at random, in phases of tens of
    milliseconds, so the median of 10 calls of a 4 KiB all-reduce moved
    from 0.4 to 3.7 ms between rounds of the same launch, where the fastest
    stayed within 0.24-0.36 ms.) `send` is timed as a ping-pong between
    paired ranks (0 with 1, 2 with 3, ...; the odd one out waits), half the
    round trip. Then `latency + nbytes / bandwidth` is fitted to the sizes
    by least squares on relative error (so a 4 KiB call weighs as much as
    a 4 MiB one), latency and 1 / bandwidth clamped at 0. A size whose
    warm-up takes over a quarter of a second gets fewer repeats, and the
    larger sizes of its kind are left out, so a slow link does not hold the
    job for long. On 2 Gloo ranks sharing 2 CPU cores it takes about half
    a second, on 4 about 1.2 s.

    The ranks check in through the default group's store before any
    collective: a rank that has not called `calibrate` on this group within
    `timeout` seconds fails every rank that did with a TimeoutError naming
    it, instead of leaving them waiting. Past the check-in, a rank that dies
    fails the others at the process group's own timeout.

    A group of one rank gets `Links.free()` at once, without communicating.
    """
    sizes = _check_sizes(sizes)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"mpmd.calibrate: repeats must be a positive int, got {repeats!r}")
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if not (_is_number(seconds) and 0 < seconds < math.inf):
        raise ValueError(
            f"mpmd.calibrate: timeout must be a positive number of seconds, got {timeout!r}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "mpmd.calibrate measures the links of a process group: call it on every rank under "
            "torchrun (torch.distributed initialised, e.g. dist.init_process_group('nccl') on "
            "GPUs or 'gloo' on CPUs); on one device use mpmd.Links.free()"
        )
    me, g = dist.get_rank(group), dist.get_world_size(group)
    if me < 0:
        raise ValueError(
            "mpmd.calibrate: this rank is not in the group it was given; call it only on the "
            "group's ranks"
        )
    if g == 1:
        return Links.free()
    _check_in(group, float(seconds), {"sizes": list(sizes), "repeats": repeats})
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    device = _device(group)
    measured = torch.full((len(KINDS), len(sizes)), -1.0, dtype=torch.float64, device=device)
    nbytes = [[0.0] * len(sizes) for _ in KINDS]
    for k, kind in enumerate(KINDS):
        for s, size in enumerate(sizes):
            op, nbytes[k][s] = _op(kind, size, group, ranks, me, device)
            warm = _agreed_max(_timed(op, device, group, barrier=False), group, device)
            n = repeats if warm * repeats <= _BUDGET else max(1, int(_BUDGET / max(warm, 1e-9)))
            measured[k, s] = min(_timed(op, device, group, barrier=True) for _ in range(n))
            if warm > _BUDGET and s >= 1:
                break
    dist.reduce(measured, dst=ranks[0], op=dist.ReduceOp.MAX, group=group)
    box: list[Any] = [None]
    if me == 0:
        rows = measured.tolist()
        links = {
            kind: _fit(
                [n for n, t in zip(nbytes[k], rows[k], strict=True) if t >= 0],
                [t for t in rows[k] if t >= 0],
            )
            for k, kind in enumerate(KINDS)
        }
        box[0] = Links(**links, group_size=g)
    dist.broadcast_object_list(box, src=ranks[0], group=group)
    result: Links = box[0]
    return result


def _check_sizes(sizes: Sequence[int] | None) -> tuple[int, ...]:
    if sizes is None:
        return DEFAULT_SIZES
    bad = isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence)
    if bad or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise ValueError(
            f"mpmd.calibrate: sizes must be a sequence of positive ints (message sizes in "
            f"bytes), got {sizes!r}; e.g. sizes=(4096, 262144, 4194304)"
        )
    distinct = tuple(sorted(set(sizes)))
    if len(distinct) < 2:
        raise ValueError(
            f"mpmd.calibrate: sizes must hold at least 2 distinct message sizes to separate "
            f"latency from bandwidth, got {sizes!r}; e.g. sizes=(4096, 4194304)"
        )
    return distinct


def _check_in(group: dist.ProcessGroup | None, seconds: float, entry: dict[str, Any]) -> None:
    """Every rank of the group calls it within `seconds`, with the same
    arguments (`check_in`)."""
    me = dist.get_rank()
    advice = "Call it on every rank of the group, or raise timeout= if a rank is only slow"
    for r, other in check_in("mpmd.calibrate", group, seconds, entry, advice).items():
        differ = [k for k in entry if other[k] != entry[k]]
        if differ:
            raise ValueError(
                f"mpmd.calibrate: rank {me} and rank {r} were given different {differ[0]} "
                f"({entry[differ[0]]!r} and {other[differ[0]]!r}); pass the same sizes and "
                "repeats on every rank"
            )


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives run: the current CUDA device under
    NCCL (alone or beside Gloo, as the links a GPU job uses), else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _op(
    kind: str,
    size: int,
    group: dist.ProcessGroup | None,
    ranks: list[int],
    me: int,
    device: torch.device,
) -> tuple[Callable[[], float], float]:
    """A call of `kind` on about `size` bytes of float32 (a multiple of the
    group size in elements) returning the share of its time to count (1;
    a ping-pong 0.5), and the bytes it moves as the links count them."""
    g = len(ranks)
    numel = max(g, size // 4 // g * g)
    x = torch.zeros(numel, dtype=torch.float32, device=device)
    if kind == "send":
        peer = me ^ 1

        def ping_pong() -> float:
            if peer >= g:  # the odd rank out of an odd group
                return 0.5
            if me % 2 == 0:
                dist.send(x, ranks[peer], group=group)
                dist.recv(x, ranks[peer], group=group)
            else:
                dist.recv(x, ranks[peer], group=group)
                dist.send(x, ranks[peer], group=group)
            return 0.5

        return ping_pong, numel * 4.0
    part = torch.zeros(numel // g, dtype=torch.float32, device=device)
    out = torch.empty_like(x)
    calls: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(x, group=group),
        "all_gather": lambda: _all_gather(out, part, group=group),
        "reduce_scatter": lambda: _reduce_scatter(part, x, group=group),
        "all_to_all": lambda: dist.all_to_all_single(out, x, group=group),
    }
    call = calls[kind]

    def once() -> float:
        call()
        return 1.0

    return once, numel * 4.0


# torch 2.13 renamed the tensor forms of all-gather and reduce-scatter.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _timed(
    op: Callable[[], float],
    device: torch.device,
    group: dist.ProcessGroup | None,
    *,
    barrier: bool,
) -> float:
    """Seconds of one call of `op` on this rank, its device's work
    included, times the share `op` returns; after a barrier of the group
    if `barrier`, so that the ranks start it together."""
    if barrier:
        dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    share = op()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * share


def _agreed_max(value: float, group: dist.ProcessGroup | None, device: torch.device) -> float:
    """The largest `value` over the group's ranks, so that every rank makes
    the same choice from it (how many repeats) and no rank waits alone."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _fit(nbytes: Sequence[float], seconds: Sequence[float]) -> Link:
    """`latency + nbytes / bandwidth` through the points, by least squares
    on relative error (weights 1 / t^2), latency and 1 / bandwidth clamped
    at 0 (inf bandwidth: no time per byte seen)."""
    w = [1.0 / max(t, 1e-9) ** 2 for t in seconds]
    sw = sum(w)
    sn = sum(wi * n for wi, n in zip(w, nbytes, strict=True))
    snn = sum(wi * n * n for wi, n in zip(w, nbytes, strict=True))
    st = sum(wi * t for wi, t in zip(w, seconds, strict=True))
    snt = sum(wi * n * t for wi, n, t in zip(w, nbytes, seconds, strict=True))
    det = sw * snn - sn * sn
    slope = (sw * snt - sn * st) / det if det > 0 else 0.0
    latency = (st - sn * slope) / sw
    if slope <= 0:
        slope, latency = 0.0, st / sw
    elif latency < 0:
        slope, latency = snt / snn, 0.0
    return Link(max(latency, 0.0), 1.0 / slope if slope > 0 else math.inf)
