"""`mpmd.tune_cpu()`: the two process-wide CPU policies under which a
pipeline over Gloo runs fastest, made explicit.

Neither is made behind the user's back (a runner's construction changes
nothing in the process): a training script calls `tune_cpu()` once at
start-up, as `examples/train_gpt.py` and the benchmarks do.

- `keep_freed_memory`: glibc malloc's mmap and trim thresholds fixed at
  32 MiB and 1 GiB, so what a microbatch frees stays in the heap for the
  next instead of going back to the kernel and returning as page faults (a
  split backward's I paid 6% for them; `torchmpmd.runtime.heap`). For good:
  glibc has no way back to its adaptive thresholds. Nothing changes where
  you set malloc's thresholds yourself (`MALLOC_*_`, `GLIBC_TUNABLES`) or
  malloc is not glibc's.
- `gloo_sched_batch`: Gloo's socket threads (`gloo_tcp_loop`) under
  SCHED_BATCH until `release()`: a normal one, woken while a thread holds
  its socket's lock, preempts that thread and spins until the next
  scheduler tick, a 4 ms stall on a 0.2 ms transfer that ranks sending to
  each other at once meet often (`torchmpmd.runtime.gloo_threads`). Loop
  threads of groups made later are covered at each runner call. Linux only;
  elsewhere it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import gloo_threads, heap
from .gloo_threads import BatchHold

__all__ = ["CpuTuning", "tune_cpu"]


@dataclass(frozen=True, slots=True)
class CpuTuning:
    """What `tune_cpu` changed in this process, in words, and the Gloo
    threads' policy to give back (`release()`)."""

    malloc: str
    gloo_threads: str
    _hold: BatchHold | None = field(default=None, repr=False)

    def release(self) -> None:
        """Gives Gloo's loop threads their normal policy back (once every
        hold is released). Malloc's thresholds stay: glibc cannot go back."""
        if self._hold is not None:
            self._hold.release()


def tune_cpu(*, keep_freed_memory: bool = True, gloo_sched_batch: bool = True) -> CpuTuning:
    """Sets this process's CPU policies for pipelines over Gloo (see the
    module docstring); returns what it did. Call it once, at start-up."""
    # Checked before anything changes: a truthy "no" would fix malloc's
    # thresholds for the life of the process.
    for name, value in (
        ("keep_freed_memory", keep_freed_memory),
        ("gloo_sched_batch", gloo_sched_batch),
    ):
        if not isinstance(value, bool):
            raise TypeError(
                f"mpmd.tune_cpu: {name} must be True or False, got {value!r} "
                f"({type(value).__name__}); nothing was changed. Pass {name}=False to leave "
                "that policy alone"
            )
    if not keep_freed_memory:
        malloc = "left alone (keep_freed_memory=False)"
    elif heap.keep_freed_memory():
        malloc = (
            f"thresholds fixed (mmap {heap.MMAP_THRESHOLD >> 20} MiB, trim "
            f"{heap.TRIM_THRESHOLD >> 20} MiB), for the life of the process"
        )
    else:
        mine = heap.user_tuned()
        malloc = f"left alone ({'you set ' + mine if mine else 'not glibc malloc'})"
    hold = BatchHold() if gloo_sched_batch else None
    if hold is None:
        threads = "left alone (gloo_sched_batch=False)"
    else:
        found = len(gloo_threads.loop_threads())
        threads = (
            f"SCHED_BATCH for Gloo's loop threads ({found} now; groups made later are covered "
            "at each runner call) until release()"
        )
    return CpuTuning(malloc, threads, hold)
