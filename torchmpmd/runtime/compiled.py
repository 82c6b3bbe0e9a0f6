"""A pipe compiled for this rank, one per input signature.

Variable shapes work as a cache of programs keyed by the microbatch inputs'
shapes, dtypes and constants (`Signature`): a signature seen for the first
time is traced again from the model (`Pipe.retrace`, on every rank alike,
since every rank gets the same batch, so no message is exchanged to agree),
and its stages take this rank's existing parameters and buffers by name. A
signature seen before costs a dictionary lookup. The alternative, symbolic
dimensions from torch.export carried through the plan, would need dynamic
shapes in the C++ plan, the transfers and the split (I/W) graphs, and loses
the shape checks and static buffers the executor relies on; one program per
shape keeps every program static.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import _C
from ..graph.pipe import Pipe, TensorSpec
from ..graph.split import data_dependent
from ..graph.stage import as_stage
from ..parallel.layout import Layout
from ..schedule.kinds import part_of_backward, recomputes
from ..schedule.program import Edge, Program, StageGraph, compile_schedule
from ..schedule.task import Schedule
from ..schedule.timeline import Timeline, from_records
from .microbatch import Microbatcher
from .options import RunnerOptions, StageWrapper
from .stages import LocalStages, LossFn
from .transport import Transport

__all__: list[str] = []

# Per flat input: its TensorSpec, or (type name, repr) of a constant.
Signature = tuple[Any, ...]


def signature_of(values: list[Any]) -> Signature:
    """The signature of one microbatch's flat inputs."""
    return tuple(
        TensorSpec.of_tensor(v) if isinstance(v, torch.Tensor) else (type(v).__name__, repr(v))
        for v in values
    )


def traced_signature(pipe: Pipe) -> Signature:
    """The signature of the example `pipe` was traced with."""
    return tuple(
        s if isinstance(s, TensorSpec) else (type(s).__name__, repr(s)) for s in pipe.input_specs
    )


@dataclass(kw_only=True, frozen=True, slots=True)
class PipeSettings:
    """What every compiled pipe of a runner shares."""

    schedule: Schedule
    transport: Transport
    device: torch.device
    loss_fn: LossFn | None
    chunk_dims: Mapping[str, int | None] | None
    timeout: float
    max_early_recvs: int
    split_backward: bool | str
    compile_options: Mapping[str, Any] | None
    selective_recompute: frozenset[int] = frozenset()
    measure_memory: bool = False
    wrap_stage: StageWrapper | None = None  # RunnerOptions.wrap_stage
    # The parallelisms inside the stages (their collectives go in every
    # stage's training program).
    layout: Layout = dataclasses.field(default_factory=lambda: Layout(None, None, []))

    @staticmethod
    def of(
        options: RunnerOptions,
        schedule: Schedule,
        transport: Transport,
        device: torch.device,
        loss_fn: LossFn | None,
        timeout: float,
        selective: frozenset[int],
        layout: Layout,
    ) -> PipeSettings:
        """A runner's settings: its checked `options` (`timeout` in seconds,
        the `selective` recompute's stages) and what it runs on."""
        compiled = options.compile
        return PipeSettings(
            schedule=schedule,
            transport=transport,
            device=device,
            loss_fn=loss_fn,
            chunk_dims=options.chunk_dims,
            timeout=timeout,
            max_early_recvs=options.max_early_recvs,
            split_backward=options.split_backward,
            compile_options=None if compiled is False else ({} if compiled is True else compiled),
            selective_recompute=selective,
            measure_memory=bool(options.measure_memory),
            wrap_stage=options.wrap_stage,
            layout=layout,
        )


