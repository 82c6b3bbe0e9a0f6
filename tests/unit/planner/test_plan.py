"""`mpmd.plan`: the schedule, stages per rank, split and microbatches it
chooses run (the runner takes them as they are and its step equals the
unpipelined model's), the memory cap holds in simulation, the fastest
candidate wins among those the simulator weighed, and a cap nothing fits is
an error giving the smallest peak. Planning under torch.distributed gives
every rank the same plan: tests/distributed/test_plan_ranks.py."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline


class _Uneven(torch.nn.Module):
    """Residual MLP layers and a heavy head (an LM's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
            for _ in range(6)
        )
        self.head = torch.nn.Linear(16, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, target)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Uneven().double()


def _plan(**kwargs):
    x = torch.randn(2, 16, dtype=torch.float64)
    target = torch.randint(0, 256, (2,))
    return mpmd.plan(_model(), (x,), 2, loss_fn=_loss, example_target=target, repeats=2, **kwargs)


def runs_as_planned(found) -> None:
    """The runner takes the plan's pieces as they are (recompute included)
    on a batch of 16 rows; its loss and every gradient equal the
    unpipelined model's."""
    model, reference = _model(), _model()
    x = torch.randn(16, 16, dtype=torch.float64)
    target = torch.randint(0, 256, (16,))
    m = found.num_microbatches
    pipe = mpmd.trace(model, (x[: 16 // m],), split_before=found.split_before)
    assert pipe.num_stages == found.num_stages
    local = LocalPipeline(
        pipe,
        found.schedule,
        found.num_ranks,
        options=mpmd.RunnerOptions(timeout=60, recompute=found.recompute or False),
        loss_fn=_loss,
    )
    outs = local.step(x, target=target)
    losses = []
    for xb, yb in zip(x.chunk(m), target.chunk(m), strict=True):
        loss = _loss(reference(xb), yb)
        (loss / m).backward()
        losses.append(loss.detach())
    torch.testing.assert_close(outs[0].loss, torch.stack(losses).mean(), rtol=1e-10, atol=1e-10)
    seen = set()
    for runner in local.runners:
        for name, p in runner.named_parameters():
            torch.testing.assert_close(
                p.grad, reference.get_parameter(name).grad, rtol=1e-10, atol=1e-10, msg=name
            )
            seen.add(name)
    assert seen == {n for n, _ in reference.named_parameters()}


def planned_timeline(found, prof):
    """The simulated step of a plan as the runner runs it: R tasks for the
    stages recomputed in full, selective costs for the others."""
    full = [s for s, mode in found.recompute.items() if mode == "full"]
    return mpmd.planner.simulate(
        prof,
        found.split_before,
        schedule=found.schedule.with_recompute(full) if full else found.schedule,
        num_ranks=found.num_ranks,
        selective=[s for s, mode in found.recompute.items() if mode == "selective"],
    )


def smallest_free_peak(prof) -> int:
    """The smallest simulated peak of any split of any built-in schedule
    without recomputing (peaks depend on the bytes, not on the timings)."""
    plan_module = sys.modules["torchmpmd.planner.weigh"]
    peaks = []
    for name in mpmd.schedules.__all__:
        cls = getattr(mpmd.schedules, name)
        for stages in plan_module.stage_counts(cls, 2):
            for cuts in itertools.combinations(prof.units[1:], stages - 1):
                try:
                    timeline = mpmd.planner.simulate(prof, list(cuts), schedule=cls(8), num_ranks=2)
                except ValueError:  # the schedule cannot run that many stages
                    continue
                peaks.append(max(timeline.peak_activation_bytes))
    return min(peaks)


def test_the_plan_runs_as_given_and_equals_the_unpipelined_model():
    found = _plan(batch_size=16)
    assert isinstance(found.schedule, mpmd.Schedule)
    assert found.num_microbatches == found.schedule.num_microbatches
    assert 16 % found.num_microbatches == 0
    runs_as_planned(found)


def test_the_plan_is_the_fastest_candidate_and_says_what_it_weighed():
    found = _plan(batch_size=16, tolerance=0.0)
    weighed = [c for c in found.alternatives if c.schedule is not None]
    names = {type(c.schedule).__name__ for c in weighed} | {type(found.schedule).__name__}
    assert names == set(mpmd.schedules.__all__)
    # Same global batch for all: the step times compare directly.
    assert all(c.predicted_step_time >= found.predicted_step_time for c in weighed)
    assert all("slower" in c.rejected or "within tolerance" in c.rejected for c in weighed)
    # The plan's prediction is the simulator's for its pieces.
    assert found.balance is not None
    assert found.balance.predicted_step == found.predicted_step_time
    text = repr(found)
    assert "plan" in text and repr(found.schedule) in text


def test_the_memory_cap_holds_in_simulation_and_a_cap_nothing_fits_is_an_error():
    free = _plan(num_microbatches=8)
    limit = 0.6 * max(free.predicted_peak_bytes)
    capped = _plan(num_microbatches=8, memory_limit=limit)
    assert max(capped.predicted_peak_bytes) <= limit
    timeline = planned_timeline(capped, capped.balance.profile)
    assert max(timeline.peak_activation_bytes) <= limit
    rejected = [c for c in capped.alternatives if c.schedule is None or "memory" in c.rejected]
    assert rejected, capped  # GPipe keeps every microbatch: it cannot fit
    with pytest.raises(
        ValueError,
        match=r"no candidate runs within memory_limit=.*; the smallest simulated peak found is",
    ):
        _plan(num_microbatches=8, memory_limit=16)


def test_a_tight_cap_is_met_by_recomputing_and_the_runner_takes_the_policy():
    free = _plan(num_microbatches=8)
    # Below what any split of any schedule holds without recomputing.
    limit = 0.5 * smallest_free_peak(free.balance.profile)
    capped = _plan(num_microbatches=8, memory_limit=limit)
    assert capped.recompute, capped  # no schedule fits without recomputing
    assert set(capped.recompute.values()) == {"full"}
    assert max(capped.predicted_peak_bytes) <= limit
    # The runner takes the policy as it is; the step still equals the model.
    runs_as_planned(capped)


def test_bad_arguments_are_refused_before_profiling():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="num_ranks must be a positive int"):
        mpmd.plan(_Uneven(), (x,), 0)
    with pytest.raises(ValueError, match="does not divide"):
        mpmd.plan(_Uneven(), (x,), 2, batch_size=10, num_microbatches=4)
    with pytest.raises(TypeError, match="schedules must be Schedule classes"):
        mpmd.plan(_Uneven(), (x,), 2, schedules=[mpmd.schedules.OneFOneB(4)])


def test_within_tolerance_the_simplest_candidate_is_the_plan():
    found = _plan(batch_size=16, tolerance=0.5)
    weighed = [c for c in found.alternatives if c.schedule is not None]
    fastest = min([found.predicted_step_time, *(c.predicted_step_time for c in weighed)])
    assert found.predicted_step_time <= 1.5 * fastest
    close = [c for c in weighed if c.predicted_step_time <= 1.5 * fastest]
    # None of those has fewer stages, or as few and no split backward (which
    # of them are close moves with the profile's timings; the rule does not).
    assert all(c.num_stages >= found.num_stages for c in close)
    plain = [
        c
        for c in close
        if c.num_stages == found.num_stages
        and not c.schedule.splits_backward(c.num_stages, found.num_ranks)
    ]
    if plain:
        assert not found.schedule.splits_backward(found.num_stages, found.num_ranks)
    assert close and all("within tolerance" in c.rejected for c in close)
    with pytest.raises(ValueError, match="tolerance must be in"):
        _plan(batch_size=16, tolerance=1.5)


class _VGPipe(mpmd.Schedule):
    """A user's own V-shaped schedule (stage s on rank s, then back up, as
    ZBV places them), GPipe's order on each rank; it says its own shape."""

    stages_per_rank = 2

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        return [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(num_stages)]

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int):
        out = []
        for r in range(num_ranks):
            down, up = r, 2 * num_ranks - 1 - r
            ms = range(num_microbatches)
            out.append(
                [mpmd.Task("F", down, m) for m in ms]
                + [mpmd.Task("F", up, m) for m in ms]
                + [mpmd.Task("B", up, m) for m in ms]
                + [mpmd.Task("B", down, m) for m in ms]
            )
        return out


def test_a_users_v_shaped_schedule_is_weighed_with_its_own_stages_per_rank():
    # The planner knew ZBV and DualPipeV by name: a V of the user's own was
    # weighed with one stage per rank, which its placement cannot take.
    found = _plan(batch_size=16, schedules=[_VGPipe])
    assert isinstance(found.schedule, _VGPipe)
    assert found.num_stages == 4 and len(found.split_before) == 3
    runs_as_planned(found)
