"""A mixture of experts' experts module as one call in the traced graph.

An experts module (a layer's stacked experts: Hugging Face's
`Qwen3MoeExperts`, torchtitan's `GroupedExperts`) runs its routed tokens
with shapes that depend on the data: `.tolist()` split sizes, `torch.split`,
`nonzero` over the routing, a loop over the experts hit. torch.export either
fails there (an unbacked size that "should have been constant") or fixes one
microbatch's routing. So the trace records each experts module as a single
call, `torchmpmd::experts(args, state, path)`, whose output is shaped like
its first argument (token rows in, token rows out, as every experts module
computes them), and the stage built from the graph calls the module itself
there (`call_module` at the model's own path, over a copy of the module that
shares its parameters): the routed tokens run eagerly, with the shapes of
each microbatch, and an expert parallelism can wrap that call (dispatch the
tokens to the ranks holding their experts, and combine them back) without
rewriting the graph.

Which modules: those an `experts` argument of `mpmd.trace` names (module
path patterns, `*` for one path component), or by default every module that
holds stacked experts: an int `num_experts` attribute E > 1 and parameters
of its own that all have E rows, one at least of three dimensions or more
(a router's `[E, dim]` weight alone is not an experts module), and a model's
own Hugging Face expert-parallel plan's `ep_dispatch_experts` modules.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from .names import path_pattern

__all__ = [
    "EXPERTS_OP",
    "checkpointed_experts_message",
    "experts_call",
    "experts_calls",
    "experts_modules",
    "hf_experts_patterns",
    "matches_pattern",
    "module_copy",
    "traced_as_calls",
]


@torch.library.custom_op("torchmpmd::experts", mutates_args=())
def _experts(args: list[torch.Tensor], state: list[torch.Tensor], path: str) -> torch.Tensor:
    raise RuntimeError(
        f"torchmpmd::experts ({path!r}) only marks an experts module in a traced graph; the stages "
        "built from the graph call the module itself"
    )


@_experts.register_fake
def _(args: list[torch.Tensor], state: list[torch.Tensor], path: str) -> torch.Tensor:
    return torch.empty_like(args[0])


def _no_backward(ctx: Any, grad: torch.Tensor) -> Any:
    raise RuntimeError("torchmpmd::experts has no backward of its own: its stage calls the module")


def _setup(ctx: Any, inputs: Any, output: Any) -> None:
    pass


_experts.register_autograd(_no_backward, setup_context=_setup)

EXPERTS_OP = torch.ops.torchmpmd.experts.default


def matches_pattern(path: str, pattern: str) -> bool:
    """Whether module `path` is one the plan pattern names (`names.path_pattern`)."""
    return path_pattern(pattern).fullmatch(path) is not None


def _stacked_experts(module: torch.nn.Module) -> bool:
    count = getattr(module, "num_experts", None)
    own = [p for p in module._parameters.values() if p is not None]
    if not isinstance(count, int) or isinstance(count, bool) or count < 2 or not own:
        return False
    return all(p.dim() >= 2 and p.shape[0] == count for p in own) and any(p.dim() >= 3 for p in own)


def hf_experts_patterns(model: torch.nn.Module) -> list[str]:
    """The model's own Hugging Face ep plan's experts modules, as paths of
    `model` (the plan is written for the base model: `model.layers.*...`)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_ep_plan", None) or {}
    experts = [k for k, style in plan.items() if style == "ep_dispatch_experts"]
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix) and model is not getattr(model, prefix):
        experts = [f"{prefix}.{k}" for k in experts]
    return experts


def experts_modules(
    model: torch.nn.Module, patterns: Sequence[str] | None = None
) -> dict[str, torch.nn.Module]:
    """The experts modules of `model` by path: those `patterns` name (None:
    found as the module docstring says; an empty list: none). A pattern that
    names no module is refused with the closest paths."""
    named = dict(model.named_modules())
    if patterns is not None:
        if isinstance(patterns, str):
            raise TypeError(
                f"mpmd.trace: experts= takes a list of module path patterns, got the string "
                f"{patterns!r}; write [{patterns!r}]"
            )
        found: dict[str, torch.nn.Module] = {}
        for pattern in patterns:
            hits = {p: m for p, m in named.items() if p and matches_pattern(p, pattern)}
            if not hits:
                close = [
                    p for p in named if p and p.rsplit(".", 1)[-1] == pattern.rsplit(".", 1)[-1]
                ]
                raise ValueError(
                    f"mpmd.trace: experts={list(patterns)!r}: {pattern!r} names no module of "
                    f"{type(model).__name__}"
                    + (f"; its modules named alike: {close[:4]}" if close else "")
                    + " (a pattern is a module path, '*' standing for one part: 'layers.*.moe.experts')"
                )
            found.update(hits)
        return found
    wanted = hf_experts_patterns(model)
    return {
        p: m
        for p, m in named.items()
        if p and (_stacked_experts(m) or any(matches_pattern(p, w) for w in wanted))
    }