class CompiledPipe:
    """`pipe` lowered for this rank: program, local stages and executors."""

    def __init__(self, pipe: Pipe, settings: PipeSettings, shared: CompiledPipe | None) -> None:
        self.pipe = pipe
        self._settings = settings
        transport = settings.transport
        self.rank: int = transport.rank
        layout = settings.layout
        # A parallelism that sums the tied weights' gradients itself (their
        # DTensor shards, which the executor does not exchange) takes the
        # ties out of the program.
        graph = untied(pipe, layout) if layout.sums_ties else pipe
        self.program: Program = compile_schedule(
            settings.schedule, graph, transport.size, collectives=layout.collectives
        )
        full = self._unsplittable(settings) if settings.split_backward == "auto" else {}
        if full:
            self.program = compile_schedule(
                settings.schedule.with_full_backward(full),
                graph,
                transport.size,
                collectives=layout.collectives,
            )
            if self.rank == 0:
                which = "; ".join(f"stage {s}: {where}" for s, where in sorted(full.items()))
                warnings.warn(
                    f"{type(settings.schedule).__name__} splits the backward of stages "
                    f"{sorted(full)}, whose tensor shapes depend on the data ({which}): they "
                    "run their whole backward (B) in place of I, without W; the other stages "
                    "keep I/W (split_backward='auto')",
                    stacklevel=2,
                )
        placement = self.program.placement
        self.local_stages = [s for s in range(pipe.num_stages) if placement[s] == self.rank]
        self.loss_rank = placement[pipe.num_stages - 1]
        self._check_recompute()
        m = settings.schedule.num_microbatches
        self.microbatcher = Microbatcher(pipe, m, settings.chunk_dims)
        # Tied parameters by node id, found again by name once the stages
        # hold this rank's own tensors.
        tied_names = {
            id(p): (s, name)
            for s in self.local_stages
            for name, p in pipe.stage(s).named_parameters(remove_duplicate=False)
        }
        if shared is not None:
            _take_state(pipe, shared, self.local_stages)
        else:
            # A model on the meta device: each rank allocates only its parts
            # (LocalStages allocates what is still meta).
            layout.shard_meta({s: pipe.stage(s) for s in self.local_stages}, pipe)
        self.stages = LocalStages(
            pipe,
            self.local_stages,
            settings.device,
            loss_fn=settings.loss_fn,
            num_microbatches=m,
            split=self._choose_split(settings.split_backward),
            compile_options=settings.compile_options,
            selective=set(settings.selective_recompute) & set(self.local_stages),
            recomputed={
                p.stage
                for t in self.program.tasks(self.rank)
                for p in t.parts
                if recomputes(p.kind)
            },
            split_by_autograd=layout.rewrites_stages,
        )
        modules, specs = self.stages.modules, pipe.stage_specs
        if shared is None:  # the others take its (sharded) parameters
            layout.shard(modules, pipe)
        if layout.members:
            transfers = {t.value: t.spec for t in pipe.transfers}
            self.stages.wrap_forwards(
                lambda s, call: layout.wrap_forward(modules[s], call, specs[s], transfers)
            )
        if settings.wrap_stage is not None:
            self.stages.wrap_forwards(functools.partial(settings.wrap_stage, self.rank))
        # This rank's copy of each tied parameter it holds, by node id.
        self.tied_parameters: dict[int, torch.nn.Parameter] = {
            node: self.stages.modules[tied_names[id(param)][0]].get_parameter(
                tied_names[id(param)][1]
            )
            for node, param in pipe.tied_parameters.items()
            if id(param) in tied_names
        }
        self.executor = self._executor(self.program, training=True)
        self._eval_executor: _C.runtime.Executor | None = None

    @classmethod
    def retraced(
        cls, pipe: Pipe, row: list[Any], settings: PipeSettings, shared: CompiledPipe
    ) -> CompiledPipe:
        """`pipe` traced again for one microbatch's flat inputs `row` (a
        signature not seen before) and compiled, sharing `shared`'s state.

        A trace that fails is a batch that does not fit the model (a wrong
        feature size) far more often than untraceable code: the error names
        the inputs that differ from the traced example. It is raised before
        any message is exchanged, so the runner stays usable.
        """
        try:
            new = pipe.retrace(row)
        except Exception as err:  # re-raised naming the inputs
            raise ValueError(_retrace_failure(pipe, row, err)) from err
        return cls(new, settings, shared)

    def shapes_of(self, other: CompiledPipe, mb: int) -> dict[tuple[int, int], list[int]]:
        """The shapes `other`'s transfers have, as (value, `mb`) -> shape for
        this pipe's executor, which then runs microbatch `mb` of `other`'s shapes."""
        mine = [(t.value, t.name, t.spec.dtype, t.requires_grad) for t in self.pipe.transfers]
        theirs = [(t.value, t.name, t.spec.dtype, t.requires_grad) for t in other.pipe.transfers]
        if mine != theirs:
            raise ValueError(
                f"microbatch {mb} has other input shapes than microbatch 0, and traced for them "
                "the model sends other values between stages "
                f"({[t[1] for t in theirs]} instead of {[t[1] for t in mine]}); split the model "
                "at points that do not depend on the shapes, or pass a batch that divides into "
                "equal microbatches"
            )
        shape = self._shape
        return {
            (t.value, mb): shape(t.spec)
            for t, own in zip(other.pipe.transfers, self.pipe.transfers, strict=True)
            if shape(t.spec) != shape(own.spec)
        }

    def _shape(self, spec: TensorSpec) -> list[int]:
        """The shape of a transfer's messages: this rank's part of the value
        (a parallelism's, e.g. a sequence shard)."""
        return self._settings.layout.transfer_shape(spec)

    def eval_executor(self) -> _C.runtime.Executor:
        """The forward-only executor (the schedule's F tasks), made on first use."""
        if self._eval_executor is None:
            program = compile_schedule(
                self._settings.schedule,
                self.pipe,
                self._settings.transport.size,
                forward_only=True,
            )
            self._eval_executor = self._executor(program, training=False)
        return self._eval_executor

    def _check_recompute(self) -> None:
        recomputed = {
            p.stage for t in self.program.tasks(self.rank) for p in t.parts if recomputes(p.kind)
        }
        recomputed |= set(self._settings.selective_recompute) & set(self.local_stages)
        for s in sorted(recomputed):
            if self.pipe.stage_specs[s].updates_buffers:
                raise ValueError(
                    f"stage {s} (rank {self.rank}) updates buffers in its forward (e.g. BatchNorm "
                    "running statistics) and it is recomputed (R tasks or selective "
                    "recompute): the update would apply twice; leave this stage out of recompute"
                )

    def _unsplittable(self, settings: PipeSettings) -> dict[int, str]:
        """Stages the schedule splits (I/W on any rank) that cannot be split:
        traced stages computing data-dependent shapes (an eager stage, or
        one a parallelism rewrites, splits through autograd, which can)."""
        if settings.layout.rewrites_stages:
            return {}
        with_iw = {
            p.stage
            for r in range(self.program.num_ranks)
            for t in self.program.tasks(r)
            for p in t.parts
            if part_of_backward(p.kind)
        }
        found = {}
        for s in sorted(with_iw):
            module = self.pipe.stage(s)
            where = data_dependent(as_stage(module).graph_module)
            if where is not None:
                found[s] = where
        return found

    def _choose_split(self, split_backward: bool | str) -> set[int]:
        with_iw = {
            p.stage
            for t in self.program.tasks(self.rank)
            for p in t.parts
            if part_of_backward(p.kind)
        }
        if split_backward == "auto":
            return with_iw
        if split_backward is True:
            return set(self.local_stages)
        if split_backward is False:
            if with_iw:
                raise ValueError(
                    f"{type(self._settings.schedule).__name__} has input/weight-gradient tasks "
                    f"(I/W) for stages {sorted(with_iw)} on rank {self.rank}, which need "
                    "split_backward; to run those stages' whole backward (B) instead, pass "
                    f"schedule.with_full_backward({sorted(with_iw)}) (split_backward='auto' "
                    "does so by itself for stages that cannot split)"
                )
            return set()
        raise ValueError(f"split_backward must be True, False or 'auto', got {split_backward!r}")

    def measured_timeline(self, num_ranks: int) -> Timeline:
        """This rank's timeline of the training executor's last run."""
        e = self.executor
        return from_records(
            self.rank,
            num_ranks,
            e.records(),
            e.step_start_unix_ns,
            e.peak_held_bytes,
            (e.sent_bytes, e.received_bytes),
        )

    def _executor(self, program: Program, training: bool) -> _C.runtime.Executor:
        pipe, settings = self.pipe, self._settings
        values = [
            _C.runtime.ValueInfo(
                t.value, t.name, self._shape(t.spec), t.spec.dtype, t.requires_grad
            )
            for t in pipe.transfers
        ]
        stages = [
            _C.runtime.StageInfo(
                s,
                list(spec.recv_values),
                list(spec.send_values),
                s == pipe.num_stages - 1,
                training and s in self.stages.split,
            )
            for s, spec in enumerate(pipe.stage_specs)
        ]
        return _C.runtime.Executor(
            rank=self.rank,
            program=program._native,
            stages=stages,
            values=values,
            transport=settings.transport,
            tied=dict(self.tied_parameters) if training and not settings.layout.sums_ties else {},
            timeout_s=settings.timeout,
            max_early_recvs=settings.max_early_recvs,
            training=training,
            device=settings.device,
            measure_memory=settings.measure_memory,
        )


