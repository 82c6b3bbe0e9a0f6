"""Random numbers inside tensor-parallel stages.

A tensor-parallel stage is one computation spread over its tp peers, so its
random numbers must be the computation's, not each rank's: a dropout mask
on a replicated activation must be the same on every peer (else the
"replicated" values, their gradients and then the weights drift apart), and
one on a sharded activation should be the unsharded model's (else the
shards are masked alike, or by numbers no single model draws). Megatron's
model-parallel RNG tracker and DTensor's offset-based one (CUDA only) are
the references; here:

- Every tp peer draws from one generator. At the start of each `step` and
  `eval_step` the runner copies the generator state of tp coordinate 0 (the
  CPU's, and the stage device's) to the other tp peers (`share_generators`),
  whatever each rank seeded (`torch.manual_seed(seed + rank)` included).
- A random op of a traced stage runs through `random_op`: on replicated
  values (or a dropout of partial sums, which its mask distributes over) it
  runs on each rank's local tensor, the same draws everywhere; on sharded
  values it draws for the whole tensor, as the unsharded model does, and
  keeps this rank's part: dropout (its mask), the ops whose draws depend on
  the shape alone (`rand_like`, `normal_`, `bernoulli(p)`, ...) and
  attention with dropout on heads-sharded inputs (the mask of torch's math
  kernel, (batch, heads, L, S)). Any other random op on sharded values
  (draws that depend on the values: `bernoulli` of probabilities, `rrelu`,
  `multinomial`) gathers its inputs whole and runs whole on every peer.
  Every peer thus consumes the generator alike and stays in step for the
  rest of the step; the draws of the whole are made on every peer (the cost
  of a mask, not of the op's compute or memory beyond it).
- A stage cut by hand (the user's `parallelize`) runs its random ops the
  same way, under `RandomOps` (a dispatch mode around its forward).

Data-parallel replicas and pipeline ranks keep their own generators: each
replica masks its own shard of the batch with its own numbers, as DDP's do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["RandomOps", "draws_random", "random_op", "share_generators"]

aten = torch.ops.aten


def _overloads(*names: str) -> frozenset[Any]:
    """The aten overloads named `op.overload` that this torch has."""
    found = []
    for name in names:
        op, _, overload = name.partition(".")
        packet = getattr(aten, op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


_DROPOUT = aten.native_dropout.default
_ATTENTION = aten.scaled_dot_product_attention.default
# Ops whose draws depend only on their first argument's shape, dtype and
# device (and on scalars), never on its values.
_SHAPE_ONLY = _overloads(
    "native_dropout.default",
    "rand_like.default",
    "randn_like.default",
    "randint_like.default",
    "randint_like.low_dtype",
    "bernoulli.p",
    "bernoulli_.float",
    "normal_functional.default",
    "normal_.default",
    "uniform.default",
    "uniform_.default",
    "exponential.default",
    "exponential_.default",
    "geometric.default",
    "geometric_.default",
    "cauchy.default",
    "cauchy_.default",
    "log_normal.default",
    "log_normal_.default",
    "random_.default",
    "random_.from",
    "random_.to",
)


def draws_random(op: Any) -> bool:
    """Whether aten op `op` draws from a generator (torch tags it so)."""
    tags = getattr(op, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _draws_now(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether this call of random op `op` draws (dropout off, attention
    without dropout, rrelu in evaluation do not)."""
    if op is _DROPOUT:
        train = args[2] if len(args) > 2 else kwargs.get("train")
        return train is None or bool(train)
    if op is _ATTENTION:
        p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        return float(p) > 0.0
    if op is aten.rrelu.default:
        return bool(args[3] if len(args) > 3 else kwargs.get("training", False))
    return True


