"""Expert parallelism inside a stage, over the mesh's "ep" dimension.

A mixture of experts' experts module holds every expert of its layer
stacked (`[experts, ...]` parameters); the trace records it as one call and
the stage calls the module itself (`graph.experts`). Over "ep" each rank
holds `experts / ep` of every such module (its parameters DTensors,
`Shard(0)` over the ep mesh, so that the state dict, the gradient norm and
DCP see the whole tensors), and the module's call becomes:

1. dispatch: each (token, chosen expert) row goes to the rank holding the
   expert, by one all-to-all (its split sizes exchanged first: the number
   of tokens per expert depends on the data, nothing is dropped or padded);
2. the module's own forward on the rows it received, with the local expert
   ids (a plain call: its loops, `.tolist()` and splits run eagerly);
3. combine: the results go back by a second all-to-all, to their tokens.

Autograd runs the two all-to-alls backwards. Two calling conventions are
known (a plan's styles): Hugging Face's `"ep_dispatch_experts"` (tokens,
top-k expert ids, top-k weights; the weights are applied where the token
lives) and torchtitan's `"grouped_experts"` (token rows sorted by expert,
tokens per expert).

The ep ranks are data-parallel for everything else (as in torchtitan, where
the experts borrow the data-parallel ranks): each runs its own part of the
batch, the other parameters' gradients are averaged over every data-parallel
rank (a "dp" dimension's and ep's together), and an expert's gradient, a sum
over every ep rank's tokens already, is averaged over "dp" and divided by
ep. With `data_parallel="fsdp"` the other parameters are sharded over
dp x ep and the experts over dp. Supported meshes: ("pp", "ep") and ("pp",
"dp", "ep"), each with an innermost "tp" (tensor parallelism for the rest
of the stage: `expert_dispatch.ExpertsOverTp`); anything else with "ep" is
refused, saying why. Stages cut by hand shard their experts in the user's
`parallelize` with `shard_experts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..graph.experts import experts_calls, hf_experts_patterns, matches_pattern
from ..graph.pipe import Pipe
from ..graph.stage import as_stage
from ..schedule.program import StageCollectives
from ..schedule.timeline import TimelineEvent
from .expert_dispatch import GROUPED, PARAMETER, STYLES, TOPK, Dispatch, Traffic
from .fsdp import FSDP
from .protocol import (
    Asked,
    Kind,
    Parallelism,
    Parallelize,
    RankStages,
    not_sharded_over,
    register,
)
from .replicate import Replicas, broadcast_from_first

__all__ = ["STYLES", "ExpertParallel", "Traffic", "shard_experts"]


def _style_of(value: Any) -> str:
    """A plan's style: a string of `STYLES`, or torchtitan's `ExpertParallel()`."""
    if isinstance(value, str):
        return value
    name = type(value).__name__
    if name in ("ExpertParallel", "TensorParallelExpertParallel"):  # torchtitan's styles
        return GROUPED
    return f"<{name}>"


class ExpertParallel(Parallelism):
    """Experts sharded over the mesh's "ep" dimension, tokens dispatched by
    all-to-all, every other parameter averaged over ep (and "dp")."""

    name = "ep"
    splits_batch = True
    # Its stages' experts modules are sharded and wrapped in place: a new
    # shape's stages would hold every expert.
    allows_new_shapes = False
    collectives = StageCollectives(unshard=False, reduce_grads=True)

    def __init__(
        self,
        root: DeviceMesh,
        dims: tuple[str, ...],
        plan: Mapping[str, Any] | None,
        bucket: int,
        fsdp: bool = False,
        parallelize: Parallelize | None = None,
    ) -> None:
        self.dims = dims
        self.ep_mesh = root["ep"]
        self.ep_group = self.ep_mesh.get_group()
        self.size = int(self.ep_mesh.size())
        # The forward side of a fused task whose sides run at once exchanges
        # its tokens over a second group of the same ranks (`Dispatch.lanes`).
        self.lane_group = _second_groups(root, "ep")
        self.plan = dict(plan) if plan is not None else None
        self.traffic = Traffic()
        self._parallelize = parallelize
        self._parallelized: set[int] = set()  # the stages it was called on
        self._stage_mesh = root[dims] if len(dims) > 1 else self.ep_mesh
        data = tuple(d for d in dims if d != "ep")
        if data:
            self._dp_group: dist.ProcessGroup | None = root[data[0]].get_group()
            flat = root[(*data, "ep")]._flatten()
            self._group = flat.get_group()
        else:
            self._dp_group = None
            flat, self._group = self.ep_mesh, self.ep_group
        self._expert_ids: set[int] = set()
        dp = dist.get_world_size(self._dp_group) if self._dp_group is not None else 1
        self._dp_mesh = root[data[0]] if data else None
        # The dense part: replicas, or FSDP2 over every data-parallel rank;
        # under FSDP the experts are sharded over what is left of dp (FSDP2
        # units of their own, their gradients divided by dp x ep), or left
        # out without a dp dimension.
        self._experts_sharded = fsdp and self._dp_mesh is not None
        self._dense: Replicas | FSDP = (
            FSDP(
                flat,
                None,
                bucket,
                dims=dims,
                leave_out=None if self._experts_sharded else self._is_expert,
                inner=self._shard_experts_over_dp if self._experts_sharded else None,
            )
            if fsdp
            else Replicas(self._group, dims, bucket, select=self._is_dense)
        )
        if fsdp:
            self.collectives = StageCollectives(unshard=True, reduce_grads=True)
        self._experts = Replicas(
            self._dp_group if self._dp_group is not None else self.ep_group,
            data,
            bucket,
            select=self._is_expert,
            divisor=dp * self.size,
        )
        if self._dp_group is None:
            # No replicas of the experts: only divided by ep, nothing sent.
            self._experts.size = 1
        # With tensor parallelism, a call whose rows are tokens of their own
        # (Hugging Face's convention) runs each tp rank's slice of them
        # (expert_dispatch.ExpertsOverTp): those experts' gradients are sums over tp
        # too (and averaged over dp, divided by ep).
        names = tuple(root.mesh_dim_names or ())
        self._tp_mesh = root["tp"] if "tp" in names and not self._experts_sharded else None
        self._sliced_ids: set[int] = set()
        self._sliced_paths: set[str] = set()
        self._sliced: Replicas | None = None
        if self._tp_mesh is not None:
            over = (*data, "tp")
            group = root[over]._flatten().get_group() if data else self._tp_mesh.get_group()
            self._sliced = Replicas(
                group, over, bucket, select=self._is_sliced, divisor=dp * self.size
            )
        # Rows split over tp all-reduce inside the task on tp's one group.
        self.overlaps_sides = self._tp_mesh is None
        self.sharded: dict[str, int] = {}  # experts module path -> local experts
        self._tokens: dict[str, torch.Tensor] = {}  # the last step's, per expert

    def _is_expert(self, p: torch.nn.Parameter) -> bool:
        return id(p) in self._expert_ids and id(p) not in self._sliced_ids

    def _is_sliced(self, p: torch.nn.Parameter) -> bool:
        return id(p) in self._sliced_ids

    def _is_dense(self, p: torch.nn.Parameter) -> bool:
        return id(p) not in self._expert_ids

    def groups(self) -> list[dist.ProcessGroup]:
        found = [self._group, self.ep_group, self.lane_group]
        if self._dp_group is not None:
            found.append(self._dp_group)
        return list(dict.fromkeys(found))

    # ---- build time

    def shard_meta(self, stages: Mapping[int, torch.nn.Module], pipe: Pipe) -> None:
        self.shard(stages, pipe)

    def shard(self, stages: Mapping[int, torch.nn.Module], pipe: Pipe) -> None:
        """Each experts module of the plan: its experts split over ep, its
        call dispatching the tokens (once per module)."""
        plan = self._plan_for(pipe)
        used: set[str] = set()
        for s, stage in sorted(stages.items()):
            graph = as_stage(stage).graph_module
            if graph is None:
                continue
            for node in experts_calls(graph.graph):
                path = str(node.target)
                style, pattern = self._style(path, node, plan)
                if pattern is not None:
                    used.add(pattern)
                if style is None:
                    continue
                self._shard_module(s, graph.get_submodule(path), path, style)
        if self._parallelize is not None:
            # The user's own (stages cut by hand: `shard_experts` on their
            # experts modules), after the plan's, over the stage's mesh.
            for _, module in sorted(stages.items()):
                held = as_stage(module)
                if id(held.state_root) in self._parallelized:
                    continue  # shard_meta's call, then shard's: once
                self._parallelized.add(id(held.state_root))
                self._parallelize(held.state_root, self._stage_mesh)
                held.refresh_state()
        for _, module in sorted(stages.items()):
            for name, sub in as_stage(module).state_root.named_modules():
                found = sub.__dict__.get("forward")
                if isinstance(found, Dispatch) and found.traffic is not self.traffic:
                    self._adopt(name, found)
        if plan is not None and self.plan is not None:
            unused = [p for p, v in plan.items() if p not in used and _style_of(v) != PARAMETER]
            if unused:
                raise ValueError(
                    f"ep_plan: {unused} name no experts module of this rank's stages "
                    f"{sorted(stages)}; the traced experts modules are: "
                    f"{self._traced_paths(stages) or 'none'} (mpmd.trace(..., experts=[...]) "
                    "names more)"
                )

    def _plan_for(self, pipe: Pipe) -> dict[str, Any] | None:
        if self.plan is not None:
            bad = [(p, v) for p, v in self.plan.items() if _style_of(v) not in STYLES]
            if bad:
                path, value = bad[0]
                raise ValueError(
                    f"ep_plan: {path!r} has style {value!r}; the styles are "
                    f"{', '.join(repr(s) for s in STYLES)} (or torchtitan's ExpertParallel())"
                )
            return self.plan
        source = pipe.source
        if source is None:
            return None
        found = hf_experts_patterns(source)
        return {p: TOPK for p in found} or None

    def _style(
        self, path: str, node: Any, plan: Mapping[str, Any] | None
    ) -> tuple[str | None, str | None]:
        """(the style of the experts module at `path`, the plan's pattern
        naming it); style None: the plan leaves it whole."""
        if plan is not None:
            for pattern, value in plan.items():
                style = _style_of(value)
                if style != PARAMETER and matches_pattern(path, pattern):
                    return style, pattern
            if self.plan is not None:
                return None, None
        return _infer_style(path, node), None

    def _traced_paths(self, stages: Mapping[int, torch.nn.Module]) -> list[str]:
        out = []
        for stage in stages.values():
            graph = as_stage(stage).graph_module
            if graph is not None:
                out += [str(n.target) for n in experts_calls(graph.graph)]
        return out

    def _shard_module(self, stage: int, module: torch.nn.Module, path: str, style: str) -> None:
        if path in self.sharded:
            return
        dispatch = shard_experts(module, self.ep_mesh, style, path=path, where=f" of stage {stage}")
        self._adopt(path, dispatch)

    def _adopt(self, path: str, dispatch: Dispatch) -> None:
        """Counts and shows a dispatching experts module's exchanges (one the
        plan sharded, or a user's `parallelize` with `shard_experts`)."""
        dispatch.traffic = self.traffic
        dispatch.path = path
        dispatch.lanes = (dispatch.group, self.lane_group)
        if self._tp_mesh is not None and dispatch.style == TOPK:
            dispatch.split_rows_over = self._tp_mesh
            self._sliced_paths.add(path)
        self.sharded[path] = dispatch.local

    # ---- weights

    def attach(self, stages: RankStages) -> None:
        self._expert_ids = {
            id(p)
            for m in stages.modules.values()
            for p in m.parameters()
            if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
        }
        self._sliced_ids = {
            id(p)
            for m in stages.modules.values()
            for sub in m.modules()
            if getattr(sub.__dict__.get("forward"), "split_rows_over", None) is not None
            for p in sub.parameters()
        }
        self._dense.attach(stages)
        if self._experts_sharded:
            self._expert_ids = set()  # their own FSDP2 units reduce them
        self._experts.attach(stages)
        if self._sliced is not None:
            self._sliced.attach(stages)

    def _shard_experts_over_dp(self, stage: torch.nn.Module) -> None:
        """FSDP2 over dp for each experts module of `stage` (its parameters
        DTensors over ep already: 2-D, as FSDP2 with tensor parallelism), a
        gradient being a sum over every ep rank's tokens: divided by dp x ep."""
        from torch.distributed.fsdp import fully_shard

        assert self._dp_mesh is not None
        for module in stage.modules():
            forward = module.__dict__.get("forward")
            if isinstance(forward, Dispatch):
                fully_shard(module, mesh=self._dp_mesh, reshard_after_forward=False)
                divide = getattr(module, "set_gradient_divide_factor", None)
                if divide is not None:
                    divide(float(self._experts.divisor))

    def start_equal(self, tensors: list[torch.Tensor]) -> None:
        """Every data-parallel rank starts from the first's dense tensors; an
        expert shard from its dp replica's first."""
        self._dense.start_equal(tensors)
        self._experts_equal(tensors)

    def make_equal(self, tensors: list[torch.Tensor]) -> None:
        self._dense.make_equal(tensors)
        self._experts_equal(tensors)

    def _experts_equal(self, tensors: list[torch.Tensor]) -> None:
        """The expert shards (sharded over ep) like their dp replica's first."""
        if self._dp_group is None:
            return
        whole = {id(t) for t in not_sharded_over(tensors, ("ep",))}
        shards = [t for t in tensors if id(t) not in whole]
        broadcast_from_first(
            self._dp_group, not_sharded_over(shards, self.dims[:-1]), self._experts.bucket_bytes
        )

    def unshard(self, stage: int) -> None:
        self._dense.unshard(stage)

    def after_eval(self) -> None:
        self._dense.after_eval()

    # ---- steps

    def _parts(self) -> list[Replicas | FSDP]:
        return [self._dense, self._experts, *([self._sliced] if self._sliced else [])]

    def start_step(self) -> None:
        self.traffic.reset()
        for part in self._parts():
            part.start_step()

    def reduce_grads(self, stage: int) -> None:
        for part in self._parts():
            part.reduce_grads(stage)

    def finish(self, tied: Mapping[int, torch.nn.Parameter]) -> None:
        failed: RuntimeError | None = None
        for part in self._parts():
            try:
                part.finish(tied)
            except RuntimeError as err:
                failed = failed or err
        if failed is not None:
            raise failed
        self._gather_tokens()

    def _gather_tokens(self) -> None:
        """Every expert's tokens this step over the ep group (each rank ran
        its own experts'), in one all-gather for all the modules."""
        paths = sorted(self.sharded)
        if not paths:
            return
        local = torch.cat(
            [
                self.traffic.tokens.get(p, torch.zeros(self.sharded[p], dtype=torch.long))
                for p in paths
            ]
        ).long()
        if self._sliced_paths and self._tp_mesh is not None:
            # Each tp rank ran its slice of the tokens: the whole batch's.
            mask = torch.cat(
                [
                    torch.full((self.sharded[p],), p in self._sliced_paths, dtype=torch.long)
                    for p in paths
                ]
            )
            summed = local * mask
            dist.all_reduce(summed, group=self._tp_mesh.get_group())
            local = torch.where(mask.bool(), summed, local)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.ep_group)
        per_rank = torch.stack(parts)
        out, offset = {}, 0
        for p in paths:
            n = self.sharded[p]
            out[p] = per_rank[:, offset : offset + n].reshape(-1)
            offset += n
        self._tokens = out

    def step_events(self, rank: int) -> list[TimelineEvent]:
        return [
            TimelineEvent(rank, kind, stage, mb, start, end, label)
            for kind, stage, mb, start, end, label in self.traffic.intervals
        ]

    def step_metrics(self) -> dict[str, Any]:
        return {
            "all_to_all_sent_bytes": self.traffic.sent_bytes,
            "all_to_all_received_bytes": self.traffic.received_bytes,
            "tokens_per_expert": dict(self._tokens),
        }


