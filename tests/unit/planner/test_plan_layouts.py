"""`mpmd.plan` over layouts, on the simulator with described links (one
process): pure data parallelism (pp = 1) is chosen where the collectives are
cheap, a pipeline where they are dear; a device-memory limit holds for every
candidate that ran and turns replicas into FSDP; layouts that cannot run are
refused with their reason; a unit's fixed cost per call is learned from two
microbatch sizes; `refine` compares what its docstring says."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import torchmpmd as mpmd
from torchmpmd.planner.results import Profile
from torchmpmd.planner.rows import RowCosts
from torchmpmd.refine import _candidates

# The plans here profile the model on this machine and compare it with
# links described in the test (a pipeline wins only where the profile's
# compute is what it is alone): no other test beside them (scripts/test.sh).
pytestmark = pytest.mark.alone

WIDTH, DEPTH, BATCH = 256, 8, 64


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(_Block() for _ in range(DEPTH)))


def _links(bandwidth: float, latency: float) -> mpmd.Links:
    machine = mpmd.Machine(
        flops=1e12,
        memory=1e12,
        devices_per_node=8,
        intra_node_bandwidth=bandwidth,
        intra_node_latency=latency,
        inter_node_bandwidth=bandwidth,
        inter_node_latency=latency,
    )
    return mpmd.Links.from_machine(machine, 4)


@pytest.fixture(scope="module")
def cheap_and_dear() -> tuple[mpmd.Plan, mpmd.Plan]:
    model, x = _model(), torch.randn(8, WIDTH)
    schedules = [mpmd.schedules.OneFOneB, mpmd.schedules.Interleaved1F1B]
    kw = {"batch_size": BATCH, "repeats": 3, "schedules": schedules}
    cheap = mpmd.plan(model, (x,), 4, links=_links(1e12, 1e-6), **kw)
    # All-reducing the 2 MiB of gradients takes ~40 ms on these links; the
    # whole model's compute on the batch takes a few.
    dear = mpmd.plan(model, (x,), 4, links=_links(1e8, 1e-4), **kw)
    return cheap, dear


def test_pure_data_parallelism_wins_where_collectives_are_cheap(cheap_and_dear):
    cheap, _ = cheap_and_dear
    assert cheap.mesh_layout.pp == 1 and cheap.mesh_layout.dp == 4, cheap
    assert cheap.num_stages == 1 and cheap.split_before == []
    weighed = {str(c.layout) for c in cheap.alternatives if c.schedule is not None}
    assert {"pp 4", "pp 2 x dp 2 (replicate)", "pp 2 x dp 2 (fsdp)", "dp 4 (fsdp)"} <= weighed
    pipelines = [c for c in cheap.alternatives if c.layout is not None and c.layout.pp > 1]
    assert pipelines and all("slower" in c.rejected for c in pipelines if c.schedule)
    assert "dp 4 (replicate)" in repr(cheap)


def test_a_pipeline_wins_where_the_gradient_all_reduce_is_dear(cheap_and_dear):
    cheap, dear = cheap_and_dear
    assert dear.mesh_layout == mpmd.Layout(pp=4), dear
    spmd = [c for c in dear.alternatives if c.layout == mpmd.Layout(dp=4)]
    assert spmd and min(c.predicted_step_time for c in spmd) > 2 * dear.predicted_step_time
    # The same profile underneath: the pipeline's own step barely moves.
    same = [c for c in cheap.alternatives if c.layout == dear.mesh_layout]
    assert same and min(c.predicted_step_time for c in same) <= dear.predicted_step_time * 1.5


def test_device_memory_holds_for_every_candidate_and_fsdp_fits_where_replicas_do_not():
    model, x = _model(), torch.randn(8, WIDTH)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # Replicas hold 4x the parameters (parameter, gradient, two AdamW
    # moments); FSDP over 4 holds 1 + the stage's 2 unsharded: 3x.
    limit = 3.5 * params
    found = mpmd.plan(
        model,
        (x,),
        4,
        batch_size=BATCH,
        links=_links(1e12, 1e-6),
        device_memory=limit,
        repeats=2,
        schedules=[mpmd.schedules.OneFOneB],
        layouts=[mpmd.Layout(dp=4), mpmd.Layout(dp=4, data_parallel="fsdp")],
    )
    assert found.mesh_layout == mpmd.Layout(dp=4, data_parallel="fsdp"), found
    assert max(found.predicted_peak_bytes) <= limit
    assert found.state_bytes and found.state_bytes[0] == pytest.approx(3 * params, rel=0.01)
    for c in found.alternatives:
        if c.schedule is not None:
            assert max(c.predicted_peak_bytes) <= limit, c
        else:
            assert c.layout == mpmd.Layout(dp=4) and "smallest peak" in c.rejected, c
    with pytest.raises(ValueError, match=r"no candidate runs within device_memory=.*smallest"):
        mpmd.plan(
            model,
            (x,),
            4,
            batch_size=BATCH,
            links=_links(1e12, 1e-6),
            device_memory=params,
            repeats=1,
            schedules=[mpmd.schedules.OneFOneB],
            layouts=[mpmd.Layout(dp=4)],
        )


def test_layouts_that_cannot_run_are_refused_with_their_reason():
    model, x = _model(), torch.randn(8, WIDTH)
    found = mpmd.plan(
        model,
        (x,),
        4,
        batch_size=6,  # 6 rows do not divide over 4 replicas
        links=_links(1e12, 1e-6),
        repeats=1,
        schedules=[mpmd.schedules.OneFOneB],
        layouts=[
            mpmd.Layout(dp=4),
            mpmd.Layout(pp=2, dp=2),
            mpmd.Layout(pp=2, tp=2),
            mpmd.Layout(pp=2, ep=2),
        ],
    )
    why = {str(c.layout): c.rejected for c in found.alternatives if c.schedule is None}
    assert "does not divide over dp=4" in why["dp 4 (replicate)"]
    assert "no tensor-parallel plan" in why["pp 2 x tp 2"]
    assert "no experts modules" in why["pp 2 x ep 2 (replicate)"]
    with pytest.raises(ValueError, match="takes 2 devices but num_ranks=4"):
        mpmd.plan(model, (x,), 4, batch_size=8, layouts=[{"pp": 2}])
    with pytest.raises(ValueError, match="pass batch_size"):
        mpmd.plan(model, (x,), 4, layouts=[{"dp": 4}])
    with pytest.raises(TypeError, match="write layouts="):
        mpmd.plan(model, (x,), 4, batch_size=8, layouts=mpmd.Layout(dp=4))
    with pytest.raises(ValueError, match="not both"):
        mpmd.plan(model, (x,), 4, batch_size=8, memory_limit=1e9, device_memory=1e9)


def test_without_links_a_single_process_weighs_the_pipeline_and_says_why():
    model, x = _model(), torch.randn(8, WIDTH)
    found = mpmd.plan(model, (x,), 2, batch_size=16, repeats=1)
    assert found.mesh_layout == mpmd.Layout(pp=2)
    assert any("collectives not priced" in n for n in found.notes), found.notes
    assert "note: collectives not priced" in repr(found)


class _Sleepy(torch.nn.Module):
    """A layer with a fixed cost per call (2 ms, as a kernel launch or a
    Python-heavy block would have) on top of its matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return self.linear(x)