def untied(pipe: Pipe, layout: Layout) -> StageGraph:
    """`pipe`'s stages and transfers without its tied groups, each transfer
    with the bytes this rank sends (`Layout.transfer_shape`), which the
    simulator charges."""
    specs = {t.value: t.spec for t in pipe.transfers}

    def nbytes(value: int, whole: int) -> int:
        spec = specs.get(value)
        if spec is None:
            return whole
        return math.prod(layout.transfer_shape(spec)) * spec.dtype.itemsize

    edges = tuple(
        Edge(e.value, e.src, e.dst, nbytes(e.value, e.bytes), e.requires_grad)
        for e in pipe.plan.edges()
    )
    return StageGraph(pipe.num_stages, edges)


def _retrace_failure(pipe: Pipe, row: list[Any], err: Exception) -> str:
    """Why a microbatch's inputs could not be traced: which differ from the
    traced example, and the trace's own first line."""
    changes = []
    for name, traced, value in zip(pipe.input_names, pipe.input_specs, row, strict=True):
        if isinstance(traced, TensorSpec) and isinstance(value, torch.Tensor):
            got = TensorSpec.of_tensor(value)
            if got.shape != traced.shape:
                changes.append(
                    f"input '{name}' has shape {got.shape} where the pipeline was traced "
                    f"with {traced.shape}"
                )
            if got.dtype != traced.dtype:
                changes.append(
                    f"input '{name}' has dtype {got.dtype} where the pipeline was traced "
                    f"with {traced.dtype}"
                )
        elif (type(traced).__name__, repr(traced)) != (type(value).__name__, repr(value)):
            changes.append(
                f"input '{name}' is {value!r} where the pipeline was traced with {traced!r}"
            )
    text = str(err).strip()
    cause = text.splitlines()[0].split(" To fix:")[0] if text else type(err).__name__
    return (
        f"microbatch {'; '.join(changes) or 'inputs differ from the traced example'}, and "
        f"tracing the model for them failed ({cause.rstrip('.')}): the batch probably does "
        "not fit the model; pass batches like the traced example (only the sizes the model "
        "allows to vary, such as batch size or sequence length, may change between steps)"
    )


def _take_state(pipe: Pipe, shared: CompiledPipe, stages: list[int]) -> None:
    """Makes `pipe`'s local stages use `shared`'s parameters and buffers (by name)."""
    for s in stages:
        old = shared.stages.modules[s]
        new = pipe.stage(s)
        try:
            for name, _ in list(new.named_parameters(remove_duplicate=False)):
                owner, leaf = _owner(new, name)
                owner._parameters[leaf] = old.get_parameter(name)
            for name, _ in list(new.named_buffers(remove_duplicate=False)):
                owner, leaf = _owner(new, name)
                owner._buffers[leaf] = old.get_buffer(name)
        except AttributeError as err:
            raise ValueError(
                f"stage {s} traced for new input shapes holds state that stage {s} of the first "
                f"trace does not ({err}): the stages changed with the input shapes; split the "
                "model at points that do not depend on them"
            ) from None


def _owner(root: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf
