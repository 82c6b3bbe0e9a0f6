"""A tensor-parallel plan checked against the model when the runner is built,
on every rank alike, before anything is sharded or exchanged.

A plan that matched nothing used to run anyway: every parameter stayed a
replicated DTensor and every tp rank computed the whole stage, with no word.
Now a pattern of the user's plan that matches no module is an error naming
the closest module paths (and a regular expression or a wrong prefix for
what it is), one that matches only containers (`blocks.*`) says which
layers to name, and a plan that shards no parameter at all is an error. A
style that cannot shard a module's weight (`rowwise` on a LayerNorm), a
sharded dimension the tp ranks cannot share evenly, and attention heads
that the tp size does not divide (`num_key_value_heads=2` on tp 4) are named
with the module and the config field, where DTensor would fail in the first
step. A model's own plan (Hugging Face's, written for all its variants) may
name modules a variant lacks."""

from __future__ import annotations

import difflib
import re

import torch
from torch.distributed.tensor import Shard

from .tensor_plan import TensorPlan, _pattern

__all__ = ["check_plan"]

# Attributes holding an attention module's head counts: torchtitan's
# (`n_heads`, `n_kv_heads`), nanoGPT's (`n_head`), torch's (`num_heads`) and
# a Hugging Face attention module's config (`config.num_attention_heads`).
_HEADS = ("n_heads", "n_kv_heads", "n_head", "num_heads", "num_kv_heads")
_CONFIG_HEADS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")
_REGEX = re.compile(r"[\\^$()\[\]+?|{}]")


def check_plan(plan: TensorPlan, model: torch.nn.Module, tp: int) -> None:
    """Raises ValueError naming what in `plan` does not fit `model` on `tp`
    ranks (see the module's docstring)."""
    where = plan.where
    modules = dict(model.named_modules(remove_duplicate=False))
    owners = {p for p, m in modules.items() if next(m.parameters(recurse=False), None) is not None}
    if not plan.rules:
        raise ValueError(
            f"PipelineRunner: {where} is empty: it shards nothing, so every tp rank would "
            "compute every stage whole. Name the layers to shard, e.g. {'layers.*.mlp.up': "
            "'colwise', 'layers.*.mlp.down': 'rowwise'}, or build the mesh without 'tp'"
        )
    if plan.explicit:
        for key, named in plan.rules:
            _check_key(key, named, modules, owners, where)
    sharded: list[tuple[str, torch.nn.Module]] = []
    for path in sorted(owners):
        style = plan.style_of(path)
        if style is None:
            continue
        module = modules[path]
        for leaf, param in module.named_parameters(recurse=False):
            placement = plan.placement(f"{path}.{leaf}" if path else leaf, model)
            if not isinstance(placement, Shard):
                continue
            _check_dim(path, module, leaf, param, style, placement.dim, tp, where)
            sharded.append((path, module))
    if not sharded:
        styled = sorted({s for _, s in plan.rules})
        raise ValueError(
            f"PipelineRunner: {where} shards no parameter of the model (its styles: "
            f"{', '.join(styled)}), so every tp rank would compute every stage whole; style "
            "linear layers 'colwise' / 'rowwise' (or an embedding 'embedding_rowwise')"
        )
    _check_heads(sharded, modules, tp, where)


