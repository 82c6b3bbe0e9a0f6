"""Every checkpoint function refuses a `runner` that is not this rank's
`PipelineRunner` with a TypeError naming what it got: a
`testing.LocalPipeline` (which used to fail with a raw AttributeError on
`own_transport`) says to call the function on every rank's runner with
`on_all_ranks`; a plain model or None names its type. Nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from models import square_loss

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

ckpt = mpmd.checkpoint
CALLS = {
    "save": lambda path, runner: ckpt.save(path, runner),
    "async_save": lambda path, runner: ckpt.async_save(path, runner),
    "load": lambda path, runner: ckpt.load(path, runner),
    "save_hf": lambda path, runner: ckpt.save_hf(path, runner),
    "load_hf": lambda path, runner: ckpt.load_hf(path, runner),
}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("call", list(CALLS))
def test_a_local_pipeline_is_refused_naming_on_all_ranks(tmp_path: Path, call: str) -> None:
    model = _model()
    pipe = mpmd.trace(model, (torch.randn(2, 4),), split_before=["2"])
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(2), 2, loss_fn=square_loss, timeout=10)
    hint = rf"lp\.on_all_ranks\(lambda r: mpmd\.checkpoint\.{call}\(path, r\)\)"
    with pytest.raises(
        TypeError, match=rf"^checkpoint\.{call}: runner is a testing\.LocalPipeline.*{hint}"
    ):
        CALLS[call](tmp_path / "ckpt", local)
    with pytest.raises(
        TypeError, match=rf"^checkpoint\.{call}: runner is a torch\.nn\..*Sequential, not"
    ):
        CALLS[call](tmp_path / "ckpt", model)
    with pytest.raises(
        TypeError, match=rf"^checkpoint\.{call}: runner is None, not a PipelineRunner"
    ):
        CALLS[call](tmp_path / "ckpt", None)
    assert not any(tmp_path.iterdir())