def test_the_fixed_cost_per_call_is_learned_from_two_microbatch_sizes():
    model = torch.nn.Sequential(_Sleepy(), torch.nn.Linear(WIDTH, WIDTH), _Sleepy())
    found = mpmd.plan(
        model,
        (torch.randn(16, WIDTH),),
        1,
        batch_size=64,
        repeats=3,
        schedules=[mpmd.schedules.OneFOneB],
    )
    # Linear scaling from 16 rows would price 16 microbatches of 4 rows at
    # the cost of one of 64: the sleeps make each call cost 4 ms more.
    by_count = {
        c.num_microbatches: c.predicted_step_time
        for c in (found, *found.alternatives)
        if c.schedule is not None
    }
    assert found.num_microbatches == 1, by_count
    assert by_count[4] - by_count[1] > 3 * 0.004 * 0.8, by_count


def test_row_costs_are_a_line_through_the_two_sizes():
    def profile(f: float) -> Profile:
        return Profile.chain(["a", "b"], [f, 2 * f])

    costs = RowCosts(profile(3.0), 8, profile(2.0), 4)  # 1.0 fixed, 0.25 per row
    at = costs.at(16)
    assert at.forward == pytest.approx((5.0, 10.0))
    assert costs.fixed() == pytest.approx((3.0, 6.0))  # F + B with B = 2F
    # A half that costs more than the whole (noise): all fixed, never negative.
    noisy = RowCosts(profile(2.0), 8, profile(3.0), 4)
    assert noisy.at(1).forward == pytest.approx((2.0, 4.0))
    linear = RowCosts(profile(3.0), 8)  # one size: linear, as before
    assert not linear.fixed_cost_known and linear.at(4).forward == pytest.approx((1.5, 3.0))


