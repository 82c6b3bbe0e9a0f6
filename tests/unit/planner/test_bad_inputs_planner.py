"""Misuse of the planner fails before any profiling or simulation, with a
message naming the argument and the fix: `mpmd.plan`'s schedules, loss and
target, and a model `mpmd.trace` refuses; `mpmd.project`'s sizes, a tp the
heads do not divide, a bad `TransformerShape`, a schedule that needs two
stages per rank; and a projected layout over the machine's memory warns.
`mpmd.refine` called on one rank only: tests/distributed/test_refine_collective.py."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import torchmpmd as mpmd


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _ValueBranch(_Chain):
    """Runs eagerly, but its control flow reads a tensor's value: no trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if x.sum() > 0:
                x = x * 2
        return x


def _x() -> torch.Tensor:
    return torch.randn(2, 8)


def test_schedules_must_be_a_list_of_schedule_classes():
    with pytest.raises(TypeError, match=r"got the class GPipe; write schedules=\[GPipe\]"):
        mpmd.plan(_Chain(), (_x(),), 2, schedules=mpmd.schedules.GPipe)
    with pytest.raises(TypeError, match=r"must be a list of Schedule classes.*got 'GPipe'"):
        mpmd.plan(_Chain(), (_x(),), 2, schedules="GPipe")
    with pytest.raises(TypeError, match=r"schedules\[1\] is <class 'int'>"):
        mpmd.plan(_Chain(), (_x(),), 2, schedules=[mpmd.schedules.GPipe, int])
    with pytest.raises(TypeError, match=r"schedules\[0\] is .*; pass its class OneFOneB"):
        mpmd.plan(_Chain(), (_x(),), 2, schedules=[mpmd.schedules.OneFOneB(4)])


def test_a_loss_that_reads_the_target_needs_example_target_and_the_reverse():
    with pytest.raises(TypeError, match=r"mpmd\.plan: loss_fn\(output, target\) failed with no "):
        mpmd.plan(_Chain(), (_x(),), 2, loss_fn=torch.nn.functional.cross_entropy)
    with pytest.raises(ValueError, match=r"mpmd\.plan: example_target is given but no loss_fn"):
        mpmd.plan(_Chain(), (_x(),), 2, example_target=torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match=r"mpmd\.plan: loss_fn must be callable"):
        mpmd.plan(_Chain(), (_x(),), 2, loss_fn="mse", example_target=torch.zeros(2))


def test_a_model_the_trace_refuses_fails_plan_with_the_traces_error():
    with pytest.raises(RuntimeError, match=r"mpmd\.plan: .*mpmd\.trace could not trace the model"):
        mpmd.plan(_ValueBranch(), (_x(),), 2, repeats=1)


H100 = mpmd.Machine(
    flops=400e12,
    memory=80 * 2**30,
    devices_per_node=8,
    intra_node_bandwidth=450e9,
    intra_node_latency=5e-6,
    inter_node_bandwidth=50e9,
    inter_node_latency=10e-6,
)
SHAPE = mpmd.TransformerShape(layers=4, hidden=64, ffn_hidden=128, heads=4, kv_heads=2, vocab=96)


def _project(**kwargs):
    args = {"pp": 2, "microbatch_size": 1, "seq_len": 16}
    schedule = kwargs.pop("schedule", mpmd.schedules.OneFOneB(4))
    return mpmd.project(
        kwargs.pop("shape", SHAPE), kwargs.pop("machine", H100), schedule, **(args | kwargs)
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("microbatch_size", 0),
        ("microbatch_size", -1),
        ("microbatch_size", 1.5),
        ("microbatch_size", True),
        ("seq_len", 0),
        ("seq_len", 16.0),
        ("pp", True),
        ("dp", True),
        ("stages_per_rank", True),
    ],
)
def test_every_size_of_project_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=rf"mpmd\.project: {name} must be a positive int"):
        _project(**{name: value})


@pytest.mark.parametrize("tp", [3, 16, 64])
def test_tp_must_divide_the_heads(tp):
    with pytest.raises(ValueError, match=rf"tp={tp} does not divide TransformerShape\.heads=4"):
        _project(tp=tp)


def test_tp_must_divide_the_key_value_heads():
    with pytest.raises(ValueError, match=r"tp=4 does not divide TransformerShape\.kv_heads=2"):
        _project(tp=4)
    assert _project(tp=2).step_time > 0


def test_the_shapes_fields_are_checked():
    with pytest.raises(ValueError, match=r"TransformerShape\.heads must be a positive int, got 0"):
        dataclasses.replace(SHAPE, heads=0)
    with pytest.raises(ValueError, match=r"TransformerShape\.layers must be a positive int"):
        dataclasses.replace(SHAPE, layers=-1)
    with pytest.raises(ValueError, match="heads=4 does not divide hidden=66"):
        dataclasses.replace(SHAPE, hidden=66)
    with pytest.raises(ValueError, match="kv_heads=3 does not divide heads=4"):
        dataclasses.replace(SHAPE, kv_heads=3)
    with pytest.raises(TypeError, match=r"TransformerShape\.gated must be True or False"):
        dataclasses.replace(SHAPE, gated="yes")
    with pytest.raises(TypeError, match=r"shape must be an mpmd\.TransformerShape"):
        _project(shape={"num_hidden_layers": 4})


def test_a_v_schedule_is_told_to_take_two_stages_per_rank():
    # By default project takes the schedule's own (ZBV.stages_per_rank: 2).
    with pytest.raises(ValueError, match=r"needs 4 stages, got 2; pass stages_per_rank=2$"):
        _project(schedule=mpmd.schedules.ZBV(4), stages_per_rank=1)
    assert _project(schedule=mpmd.schedules.ZBV(4), stages_per_rank=2).step_time > 0
    assert _project(schedule=mpmd.schedules.ZBV(4)).step_time > 0


def test_a_layout_over_the_machines_memory_warns_and_says_so():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fits = _project()
    assert fits.fits_memory
    small = dataclasses.replace(H100, memory=64 * 2**10)
    with pytest.warns(
        UserWarning,
        match=r"does not fit Machine\.memory: pipeline rank 0 holds 140\.0 KiB of activations "
        r"per device .* over the machine's 64\.0 KiB .* raise pp or tp, recompute=True, or lower "
        "microbatch_size",
    ):
        over = _project(machine=small)
    assert not over.fits_memory
    assert max(over.peak_activation_bytes) > small.memory
