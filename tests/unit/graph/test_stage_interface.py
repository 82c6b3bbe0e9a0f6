"""Traced and hand-cut stages present one interface (graph/stage.py) to the
runtime, the checkpoint and the fingerprint."""

import copy

import pytest
import torch
from models import CASES

import torchmpmd as mpmd
from torchmpmd.graph.stage import as_stage


def _pipes():
    case = CASES["mlp"]
    model = case.model()
    args, kwargs = case.inputs(2)
    traced = mpmd.trace(model, args, kwargs, **case.split)
    halves = [
        torch.nn.Sequential(
            *(m for layer in model.layers[i : i + 2] for m in (layer, torch.nn.Tanh()))
        )
        for i in (0, 2)
    ]
    eager = mpmd.from_stages(halves, args, model=model)
    return traced, eager


def test_both_kinds_of_stage_answer_the_interface():
    traced, eager = _pipes()
    for pipe, kind in ((traced, True), (eager, False)):
        for s in range(pipe.num_stages):
            stage = as_stage(pipe.stage(s))
            assert stage.traced is kind
            # What the runtime asks instead of the kind: the graph, the user's module.
            assert (stage.graph_module is pipe.stage(s)) is kind
            assert (stage.user_module is None) is kind
            names = {n for n, _ in stage.state_root.named_parameters()}
            assert names, f"stage {s} shows no parameters through state_root"
            assert isinstance(stage.ops_text(), str)
            stage.retarget_devices(torch.device("cpu"))
            stage.refresh_state()


def test_the_interface_survives_copies_moves_and_replicas():
    traced, _ = _pipes()
    for stage in (
        copy.deepcopy(traced.stage(0)),
        traced.stage(0).to(torch.float64),
        traced.replicate().stage(1),
    ):
        assert as_stage(stage).traced is True
    assert as_stage(traced.replicate().stage(1)).ops_text() == as_stage(traced.stage(1)).ops_text()


def test_a_module_that_is_not_a_stage_is_refused_naming_its_type():
    with pytest.raises(TypeError, match="Linear is not a pipeline stage"):
        as_stage(torch.nn.Linear(2, 2))