def test_refine_compares_predicted_steps_per_global_batch():
    sched = mpmd.schedules

    def candidate(cls, m: int, step: float) -> mpmd.planner.Candidate:
        return mpmd.planner.Candidate(
            name=f"{cls.__name__}({m})",
            schedule=cls(m),
            num_stages=2 if cls is not sched.Interleaved1F1B else 4,
            num_microbatches=m,
            split_before=["x"],
            predicted_step_time=step,
            predicted_peak_bytes=[1],
        )

    # Per microbatch the 16-microbatch ZB-H1 looks 4x cheaper than the plan;
    # per global batch (what the plan compares) it is 1.5x slower, out of
    # a 1.25 slack.
    plan = mpmd.Plan(
        schedule=sched.OneFOneB(4),
        split_before=["x"],
        num_microbatches=4,
        num_ranks=2,
        predicted_step_time=1.0,
        predicted_peak_bytes=[1],
        batch_size=16,
        alternatives=(
            candidate(sched.ZeroBubbleH1, 16, 1.5),
            candidate(sched.ZeroBubbleH1, 8, 1.1),
        ),
    )
    chosen = _candidates(plan, 1.25, 16)
    assert [c.num_microbatches for c in chosen] == [4, 8]
    per_microbatch = dataclasses.replace(plan, batch_size=None)
    assert [c.num_microbatches for c in _candidates(per_microbatch, 1.25, 16)] == [4, 16]


def test_expert_parallelism_divides_the_experts_state_and_reduces_each_part_over_its_replicas():
    from torchmpmd.planner.layouts import StageCharges

    links = _links(1e9, 1e-5)
    both = mpmd.Layout(dp=2, ep=2, data_parallel="fsdp")
    assert both.mesh_dim_names == ("pp", "dp", "ep") and both.replicas == 4
    # 100 bytes of parameters, 40 of them experts: the dense 60 over dp x ep
    # = 4 replicas, a rank's 20 bytes of experts over dp = 2.
    fsdp = StageCharges(both, links)
    assert fsdp.held(100, 40) == 60 * 4 / 4 + 2 * 60 + 20 * 4 / 2 + 2 * 20
    replicas = StageCharges(mpmd.Layout(dp=2, ep=2), links)
    assert replicas.held(100, 40) == 60 * 4 + 20 * 4
    assert replicas.reduce(100, 40) == pytest.approx(
        links.time("all_reduce", 60, group_size=4) + links.time("all_reduce", 20, group_size=2)
    )
    assert fsdp.gather(100, 40) == pytest.approx(
        links.time("all_gather", 60, group_size=4) + links.time("all_gather", 20, group_size=2)
    )
    with pytest.raises(ValueError, match="ep must be a positive int"):
        mpmd.Layout(ep=0)


def test_a_close_rival_of_another_layout_is_named_in_the_notes():
    from torchmpmd.planner.plan import _close_calls

    def candidate(layout: mpmd.Layout, step: float) -> mpmd.planner.Candidate:
        return mpmd.planner.Candidate(
            name="OneFOneB(4)",
            schedule=mpmd.schedules.OneFOneB(4),
            num_stages=layout.pp,
            num_microbatches=4,
            split_before=[],
            predicted_step_time=step,
            predicted_peak_bytes=[1],
            layout=layout,
        )

    best = candidate(mpmd.Layout(dp=4), 1.0)
    near = [best, candidate(mpmd.Layout(dp=4), 1.01), candidate(mpmd.Layout(pp=4), 1.05)]
    (note,) = _close_calls(best, near, 64, 0.03)
    assert "close call" in note and "pp 4" in note and "1.050x" in note
    far = [best, candidate(mpmd.Layout(pp=4), 1.2)]
    assert _close_calls(best, far, 64, 0.03) == []


