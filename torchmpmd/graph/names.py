"""The names a model gives its parameters and buffers (a tied tensor has
several): one walk, for traced and hand-cut stages alike; and the module-path
patterns plans name modules by (`path_pattern`)."""

from __future__ import annotations

import functools
import re

import torch

__all__ = ["aliases_of", "path_pattern", "tensor_names"]


@functools.cache
def path_pattern(key: str) -> re.Pattern[str]:
    """A plan's module-path pattern as a regular expression (for `fullmatch`):
    `*` stands for one path component ('layers.*.mlp.experts'). Tensor and
    expert plans and `mpmd.trace(..., experts=...)` read patterns alike."""
    return re.compile(
        ".".join("[^.]+" if part == "*" else re.escape(part) for part in key.split("."))
    )


def tensor_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter and buffer of `model`, keyed by the
    tensor's id, parameters first, in the model's order."""
    by_id: dict[int, list[str]] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        by_id.setdefault(id(t), []).append(name)
    return by_id


def aliases_of(by_id: dict[int, list[str]]) -> dict[str, list[str]]:
    """Every name of each tensor, keyed by each of its names."""
    return {name: names for names in by_id.values() for name in names}
