"""Run a whole pipeline inside one process: ranks as threads over an in-memory
transport that follows the same matching and ordering rules as c10d.

Each rank gets its own copy of the parameters, as separate processes would,
so tied weights and optimizer steps behave exactly as in a real job. Forward
calls take turns on the GIL; backward passes run in parallel.

Each rank also draws random numbers (dropout) from a generator state of its
own, as a process would, so identical seeded runs give identical results:
a call starts every rank from the calling thread's generator state if it
changed since the previous call (`torch.manual_seed(s)` before a step gives
what processes seeded with `s` give), else each rank continues from its own;
afterwards the caller's generator holds rank 0's (`runtime.rank_rng` says
how, and what it does not cover: full recompute on one rank while another
draws).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _C
from ..graph.pipe import Pipe
from ..schedule.task import Schedule, require_schedule
from .checks import require_pipe
from .options import RunnerOptions
from .rank_rng import RankGenerators
from .runner import PipelineRunner, StepOutput
from .stages import LossFn
from .transport import LocalWorld

__all__ = ["LocalPipeline"]


class LocalPipeline:
    """`num_ranks` PipelineRunners in threads of this process. `loss_fn` and
    `device` are the runners'; the other keywords are `RunnerOptions`
    fields (or pass `options=`), for short test set-ups.

    Faults are injected through the public hook `wrap_stage=fn` (a
    `RunnerOptions` field): `fn(rank, stage, forward)` returns what runs in
    place of stage `stage`'s forward on rank `rank`, e.g. a wrapper that
    raises at the second microbatch, sleeps, or returns altered outputs::

        def wrap(rank, stage, forward):
            if (rank, stage) != (1, 1):
                return forward
            def crash(*inputs):
                raise RuntimeError("injected")
            return crash

        LocalPipeline(pipe, schedule, 2, loss_fn=loss, wrap_stage=wrap)

    `runners` are the per-rank PipelineRunners; `on_all_ranks(fn)` runs
    `fn(runner)` on every rank at once, as `step` does. A `torch.profiler.
    profile()` around a call records every rank's thread (their tasks as
    ranges, as a rank's own process would).
    """

    def __init__(
        self,
        pipe: Pipe,
        schedule: Schedule,
        num_ranks: int,
        *,
        loss_fn: LossFn | None = None,
        device: torch.device | str | None = None,
        options: RunnerOptions | None = None,
        **knobs: Any,
    ) -> None:
        require_pipe(pipe, "LocalPipeline")
        require_schedule(schedule, "LocalPipeline")
        if knobs:
            if options is not None:
                raise TypeError("LocalPipeline: pass options= or RunnerOptions fields, not both")
            options = RunnerOptions(**knobs)
        self.world = LocalWorld(num_ranks)
        self._rng = RankGenerators(num_ranks)
        self.pipes = [pipe.replicate() for _ in range(num_ranks)]
        self.runners = [
            PipelineRunner(
                self.pipes[r],
                schedule,
                transport=self.world.transport(r),
                loss_fn=loss_fn,
                device=device,
                options=options,
            )
            for r in range(num_ranks)
        ]

    @property
    def num_ranks(self) -> int:
        return len(self.runners)

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> list[StepOutput]:
        """One training step on every rank; the per-rank results."""
        return self._on_all(lambda r: r.step(*args, target=target, **kwargs))

    def eval_step(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._on_all(lambda r: r.eval_step(*args, **kwargs))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> list[torch.Tensor]:
        """`PipelineRunner.clip_grad_norm_` on every rank; the per-rank norms."""
        return self._on_all(lambda r: r.clip_grad_norm_(max_norm, norm_type))

    def init_weights(self, fn: Callable[[torch.nn.Module], object] | None = None) -> None:
        """`PipelineRunner.init_weights` on every rank at once (it is
        collective: tied weights' copies travel between ranks)."""
        self._on_all(lambda r: r.init_weights(fn))

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """`PipelineRunner.load_state_dict` on every rank at once (collective too)."""
        self._on_all(lambda r: r.load_state_dict(state_dict, strict))

    def kill(self, rank: int) -> None:
        """Makes `rank` look dead to its peers (their receives from it fail)."""
        self.world.kill(rank)

    def on_all_ranks(self, fn: Callable[[PipelineRunner], Any]) -> list[Any]:
        """`fn(runner)` on every rank at once, each in its rank's thread (a
        collective call, e.g. `r.step(...)` with per-rank arguments); the
        per-rank results. A failure on one rank stops the others and is
        raised, as from `step`."""
        return self._on_all(fn)

    def _on_all(self, fn: Callable[[PipelineRunner], Any]) -> list[Any]:
        self._rng.start_call(max(r.timeout for r in self.runners))
        results: list[Any] = [None] * self.num_ranks
        errors: list[tuple[float, int, BaseException]] = []

        # Ranks that failed before exchanging any message (checking their
        # input): killed only if a peer is still running a moment later, so
        # it is not left waiting for them. When every rank fails the same
        # check (the same bad input), the world stays as it was and the
        # pipeline stays usable.
        quiet_failures: list[int] = []
        # A torch.profiler started on the calling thread records the ranks'
        # threads too, as a process's profiler records its rank: one trace,
        # a thread per rank, each with its tasks' ranges and their ops.
        profiler = _C.runtime.ProfilerContext.current()
        # The caller's torch.autocast, which thread-local state leaves
        # behind: a rank's thread runs under it, as a process's runner would
        # (and step / eval_step refuse it, naming it).
        autocast = self._caller_autocast()

        def run(rank: int) -> None:
            runner = self.runners[rank]
            runner.communicated = False  # this call's, not an earlier one's
            try:
                with autocast():
                    if profiler.active:
                        results[rank] = profiler.run(lambda: fn(runner))
                    else:
                        results[rank] = fn(runner)
            except BaseException as err:  # reported below, per rank
                if runner.communicated:
                    # Gone for its peers, as a crashed process is.
                    self.world.kill(rank)
                else:
                    quiet_failures.append(rank)
                errors.append((time.monotonic(), rank, err))

        threads = [
            threading.Thread(target=self._rng.in_rank(run), args=(r,), daemon=True)
            for r in range(self.num_ranks)
        ]
        for t in threads:
            t.start()
        # A rank stuck in user code is not waited for past the runners'
        # timeout (its peers give up on it by then).
        limit = max(r.timeout for r in self.runners) + 5.0
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.02)
            since = time.monotonic() - min(e[0] for e in errors) if errors else 0.0
            if quiet_failures and since > 0.5:
                for r in quiet_failures:
                    self.world.kill(r)
                quiet_failures.clear()
            if errors and since > limit:
                break
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        for r in stuck:
            self.world.kill(r)
            errors.append(
                (time.monotonic(), r, RuntimeError(f"rank {r} still running {limit:.0f} s later"))
            )
        if errors:
            # The first failure is the cause; the others followed from it
            # (a rank that failed first says so: its peers' errors may be
            # raised before its own is).
            errors.sort(key=lambda e: (not self.runners[e[1]].failed_first, e[0]))
            first = errors[0][2]
            for _, rank, err in errors[1:]:
                if hasattr(first, "add_note"):  # Python >= 3.11
                    said = str(err)
                    # Most errors name their rank already.
                    head = "then " if said.startswith(f"rank {rank}:") else f"then rank {rank}: "
                    first.add_note(head + said)
            raise first
        self._rng.end_call()
        return results

    def _caller_autocast(self) -> Callable[[], contextlib.ExitStack[bool | None]]:
        """Enters, in a rank's thread, the autocast the calling thread is under."""
        kinds = dict.fromkeys(["cpu", *(r.device.type for r in self.runners)])
        on = [
            (kind, torch.get_autocast_dtype(kind))
            for kind in kinds
            if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
        ]

        def enter() -> contextlib.ExitStack[bool | None]:
            stack = contextlib.ExitStack()
            for kind, dtype in on:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            return stack

        return enter