def shard_experts(
    module: torch.nn.Module,
    ep_mesh: DeviceMesh,
    style: str,
    *,
    path: str = "experts",
    where: str = "",
) -> Dispatch:
    """Shards an experts module (stacked `[experts, ...]` parameters) over
    `ep_mesh` and makes its calls dispatch their tokens there, as the runner
    does for a traced stage's: for a stage cut by hand, call it in your
    `RunnerOptions(parallelize=fn)`, `fn(stage, stage_mesh)`, on each experts
    module (`shard_experts(stage.layers[1].moe.experts, stage_mesh["ep"],
    "grouped_experts")`). `style`: how it is called, "ep_dispatch_experts"
    (tokens, top-k ids, top-k weights) or "grouped_experts" (rows sorted by
    expert, tokens per expert). Its parameters become DTensors `Shard(0)`
    (ep rank 0's, scattered; a meta tensor is cut), its `num_experts` the
    local count. Returns the module's new call."""
    if style not in (TOPK, GROUPED):
        raise ValueError(
            f"shard_experts: style {style!r} for {path!r}; use {TOPK!r} (tokens, top-k ids, "
            f"top-k weights) or {GROUPED!r} (rows sorted by expert, tokens per expert)"
        )
    size = int(ep_mesh.size())
    params = {n: p for n, p in module._parameters.items() if p is not None}
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int):
        count = next(iter(params.values())).shape[0] if params else 0
    if not params or count % size or any(p.shape[0] != count for p in params.values()):
        raise ValueError(
            f"ep: the experts module {path!r}{where} holds {count} experts (parameters "
            f"{[(n, tuple(p.shape)) for n, p in params.items()]}), which {size} ep ranks "
            f"cannot share evenly; choose an ep size that divides {count}"
        )
    local = count // size
    for name, p in params.items():
        if isinstance(p, DTensor):
            continue
        # A meta tensor is cut without a message (each rank allocates its
        # own); a real one is ep rank 0's, scattered.
        dt = distribute_tensor(
            p.detach(), ep_mesh, [Shard(0)], src_data_rank=None if p.is_meta else 0
        )
        module._parameters[name] = torch.nn.Parameter(dt, requires_grad=p.requires_grad)
    if hasattr(module, "num_experts"):
        setattr(module, "num_experts", local)  # noqa: B010 (an attribute of the model's own class)
    dispatch = Dispatch(module, path, style, local, ep_mesh.get_group(), Traffic())
    module.forward = dispatch
    return dispatch


