"""Gloo's socket threads under SCHED_BATCH while a pipeline runs over Gloo.

Gloo (torch.distributed's CPU backend) moves a device's bytes on one event
loop thread, named `gloo_tcp_loop`. The loop waits on its sockets
level-triggered and only try-locks a socket's pair (`Pair::handleEvents`):
when the lock is held, it returns and epoll hands it the same event again
at once. So when data arrives for a pair while a thread of the same process
is inside a Gloo send or receive on it (the pair's lock held), the loop
thread, woken on that thread's CPU, preempts the lock holder and then spins
on the lock until the scheduler takes the CPU back at its next tick: a
transfer that takes 0.2 ms stalls about 4 ms. Ranks that send to each other
at the same moments, as an evenly balanced pipeline does, meet it most
(`python benchmarks/gloo_exchange.py` shows it on plain `dist.isend`/`irecv`).

SCHED_BATCH (Linux; no privilege needed) is the normal fair policy without
wakeup preemption: the loop thread then runs when a CPU is free or at the
next tick, never on top of the thread that holds its lock. While a
`BatchHold` is active, the `gloo_tcp_loop` threads of this process run under
it; when the last is released, the threads it changed get their normal
policy back. Elsewhere (other systems, a Gloo whose threads have
another name) it changes nothing.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["BatchHold", "cover", "loop_threads"]

LOOP_THREAD_NAME = "gloo_tcp_loop"
# A new thread carries its creator's name until it names itself (a loop
# thread does at once): a thread seen this long under another name is
# taken as not a loop thread and not read again.
SETTLE_S = 1.0

# Re-entrant: a runner's finalizer may release its hold from a garbage
# collection that runs inside cover() on the same thread.
_lock = threading.RLock()
_holders = 0
_generation = 0  # bumped in a forked child: holds made before are not its own
_changed: set[int] = set()  # thread ids this module set to SCHED_BATCH
_first_seen: dict[int, float] = {}  # thread ids not known yet, since when
_settled: set[int] = set()  # thread ids checked, not read again


def _after_fork_in_child() -> None:
    # The child has only the forking thread: no loop threads, no holds.
    global _lock, _holders, _generation
    _lock = threading.RLock()
    _holders = 0
    _generation += 1
    _changed.clear()
    _first_seen.clear()
    _settled.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def loop_threads() -> list[int]:
    """The thread ids of this process's Gloo event loops (empty off Linux).
    A loop thread names itself once it runs, so one of a group made this
    instant may not be listed yet."""
    return [tid for tid in _thread_ids() if _name(tid) == LOOP_THREAD_NAME]


class BatchHold:
    """Runs this process's Gloo loop threads under SCHED_BATCH until
    `release()`: those alive when it is made, and those `cover()` finds later
    (a group made since, or a loop thread that had not named itself yet).
    Holds nest; the last release restores the normal policy of the threads
    set to SCHED_BATCH here (a thread the user gave another policy is left
    alone). Releasing twice is harmless."""

    def __init__(self) -> None:
        global _holders
        with _lock:
            self._generation = _generation
            self._released = False
            _holders += 1
        self.cover()

    def cover(self) -> None:
        """Sets loop threads not yet under SCHED_BATCH to it. A thread's name
        is read only until it is known (`SETTLE_S`), so a call costs a
        directory listing and the reads of new threads."""
        with _lock:
            if not self._released and self._generation == _generation:
                _cover()

    def release(self) -> None:
        global _holders
        with _lock:
            if self._released or self._generation != _generation:
                return
            self._released = True
            _holders -= 1
            if _holders > 0:
                return
            for tid in _changed:
                # A thread id may have been reused since: only a loop thread
                # still under SCHED_BATCH is given its policy back.
                if _name(tid) == LOOP_THREAD_NAME:
                    _set_policy(tid, os.SCHED_BATCH, os.SCHED_OTHER)
            _changed.clear()
            _first_seen.clear()
            _settled.clear()


def cover() -> None:
    """While any hold is active (`mpmd.tune_cpu()`), sets the loop threads
    made since to SCHED_BATCH; else nothing (a lock and a check)."""
    with _lock:
        if _holders > 0:
            _cover()


def _cover() -> None:
    """Under `_lock`: loop threads not yet under SCHED_BATCH are set to it."""
    if not hasattr(os, "sched_setscheduler"):
        return
    tids = _thread_ids()
    _settled.intersection_update(tids)  # forget exited threads
    for tid in list(_first_seen):
        if tid not in tids:
            del _first_seen[tid]
    now = time.monotonic()
    for tid in tids - _settled:
        name = _name(tid)
        if name == LOOP_THREAD_NAME:
            if _set_policy(tid, os.SCHED_OTHER, os.SCHED_BATCH):
                _changed.add(tid)
            _settled.add(tid)
            _first_seen.pop(tid, None)
        elif now - _first_seen.setdefault(tid, now) >= SETTLE_S:
            _settled.add(tid)
            del _first_seen[tid]


def _thread_ids() -> set[int]:
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:  # not Linux
        return set()


def _name(tid: int) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # the thread has exited
        return None


def _set_policy(tid: int, expected: int, policy: int) -> bool:
    """Sets `tid`'s policy if it is `expected` now; whether it did."""
    try:
        if os.sched_getscheduler(tid) != expected:
            return False
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except OSError:  # exited, or not allowed
        return False
    return True
