"""Random numbers of ranks run as threads of one process (`testing.LocalPipeline`).

Separate processes each draw from their own generator. Threads share torch's
one global CPU generator, so the order in which rank threads happen to draw
(dropout in a forward, a recompute replaying a saved state) would decide
every rank's random numbers, and two identical seeded runs would differ.
Here each rank has a generator state of its own: the code that draws (a
stage's forward, tracing a split stage, a selective recompute's replay) runs
under one process-wide lock with the global generator set to the rank's
state, saved back when it is done. Outside a LocalPipeline's rank threads
every function here does nothing.

A LocalPipeline's ranks follow the generator of the thread that calls it, as
processes seeded alike would: a call starts every rank from the caller's
state when that state is not the one the previous call left behind (the
caller seeded or drew since), else each rank continues from its own; after
a call the caller's generator holds rank 0's state.

Ranks take turns at drawing: a rank waits for another's forward, at most the
runners' timeout (a rank stuck in its stage or loss fails the others then,
named, as a receive from it would).

A full recompute (R) replays the same way: its forward is the second call
of the forward callable for that stage and microbatch, which replays the
state the first began from, and the runner tells the native executor not to
set the shared generator itself (`Executor.run(replay_rng=False)`) in rank
threads. Only the CPU generator is kept per rank: stages on a GPU replay
their recomputes from the device's shared generator, exact only while one
rank thread draws at a time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__: list[str] = []

# One lock for the process: the global generator it guards is the process's.
_LOCK = threading.RLock()
_holder: int | None = None  # the rank holding it
_local = threading.local()


class RankGenerators:
    """The generator states of one LocalPipeline's ranks.

    `start_call` and `end_call` run on the calling thread around a call;
    `in_rank` wraps a rank thread's target. Not for concurrent calls of one
    LocalPipeline (it makes none)."""

    def __init__(self, num_ranks: int) -> None:
        self._states: list[torch.Tensor | None] = [None] * num_ranks
        self._left: torch.Tensor | None = None  # the caller's state after the last call
        self.timeout = 300.0

    def start_call(self, timeout: float) -> None:
        """Every rank starts from the caller's state if it changed since the
        last call. A rank waits at most `timeout` seconds for another to finish
        drawing (as it would for that rank's message)."""
        self.timeout = timeout
        caller = torch.get_rng_state()
        if self._left is None or not torch.equal(caller, self._left):
            # One buffer per rank, written in place after each draw: a state
            # left in a new tensor would count as memory the forward kept.
            self._states = [caller.clone() for _ in self._states]

    def end_call(self) -> None:
        """The caller continues from rank 0's state, as rank 0's process would."""
        state = self._states[0]
        if state is not None:
            torch.set_rng_state(state)
        self._left = torch.get_rng_state()

    def in_rank(self, target: Callable[[int], Any]) -> Callable[[int], None]:
        """`target(rank)` run with `rank`'s generator for what it draws."""

        def run(rank: int) -> None:
            _local.current = (self, rank)
            _local.depth = 0
            try:
                target(rank)
            finally:
                del _local.current

        return run


@contextlib.contextmanager
def own_generator(replay: torch.Tensor | None = None) -> Iterator[torch.Tensor | None]:
    """Runs the block with the calling rank thread's own generator state, or
    with `replay` (a state yielded before) leaving the rank's state as it
    was; yields the state the block starts from. Waits until no other rank
    thread is drawing, at most the runners' timeout. Outside a LocalPipeline's
    rank threads (and nested in a block that has the rank's state already)
    it does nothing and yields None. The rank's own state (the yielded
    tensor) is updated in place afterwards: clone it to keep it."""
    global _holder
    current: tuple[RankGenerators, int] | None = getattr(_local, "current", None)
    if current is None or (replay is None and _local.depth > 0):
        yield None
        return
    gens, rank = current
    if not _LOCK.acquire(timeout=gens.timeout):
        raise RuntimeError(
            f"rank {rank} waited {gens.timeout:g} s for rank {_holder} to finish its forward: "
            "a LocalPipeline's ranks take turns at drawing random numbers (each from its own "
            f"generator), and rank {_holder} may be stuck in its stage or its loss"
        )
    outer_holder, _holder = _holder, rank
    try:
        outer = torch.get_rng_state()
        start = gens._states[rank] if replay is None else replay
        if start is None:  # a rank thread not started by a call: the state it finds
            start = outer
        torch.set_rng_state(start)
        _local.depth += 1
        try:
            yield start
        finally:
            _local.depth -= 1
            if replay is None:
                own = gens._states[rank]
                if own is None:
                    gens._states[rank] = torch.get_rng_state()
                else:
                    own.copy_(torch.get_rng_state())
            torch.set_rng_state(outer)
    finally:
        _holder = outer_holder
        _LOCK.release()


def in_rank_thread() -> bool:
    """Whether the calling thread is a rank of a LocalPipeline."""
    return getattr(_local, "current", None) is not None


class _Recorded:
    """A checkpoint's forward context: notes the generator state its forward
    starts from (the rank's own), then enters `inner`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.state: torch.Tensor | None = None

    def __enter__(self) -> None:
        self.state = torch.get_rng_state()
        self._inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)


class _Replayed:
    """A checkpoint's recompute context: the forward's state under the lock
    (re-entrant: a second backward recomputes again)."""

    def __init__(self, forward: _Recorded, inner: Any) -> None:
        self._forward = forward
        self._inner = inner
        self._entered: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            stack.enter_context(own_generator(replay=self._forward.state))
            stack.enter_context(self._inner)
            self._entered.append(stack.pop_all())

    def __exit__(self, *exc: Any) -> None:
        self._entered.pop().__exit__(*exc)


def checkpoint_rng(
    context_fn: Callable[[], tuple[Any, Any]], device: torch.device
) -> tuple[Callable[[], tuple[Any, Any]], bool]:
    """`context_fn` and `preserve_rng_state` for torch.utils.checkpoint: as
    given outside a LocalPipeline's rank threads and for stages on another
    device than the CPU (whose generator is not kept per rank: the
    checkpoint replays it); in them, the recompute replays the forward's
    generator state under the lock itself (the checkpoint's own replay would
    set the shared generator while another rank draws)."""
    if not in_rank_thread() or device.type != "cpu":
        return context_fn, True

    def contexts() -> tuple[Any, Any]:
        forward, recompute = context_fn()
        recorded = _Recorded(forward)
        return recorded, _Replayed(recorded, recompute)

    return contexts, False
