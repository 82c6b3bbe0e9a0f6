"""The bad-input catalogues (tests/unit/*/test_bad_inputs*.py): each case is
(id, call, exception type, message pattern); the call must fail with that
type and a message matching the pattern, never a raw pybind11 signature dump."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchmpmd as mpmd

Case = tuple[str, Callable[[], Any], type[BaseException], str]


def cases(catalogue: list[Case]) -> Any:
    """Parametrizes a test over the catalogue's (call, kind, pattern), by id."""
    return pytest.mark.parametrize(
        ("call", "kind", "pattern"), [c[1:] for c in catalogue], ids=[c[0] for c in catalogue]
    )


def clear_error(call: Callable[[], Any], kind: type[BaseException], pattern: str) -> str:
    """The message of the error `call` raises, checked; returned for more checks."""
    with pytest.raises(kind) as err:
        call()
    text = str(err.value)
    assert re.search(pattern, text, re.S), text
    assert "incompatible function arguments" not in text and "incompatible constructor" not in text
    return text


def tiny_model() -> nn.Sequential:
    """The catalogues' model: two linear layers, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def tiny_pipe() -> mpmd.Pipe:
    """`tiny_model` traced in two stages."""
    return mpmd.trace(tiny_model(), (torch.randn(2, 4),), split_before=["2"])