def random_op(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> Any:
    """Random aten op `op` on `args` (DTensors over a tp mesh, or not), drawn
    as the unsharded computation draws (the module's docstring);
    differentiable where the op is."""
    kwargs = dict(kwargs or {})
    dts = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    if not dts or not _draws_now(op, args, kwargs):
        return op(*args, **kwargs)
    first = dts[0]
    placements = first.placements
    alike = all(d.device_mesh == first.device_mesh and d.placements == placements for d in dts)
    whole = all(p.is_replicate() for p in placements)
    if alike and (whole or (op is _DROPOUT and not any(p.is_shard() for p in placements))):
        return _locally(op, args, kwargs, first)
    if alike and len(dts) == 1 and op in _SHAPE_ONLY and args and args[0] is first:
        return _sliced(op, args, kwargs, first)
    if op is _ATTENTION and _heads_sharded(args, kwargs):
        return _attention(args, kwargs)
    # Draws that depend on the values: the inputs whole on every peer.
    gathered = pytree.tree_map_only(DTensor, _whole, (args, kwargs))
    return _locally(op, gathered[0], gathered[1], _whole(first))


def _whole(value: DTensor) -> DTensor:
    if all(p.is_replicate() for p in value.placements):
        return value
    return value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)


def _locally(op: Any, args: Sequence[Any], kwargs: dict[str, Any], like: DTensor) -> Any:
    """`op` on each rank's local tensors (every peer draws the same numbers),
    its tensor results placed as `like` (a dropout's mask: replicated)."""
    mesh, placements = like.device_mesh, like.placements
    local = pytree.tree_map_only(DTensor, lambda d: d.to_local(), (list(args), kwargs))
    out = op(*local[0], **local[1])
    if op is _DROPOUT:
        result, mask = out
        return (
            DTensor.from_local(result, mesh, placements, run_check=False),
            DTensor.from_local(mask, mesh, [Replicate()] * mesh.ndim, run_check=False),
        )
    return pytree.tree_map_only(
        torch.Tensor, lambda t: DTensor.from_local(t, mesh, placements, run_check=False), out
    )


def _part(value: DTensor) -> tuple[slice, ...]:
    """Where this rank's local tensor lies in `value`'s global shape."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _sliced(op: Any, args: Sequence[Any], kwargs: dict[str, Any], first: DTensor) -> Any:
    """A shape-only random op on a sharded DTensor: drawn for the whole
    shape (on an uninitialised tensor, whose values the op ignores), this
    rank's part kept."""
    local = first._local_tensor
    part = _part(first)
    dummy = torch.empty(tuple(first.shape), dtype=first.dtype, device=local.device)
    mesh, placements = first.device_mesh, first.placements
    with torch.no_grad():
        out = op(dummy, *args[1:], **kwargs)
    if op is _DROPOUT:
        p = float(args[1] if len(args) > 1 else kwargs["p"])
        mask = out[1][part].clone()
        kept = 1.0 - p
        scale = 0.0 if kept == 0.0 else 1.0 / kept
        # As ATen's dropout: input * mask * scale (differentiable in input).
        result = first.to_local().mul(mask).mul(scale)
        return (
            DTensor.from_local(result, mesh, placements, run_check=False),
            DTensor.from_local(mask, mesh, placements, run_check=False),
        )
    drawn = out[part].clone()
    if op._schema.is_mutable:  # an in-place fill: `first` takes its part
        local.copy_(drawn)
        return first
    return DTensor.from_local(drawn, mesh, placements, run_check=False)