def _generalised(paths: list[str]) -> list[str]:
    """Module paths with their numbers as `*`, once each (what a plan names)."""
    return list(dict.fromkeys(re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", p) for p in paths))


def _check_key(
    key: str, style: str, modules: dict[str, torch.nn.Module], owners: set[str], where: str
) -> None:
    pattern = _pattern(key)
    hits = [p for p in modules if p and pattern.fullmatch(p)]
    if not hits:
        raise ValueError(
            f"PipelineRunner: {where}: {key!r} matches no module of the model.{_why(key, modules)}"
            f"{_closest(key, [p for p in modules if p])}"
        )
    if not any(h in owners for h in hits):
        inside = sorted(
            {_generalised([p])[0] for p in owners for h in hits if p.startswith(h + ".")}
        )
        shown = ", ".join(repr(p) for p in inside[:4]) or "none"
        raise ValueError(
            f"PipelineRunner: {where}: {key!r} matches {', '.join(repr(h) for h in hits[:3])}"
            f"{' ...' if len(hits) > 3 else ''}, which hold no parameters of their own: a style "
            f"({style!r}) applies to the layer whose weight it shards. Name the layers inside "
            f"(they are {shown})"
        )


def _why(key: str, modules: dict[str, torch.nn.Module]) -> str:
    """What a pattern that matches nothing is likely to be."""
    if _REGEX.search(key) or any("*" in c and c != "*" for c in key.split(".")):
        return (
            " Plan keys are module paths in which '*' stands for one component (Hugging "
            "Face's tp_plan format, e.g. 'layers.*.attn.q'), not regular expressions."
        )
    head, _, rest = key.partition(".")
    if rest and any(_pattern(rest).fullmatch(p) for p in modules if p):
        return f" Drop the {head + '.'!r} prefix: the model's module paths start below it."
    tops = sorted({p.split(".")[0] for p in modules if p})
    for top in tops:
        if any(_pattern(f"{top}.{key}").fullmatch(p) for p in modules):
            return f" The model's modules are under {top + '.'!r}: name it {top + '.' + key!r}."
    return ""


def _closest(key: str, paths: list[str]) -> str:
    known = _generalised(paths)
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.0)
    return f" Closest module paths: {', '.join(repr(c) for c in close)}." if close else ""


def _check_dim(
    path: str,
    module: torch.nn.Module,
    leaf: str,
    param: torch.Tensor,
    style: str,
    dim: int,
    tp: int,
    where: str,
) -> None:
    kind = type(module).__name__
    if param.dim() <= dim:
        raise ValueError(
            f"PipelineRunner: {where}: {path!r} ({kind}) is styled {style!r}, which shards its "
            f"{leaf} along dimension {dim}, but that {leaf} has {param.dim()} dimension(s) "
            f"(shape {list(param.shape)}). Styles shard linear layers and embeddings; leave "
            f"{kind} out of the plan (it stays replicated), or style it 'sequence_parallel' "
            "if it is a norm of a sequence-parallel plan"
        )
    if param.shape[dim] % tp:
        raise ValueError(
            f"PipelineRunner: {where}: {path!r} ({kind}) is styled {style!r}: its {leaf} has "
            f"{param.shape[dim]} rows along dimension {dim}, which {tp} tp ranks cannot share "
            "evenly; choose a tp size that divides it, or another style"
        )


def _check_heads(
    sharded: list[tuple[str, torch.nn.Module]],
    modules: dict[str, torch.nn.Module],
    tp: int,
    where: str,
) -> None:
    """Attention whose projections the plan shards must have head counts
    that `tp` divides (each rank computes whole heads)."""
    seen: set[str] = set()
    for path, _ in sharded:
        parts = path.split(".")
        for n in range(len(parts) - 1, 0, -1):
            owner = ".".join(parts[:n])
            module = modules.get(owner)
            if module is None or not _is_attention(owner, module):
                continue
            if owner in seen:
                break
            seen.add(owner)
            config = getattr(module, "config", None)
            fields = [(f, getattr(module, f, None)) for f in _HEADS]
            fields += [(f"config.{f}", getattr(config, f, None)) for f in _CONFIG_HEADS]
            for field, value in fields:
                if isinstance(value, int) and not isinstance(value, bool) and value % tp:
                    raise ValueError(
                        f"PipelineRunner: {where} shards the attention {owner!r} "
                        f"({type(module).__name__}) by heads, but its {field} is {value}, "
                        f"which {tp} tp ranks cannot share (each computes whole heads): choose "
                        f"a tp size that divides {value}, or leave its projections replicated"
                    )
            break


def _is_attention(path: str, module: torch.nn.Module) -> bool:
    name = (type(module).__name__ + "." + path.rsplit(".", 1)[-1]).lower()
    return "attention" in name or "attn" in name
