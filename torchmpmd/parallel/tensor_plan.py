"""A tensor-parallel plan (`TensorPlan`): module-path patterns and their
styles, in Hugging Face's `tp_plan` format, and where each style places a
module's parameters (`STYLES`) and hands on its output. A plan may give
torch's `ParallelStyle` objects instead of names, as a torchtitan
`parallelize.py` writes them (`style_name`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed.tensor.parallel
from torch.distributed.tensor import Placement, Replicate, Shard

from ..graph.names import path_pattern

__all__ = ["STYLES", "TensorPlan"]


# Each style: the placement of a module's weight and of its other parameters
# (bias), over the tp dimension; sequence_parallel and replicate keep the
# parameters whole.
_COLWISE = (Shard(0), Shard(0))
_ROWWISE = (Shard(1), Replicate())
_WHOLE = (Replicate(), Replicate())
STYLES: dict[str, tuple[Placement, Placement]] = {
    "colwise": _COLWISE,
    "colwise_rep": _COLWISE,
    "colwise_gather_output": _COLWISE,
    "rowwise": _ROWWISE,
    "rowwise_rep": _ROWWISE,
    "embedding_rowwise": (Shard(0), Replicate()),
    "replicate": _WHOLE,
    "sequence_parallel": _WHOLE,
}


# Styles whose module hands its output on replicated (Hugging Face's and
# torch's output layouts): the all-reduce of a row-parallel layer's partial
# sums, the all-gather of a "_rep" / "gather_output" column-parallel one, a
# vocabulary-parallel embedding's masked sum. Other outputs stay as DTensor
# placed them until an op needs them otherwise.
_REPLICATED_OUTPUT = {
    "colwise_rep",
    "colwise_gather_output",
    "rowwise",
    "rowwise_rep",
    "embedding_rowwise",
}


# Under sequence parallelism (a plan with "sequence_parallel" modules, as
# Megatron's): the styles whose module hands its output on sequence-sharded
# instead (a reduce-scatter of a row-parallel layer's or a vocabulary-parallel
# embedding's partial sums), and the placement a styled module's activation
# inputs take where they enter it (torch's SequenceParallel and
# ColwiseParallel(input_layouts=Shard(1)): norms on sequence shards, an
# all-gather of the sequence into each column-parallel layer).
_SEQUENCE_OUTPUT = {"rowwise", "embedding_rowwise"}
_INPUT_PLACEMENT = {
    "sequence_parallel": "_tp_enter_sequence",
    "colwise": "_tp_enter_replicated",
    "colwise_rep": "_tp_enter_replicated",
    "colwise_gather_output": "_tp_enter_replicated",
}


def style_name(value: object, key: str, where: str) -> str | None:
    """A plan entry's style name: a string as it is, or torch's (and
    torchtitan's) `ParallelStyle` objects: `ColwiseParallel()` is "colwise"
    ("colwise_rep" with `output_layouts=Replicate()`), `RowwiseParallel()`
    "rowwise" (on an embedding: the vocabulary), `SequenceParallel()`
    "sequence_parallel", torchtitan's `NoParallel()` "replicate". Their
    layouts need nothing more: the stage rewrite places every value by the
    styles around it (a row-parallel layer's `output_layouts=Shard(1)` is
    what a plan with sequence-parallel norms does). `PrepareModuleInput`,
    `PrepareModuleOutput` and `PrepareModuleInputOutput` only say where
    values lie between those modules: None (nothing to do)."""
    if isinstance(value, str):
        return value
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    prepare: tuple[type, ...] = (PrepareModuleInput, PrepareModuleOutput)
    both = getattr(torch.distributed.tensor.parallel, "PrepareModuleInputOutput", None)
    if both is not None:
        prepare = (*prepare, both)
    if isinstance(value, ColwiseParallel):
        layouts = getattr(value, "output_layouts", None) or ()
        layout = layouts[0] if isinstance(layouts, tuple) and layouts else layouts
        return "colwise_rep" if isinstance(layout, Replicate) else "colwise"
    if isinstance(value, RowwiseParallel):
        return "rowwise"
    if isinstance(value, SequenceParallel):
        return "sequence_parallel"
    if isinstance(value, prepare):
        return None
    if type(value).__name__ == "NoParallel":  # torchtitan's: a module kept whole
        return "replicate"
    raise TypeError(
        f"{where}: {key!r} is {value!r} ({type(value).__name__}); a style is a name "
        f"({', '.join(STYLES)}) or one of torch's ColwiseParallel(), RowwiseParallel(), "
        "SequenceParallel(), PrepareModuleInput(...), PrepareModuleOutput(...)"
    )


_pattern = path_pattern  # a plan key as a regular expression (tensor_checks reads it too)


@dataclass(frozen=True)
class TensorPlan:
    """Module-path patterns and their styles, in Hugging Face's `tp_plan`
    format; the first pattern that matches a module's whole path wins."""

    rules: tuple[tuple[str, str], ...]
    where: str = "tp_plan"  # where it came from, for messages
    explicit: bool = True  # the user's (else the model's own)

    @staticmethod
    def of(plan: Mapping[str, object], where: str = "tp_plan") -> TensorPlan:
        if not isinstance(plan, Mapping):
            raise TypeError(
                f"{where} must map module-path patterns to styles, e.g. "
                f"{{'layers.*.mlp.up_proj': 'colwise'}}, got {type(plan).__name__}"
            )
        named: dict[str, str] = {}
        for key, value in plan.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: {key!r}: {value!r}: patterns are strings")
            style = style_name(value, key, where)
            if style is None:
                continue
            named[key] = style
            if style not in STYLES:
                raise ValueError(
                    f"{where}: {key!r} has style {style!r}, which torchmpmd does not run; use "
                    f"one of {', '.join(STYLES)}"
                )
        return TensorPlan(tuple(named.items()), where, where == "tp_plan")

    @staticmethod
    def for_model(plan: Mapping[str, object] | None, source: torch.nn.Module | None) -> TensorPlan:
        """`plan`, or the model's own (a Hugging Face model's `_tp_plan`, or
        its config's `base_model_tp_plan` under the base model's prefix)."""
        if plan is not None:
            return TensorPlan.of(plan)
        own = getattr(source, "_tp_plan", None)
        if isinstance(own, Mapping) and own:
            return TensorPlan.of(own, f"{type(source).__name__}._tp_plan")
        config = getattr(source, "config", None)
        base = getattr(config, "base_model_tp_plan", None)
        if isinstance(base, Mapping) and base:
            prefix = getattr(source, "base_model_prefix", "")
            if prefix and hasattr(source, prefix):
                base = {f"{prefix}.{k}": v for k, v in base.items()}
            return TensorPlan.of(base, f"{type(config).__name__}.base_model_tp_plan")
        raise ValueError(
            "PipelineRunner: the mesh has a 'tp' dimension but no tensor-parallel plan was "
            "given and the model has none of its own (a Hugging Face model's _tp_plan or "
            "config.base_model_tp_plan); pass options=mpmd.RunnerOptions(tp_plan={'layers.*."
            "mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': 'rowwise', ...})"
        )

    @property
    def sequence_parallel(self) -> bool:
        """Whether the plan keeps the residual stream sharded along the
        sequence (any module styled "sequence_parallel")."""
        return any(style == "sequence_parallel" for _, style in self.rules)

    def style_of(self, module_path: str) -> str | None:
        for key, style in self.rules:
            if _pattern(key).fullmatch(module_path):
                return style
        return None

    def placement(self, name: str, source: torch.nn.Module | None) -> Placement:
        """Where parameter `name` (its model path) lies over tp."""
        module_path, _, leaf = name.rpartition(".")
        style = self.style_of(module_path)
        if style is None:
            return Replicate()
        weight, other = STYLES[style]
        owner = _submodule(source, module_path)
        if isinstance(owner, torch.nn.Embedding) and style.startswith("colwise"):
            return Shard(1)  # an embedding's output features are its weight's columns
        if isinstance(owner, torch.nn.Embedding) and style.startswith("rowwise"):
            return Shard(0)  # torch's RowwiseParallel on an embedding: its vocabulary
        return weight if leaf == "weight" else other


def _submodule(source: torch.nn.Module | None, path: str) -> torch.nn.Module | None:
    if source is None:
        return None
    try:
        return source.get_submodule(path)
    except AttributeError:
        return None
