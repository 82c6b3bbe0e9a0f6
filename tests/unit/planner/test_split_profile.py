"""The split backward's own costs in the planner: I and W are profiled per
unit apart from B (on the graphs the runtime runs), and the simulator
charges them, so that a zero-bubble schedule whose I + W costs more than the
bubble it fills is not chosen."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import torchmpmd as mpmd
from torchmpmd.planner import Profile, search
from torchmpmd.planner.profiler import profile


class _Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
            for _ in range(4)
        )
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_profile_times_input_and_weight_gradients_of_every_unit():
    torch.manual_seed(0)
    model = _Residual()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(8, 16)
    prof = profile(
        model,
        (x,),
        min_units=4,
        repeats=2,
        loss_fn=torch.nn.functional.cross_entropy,
        example_target=torch.randint(0, 32, (8,)),
        split_backward=True,
    )
    assert prof.input_grad is not None and prof.weight_grad is not None
    assert len(prof.input_grad) == len(prof.weight_grad) == len(prof.units)
    assert all(math.isfinite(v) and v >= 0 for v in (*prof.input_grad, *prof.weight_grad))
    assert sum(prof.weight_grad) > 0 and sum(prof.input_grad[1:]) > 0
    # The model is left as it was: no gradients, same parameters.
    for n, p in model.named_parameters():
        assert p.grad is None, n
        torch.testing.assert_close(p, before[n], rtol=0, atol=0)
    # Without split_backward nothing is measured: I and W are derived (B / 2).
    plain = profile(model, (x,), min_units=4, repeats=1)
    assert plain.input_grad is None and plain.weight_grad is None


def _chain(split_cost: float) -> Profile:
    """Four equal units whose I + W costs `split_cost` x their B."""
    base = Profile.chain(["a", "b", "c", "d"], [1.0] * 4, [2.0] * 4, [10] * 4, [1] * 3)
    return dataclasses.replace(
        base,
        input_grad=tuple(b * split_cost / 2 for b in base.backward),
        weight_grad=tuple(b * split_cost / 2 for b in base.backward),
    )


def _step(prof: Profile, schedule: mpmd.Schedule) -> float:
    return search(prof, 2, schedule=schedule, num_ranks=2).predicted_step


def test_the_simulator_charges_the_measured_split_backward():
    one = mpmd.schedules.OneFOneB(4)
    zb = mpmd.schedules.ZeroBubbleH1(4)
    # I + W = B: the split fills the bubble, ZB-H1 wins.
    assert _step(_chain(1.0), zb) < _step(_chain(1.0), one)
    # I + W = 1.4 B: what it fills costs more than it saves.
    assert _step(_chain(1.4), zb) > _step(_chain(1.4), one)
    # 1F1B runs B: the split's cost does not touch it.
    assert _step(_chain(1.4), one) == _step(_chain(1.0), one)


def test_the_first_stage_runs_its_whole_backward_as_w():
    prof = _chain(1.0)
    found = search(prof, 2, schedule=mpmd.schedules.ZeroBubbleH1(4), num_ranks=2)
    tasks = {(e.kind, e.stage): e.duration for e in found.timeline.tasks}
    assert tasks[("I", 0)] == 0.0
    assert tasks[("W", 0)] == sum(prof.backward[:2])
    assert tasks[("I", 1)] + tasks[("W", 1)] == sum(prof.backward[2:])


def test_a_split_stage_runs_its_b_as_its_i_and_w():
    """DualPipeV gives every stage I / W tasks and B tasks besides (alone and
    fused with a forward): the runtime splits those stages and runs each B
    as their I and W graphs, so the simulator charges it I + W (here 1.4x
    the autograd backward profiled), fused or not."""
    prof = _chain(1.4)
    found = search(prof, 4, schedule=mpmd.schedules.DualPipeV(4), num_ranks=2)
    split = {s: 1.4 * prof.backward[s] for s in range(4)}  # one unit per stage
    alone = fused = 0
    for e in found.timeline.tasks:
        parts = e.sub_tasks or (e.task,)
        if any(p.kind == "B" for p in parts):
            charged = sum(split[p.stage] if p.kind == "B" else prof.forward[p.stage] for p in parts)
            if e.sub_tasks:  # a part's wait for what it receives runs inside the task
                assert e.duration >= charged - 1e-9, e
                fused += 1
            else:
                assert e.duration == pytest.approx(charged), e
                alone += 1
    assert alone >= 3 and fused >= 3, found.timeline.tasks
    # A schedule without I / W tasks runs the autograd backward profiled.
    one = search(prof, 2, schedule=mpmd.schedules.OneFOneB(4), num_ranks=2)
    b = {e.stage: e.duration for e in one.timeline.tasks if e.kind == "B"}
    assert b == {0: pytest.approx(sum(prof.backward[:2])), 1: pytest.approx(sum(prof.backward[2:]))}


def test_a_profile_needs_both_or_neither():
    base = Profile.chain(["a", "b"], [1.0, 1.0])
    with pytest.raises(ValueError, match="input_grad and weight_grad together"):
        dataclasses.replace(base, input_grad=(1.0, 1.0))
