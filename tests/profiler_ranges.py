"""What torch.profiler must show of a pipeline step, for the tests of
tests/unit/runtime/test_profiler_ranges.py and tests/distributed.

Each rank's thread holds exactly one range per task of the rank's program,
named as errors name tasks (`F(stage=0, mb=1)`, a fused task
`F(stage=0, mb=3)+B(stage=3, mb=1)`), in program order, one after another,
each holding the ops the task ran; a range for each wait on a receive
(`wait recv(act 'h', mb=1, from rank 0)`, `wait recv(grad ...)`,
`wait recv(tied grad #0, from rank 1)`), outside every task's range but for
a fused task's waits for its later parts' inputs; and a range per
tied-gradient sum (`REDUCE_tied(p0)`).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from torchmpmd.schedule.program import Program

# A task, or a fused task: its parts' names joined by '+'.
TASK = re.compile(r"^[A-Z]\(stage=\d+, mb=\d+\)(\+[A-Z]\(stage=\d+, mb=\d+\))*$")
WAIT = re.compile(
    r"^wait recv\((?:(act|grad) '([^']+)', mb=(\d+)|tied grad #(\d+)), from rank (\d+)\)$"
)
REDUCE = re.compile(r"^REDUCE_tied\(p\d+\)$")
RECV = re.compile(r"^RECV_(act|grad|tied)\(v(\d+) mb(-?\d+) <-r(\d+) #\d+\)$")


def task_name(task: Any) -> str:
    return "+".join(f"{p.kind}(stage={p.stage}, mb={p.microbatch})" for p in task.parts)


def expected_waits(program: Program, rank: int) -> Counter[tuple[str, int, int]]:
    """(payload, microbatch or tied parameter, peer) of each receive of `rank`."""
    out: Counter[tuple[str, int, int]] = Counter()
    for line in program.instructions(rank):
        m = RECV.match(line)
        if m:
            payload, value, mb, peer = m[1], int(m[2]), int(m[3]), int(m[4])
            out[(payload, value if payload == "tied" else mb, peer)] += 1
    return out


def wait_key(name: str) -> tuple[str, int, int]:
    m = WAIT.match(name)
    assert m, name
    if m[1]:
        return (m[1], int(m[3]), int(m[5]))
    return ("tied", int(m[4]), int(m[5]))


def _ours(name: str) -> bool:
    return bool(TASK.match(name) or name.startswith("wait recv(") or REDUCE.match(name))


def _holds_an_op(event: Any) -> bool:
    return any(c.name.startswith("aten::") or _holds_an_op(c) for c in event.cpu_children)


def by_thread(events: Iterable[Any]) -> dict[int, list[Any]]:
    """The executor's ranges (tasks, waits, tied sums) of each thread that has any."""
    threads: dict[int, list[Any]] = {}
    for e in events:
        if _ours(e.name):
            threads.setdefault(e.thread, []).append(e)
    return threads


def check_rank(ranges: list[Any], program: Program, rank: int) -> dict[str, int]:
    """Checks one rank's ranges (one thread's) against its program; the
    number of ranges of each sort."""
    ranges = sorted(ranges, key=lambda e: e.time_range.start)
    tasks = [e for e in ranges if TASK.match(e.name)]
    waits = [e for e in ranges if e.name.startswith("wait recv(")]
    reduces = [e for e in ranges if REDUCE.match(e.name)]
    # Exactly one range per task, in program order.
    assert [e.name for e in tasks] == [task_name(t) for t in program.tasks(rank)]
    # One wait per receive: what it waits for, from whom.
    assert Counter(wait_key(e.name) for e in waits) == expected_waits(program, rank)
    instructions = program.instructions(rank)
    assert len(reduces) == sum(i.startswith("REDUCE_tied(") for i in instructions)
    # One after another: no range inside another (a wait is not part of its
    # task), but a fused task's waits for its later parts' inputs, inside it.
    fused = [e for e in tasks if "+" in e.name]

    def in_fused(e: Any) -> bool:
        return any(
            f.time_range.start <= e.time_range.start and e.time_range.end <= f.time_range.end
            for f in fused
        )

    later = {id(e) for e in waits if in_fused(e)}
    for a, b in itertools.pairwise(e for e in ranges if id(e) not in later):
        assert a.time_range.end <= b.time_range.start, (a.name, b.name)
    # A task's range holds the ops it ran.
    for e in tasks:
        assert _holds_an_op(e), f"{e.name} holds no aten op"
    return {"tasks": len(tasks), "waits": len(waits), "reduces": len(reduces)}


def check_step(
    events: Iterable[Any], program: Program, ranks: Sequence[int]
) -> list[dict[str, int]]:
    """`events` (torch.profiler's) hold the ranges of `ranks`, one thread
    each, and no other thread holds any; per rank, check_rank's counts."""
    threads = by_thread(events)
    assert len(threads) == len(ranks), sorted(
        Counter(e.name for es in threads.values() for e in es).items()
    )
    counts = []
    for rank in ranks:
        first = task_name(program.tasks(rank)[0])
        mine = [t for t, es in threads.items() if any(e.name == first for e in es)]
        assert len(mine) == 1, (rank, first, mine)
        counts.append(check_rank(threads[mine[0]], program, rank))
    return counts
