"""Expert parallelism's token exchange (`expert.py` shards the experts and
drives it): an experts module's call over the ep group, `Dispatch`, which
sends each routed token row to its expert's rank by all-to-all, runs the
module's own forward on what arrived, and brings the results back (see
`expert.py`'s docstring); what it moved and when (`Traffic`)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import _disable_current_modes

from .. import _C
from .protocol import running_again, running_task

__all__ = ["GROUPED", "PARAMETER", "STYLES", "TOPK", "Dispatch", "ExpertsOverTp", "Traffic"]

TOPK = "ep_dispatch_experts"  # Hugging Face: (tokens, top-k ids, top-k weights)
GROUPED = "grouped_experts"  # torchtitan: (rows sorted by expert, tokens per expert)
PARAMETER = "grouped_gemm"  # Hugging Face's entries for the experts' parameters
STYLES = (TOPK, GROUPED, PARAMETER)


@dataclass(slots=True)
class Traffic:
    """What this rank's experts modules moved and ran in one step: bytes
    sent to other ranks by the all-to-alls (dispatch and combine, forward
    and backward), per experts module the tokens each of its local experts
    ran, and each all-to-all's interval (for the timeline)."""

    sent_bytes: int = 0
    received_bytes: int = 0
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)  # path -> per local expert
    # (kind, stage, microbatch, start, end, label), seconds since the epoch.
    intervals: list[tuple[str, int, int, float, float, str]] = field(default_factory=list)

    def reset(self) -> None:
        self.sent_bytes = 0
        self.received_bytes = 0
        self.tokens = {}
        self.intervals = []


@dataclass(frozen=True, slots=True)
class _Exchange:
    """One all-to-all of an experts module's call: which, over what, for
    which (stage, microbatch)'s forward (None outside a pipeline task)."""

    kind: str  # "dispatch" or "combine"
    path: str
    lanes: tuple[dist.ProcessGroup, ...]  # Dispatch.lanes
    traffic: Traffic
    task: tuple[int, int] | None

    @property
    def group(self) -> dist.ProcessGroup:
        """The group of the side of a fused task that runs the exchange now
        (`_C.runtime.current_lane`): a backward's is the side that runs the
        backward, not the forward's."""
        return self.lanes[min(_C.runtime.current_lane(), len(self.lanes) - 1)]

    def run(
        self, x: torch.Tensor, recv: list[int], send: list[int], backward: bool = False
    ) -> torch.Tensor:
        """Rows of `x` to the group's ranks (`send[r]` rows to rank r),
        `recv[r]` rows from each, counted, timed and named if it fails."""
        out = x.new_empty((sum(recv), *x.shape[1:]))
        what = f"{self.kind}{' backward' if backward else ''} {self.path}"
        start = time.time()
        with torch.profiler.record_function(f"ep {what}"):
            try:
                dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
            except RuntimeError as err:
                raise RuntimeError(self.failed(what, err)) from err
        end = time.time()
        me = dist.get_rank(self.group)
        row = math.prod(x.shape[1:]) * x.element_size()  # bytes of one row (none may come)
        self.traffic.sent_bytes += (sum(send) - send[me]) * row
        self.traffic.received_bytes += (sum(recv) - recv[me]) * row
        stage, mb = self.task if self.task is not None else (-1, -1)
        if stage >= 0:
            self.traffic.intervals.append((self.kind, stage, mb, start, end, f"ep {what}"))
        return out

    def failed(self, what: str, err: BaseException) -> str:
        ranks = dist.get_process_group_ranks(self.group)
        me = dist.get_rank()
        peers = [r for r in ranks if r != me]
        where = (
            f" in stage {self.task[0]}'s microbatch {self.task[1]}" if self.task is not None else ""
        )
        return (
            f"expert parallelism: rank {me}'s all-to-all ({what}){where} over the ep ranks "
            f"{ranks} did not complete: {str(err).splitlines()[0] if str(err) else err!r}; "
            f"the peer it waited for is among ranks {peers} (stalled, failed or gone: its own "
            "error names the cause)"
        )


def _all_to_all(
    x: torch.Tensor, recv: list[int], send: list[int], exchange: _Exchange
) -> torch.Tensor:
    out: torch.Tensor = _AllToAll.apply(x, recv, send, exchange)  # type: ignore[no-untyped-call]
    return out