def _attention_args(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    out: dict[str, Any] = {"attn_mask": None, "is_causal": False, "scale": None}
    out["enable_gqa"] = False
    out.update(zip(names, args, strict=False))
    out.update(kwargs)
    return out


def _heads_sharded(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Attention whose query, key and value are sharded by heads alike (dim
    1 of (batch, heads, L, E)) and whose mask, if any, is whole or sharded alike."""
    a = _attention_args(args, kwargs)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    qkv = (q, k, v)
    if not all(isinstance(t, DTensor) and t.dim() == 4 for t in qkv):
        return False
    heads = (Shard(1),)
    if any(tuple(t.placements) != heads or t.device_mesh != q.device_mesh for t in qkv):
        return False
    if a["enable_gqa"] and q.shape[1] != k.shape[1]:
        return False  # key/value heads repeated across shards: not by slices
    if isinstance(mask, DTensor):
        return mask.device_mesh == q.device_mesh and (
            all(p.is_replicate() for p in mask.placements)
            or (mask.dim() == 4 and tuple(mask.placements) == heads)
        )
    return True


def _attention(args: Sequence[Any], kwargs: dict[str, Any]) -> DTensor:
    """Attention with dropout on heads-sharded inputs: torch's math kernel
    (what the CPU runs with dropout) with the mask it would draw for all
    heads, (batch, heads, L, S), this rank's heads kept."""
    a = _attention_args(args, kwargs)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    p = float(a["dropout_p"])
    batch, heads, length, dim = q.shape
    source = k.shape[-2]
    heads_part = _part(q)[1]
    ql, kl, vl = q.to_local(), k.to_local(), v.to_local()
    with torch.no_grad():
        dummy = torch.empty((batch, heads, length, source), dtype=ql.dtype, device=ql.device)
        keep = aten.native_dropout.default(dummy, p, True)[1][:, heads_part].clone()
    if isinstance(mask, torch.Tensor):
        # A whole mask over every head keeps this rank's; one sharded by
        # heads (or broadcast over them) is this rank's already.
        whole = not isinstance(mask, DTensor) or all(p.is_replicate() for p in mask.placements)
        mask = mask.to_local() if isinstance(mask, DTensor) else mask
        if whole and mask.dim() == 4 and mask.shape[1] == heads:
            mask = mask[:, heads_part]
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(dim)
    scores = ql @ kl.transpose(-2, -1) * scale
    if a["is_causal"]:
        causal = torch.ones(length, source, dtype=torch.bool, device=ql.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    weights = scores.softmax(-1)
    kept = 1.0 - p
    weights = weights * keep * (0.0 if kept == 0.0 else 1.0 / kept)
    out = weights @ vl
    return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)


class RandomOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs the random ops of a stage cut by hand through `random_op` (a
    traced stage's are rewritten instead); every other op as it is."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if draws_random(func) and _any_dtensor(args, kwargs):
            return random_op(func, args, kwargs)
        return func(*args, **(kwargs or {}))


class _Attention(TorchFunctionMode):
    """Attention with dropout on DTensors, in a stage cut by hand, through
    `random_op` (torch's composite attention never reaches the dispatch
    mode whole, and its math path adds a causal mask DTensor refuses)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _any_dtensor(args, kwargs):
            return random_op(_ATTENTION, args, kwargs)
        return func(*args, **kwargs)


def _any_dtensor(args: Sequence[Any], kwargs: dict[str, Any] | None) -> bool:
    return any(isinstance(a, DTensor) for a in pytree.tree_leaves((args, kwargs)))


def with_random_ops(call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` (a hand-cut stage's forward) with its random ops on DTensors
    drawn as a traced stage's are."""

    def run(*args: Any) -> Any:
        with _Attention(), RandomOps():  # type: ignore[no-untyped-call]
            return call(*args)

    return run


def share_generators(group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank of `group` (a tp group) takes its first rank's generator
    states, the CPU's and `device`'s (collective over `group`)."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    sizes = [s.numel() for s in states]
    comm = torch.device("cpu") if _cpu_group(group) else device
    flat = torch.cat(states).to(comm)
    dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
    flat = flat.cpu()
    shared = torch.split(flat, sizes)
    torch.set_rng_state(shared[0].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(shared[1].clone(), device)


def _cpu_group(group: dist.ProcessGroup) -> bool:
    """Whether `group` exchanges CPU tensors (Gloo)."""
    try:
        group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return False
    return True