def _second_groups(root: DeviceMesh, dim: str) -> dist.ProcessGroup:
    """A second process group of this rank's ranks along `dim` of `root`:
    every rank makes every such group (`new_group` is collective over the
    world), in one order."""
    names = list(root.mesh_dim_names or ())
    ranks = root.mesh.movedim(names.index(dim), -1).reshape(-1, root.mesh.shape[names.index(dim)])
    mine: dist.ProcessGroup | None = None
    for row in ranks.tolist():
        group = dist.new_group(row)
        if dist.get_rank() in row:
            mine = group
    if mine is None:
        raise RuntimeError(
            f"expert parallelism: rank {dist.get_rank()} is not in its mesh {root.mesh.tolist()}"
        )
    return mine


def _infer_style(path: str, node: Any) -> str:
    found = [a.meta.get("val") if hasattr(a, "meta") else None for a in node.args]
    vals = [v for v in found if isinstance(v, torch.Tensor)]
    if len(vals) != len(found):
        vals = []
    if (
        len(vals) == 3
        and vals[0].dim() == 2
        and not vals[1].is_floating_point()
        and vals[1].dim() == 2
        and vals[2].shape == vals[1].shape
    ):
        return TOPK
    if len(vals) == 2 and vals[0].dim() == 2 and vals[1].dim() == 1:
        return GROUPED
    shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in found]
    raise ValueError(
        f"ep: cannot tell how the experts module {path!r} takes its tokens (called with {shapes}); "
        f"name its style in RunnerOptions(ep_plan={{{path!r}: ...}}): {TOPK!r} for (tokens, top-k "
        f"expert ids, top-k weights), {GROUPED!r} for (rows sorted by expert, tokens per expert)"
    )


