"""`mpmd.refine` on two Gloo ranks: the plan's close candidates run on the
job, every rank gets the same refined plan, the choice follows the measured
medians (the fastest, or the simplest within the tolerance), the runner
takes it as it is, and the model (parameters, gradients, BatchNorm
statistics, random state) is as it was."""

from __future__ import annotations

import pytest
import torch
from harness import check_all, run_ranks

import torchmpmd as mpmd


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
            for _ in range(6)
        )
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.norm(x))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, target)


def refine_on_each_rank(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _Net().double()
    x = torch.randn(16, 16, dtype=torch.float64)
    target = torch.randint(0, 8, (16,))
    found = mpmd.plan(
        model, (x[:2],), 2, num_microbatches=8, loss_fn=_loss, example_target=target[:2], repeats=1
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.layers[0][0].weight.grad = torch.full_like(model.layers[0][0].weight, 3.0)
    rng = torch.get_rng_state()
    refined = mpmd.refine(found, model, x, target=target, loss_fn=_loss, rounds=2, slack=10.0)
    rng_kept = torch.equal(rng, torch.get_rng_state())
    after = model.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    grads_kept = bool((model.layers[0][0].weight.grad == 3.0).all()) and all(
        p.grad is None for n, p in model.named_parameters() if n != "layers.0.0.weight"
    )
    measured = [
        (c.name, c.num_stages, c.measured_step_time, c.rejected)
        for c in refined.alternatives
        if c.measured_step_time is not None
    ]
    # A candidate's family: its stage count and whether it splits the backward
    # (asked of the schedule, not read from its name).
    families = sorted(
        {
            (c.num_stages, c.schedule.splits_backward(c.num_stages, world))
            for c in refined.alternatives
            if c.measured_step_time is not None and c.schedule is not None
        }
    )
    # The runner takes the refined plan as it is; its step equals the model's.
    model.layers[0][0].weight.grad = None
    reference = _Net().double()
    reference.load_state_dict(model.state_dict())
    pipe = mpmd.trace(model, (x[:2],), split_before=refined.split_before)
    runner = mpmd.PipelineRunner(
        pipe,
        refined.schedule,
        loss_fn=_loss,
        options=mpmd.RunnerOptions(timeout=60, recompute=refined.recompute or False),
    )
    out = runner.step(x, target=target)
    m = refined.num_microbatches
    losses = []
    for xb, yb in zip(x.chunk(m), target.chunk(m), strict=True):
        loss = _loss(reference(xb), yb)
        (loss / m).backward()
        losses.append(loss.detach())
    grads_equal = all(
        torch.allclose(p.grad, reference.get_parameter(n).grad, rtol=1e-9, atol=1e-10)
        for n, p in runner.named_parameters()
    )
    loss_equal = out.loss is None or torch.allclose(out.loss, torch.stack(losses).mean())
    return {
        "plan": (repr(refined.schedule), refined.split_before, refined.recompute),
        "measured_plan": refined.measured_step_time,
        "measured": measured,
        "families": families,
        "plan_family": (
            len(refined.split_before) + 1,
            refined.schedule.splits_backward(len(refined.split_before) + 1, world),
        ),
        "first": (repr(found.schedule), found.split_before),
        "kept_balance": refined.balance is not None,
        "unchanged": unchanged,
        "grads_kept": grads_kept,
        "rng_kept": rng_kept,
        "grads_equal": grads_equal,
        "loss_equal": loss_equal,
        "text": repr(refined),
    }


def test_refine_measures_the_close_candidates_and_every_rank_gets_the_same_plan():
    r0, r1 = check_all(run_ranks(refine_on_each_rank, 2, deadline=240))
    assert r0["plan"] == r1["plan"] and r0["measured"] == r1["measured"], (r0, r1)
    assert r0["measured_plan"] > 0 and r0["measured"], r0
    # One candidate per family (stage count, split backward): with slack=10
    # all four families on 2 ranks.
    assert len(r0["measured"]) == 3 and len(r0["families"]) == 3, (r0["measured"], r0["families"])
    assert tuple(r0["plan_family"]) not in {tuple(f) for f in r0["families"]}, r0
    # The choice follows the medians: none measured faster beyond tolerance.
    for _, _, t, why in r0["measured"]:
        assert why.startswith("measured")
        assert t >= r0["measured_plan"] * (1 - 0.03) or "within tolerance" in why, r0
    assert r0["kept_balance"] == (r0["plan"][:2] == r0["first"])
    assert "measured" in r0["text"]
    for r in (r0, r1):
        assert r["unchanged"] and r["grads_kept"] and r["rng_kept"], r
        assert r["grads_equal"] and r["loss_equal"], r


def test_refine_refuses_bad_arguments_and_a_job_without_its_ranks():
    found = mpmd.plan(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
        (torch.randn(2, 4),),
        2,
        num_microbatches=4,
        repeats=1,
    )
    with pytest.raises(RuntimeError, match="call it on every rank under torchrun"):
        mpmd.refine(found, torch.nn.Linear(4, 4), torch.randn(8, 4))
    with pytest.raises(TypeError, match=r"must be what mpmd\.plan returned"):
        mpmd.refine("1F1B", torch.nn.Linear(4, 4), torch.randn(8, 4))
    with pytest.raises(ValueError, match="rounds must be a positive int"):
        mpmd.refine(found, torch.nn.Linear(4, 4), torch.randn(8, 4), rounds=0)
