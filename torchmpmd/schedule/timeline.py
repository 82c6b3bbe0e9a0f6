"""`Timeline`: when each task ran on each rank, predicted or measured."""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _C
from .hidden import hidden_communication
from .task import Task

__all__ = ["COLLECTIVES", "Timeline", "TimelineEvent"]

# An event is a task (its kind's letter in the native task-kind table) or one
# of the others: a data-parallel collective of a stage (StageCollectives),
# a message in flight, a rank waiting for one.
_TASK_KINDS = tuple(_C.schedule.TaskKind.__members__)
COLLECTIVES = ("unshard", "reduce_grads")
# A parallelism's exchanges inside a task (expert parallelism's all-to-alls).
EXCHANGES = ("dispatch", "combine")
_OTHER_KINDS = ("transfer", "wait", *COLLECTIVES, *EXCHANGES)


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    rank: int
    # A task kind's letter ("F", "B", ...); "unshard", "reduce_grads",
    # "dispatch", "combine", "transfer" or "wait" otherwise.
    kind: str
    stage: int
    microbatch: int
    start: float  # seconds (measured) or cost units (simulated)
    end: float
    label: str = ""
    # Measured with PipelineRunner(measure_memory=True), else -1. held: bytes
    # every local stage held for its backward right after this task. kept:
    # what this (stage, microbatch) held: after F or R what the forward left,
    # before B, I or W what it kept until then.
    held_bytes: int = -1
    kept_bytes: int = -1
    # A fused task's parts, in order (it is one event, with its first part's
    # kind, stage and microbatch); () for anything else.
    sub_tasks: tuple[Task, ...] = ()
    # Measured on CPU: each part's (start, end, lane), in sub_tasks' order;
    # lane 1 is the forward side of a fused task whose sides ran at once
    # (on a thread of its own), 0 the rest. () where not measured.
    part_spans: tuple[tuple[float, float, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _TASK_KINDS and self.kind not in _OTHER_KINDS:
            raise ValueError(
                f"{self!r}: kind must be a task kind ({', '.join(_TASK_KINDS)}) or one of "
                f"{', '.join(map(repr, _OTHER_KINDS))}, got {self.kind!r}"
            )
        for name in ("rank", "stage", "microbatch", "held_bytes", "kept_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(
                    f"{self!r}: {name} must be an int, got {value!r} ({type(value).__name__})"
                )
        if self.rank < 0:
            raise ValueError(f"{self!r}: rank must be 0 or more, got {self.rank}")
        for name in ("start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"{self!r}: {name} must be a number (seconds or cost units), got "
                    f"{value!r} ({type(value).__name__})"
                )
        if self.sub_tasks:
            parts: tuple[object, ...] = self.sub_tasks
            if len(parts) < 2 or not all(isinstance(p, Task) for p in parts):
                raise ValueError(
                    f"{self!r}: sub_tasks are a fused task's parts, two or more mpmd.Task"
                )
            first = self.sub_tasks[0]
            if (first.kind, first.stage, first.microbatch) != (
                self.kind,
                self.stage,
                self.microbatch,
            ):
                raise ValueError(
                    f"{self!r}: a fused task's event has its first part's kind, stage and "
                    f"microbatch ({first})"
                )

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def is_task(self) -> bool:
        return self.kind not in _OTHER_KINDS

    @property
    def is_fused(self) -> bool:
        return bool(self.sub_tasks)

    @property
    def task(self) -> Task | None:
        """The task of a task event (fused or not); None for the others."""
        if not self.is_task:
            return None
        if self.sub_tasks:
            return Task.fused(*self.sub_tasks)
        return Task(self.kind, self.stage, self.microbatch)

    @property
    def name(self) -> str:
        """A task's action ('2F5', fused '(2F5;3B1)OVERLAP_F_B'); else the
        label, or what the event is."""
        task = self.task
        if task is not None:
            return str(task)
        if self.label:
            return self.label
        if self.kind in EXCHANGES:
            return f"{self.kind} stage {self.stage} mb {self.microbatch}"
        return f"{self.kind} stage {self.stage}" if self.kind in COLLECTIVES else self.kind


# Chrome-trace rows per rank: tasks 0, transfers 1, waits 2, collectives and
# exchanges 3; a fused task's parts as they ran, 4 + their lane (side).
_TRACK = {"transfer": 1, "wait": 2, **dict.fromkeys((*COLLECTIVES, *EXCHANGES), 3)}
_PART_TRACK = 4


@dataclass(slots=True)
class Timeline:
    """Task intervals per rank. The simulator and the runtime produce the same type."""

    num_ranks: int
    events: list[TimelineEvent]
    source: str = "measured"  # or "simulated"
    unit: str = "s"
    # Per rank, the most bytes held for backward at once (simulated, or
    # measured with PipelineRunner(measure_memory=True); -1: not measured).
    peak_activation_bytes: list[int] = field(default_factory=list)
    # Per rank, activations plus unsharded parameters (simulated with
    # Costs.unsharded_bytes; empty: not known).
    peak_bytes: list[int] = field(default_factory=list)
    # Per rank, the bytes of every message it sent and received in the step
    # (the program's sends and receives when simulated; the executor's own
    # counters when measured, -1 for a rank not measured; empty: not known).
    sent_bytes: list[int] = field(default_factory=list)
    received_bytes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int):
            raise TypeError(
                f"Timeline: num_ranks must be an int, got {self.num_ranks!r} "
                f"({type(self.num_ranks).__name__})"
            )
        if self.num_ranks < 0:
            raise ValueError(f"Timeline: num_ranks must be 0 or more, got {self.num_ranks}")
        if isinstance(self.events, (tuple, Iterator)):  # any sequence of events, kept as a list
            self.events = list(self.events)
        self._check("Timeline")

    def _check(self, who: str) -> None:
        """Raises, naming the event, if an event is not a TimelineEvent or lies
        on a rank the timeline does not have (events may be added after
        construction: `plot` checks again)."""
        if not isinstance(self.events, list):
            raise TypeError(
                f"{who}: events must be a list of mpmd.TimelineEvent, got "
                f"{type(self.events).__name__}"
            )
        for i, e in enumerate(self.events):
            if not isinstance(e, TimelineEvent):
                raise TypeError(
                    f"{who}: event {i} is a {type(e).__name__}, not an mpmd.TimelineEvent"
                )
            if e.rank >= self.num_ranks:
                raise ValueError(
                    f"{who}: event {i} {e!r} is on rank {e.rank}, but the timeline has "
                    f"{self.num_ranks} ranks (0..{self.num_ranks - 1}); give "
                    f"Timeline(num_ranks={e.rank + 1}, ...) or fix the event's rank"
                )

    @property
    def tasks(self) -> list[TimelineEvent]:
        return [e for e in self.events if e.is_task]

    def hidden_communication(self) -> tuple[float, float]:
        """Of the exchanges inside fused tasks (expert parallelism's dispatch
        and combine, measured), the seconds that ran while the task's other
        side computed, and all their seconds, over every rank. (0, 0) where
        no fused task's sides were measured running at once."""
        return hidden_communication(self.events, EXCHANGES)

    def _stats(self) -> tuple[float, float]:
        # The native core's one definition, shared with its simulator: first
        # task (or collective) start to last end; idle share of the ranks
        # with tasks, counting tasks only.
        spans = [e for e in self.events if e.is_task or e.kind in COLLECTIVES]
        return _C.schedule.timeline_stats(
            [e.rank for e in spans],
            [e.start for e in spans],
            [e.end for e in spans],
            [e.is_task for e in spans],
        )

    @property
    def step_time(self) -> float:
        """From the first task's start to the last task's end, data-parallel
        collectives included (transfers and waits not counted)."""
        return self._stats()[0]

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time over the step not spent in tasks, over the ranks with tasks."""
        return self._stats()[1]

    def busy_time(self) -> list[float]:
        busy = [0.0] * self.num_ranks
        for e in self.tasks:
            busy[e.rank] += e.duration
        return busy

    @property
    def ranks(self) -> list[int]:
        """Ranks that have events (one, for a rank's own measured timeline)."""
        return sorted({e.rank for e in self.events})

    @staticmethod
    def merge(timelines: Iterable[Timeline]) -> Timeline:
        """One timeline from per-rank ones (e.g. gathered from every rank)."""
        parts = list(timelines)
        events = [e for t in parts for e in t.events]
        num_ranks = max((t.num_ranks for t in parts), default=0)
        peaks = [-1] * num_ranks
        totals = [-1] * num_ranks
        for t in parts:
            for r, b in enumerate(t.peak_activation_bytes):
                peaks[r] = max(peaks[r], b)
            for r, b in enumerate(t.peak_bytes):
                totals[r] = max(totals[r], b)
        return Timeline(
            num_ranks,
            events,
            parts[0].source if parts else "measured",
            parts[0].unit if parts else "s",
            peaks,
            totals if any(t.peak_bytes for t in parts) else [],
        )

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON (opens in Perfetto / chrome://tracing)."""
        scale = 1e6 if self.unit == "s" else 1.0  # microseconds, or raw units
        trace = []
        for r in range(self.num_ranks):
            trace.append(
                {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
            )
        for e in self.events:
            trace.append(
                {
                    "name": e.name,
                    "cat": e.kind,
                    "ph": "X",
                    "pid": e.rank,
                    "tid": 0 if e.is_task else _TRACK.get(e.kind, 2),
                    "ts": e.start * scale,
                    "dur": max(e.duration * scale, 0.0),
                    "args": {
                        "stage": e.stage,
                        "microbatch": e.microbatch,
                        "source": self.source,
                        **({"parts": [str(p) for p in e.sub_tasks]} if e.sub_tasks else {}),
                    },
                }
            )
            # A fused task's parts where they ran, a row per side: sides
            # that ran at once show side by side, under the exchanges (row
            # 3) each one hid.
            for part, (a, b, lane) in zip(e.sub_tasks, e.part_spans, strict=False):
                trace.append(
                    {
                        "name": f"{part} (part of {e.name})",
                        "cat": "fused part",
                        "ph": "X",
                        "pid": e.rank,
                        "tid": _PART_TRACK + lane,
                        "ts": a * scale,
                        "dur": max((b - a) * scale, 0.0),
                        "args": {"stage": part.stage, "microbatch": part.microbatch, "side": lane},
                    }
                )
        return {"traceEvents": trace, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace()))

    def summary(self) -> str:
        unit = self.unit
        ranks = self.ranks
        which = (
            f"{len(ranks)} of {self.num_ranks} ranks"
            if len(ranks) < self.num_ranks
            else (f"{self.num_ranks} ranks")
        )
        return (
            f"{self.source} timeline: {which}, step {self.step_time:.4g} {unit}, "
            f"bubble {100 * self.bubble_fraction:.1f}%"
        )

    def __repr__(self) -> str:
        return f"Timeline({self.summary()})"


def from_records(
    rank: int,
    num_ranks: int,
    records: Sequence[
        tuple[str, int, int, int, int, int, int, int, Sequence[tuple[int, int, int]]]
    ],
    step_start_unix_ns: int = 0,
    peak_held_bytes: int = -1,
    message_bytes: tuple[int, int] = (-1, -1),
) -> Timeline:
    """A measured timeline of one rank from the executor's task records
    (nanoseconds since the step started), in seconds since the Unix epoch so
    that timelines of different ranks line up. A fused task's record names
    it by its action ('(0F3;1B2)OVERLAP_F_B'): one event with its parts
    (and, on CPU, when each ran, on which lane)."""
    origin = step_start_unix_ns / 1e9
    events = []
    for kind, stage, mb, start, end, _waited, held, kept, spans in records:
        parts = Task.parse(kind).parts if kind.startswith("(") else ()
        events.append(
            TimelineEvent(
                rank,
                parts[0].kind if parts else kind,
                stage,
                mb,
                origin + start / 1e9,
                origin + end / 1e9,
                "",
                held,
                kept,
                parts,
                tuple((origin + a / 1e9, origin + b / 1e9, lane) for a, b, lane in spans),
            )
        )
    peaks, sent, received = [-1] * num_ranks, [-1] * num_ranks, [-1] * num_ranks
    peaks[rank] = peak_held_bytes
    sent[rank], received[rank] = message_bytes
    return Timeline(num_ranks, events, "measured", "s", peaks, [], sent, received)