@contextlib.contextmanager
def traced_as_calls(modules: dict[str, torch.nn.Module], named: bool = True) -> Iterator[None]:
    """While tracing: each module of `modules` records one `EXPERTS_OP` call
    (its tensor arguments, its parameters and buffers, its path). A module
    called with other arguments (JetMoE's per-expert size list) is refused
    if the user `named` the modules, else traced through as before."""
    patched = []
    for path, module in modules.items():
        if "forward" in module.__dict__:
            raise ValueError(
                f"mpmd.trace: the experts module {path!r} ({type(module).__name__}) has its forward "
                "replaced on the instance (by a parallelism's hooks?); trace the model before "
                "parallelizing it: torchmpmd shards the experts itself (RunnerOptions(ep_plan=...))"
            )
        module.forward = _as_call(path, module, named)
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _as_call(path: str, module: torch.nn.Module, named: bool) -> Any:
    own = type(module).forward
    signature = inspect.signature(own)

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(module, *args, **kwargs)
        values = list(bound.arguments.items())[1:]
        bad = [(n, v) for n, v in values if not isinstance(v, torch.Tensor)]
        if bad and not named:
            return own(module, *args, **kwargs)  # type: ignore[no-any-return]
        if bad:
            name, value = bad[0]
            raise TypeError(
                f"mpmd.trace: the experts module {path!r} ({type(module).__name__}) is called with "
                f"{name}={value!r}, which is not a tensor; an experts module is traced as one call "
                "of tensors (token rows first): pass the others at construction, or leave the "
                f"module out of mpmd.trace(..., experts=[...])"
            )
        state = [*module.parameters(), *module.buffers()]
        out: torch.Tensor = EXPERTS_OP([v for _, v in values], state, path)
        return out

    return forward


def experts_calls(graph: fx.Graph) -> list[fx.Node]:
    """The graph's experts calls: `EXPERTS_OP` nodes (in a traced graph) and
    `call_module` nodes their stages made of them."""
    return [
        n
        for n in graph.nodes
        if n.target is EXPERTS_OP or (n.op == "call_module" and n.meta.get("experts_call"))
    ]


def experts_call(
    graph: fx.Graph,
    root: torch.nn.Module,
    node: fx.Node,
    env: dict[fx.Node, fx.Node],
    model: torch.nn.Module,
) -> fx.Node:
    """A traced `EXPERTS_OP` node as its stage runs it: a call of the module
    (a `module_copy` of `model`'s, at the model's path under `root`), on the
    values `env` holds for the node's arguments."""
    args, _state, path = node.args
    path = str(path)
    *parents, leaf = path.split(".")
    owner = root
    for part in parents:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    # Replaces the plain module the builder put its parameters in.
    setattr(owner, leaf, module_copy(model.get_submodule(path)))
    assert isinstance(args, (list, tuple))
    call = graph.call_module(path, tuple(env[a] for a in args if isinstance(a, fx.Node)))
    call.meta = dict(node.meta)
    call.meta["experts_call"] = True
    return call


def checkpointed_experts_message(node: fx.Node) -> str:
    return (
        f"mpmd.trace: the experts module {node.args[2]!r} runs inside an activation-"
        "checkpointed region (torch.utils.checkpoint), where torchmpmd does not recompute "
        "experts yet; checkpoint the attention and the router only, or trace the experts "
        "through: mpmd.trace(..., experts=[])"
    )


def module_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` sharing its tensors and submodules, whose own slots
    (parameters, buffers, submodules, attributes such as `num_experts`) can
    be replaced without touching the original (the user's model)."""
    new = copy.copy(module)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    new._modules = dict(module._modules)
    new.__dict__.pop("forward", None)
    return new