def _claim(names: tuple[str, ...] | None, left: tuple[str, ...], asked: Asked) -> tuple[str, ...]:
    """ "ep", with "dp" as replicas (the experts' replicas too)."""
    if "ep" not in left:
        if asked.ep_plan is not None:
            given = "no mesh" if names is None else f"a mesh of dimensions {names}"
            raise ValueError(
                f"PipelineRunner: ep_plan needs a mesh with an 'ep' dimension (got {given}), e.g. "
                "init_device_mesh('cpu', (pp, ep), mesh_dim_names=('pp', 'ep'))"
            )
        return ()
    others = [n for n in left if n not in ("ep", "dp")]
    if others:
        raise ValueError(
            f"PipelineRunner: expert parallelism runs on meshes ('pp', 'ep') and ('pp', 'dp', "
            f"'ep'), with 'tp' innermost for tensor parallelism (got dimensions {names}); "
            "torchtitan's dp_shard / dp_replicate names do not combine with 'ep' yet: use those "
            "meshes (data_parallel='fsdp' for FSDP2 over every data-parallel rank), or leave 'ep' "
            "out"
        )
    if names is not None and "tp" in names and names.index("tp") < names.index("ep"):
        raise ValueError(
            f"PipelineRunner: the mesh's 'tp' dimension must come after 'ep' (got {names}): "
            "tensor parallelism's ranks share one batch and are neighbours; name them (pp, ep, tp)"
        )
    if names is not None and "dp" in left and names.index("dp") > names.index("ep"):
        raise ValueError(
            f"PipelineRunner: the mesh's 'ep' dimension must come after 'dp' (got {names}): the "
            "ranks of one ep group are neighbours, as in torchtitan; name them (pp, dp, ep)"
        )
    return ("dp", "ep") if "dp" in left else ("ep",)


def _make(mesh: DeviceMesh, dims: tuple[str, ...], pipe: Pipe, asked: Asked) -> ExpertParallel:
    fsdp = asked.data_parallel == "fsdp"
    return ExpertParallel(mesh, dims, asked.ep_plan, asked.bucket_bytes, fsdp, asked.parallelize)


register(
    Kind(
        ExpertParallel.name,
        ("ep",),
        _claim,
        _make,
        order=5,
        options=("ep_plan", "parallelize"),
    )
)