def test_tp_measured_on_the_job_is_charged_per_call_to_the_planned_modules():
    """What a tp run exceeds its prediction by, beyond the job's offset
    (the forward without tp's, the backward's in proportion), goes to the
    units by their planned modules, per call: at any microbatch size a call
    costs it once. The run without tp's backward, slowed by averaging every
    gradient, does not cancel tp's."""
    from torchmpmd.planner.job_runs import Run, per_call_costs
    from torchmpmd.planner.tensor_costs import TensorShares, over_tp, per_call

    shares = TensorShares(
        rows=8,
        compute=(0.0, 1.0, 1.0),
        parameters=(0.0, 1.0, 1.0),
        forward_bytes=((), (), ()),
        backward_bytes=((), (), ()),
        divisible=(8,),
        modules=(0, 3, 1),
    )
    costs = RowCosts(Profile.chain(["emb", "a", "b"], [0.010, 0.040, 0.040]), 8)
    # Predicted without links: tp 2 halves a and b, forward 0.01 + 0.02 + 0.02.
    # The job runs 1/18 over the profile (0.005 of the forward's 0.090,
    # 0.010 of the backward's 0.180); without tp its backward also averages
    # (0.030 more), tp 2 on 2 ranks has no replicas to average over.
    measured = {
        1: Run(0.090 + 0.005, 0.180 + 0.010 + 0.030, 0.3),
        2: Run(0.050 + 0.005 + 0.020, 0.100 + 0.010 + 0.040, 0.3),
    }
    notes: list[str] = []
    calls = per_call_costs(measured, costs, shares, None, 0.0, notes, 0.0, 2)
    assert calls[2].forward == pytest.approx((0.0, 0.015, 0.005))
    assert calls[2].backward == pytest.approx((0.0, 0.030, 0.010))
    # A tp run with replicas: what `charged` prices its averaging at is
    # not charged again per call (tp 2 of 4 ranks: dp 2 over half the bytes).
    sized = RowCosts(dataclasses.replace(costs.full, parameter_bytes=(0, 2**20, 2**20)), 8)
    per_byte = 0.008 / 2**20  # a ring of 2 moves each byte once: 8 ms for tp 2's 1 MiB
    four = per_call_costs(measured, sized, shares, None, 0.0, [], per_byte, 4)
    assert sum(four[2].backward) == pytest.approx(0.040 - 0.008)
    assert four[2].forward == pytest.approx(calls[2].forward)
    # With the model computed alone in the tp run's turns, its figures are
    # read at the profile's level: a machine 1.5x slower during that run
    # (the model alone 0.135 / 0.270 s against 0.090 / 0.180 profiled)
    # charges what tp adds, not the machine's slowness.
    slow = Run(1.5 * 0.070, 1.5 * 0.140, 0.5, 1.5 * 0.090, 1.5 * 0.180)
    level = per_call_costs({1: measured[1], 2: slow}, costs, shares, None, 0.0, [], 0.0, 2)
    assert sum(level[2].forward) == pytest.approx(0.020)
    assert sum(level[2].backward) == pytest.approx(0.040)
    assert len(notes) == 1 and notes[0].startswith("tp 2 measured on the job"), notes
    # Per call: at half the rows the compute halves, the charge does not.
    half = over_tp(costs.at(4), shares, 2, None, 4, None, 0.0, calls[2])
    assert half.forward == pytest.approx((0.005, 0.010 + 0.015, 0.010 + 0.005))
    # A tp run faster than predicted charges nothing (never a discount).
    assert per_call(shares, -0.01, 0.0).forward == (0.0, 0.0, 0.0)


def test_data_parallelism_measured_on_the_job_is_charged_to_the_backward_by_the_bytes_averaged():
    """What the step without tp exceeds its compute (as the prediction
    charges it: the profile's, whatever its forward measured on the job)
    and the links' price for its all-reduce by is charged per gradient byte
    averaged to each backward call, a step's worth over its microbatches,
    scaled to the group's ring traffic: the prediction of the measured run
    is that run's step."""
    from torchmpmd.planner.job_runs import Run, charged, dp_per_byte

    prof = dataclasses.replace(
        Profile.chain(["a", "b"], [0.010, 0.010]), parameter_bytes=(2**20, 3 * 2**20)
    )
    costs = RowCosts(prof, 8)
    # The profile's compute is 0.060 s (its forward measured 1.1x on the
    # job, which does not change the charge); 20 ms more than that, no links.
    notes: list[str] = []
    per_byte = dp_per_byte(Run(0.022, 0.044, 0.080), costs, None, 2, notes)
    assert per_byte * 4 * 2**20 == pytest.approx(0.020)
    assert notes and notes[0].startswith("dp 2 measured on the job"), notes
    two = charged(prof, per_byte, 2, 2)
    assert two.forward == prof.forward
    added = [b - p for b, p in zip(two.backward, prof.backward, strict=True)]
    assert added == pytest.approx([0.0025, 0.0075])
    # Four replicas move 1.5x the bytes of two per byte averaged.
    four = charged(prof, per_byte, 4, 1)
    assert sum(four.backward) - sum(prof.backward) == pytest.approx(1.5 * 0.020)
    assert charged(prof, per_byte, 1, 1) is prof  # nothing averaged
    # A step faster than its prediction charges nothing.
    assert dp_per_byte(Run(0.022, 0.044, 0.055), costs, None, 2, []) == 0.0
    # With the model computed alone in the same turns (0.090 s: the machine
    # 1.5x slower than when profiled), the step's excess over it (30 ms)
    # counts at the profile's level (20 ms), not the machine's slowness.
    slow = Run(0.033, 0.066, 0.120, 0.030, 0.060)
    assert dp_per_byte(slow, costs, None, 2, []) * 4 * 2**20 == pytest.approx(0.020)


