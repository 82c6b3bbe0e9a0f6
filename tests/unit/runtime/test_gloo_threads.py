"""Gloo's event-loop threads run under SCHED_BATCH while held (so a loop woken
for data does not preempt a thread that holds its socket's lock and then spin
on it until the next tick), holds nest, a hold covers loop threads made after
it, and the last release gives the threads their normal policy back."""

import os
import time

import pytest
import torch.distributed as dist

from torchmpmd.runtime import gloo_threads


def _policies(tids):
    return {os.sched_getscheduler(t) for t in tids}


def _gloo_group():
    """A one-rank Gloo group and its loop threads (once named: a loop thread
    names itself when it starts running)."""
    before = set(gloo_threads.loop_threads())
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    deadline = time.monotonic() + 10
    while not set(gloo_threads.loop_threads()) - before:
        # If torch's Gloo renames its loop thread, this fails instead of the
        # tuning silently doing nothing.
        assert time.monotonic() < deadline, "no gloo_tcp_loop thread in a Gloo group"
        time.sleep(0.01)
    return group, sorted(set(gloo_threads.loop_threads()) - before)


def test_holds_nest_and_the_last_release_restores_the_normal_policy():
    group, tids = _gloo_group()
    assert _policies(tids) == {os.SCHED_OTHER}
    first = gloo_threads.BatchHold()
    second = None
    try:
        assert _policies(tids) == {os.SCHED_BATCH}
        second = gloo_threads.BatchHold()
        first.release()
        first.release()  # a second release of the same hold changes nothing
        assert _policies(tids) == {os.SCHED_BATCH}
    finally:
        first.release()
        if second is not None:
            second.release()
    assert _policies(tids) == {os.SCHED_OTHER}
    del group


@pytest.mark.timeout(60)
def test_a_release_from_a_collection_inside_cover_does_not_deadlock():
    # A runner's finalizer releases its hold whenever the garbage collector
    # frees the runner, which may be inside another hold's cover().
    group, tids = _gloo_group()
    kept = gloo_threads.BatchHold()
    inner = gloo_threads.BatchHold()
    real_name = gloo_threads._name

    def name_then_release(tid):
        inner.release()  # re-enters the module lock on this thread
        return real_name(tid)

    gloo_threads._name = name_then_release
    try:
        gloo_threads._settled.clear()
        kept.cover()
    finally:
        gloo_threads._name = real_name
        inner.release()
        kept.release()
    assert _policies(tids) == {os.SCHED_OTHER}
    del group


def test_a_hold_covers_groups_made_after_it():
    hold = gloo_threads.BatchHold()
    try:
        group, tids = _gloo_group()
        assert _policies(tids) == {os.SCHED_OTHER}
        hold.cover()
        assert _policies(tids) == {os.SCHED_BATCH}
    finally:
        hold.release()
    assert _policies(tids) == {os.SCHED_OTHER}
    del group


def test_a_thread_set_to_another_policy_by_the_user_is_left_alone():
    group, (tid, *_) = _gloo_group()
    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    try:
        hold = gloo_threads.BatchHold()
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        hold.release()
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    finally:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    del group
