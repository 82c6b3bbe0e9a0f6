"""Selective recompute in `mpmd.plan`: the profile measures each unit under
the runtime's selective policy (fewer bytes kept, the rest recomputed in the
backward), the simulator prices the chosen stages with those costs, and a
memory cap that only recomputing meets gets the cheaper of selective and
full recompute, which the runner takes as it is."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import torchmpmd as mpmd
from torchmpmd.planner.profiler import profile
from torchmpmd.planner.results import Profile

from .test_plan import _loss, _model, planned_timeline, runs_as_planned, smallest_free_peak

_PLAN_MODULE = sys.modules["torchmpmd.planner.plan"]


def _example() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(2, 16, dtype=torch.float64), torch.randint(0, 256, (2,))


def test_the_profile_measures_selective_recompute_per_unit():
    x, target = _example()
    prof = profile(
        _model(), (x,), min_units=4, repeats=1, loss_fn=_loss, example_target=target, selective=True
    )
    sel = prof.selective
    assert sel is not None and sel.units == prof.units
    assert sel.transfers == prof.transfers
    # Each residual MLP layer keeps its input and its first matmul's output
    # (GELU's input), and recomputes GELU's output that the second matmul's
    # backward reads: 16 + 64 values a row against 16 + 64 + 64.
    rows, item = 2, 8
    for k, unit in enumerate(prof.units):
        if unit.startswith("layers."):
            assert sel.activation_bytes[k] == rows * item * (16 + 64), unit
            assert prof.activation_bytes[k] == rows * item * (16 + 64 + 64), unit
    assert all(b > 0 for b in sel.backward)
    assert sel.input_grad is not None and sel.weight_grad is not None
    # Without selective=True nothing is measured that way.
    assert profile(_model(), (x,), min_units=4, repeats=1).selective is None


def _chain(activation: int, backward: float) -> Profile:
    return Profile.chain(
        [f"l{i}" for i in range(4)],
        [1.0] * 4,
        backward=[backward] * 4,
        activation_bytes=[activation] * 4,
    )


def test_the_simulator_prices_selective_stages_with_their_own_costs():
    plain = _chain(1000, 2.0)
    both = dataclasses.replace(plain, selective=_chain(400, 2.5))
    schedule = mpmd.schedules.OneFOneB(4)
    kwargs = {"schedule": schedule, "num_ranks": 2}
    none = mpmd.planner.simulate(both, ["l2"], **kwargs)
    first = mpmd.planner.simulate(both, ["l2"], selective=[0], **kwargs)
    every = mpmd.planner.simulate(both, ["l2"], selective=[0, 1], **kwargs)
    assert none.step_time == mpmd.planner.simulate(plain, ["l2"], **kwargs).step_time
    # Stage 0 keeps 400 bytes a unit instead of 1000, its backward costs more.
    assert first.peak_activation_bytes[0] < none.peak_activation_bytes[0]
    assert first.peak_activation_bytes[1] == none.peak_activation_bytes[1]
    assert every.peak_activation_bytes[1] < none.peak_activation_bytes[1]
    assert none.step_time < first.step_time <= every.step_time
    with pytest.raises(ValueError, match="no selective recompute costs"):
        mpmd.planner.simulate(plain, ["l2"], selective=[0], **kwargs)
    with pytest.raises(ValueError, match=r"names stages outside 0\.\.1"):
        mpmd.planner.simulate(both, ["l2"], selective=[2], **kwargs)


def test_a_cap_that_selective_recompute_meets_cheaper_than_full_gets_it(monkeypatch):
    # Selective recompute costs what it costs on a large model (5% more
    # backward); on these tiny layers its dispatch would dwarf the math.
    measured = _PLAN_MODULE.profile

    def cheap(*args, **kwargs):
        prof = measured(*args, **kwargs)
        # Measured only when a memory limit may need it.
        assert (prof.selective is not None) == kwargs["selective"]
        if prof.selective is None:
            return prof
        scale = lambda v: tuple(1.05 * t for t in v)  # noqa: E731
        sel = dataclasses.replace(
            prof.selective,
            forward=prof.forward,
            backward=scale(prof.backward),
            input_grad=scale(prof.input_grad),
            weight_grad=scale(prof.weight_grad),
        )
        return dataclasses.replace(prof, selective=sel)

    monkeypatch.setattr(_PLAN_MODULE, "profile", cheap)
    x, target = _example()

    def plan(**kwargs):
        return mpmd.plan(
            _model(), (x,), 2, loss_fn=_loss, example_target=target, repeats=1, **kwargs
        )

    free = plan(num_microbatches=8)
    # Below every split of every schedule without recomputing.
    limit = 0.85 * smallest_free_peak(free.balance.profile)
    capped = plan(num_microbatches=8, memory_limit=limit)
    assert capped.recompute, capped  # nothing fits without recomputing
    assert max(capped.predicted_peak_bytes) <= limit
    weighed = [c for c in capped.alternatives if c.schedule is not None]
    selective = [c for c in weighed if set(c.recompute.values()) == {"selective"}]
    full = [c for c in weighed if "full" in c.recompute.values()]
    assert selective, capped  # weighed, and some fit
    assert "selective" in repr(capped)
    # Selective recompute wins where it is predicted faster than every full
    # recompute beyond the tolerance (the timings decide which).
    best_selective = min(
        [c.predicted_step_time for c in selective]
        + ([capped.predicted_step_time] if "selective" in capped.recompute.values() else [])
    )
    best_full = min(
        [c.predicted_step_time for c in full]
        + ([capped.predicted_step_time] if "full" in capped.recompute.values() else [])
    )
    if best_selective * 1.03 < best_full:
        assert set(capped.recompute.values()) == {"selective"}, capped
    # The plan's prediction is the simulator's for its pieces.
    timeline = planned_timeline(capped, capped.balance.profile)
    assert timeline.step_time == pytest.approx(capped.predicted_step_time)
    assert max(timeline.peak_activation_bytes) <= limit
    # The runner takes the policy as it is; the step equals the model's.
    runs_as_planned(capped)