def test_a_pipeline_measured_on_the_job_levels_every_pipeline_and_the_plan_is_chosen_again():
    """Where the ranks compute on one host's CPU, the fastest candidates with
    and without a pipeline, stepped on the job, set the level of every
    candidate of their kind, and the plan is chosen again: here the
    pipeline predicted 0.9x DDP measured 1.5x its prediction, so DDP is the
    plan, and the pipeline is ranked behind it with its measured step; a
    kind not measured keeps its predictions."""
    from torchmpmd.planner.pipeline_level import leveled, to_measure

    def candidate(layout: mpmd.Layout, m: int, step: float) -> mpmd.planner.Candidate:
        return mpmd.planner.Candidate(
            name=f"OneFOneB({m})",
            schedule=mpmd.schedules.OneFOneB(m),
            num_stages=layout.pp,
            num_microbatches=m,
            split_before=["1"] * (layout.pp - 1),
            predicted_step_time=step,
            predicted_peak_bytes=[1],
            layout=layout,
        )

    pipe, mixed = candidate(mpmd.Layout(pp=4), 8, 0.9), candidate(mpmd.Layout(pp=2, dp=2), 4, 0.95)
    ddp, fsdp = (
        candidate(mpmd.Layout(dp=4), 1, 1.0),
        candidate(mpmd.Layout(dp=4, data_parallel="fsdp"), 1, 1.2),
    )
    plan = mpmd.Plan(
        schedule=pipe.schedule,
        split_before=pipe.split_before,
        num_microbatches=8,
        num_ranks=4,
        predicted_step_time=0.9,
        predicted_peak_bytes=[1],
        layout=pipe.layout,
        batch_size=64,
        alternatives=(mixed, ddp, fsdp),
    )
    assert to_measure(plan) == [plan.as_candidate(), ddp]
    out = leveled(plan, [(plan.as_candidate(), 1.35)], 0.03)
    assert out.mesh_layout == mpmd.Layout(dp=4) and out.predicted_step_time == 1.0
    assert out.balance is None  # the simulation's balance was the pipeline's
    ranked = {str(c.layout): c for c in out.alternatives}
    assert ranked["pp 4"].predicted_step_time == pytest.approx(1.35)
    assert ranked["pp 4"].measured_step_time == 1.35 and "1.350x slower" in ranked["pp 4"].rejected
    assert ranked["pp 2 x dp 2 (replicate)"].predicted_step_time == pytest.approx(0.95 * 1.5)
    assert ranked["dp 4 (fsdp)"].predicted_step_time == 1.2
    assert "predicted 1.50x its simulation" in out.notes[-1], out.notes
    assert "the simulation alone chose" in out.notes[-1] and "on pp 4" in out.notes[-1]
    # Measured at its prediction, nothing changes but the note.
    same = leveled(plan, [(plan.as_candidate(), 0.9)], 0.03)
    assert same.mesh_layout == mpmd.Layout(pp=4) and same.predicted_step_time == 0.9
    assert same.measured_step_time == 0.9 and same.balance is plan.balance
    assert [c.predicted_step_time for c in same.alternatives] == [0.95, 1.0, 1.2]
    # Only pipelines (or no pipeline) ran: the level cannot change the choice.
    assert to_measure(dataclasses.replace(plan, alternatives=(mixed,))) == []
    # Both kinds measured: DDP at 1.1x its prediction, FSDP with it.
    both = leveled(plan, [(plan.as_candidate(), 1.35), (ddp, 1.1)], 0.03)
    assert both.mesh_layout == mpmd.Layout(dp=4) and both.predicted_step_time == pytest.approx(1.1)
    assert both.measured_step_time == 1.1
    ranked = {str(c.layout): c for c in both.alternatives}
    assert ranked["dp 4 (fsdp)"].predicted_step_time == pytest.approx(1.2 * 1.1)
    assert ranked["pp 4"].predicted_step_time == pytest.approx(1.35)
    note = both.notes[-1]
    assert (
        "with a pipeline is predicted 1.50x" in note
        and "without a pipeline is predicted 1.10x" in note
    )