class _AllToAll(torch.autograd.Function):
    """`_Exchange.run`, whose backward sends the gradients the other way."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, recv: list[int], send: list[int], exchange: _Exchange
    ) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.exchange = recv, send, exchange
        return exchange.run(x, recv, send)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return ctx.exchange.run(grad, ctx.send, ctx.recv, backward=True), None, None, None


def _counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.bincount(ids.reshape(-1).long(), minlength=experts)[:experts]


class Dispatch:
    """One experts module's call over the ep group (see the module docstring)."""

    def __init__(
        self,
        module: torch.nn.Module,
        path: str,
        style: str,
        local: int,
        group: dist.ProcessGroup,
        traffic: Traffic,
    ) -> None:
        self.module, self.path, self.style, self.local = module, path, style, local
        self.group, self.traffic = group, traffic
        # The group of each side of a fused task (`_C.runtime.current_lane`):
        # the forward side of one whose sides run at once exchanges over a
        # second group of the same ranks (set by ExpertParallel); a call
        # sharded by hand (`shard_experts`) has one.
        self.lanes: tuple[dist.ProcessGroup, ...] = (group,)
        self.size = dist.get_world_size(group)
        self.forward = type(module).forward
        # The tp mesh whose ranks each run a slice of the call's rows (set by
        # expert parallelism beside tensor parallelism), or None.
        self.split_rows_over: Any = None

    def __call__(self, *args: Any) -> torch.Tensor:
        if self.style == TOPK:
            return self._top_k(*args)
        return self._grouped(*args)

    def _exchanges(self) -> tuple[_Exchange, _Exchange]:
        task = running_task()
        return (
            _Exchange("dispatch", self.path, self.lanes, self.traffic, task),
            _Exchange("combine", self.path, self.lanes, self.traffic, task),
        )

    def _split_sizes(
        self, per_expert: torch.Tensor, dispatch: _Exchange
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """(tokens each rank sends me per local expert [ep, local], the rows
        I send each rank, the rows each rank sends me): the one exchange of
        sizes, and the one host read, of the layer."""
        send_counts = per_expert.reshape(self.size, self.local).contiguous()
        recv_counts = torch.empty_like(send_counts)
        try:
            dist.all_to_all_single(recv_counts, send_counts, group=dispatch.group)
        except RuntimeError as err:
            raise RuntimeError(dispatch.failed(f"split sizes {self.path}", err)) from err
        send = send_counts.sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        return recv_counts, send, recv

    def _run_local(self, *args: Any) -> torch.Tensor:
        with _local_parameters(self.module):
            out: torch.Tensor = self.forward(self.module, *args)
        return out

    def _run_none(
        self, rows: torch.Tensor, args: Callable[[torch.Tensor], tuple[Any, ...]]
    ) -> torch.Tensor:
        """The experts' call when no token came to this rank: on one row of
        zeros made from the (empty) received rows, its output's first zero
        rows. So no kernel sees an empty batch, and the output stays
        connected to the received rows: the backward still runs this rank's
        reverse all-to-alls, which its peers wait for (an expert nobody
        chose gets a zero gradient)."""
        one = rows.sum(0, keepdim=True)
        out: torch.Tensor = self._run_local(*args(one))
        return out[:0]

    def _record(self, recv_counts: torch.Tensor) -> None:
        """Counts the tokens each local expert ran. A recompute's were counted
        by its forward: an R task's, or selective recompute's replay inside
        the backward. The counting's ops stay out of any dispatch mode, so
        that selective recompute, which matches the ops of its replay to the
        forward's one by one, sees the same ops in both."""
        if running_again() or torch._C._current_graph_task_id() != -1:
            return
        with _disable_current_modes():
            seen = self.traffic.tokens.get(self.path)
            ran = recv_counts.sum(0)
            self.traffic.tokens[self.path] = ran if seen is None else seen + ran

    def _top_k(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        experts = self.local * self.size
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)
        dispatch, combine = self._exchanges()
        recv_counts, send, recv = self._split_sizes(_counts(ids, experts), dispatch)
        self._record(recv_counts)
        rows = _all_to_all(hidden[order // k], recv, send, dispatch)
        local_ids = torch.arange(self.local, device=hidden.device).repeat(self.size)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv))
        # Unit weights: the routing weights are applied where the token lives.
        ones = torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=rows.device)
        if rows.shape[0]:
            out = self._run_local(rows, local_ids[:, None], ones)
        else:
            unit = torch.ones((1, 1), dtype=top_k_weights.dtype, device=rows.device)
            out = self._run_none(rows, lambda one: (one, local_ids.new_zeros((1, 1)), unit))
        back = _all_to_all(out, send, recv, combine)
        placed = back.new_zeros(back.shape).index_copy(0, order, back)
        weighted = placed.reshape(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(placed.dtype)
        return weighted.sum(1).to(hidden.dtype)

    def _grouped(self, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        dispatch, combine = self._exchanges()
        recv_counts, send, recv = self._split_sizes(per_expert.long(), dispatch)
        self._record(recv_counts)
        got = _all_to_all(rows, recv, send, dispatch)
        # Received per source rank, each part by local expert: regroup by
        # local expert (every source's rows of expert 0 first, ...).
        flat = recv_counts.reshape(-1)
        starts = torch.cumsum(flat, 0) - flat
        by_expert = recv_counts.t().reshape(-1)
        start_of = starts.reshape(self.size, self.local).t().reshape(-1)
        first = torch.repeat_interleave(start_of, by_expert, output_size=sum(recv))
        within = torch.arange(sum(recv), device=rows.device) - torch.repeat_interleave(
            torch.cumsum(by_expert, 0) - by_expert, by_expert, output_size=sum(recv)
        )
        order = first + within
        counts = recv_counts.sum(0).to(per_expert.dtype)
        if got.shape[0]:
            ran = self._run_local(got[order], counts)
        else:
            one_row = torch.zeros_like(counts)
            one_row[0] = 1
            ran = self._run_none(got, lambda one: (one, one_row))
        back = ran.new_zeros(ran.shape).index_copy(0, order, ran)
        return _all_to_all(back, send, recv, combine)


@contextlib.contextmanager
def _local_parameters(module: torch.nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their local shards (differentiable:
    the gradient reaches the DTensor) while its own forward runs."""
    saved: dict[str, Any] = dict(module._parameters)
    slots: dict[str, Any] = module._parameters
    for name, p in saved.items():
        if isinstance(p, DTensor):
            slots[name] = p.to_local()
    try:
        yield
    finally:
        module._parameters.update(saved)


class ExpertsOverTp(torch.nn.Module):
    """An experts module's call (`graph.experts`) in a tensor-parallel stage
    (the experts are not sharded over tp): its inputs, replicated DTensors,
    as local tensors, its output a replicated DTensor again. Where expert
    parallelism says the call's rows are tokens of their own
    (`split_rows_over`: Hugging Face's convention), each tp rank runs its
    slice of the rows (`Shard(0)`, no communication) and the outputs are
    gathered: no token computed twice (the experts' gradients are then
    partial over tp, which expert parallelism sums); otherwise each tp rank
    runs them all."""

    def __init__(
        self,
        experts: torch.nn.Module,
        mesh: DeviceMesh,
        replicated: Callable[[DTensor], DTensor],
    ) -> None:
        super().__init__()
        self.experts, self.mesh = experts, mesh
        # tensor.replicated: a value replicated, and its gradient too.
        self._replicated = replicated

    def forward(self, *args: Any) -> Any:
        call = self.experts.__dict__.get("forward")
        if getattr(call, "split_rows_over", None) is None:
            local = [self._replicated(a).to_local() if isinstance(a, DTensor) else a for a in args]
            out = self.experts(*local)
            return DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
        whole = [
            self._replicated(a)
            if isinstance(a, DTensor)
            else DTensor.from_local(a, self.mesh, [Replicate()], run_check=False)
            for a in args
        ]
        rows = [a.redistribute(self.mesh, [Shard(0)]).to_local() for a in whole]
        out = self.experts(*rows)
        shape = torch.Size((whole[0].shape[0], *out.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
        sliced = DTensor.from_local(
            out, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
        )
        return sliced.redistribute(self.mesh, [Replicate()])
