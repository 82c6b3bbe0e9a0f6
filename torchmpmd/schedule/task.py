"""Schedules as data: tasks and per-rank task lists."""

from __future__ import annotations

import collections
import csv
import io
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from .. import _C
from . import kinds

__all__ = ["FUSED_ACTION", "Schedule", "Task"]

Kind = str
# The task kinds the native core defines (its task-kind table), by letter.
_KINDS = tuple(_C.schedule.TaskKind.__members__)


# torch.distributed.pipelining's computation type of an action with
# sub-actions: a fused task is written "(2F5;3B1)OVERLAP_F_B".
FUSED_ACTION = "OVERLAP_F_B"


@dataclass(frozen=True, slots=True, repr=False)
class Task:
    """One piece of work: forward (F), full backward (B), input-grad (I),
    weight-grad (W) or recompute (R) of `stage` on `microbatch`; or a fused
    task (`Task.fused`): simple tasks of one rank run as one step.

    A fused task answers its first part's `kind`, `stage` and `microbatch`
    (so that what needs only a representative, such as the rank that runs
    it, works unchanged); whatever acts on what a task computes iterates
    `parts`, which is `(task,)` for a simple one."""

    kind: Kind
    stage: int
    microbatch: int
    # A fused task's parts, in the order they run; () for a simple task.
    sub_tasks: tuple[Task, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Task kind must be one of {', '.join(_KINDS)}; got {self.kind!r}")
        for field_name in ("stage", "microbatch"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"Task {field_name} must be an int, got {value!r} ({type(value).__name__})"
                )
            # Negative values are left to the schedule's validation, which
            # names the task in its grid; beyond int32 nothing can hold them.
            if not -(2**31) <= value < 2**31:
                raise ValueError(f"Task {field_name} {value} is out of range (32-bit int)")
        if not isinstance(self.sub_tasks, tuple):
            raise TypeError(
                f"Task sub_tasks must be a tuple of mpmd.Task, got {type(self.sub_tasks).__name__}; "
                "build fused tasks with Task.fused(...)"
            )
        if self.sub_tasks:
            _check_parts(self.sub_tasks)
            first = self.sub_tasks[0]
            if (self.kind, self.stage, self.microbatch) != (
                first.kind,
                first.stage,
                first.microbatch,
            ):
                raise ValueError(
                    f"a fused task answers its first part's kind, stage and microbatch "
                    f"({first}), got {self.kind!r}, {self.stage}, {self.microbatch}; build "
                    "fused tasks with Task.fused(...)"
                )

    @classmethod
    def fused(cls, *parts: Task | str) -> Task:
        """A fused task: `parts` (two or more simple tasks, or actions like
        '2F5') run in this order as one step, with one timeline record and
        one profiler range; torch.distributed.pipelining's OVERLAP_F_B action
        with sub-actions. The schedule's validation refuses parts on stages
        of another rank and parts that depend on one another."""
        tasks = tuple(Task.parse(p) if isinstance(p, str) else p for p in parts)
        _check_parts(tasks)
        first = tasks[0]
        return cls(first.kind, first.stage, first.microbatch, tasks)

    @property
    def is_fused(self) -> bool:
        return bool(self.sub_tasks)

    @property
    def parts(self) -> tuple[Task, ...]:
        """The simple tasks it runs: a fused task's parts, in order, or itself."""
        return self.sub_tasks or (self,)

    def __repr__(self) -> str:
        if self.sub_tasks:
            return f"Task.fused({', '.join(map(repr, self.sub_tasks))})"
        return f"Task(kind={self.kind!r}, stage={self.stage}, microbatch={self.microbatch})"

    def __str__(self) -> str:
        """torch.distributed.pipelining's action format: '2F5'; fused
        '(2F5;3B1)OVERLAP_F_B'."""
        if self.sub_tasks:
            return f"({';'.join(map(str, self.sub_tasks))}){FUSED_ACTION}"
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Task:
        """Reads an action like '2F5' (stage 2, forward, microbatch 5), or a
        fused one like '(2F5;3B1)OVERLAP_F_B'."""
        if not isinstance(text, str):
            raise TypeError(f"Task.parse reads an action string, got {type(text).__name__}")
        return task_from_native(_C.schedule.parse_action(text.strip().replace(" ", "")))

    def _native(self) -> _C.schedule.Task:
        if self.sub_tasks:
            return _C.schedule.fuse([p._native() for p in self.sub_tasks])
        return _C.schedule.Task(
            _C.schedule.TaskKind.__members__[self.kind], self.stage, self.microbatch
        )


def _check_parts(parts: tuple[object, ...]) -> None:
    """Raises unless `parts` can make a fused task: two or more simple tasks."""
    if len(parts) < 2:
        raise ValueError(
            f"Task.fused needs two or more parts, got {len(parts)}; schedule a single task "
            "as itself"
        )
    for i, p in enumerate(parts):
        if not isinstance(p, Task):
            raise TypeError(
                f"Task.fused: part {i + 1} is {p!r} ({type(p).__name__}), not an mpmd.Task "
                "or an action like '2F5'"
            )
        if p.sub_tasks:
            raise ValueError(
                f"Task.fused: part {i + 1} ({p}) is fused itself; fused tasks do not nest, "
                "list its parts in the outer one"
            )


def task_from_native(t: _C.schedule.Task) -> Task:
    """A native task (fused or not) as an mpmd.Task."""
    if t.parts:
        return Task.fused(*(task_from_native(p) for p in t.parts))
    return Task(t.kind.name, t.stage, t.microbatch)


class Schedule:
    """A pipeline schedule: where stages live and what each rank runs, in order.

    Subclass and implement `tasks` (and `placement`, if stages should not be
    dealt round-robin): the schedule is just data, checked by
    `compile_schedule` before anything runs.
    """

    # How many stages the schedule places on each rank: 1, or 2 for the V
    # schedules (ZBV, DualPipeV) and the interleaved ones. The planner weighs
    # it with `num_ranks * stages_per_rank` stages and `mpmd.project` takes
    # it by default; a schedule of your own says its own.
    stages_per_rank: int = 1

    def __init__(self, num_microbatches: int) -> None:
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        self.num_microbatches = num_microbatches

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        """Stage -> rank. Default: round-robin ("loop"), stage s on rank s % num_ranks."""
        return [s % num_ranks for s in range(num_stages)]

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        """Per rank, the tasks it runs, in order."""
        raise NotImplementedError(f"{type(self).__name__} must implement tasks()")

    # ---- plain lists and the action format

    @staticmethod
    def from_lists(
        tasks: Sequence[Sequence[Task | str]],
        placement: Sequence[int],
        num_microbatches: int | None = None,
    ) -> Schedule:
        """A schedule given as per-rank lists of tasks (or action strings like '1B0')."""
        lists = [[t if isinstance(t, Task) else Task.parse(t) for t in rank] for rank in tasks]
        ranks = check_placement(placement, "Schedule.from_lists")
        if num_microbatches is None:
            num_microbatches = 1 + max(
                (p.microbatch for r in lists for t in r for p in t.parts), default=0
            )
        return _ListSchedule(lists, ranks, num_microbatches)

    @staticmethod
    def from_csv(text: str, placement: Sequence[int]) -> Schedule:
        """Reads torch.distributed.pipelining's CSV: one row per rank, one action per cell."""
        rows = [
            [cell.strip() for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))
        ]
        return Schedule.from_lists(rows, placement)

    def to_csv(self, num_stages: int, num_ranks: int) -> str:
        """Writes the schedule's task lists in torch.distributed.pipelining's CSV format."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for rank in self.tasks(num_stages, num_ranks, self.num_microbatches):
            writer.writerow([str(t) for t in rank])
        return out.getvalue()

    def splits_backward(self, num_stages: int, num_ranks: int) -> bool:
        """Whether the schedule runs input- and weight-gradient tasks (I, W)
        on that many stages and ranks (its stages then split their backward)."""
        tasks = self.tasks(num_stages, num_ranks, self.num_microbatches)
        return any(kinds.part_of_backward(p.kind) for rank in tasks for t in rank for p in t.parts)

    def with_recompute(self, stages: Iterable[int] | None = None) -> Schedule:
        """This schedule with a recompute (R) right before each backward (B or I)
        of `stages` (default: every stage).

        Their forwards then keep only their received inputs, and the backward
        runs the forward again first (stage-level activation checkpointing):
        a stage holds one microbatch's activations instead of one per
        microbatch in flight, for one more forward per microbatch. A backward
        that already has its recompute (this schedule recomputes that stage
        already) gets no second one.
        """
        if stages is None:
            return _Recompute(self, None)
        return _Recompute(self, _stage_indices(stages, "with_recompute", "or none for every stage"))

    def with_full_backward(self, stages: Iterable[int]) -> Schedule:
        """This schedule with `stages` running their whole backward (B) where
        it splits it: each input-gradient task (I) becomes B, in its place,
        and the weight-gradient tasks (W) of those stages go. For a stage
        that cannot split (its shapes depend on the data, as MoE routing's
        do) under a zero-bubble schedule; the runner does this by itself
        with `split_backward="auto"`."""
        return _FullBackward(self, _stage_indices(stages, "with_full_backward", ""))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_microbatches={self.num_microbatches})"


def _stage_indices(stages: object, who: str, default: str) -> frozenset[int]:
    """`stages` checked to be stage indices (an iterable of ints)."""
    if isinstance(stages, (bool, str)) or not isinstance(stages, Iterable):
        fix = f"e.g. [0, 1]{', ' + default if default else ''}"
        if isinstance(stages, int) and not isinstance(stages, bool):
            fix = f"write [{stages}] for that one stage"
        raise TypeError(
            f"{who} takes stage indices, got {stages!r} ({type(stages).__name__}); " + fix
        )
    chosen: list[object] = list(stages)
    for s in chosen:
        if not is_index(s):
            raise TypeError(f"{who}: a stage is an int index, got {s!r} ({type(s).__name__})")
    return frozenset(int(cast(int, s)) for s in chosen)


class _Rewritten(Schedule):
    """Another schedule's task lists, rewritten for some stages (None: all);
    its placement."""

    def __init__(self, base: Schedule, stages: frozenset[int] | None) -> None:
        super().__init__(base.num_microbatches)
        self._base = base
        self._stages = stages
        self.stages_per_rank = base.stages_per_rank

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        return self._base.placement(num_stages, num_ranks)


class _FullBackward(_Rewritten):
    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        chosen = self._stages or frozenset()
        out = []
        for rank in self._base.tasks(num_stages, num_ranks, num_microbatches):
            row = []
            for task in rank:
                parts = []
                for t in task.parts:
                    if t.stage in chosen and kinds.part_of_backward(t.kind):
                        if kinds.TABLE[t.kind].backward_parts != kinds.INPUT_PART:
                            continue  # W: B computed the weight gradients already
                        t = Task(kinds.BACKWARD, t.stage, t.microbatch)
                    parts.append(t)
                # A fused task left with one part is that part alone.
                if len(parts) > 1:
                    row.append(Task.fused(*parts))
                elif parts:
                    row.append(parts[0])
            out.append(row)
        return out

    def __repr__(self) -> str:
        return f"{self._base!r}.with_full_backward({sorted(self._stages or ())})"


class _ListSchedule(Schedule):
    def __init__(self, lists: list[list[Task]], placement: list[int], num_microbatches: int):
        super().__init__(num_microbatches)
        self._lists = lists
        self._placement = placement
        held = collections.Counter(placement).values()
        self.stages_per_rank = max(held, default=1)

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        return list(self._placement)

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        return [list(r) for r in self._lists]


class _Recompute(_Rewritten):
    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        outside = sorted(s for s in self._stages or () if not 0 <= s < num_stages)
        if outside:
            raise ValueError(
                f"with_recompute: stages {outside} do not exist; the pipeline has stages "
                f"0..{num_stages - 1}"
            )
        base = self._base.tasks(num_stages, num_ranks, num_microbatches)
        # Backwards the base schedule already recomputes keep their one R.
        done = {
            (t.stage, t.microbatch)
            for rank in base
            for task in rank
            for t in task.parts
            if kinds.recomputes(t.kind)
        }
        out = []
        for rank in base:
            row = []
            for task in rank:
                wanted = [
                    t
                    for t in task.parts
                    if kinds.waits_for_recompute(t.kind)
                    and (self._stages is None or t.stage in self._stages)
                    and (t.stage, t.microbatch) not in done
                ]
                if task.is_fused and any(t.kind == kinds.FORWARD for t in task.parts):
                    # A fused forward and backward: the recompute joins the
                    # backward's side, right before it, so that it runs (and
                    # its communication hides) beside the forward.
                    parts: list[Task] = []
                    for t in task.parts:
                        if t in wanted:
                            parts.append(Task(kinds.RECOMPUTE, t.stage, t.microbatch))
                        parts.append(t)
                    row.append(Task.fused(*parts))
                    continue
                # Any other fused task's backward parts get theirs before it.
                row += [Task(kinds.RECOMPUTE, t.stage, t.microbatch) for t in wanted]
                row.append(task)
            out.append(row)
        return out

    def __repr__(self) -> str:
        which = "" if self._stages is None else f"stages={sorted(self._stages)}"
        return f"{self._base!r}.with_recompute({which})"


def recomputed_stages(schedule: Schedule, num_stages: int) -> frozenset[int]:
    """The stages `schedule` recomputes in full (R tasks), where that is known
    without its task lists: added by `with_recompute` or given in `from_lists`."""
    if isinstance(schedule, _Recompute):
        own = frozenset(range(num_stages)) if schedule._stages is None else schedule._stages
        return own | recomputed_stages(schedule._base, num_stages)
    if isinstance(schedule, _ListSchedule):
        return frozenset(
            p.stage
            for rank in schedule._lists
            for t in rank
            for p in t.parts
            if kinds.recomputes(p.kind)
        )
    return frozenset()


def is_index(value: object) -> bool:
    """An integer (numpy's too), not a bool: a stage or rank index."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_placement(placement: object, who: str) -> list[int]:
    """A placement (stage -> rank) as a list of ints; anything else (a float
    that would be truncated, a string, None, a bool) is refused, naming the stage."""
    if isinstance(placement, (str, bytes, Mapping)) or not isinstance(placement, Iterable):
        raise TypeError(
            f"{who}: placement is a list with each stage's rank, e.g. [0, 1, 0, 1], "
            f"got {placement!r} ({type(placement).__name__})"
        )
    given = list(placement)
    for stage, rank in enumerate(given):
        if not is_index(rank):
            raise TypeError(
                f"{who}: placement gives each stage's rank as an int; stage {stage} has "
                f"{rank!r} ({type(rank).__name__}), in {given!r}"
            )
    return [int(rank) for rank in given]


# Names a user may give a built-in schedule by, lower case, without '_' or '-'.
_ALIASES = {"1f1b": "OneFOneB", "interleaved": "Interleaved1F1B", "zbh1": "ZeroBubbleH1"}


def _builtin_schedules() -> dict[str, type[Schedule]]:
    """The schedules of `mpmd.schedules` by name, found among Schedule's
    subclasses (builtins.py is written with Schedule, so this module cannot
    import it)."""
    found: dict[str, type[Schedule]] = {}
    todo: list[type[Schedule]] = [Schedule]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__ == f"{__package__}.builtins":
                found[sub.__name__] = sub
    return found


def require_schedule(schedule: object, who: str) -> Schedule:
    """`schedule`, which `who` runs, as an mpmd.Schedule instance; a schedule
    class, a number of microbatches, a schedule's name or None is refused
    saying how to write one."""
    if isinstance(schedule, Schedule):
        if not isinstance(getattr(schedule, "num_microbatches", None), int):
            raise TypeError(
                f"{who}: {type(schedule).__name__} has no num_microbatches; its __init__ must "
                "call super().__init__(num_microbatches)"
            )
        return schedule
    builtins = _builtin_schedules()
    example = "mpmd.schedules.OneFOneB(num_microbatches)"
    if isinstance(schedule, type) and issubclass(schedule, Schedule):
        name = schedule.__name__
        spelled = f"mpmd.schedules.{name}" if builtins.get(name) is schedule else name
        detail = (
            f"the class {name}, not a schedule; instantiate it with the number of "
            f"microbatches: {spelled}(num_microbatches)"
        )
    elif isinstance(schedule, int) and not isinstance(schedule, bool):
        detail = (
            f"{schedule!r} (int); the number of microbatches is part of the schedule: "
            f"write mpmd.schedules.OneFOneB({schedule}) (or another schedule of "
            "mpmd.schedules)"
        )
    elif isinstance(schedule, str):
        key = schedule.lower().replace("_", "").replace("-", "")
        known = {n.lower(): n for n in builtins}
        builtin = _ALIASES.get(key) or known.get(key)
        spelled = f"mpmd.schedules.{builtin}(num_microbatches)" if builtin else example
        detail = f"{schedule!r} (str); a schedule is an object, not a name: write {spelled}"
    elif schedule is None:
        detail = f"None; pass one, e.g. {example}"
    else:
        detail = f"{type(schedule).__name__}; e.g. {example}"
    raise TypeError(f"{who}: expected an mpmd.Schedule, got {detail}")
