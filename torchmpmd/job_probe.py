"""Layouts stepped on the job, for `mpmd.plan` (`planner/job_runs.py`).

The planner prices data and tensor parallelism from the profile (rank 0
alone, the model whole) and the calibrated links. On the job both cost
more: DTensor's dispatch of every sharded op and the waits of each
collective on ranks that drift apart come per call (on CPU tp layouts
measured 1.5-2.4x their prediction), and Gloo's threads averaging the
gradients take the cores the backward runs on. So, before it plans,
`mpmd.plan` steps the model here as one stage on every rank: once without
tp (dp over every rank) and once per tp size it weighs (dp x tp), one
microbatch of the example per replica, a warm-up and four timed steps
each, and takes each rank's forward and backward task times from the
runner's timeline and its whole step: per step the slowest rank's (the
step ends when it does), the median over the steps (the fastest of a few
steps is one where the ranks happened not to compete for the cores, and
the runs they price are measured by their medians; a median per rank and
then the slowest of those drew each rank's worst moments into one figure,
9-27% apart from run to run on 2 ranks sharing 2 cores). In turns with
the runner's steps it runs the model eagerly on every rank, alone (no
averaging, no tp): the job's compute level at those moments, which the
planner compares the runner's figures with, so that a slower moment of the
machine (a single-threaded matmul here took 104-141 ms from one second to
the next) is not taken for a cost of data or tensor parallelism.

Where the ranks compute on one host's CPU, `mpmd.plan` also steps its
fastest candidates with and without a pipeline here, in turns, each at its
replica's share of the batch (`step_candidates`), to learn the level of
each kind's predictions on the job (`planner/pipeline_level.py`). Every
probe steps a copy of the model and leaves the random state as it found
it.

It lives beside `build` and `refine` because it runs the runtime, which the
planner does not import; `mpmd.plan` finds it through `set_probe` and
`set_measure`.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh

from .build import layout_mesh, runner_of
from .planner import trace
from .planner.candidates import Candidate
from .planner.job_runs import Run, set_probe
from .planner.layouts import Layout
from .planner.pipeline_level import set_measure
from .planner.weigh import batch_rows
from .runtime import PipelineRunner, RunnerOptions
from .schedules import OneFOneB

__all__ = ["step_candidates", "step_layout"]

_STEPS = 4  # timed, after one warm-up step
_P = ParamSpec("_P")
_T = TypeVar("_T")


def step_layout(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    target: Any,
    tp_plan: dict[str, Any] | None,
    tp: int,
) -> Run:
    """The forward, backward and step seconds of `model` as one stage on a
    (pp 1, dp world / tp, tp) mesh of every rank, one microbatch of the
    example per replica, and in turns with them the model's forward and
    backward computed alone on every rank: medians over four steps of the
    slowest rank's. A collective."""
    world = dist.get_world_size()
    layout = Layout(pp=1, dp=world // tp, tp=tp)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=layout.mesh_dim_names)
    pipe = trace(copy.deepcopy(model), args, kwargs or None)
    runner = PipelineRunner(
        pipe,
        OneFOneB(1),
        # Without one, the profile's backward starts from ones: the outputs' sum.
        loss_fn=loss_fn or _sum_of_outputs,
        mesh=mesh,
        options=RunnerOptions(tp_plan=tp_plan if tp > 1 else None),
    )
    alone = copy.deepcopy(model)
    forward: list[float] = []
    backward: list[float] = []
    steps: list[float] = []
    alone_f: list[float] = []
    alone_b: list[float] = []
    for step in range(_STEPS + 1):
        steps.append(_step(runner, args, target, kwargs))
        timeline = runner.timeline
        # In turns with the runner's steps (its warm-up too): the model
        # computed alone on every rank at the same moments, the job's
        # compute level then.
        f, b = _alone_step(alone, args, kwargs, loss_fn or _sum_of_outputs, target)
        if step == 0:
            continue
        mine = [t for t in (timeline.tasks if timeline else ()) if t.rank == runner.rank]
        forward.append(sum(t.end - t.start for t in mine if t.kind == "F"))
        backward.append(sum(t.end - t.start for t in mine if t.kind == "B"))
        alone_f.append(f)
        alone_b.append(b)
    return Run(*_slowest([forward, backward, steps[1:], alone_f, alone_b]))


def step_candidates(
    cs: list[Candidate],
    replica_rows: list[int],
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    target: Any,
    tp_plan: dict[str, Any] | None,
) -> list[float]:
    """The seconds of each candidate's step on the job (`cs[k]`'s replicas a
    batch of `replica_rows[k]` rows each, the example's rows repeated),
    stepped in turns: per candidate the median over its steps after a
    warm-up of the slowest rank's. A collective."""
    # A pipeline's ranks step one batch (its runner checks them in): rank
    # 0's example on every rank, where each rank was given its own.
    box = [(args, kwargs, target)]
    dist.broadcast_object_list(box, src=0)
    args, kwargs, target = box[0]
    rows = max(batch_rows(args, kwargs), 1)
    runs = []
    for c, want in zip(cs, replica_rows, strict=True):
        copies = -(-want // rows)
        batch, kw, tgt = pytree.tree_map(
            lambda t, copies=copies, want=want: (
                torch.cat([t] * copies)[:want]
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows
                else t
            ),
            (args, kwargs, target),
        )
        layout = c.layout or Layout(pp=dist.get_world_size())
        runner = runner_of(
            c,
            copy.deepcopy(model),
            batch,
            want,
            loss_fn or _sum_of_outputs,
            RunnerOptions(tp_plan=tp_plan if layout.tp > 1 else None),
            layout_mesh(layout),
            batch_kwargs=kw,
        )
        runs.append((runner, batch, tgt, kw))
    steps: list[list[float]] = [[] for _ in cs]
    for _ in range(_STEPS):
        for k, (runner, batch, tgt, kw) in enumerate(runs):
            steps[k].append(_step(runner, batch, tgt, kw))
    return _slowest([s[1:] for s in steps])


def _step(runner: PipelineRunner, args: Any, target: Any, kwargs: dict[str, Any]) -> float:
    """One step's seconds, the ranks started together; its gradients dropped."""
    dist.barrier()
    start = time.perf_counter()
    runner.step(*args, target=target, **kwargs)
    seconds = time.perf_counter() - start
    for p in runner.parameters():
        p.grad = None
    return seconds


def _alone_step(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    target: Any,
) -> tuple[float, float]:
    """The seconds of `model`'s forward (with the loss) and backward run
    eagerly on this rank, the ranks started together; its gradients
    dropped."""
    dist.barrier()
    start = time.perf_counter()
    loss = loss_fn(model(*args, **kwargs), target)
    _sync()
    middle = time.perf_counter()
    torch.autograd.backward(loss)
    _sync()
    end = time.perf_counter()
    for p in model.parameters():
        p.grad = None
    return middle - start, end - middle


def _sync() -> None:
    if _nccl():
        torch.cuda.synchronize()


def _slowest(samples: list[list[float]]) -> list[float]:
    """Per list (a figure per step, the same steps on every rank), the
    median over the steps of the slowest rank's figure (the same on every
    rank). A collective."""
    device = torch.device("cuda", torch.cuda.current_device()) if _nccl() else None
    per_step = torch.tensor(samples, dtype=torch.float64, device=device)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    return [statistics.median(row) for row in per_step.tolist()]


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def _sum_of_outputs(output: Any, _target: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    return sum((t.sum() for t in leaves if t.is_floating_point()), torch.zeros(()))


def _rng_kept(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """`fn` leaving the random state as it found it: the probes' steps draw
    from it (a model's dropout), and planning must not move a user's seed."""

    @functools.wraps(fn)
    def kept(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        devices = [torch.cuda.current_device()] if _nccl() else []
        with torch.random.fork_rng(devices=devices):
            return fn(*args, **kwargs)

    return kept


set_probe(_rng_kept(step_layout))
set_measure(_rng_kept(step_candidates))
