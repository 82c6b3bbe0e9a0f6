"""Recompute tasks (R) must leave training unchanged: a schedule whose forwards
keep nothing for the backward and are re-run before it gives the loss and every
gradient of unpipelined gradient accumulation, for full (B) and split (I/W)
backwards, with the forward's random numbers (dropout) replayed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from models import CASES, eager_step
from pipeline_check import check, data, reference, traced

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

S = mpmd.schedules
M = 4


def with_recompute(
    schedule: mpmd.Schedule, num_stages: int, ranks: int, stages: set[int] | None = None
) -> mpmd.Schedule:
    """`schedule` with R(s, m) right before each B(s, m) or I(s, m) of `stages` (all)."""

    def recomputed(t: mpmd.Task) -> bool:
        return t.kind in ("B", "I") and (stages is None or t.stage in stages)

    lists = [
        [
            r
            for t in rank
            for r in ([mpmd.Task("R", t.stage, t.microbatch)] if recomputed(t) else []) + [t]
        ]
        for rank in schedule.tasks(num_stages, ranks, schedule.num_microbatches)
    ]
    return mpmd.Schedule.from_lists(
        lists, schedule.placement(num_stages, ranks), schedule.num_microbatches
    )


@pytest.mark.parametrize(
    ("cls", "num_stages"), [(S.GPipe, 4), (S.OneFOneB, 2), (S.ZeroBubbleH1, 2)]
)
def test_recompute_matches_gradient_accumulation(cls, num_stages):
    pipe = traced("gpt", num_stages)
    schedule = with_recompute(cls(M), num_stages, 2)
    local = LocalPipeline(pipe, schedule, 2, loss_fn=CASES["gpt"].loss, timeout=60)
    batch, target = data("gpt", M)
    outs = local.step(batch, target=target)
    seen = set()
    for out, runner in zip(outs, local.runners, strict=True):
        seen |= check("gpt", out.loss, runner, M)
        ran = [e for e in runner.timeline.tasks if e.kind == "R"]
        assert len(ran) == M * len(runner.local_stages)
    _, ref_grads = reference("gpt", M)
    assert seen >= {n for n in ref_grads if not n.startswith("head.")}
    ran_split = any(e.kind in "IW" for r in local.runners for e in r.timeline.tasks)
    assert ran_split == (cls is S.ZeroBubbleH1)


class _DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.drop(self.inp(x))))


def _dropout_case() -> tuple[mpmd.Pipe, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _DropoutMLP().double()
    pipe = mpmd.trace(model, (torch.randn(2, 8, dtype=torch.float64),), split_after=["drop"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * M, 8, generator=g, dtype=torch.float64)
    y = torch.randn(2 * M, 8, generator=g, dtype=torch.float64)
    return pipe, x, y


def _dropout_reference(x: torch.Tensor, y: torch.Tensor, seed: int):
    torch.manual_seed(0)
    model = _DropoutMLP().double()
    torch.manual_seed(seed)
    losses = eager_step(lambda xb, yb: nn.functional.mse_loss(model(xb), yb), x, y, M)
    return losses.mean(), {n: p.grad for n, p in model.named_parameters()}


# Split stages draw their masks inside traced graphs (and tracing them at the
# first step draws too), so only B stages match eager dropout; both must give
# bitwise the same step with R as without. Only the dropout stage recomputes:
# ranks as threads share one generator, which another rank's recompute would
# rewind under this one (separate processes each have their own).
@pytest.mark.parametrize(("cls", "matches_eager"), [(S.GPipe, True), (S.ZeroBubbleH1, False)])
def test_recompute_replays_the_forwards_random_numbers(cls, matches_eager):
    pipe, x, y = _dropout_case()
    ref_loss, ref_grads = _dropout_reference(x, y, seed=7)
    losses, grads = [], []
    for schedule in (cls(M), with_recompute(cls(M), 2, 2, stages={0})):
        local = LocalPipeline(pipe, schedule, 2, loss_fn=nn.functional.mse_loss, timeout=60)
        # Only rank 0 draws random numbers, so the masks follow microbatch order.
        torch.manual_seed(7)
        losses.append(local.step(x, target=y)[0].loss)
        grads.append({n: p.grad.clone() for r in local.runners for n, p in r.named_parameters()})
    plain, recomputed = grads
    assert plain.keys() == recomputed.keys() == ref_grads.keys()
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    if matches_eager:
        torch.testing.assert_close(losses[1], ref_loss.double(), rtol=1e-12, atol=1e-12)
    for name, g in recomputed.items():
        assert g.isfinite().all(), name
        torch.testing.assert_close(g, plain[name], rtol=0, atol=0, msg=name)
        if matches_eager:
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("cls", [S.OneFOneB, S.ZeroBubbleH1])
def test_runner_recompute_policy_matches_gradient_accumulation(cls):
    pipe = traced("gpt", 2)
    local = LocalPipeline(pipe, cls(M), 2, loss_fn=CASES["gpt"].loss, timeout=60, recompute=True)
    batch, target = data("gpt", M)
    for out, runner in zip(local.step(batch, target=target), local.runners, strict=True):
        check("gpt", out.loss, runner, M)
        assert sum(e.kind == "R" for e in runner.timeline.tasks) == M * len(runner.local_stages)


def test_recompute_keeps_one_microbatch_of_activations_per_stage():
    pipe = traced("gpt", 2)
    plain = mpmd.compile_schedule(S.GPipe(M), pipe, 2).simulate()
    recomputed = mpmd.compile_schedule(S.GPipe(M).with_recompute(), pipe, 2).simulate()
    # What stage 1 receives per microbatch: a recomputed forward keeps it.
    received = [0, sum(t.bytes for t in pipe.plan.transfers if 1 in t.dst_stages)]
    assert received[1] > 0
    for rank, (before, after) in enumerate(
        zip(plain.peak_activation_bytes, recomputed.peak_activation_bytes, strict=True)
    ):
        # All M microbatches in flight, then one at a time, plus the inputs
        # of all M held from their forwards to their backwards.
        assert before % M == 0
        assert after == before // M + M * received[rank]
    only_last = mpmd.compile_schedule(S.GPipe(M).with_recompute([1]), pipe, 2).simulate()
    assert only_last.peak_activation_bytes[0] == plain.peak_activation_bytes[0]
    with pytest.raises(ValueError, match=r"with_recompute: stages \[7\] do not exist"):
        mpmd.compile_schedule(S.GPipe(M).with_recompute([7]), pipe, 2)


@pytest.mark.parametrize("cls", [S.OneFOneB, S.ZeroBubbleH1])
@pytest.mark.parametrize("policy", ["selective", {0: "selective", 1: "full"}])
@pytest.mark.slow
def test_selective_recompute_matches_gradient_accumulation(cls, policy):
    pipe = traced("gpt", 2)
    local = LocalPipeline(pipe, cls(M), 2, loss_fn=CASES["gpt"].loss, timeout=60, recompute=policy)
    batch, target = data("gpt", M)
    for out, runner in zip(local.step(batch, target=target), local.runners, strict=True):
        check("gpt", out.loss, runner, M)
        full = 1 if isinstance(policy, dict) else 0
        assert sum(e.kind == "R" for e in runner.timeline.tasks) == M * full * (runner.rank == 1)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.layer_norm(x, (16,))
        return x + self.down(nn.functional.gelu(self.up(h)) * 2 - 1)


def _saved_bytes(policy: object) -> int:
    """Bytes split stage 1 keeps from F for its I and W, per microbatch."""
    from torchmpmd.runtime.stages import Step, Training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Block(), _Block())
    x = torch.randn(8, 16)
    pipe = mpmd.trace(model, (x,), split_before=["1"])
    local = LocalPipeline(
        pipe, S.ZeroBubbleH1(M), 2, loss_fn=lambda out, y: out.square().mean(), recompute=policy
    )
    stages = local.runners[1]._stages
    step = Step(inputs=[[x]], targets=[None])
    stages.prepare(step, 0)
    outs = Training([stages], step).forward(1, 0, [pipe.stage(0)(x)[0].detach()])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = outs[2:]  # after the loss / m and the loss: what I and W read
    return sum(
        t.numel() * t.element_size() for t in kept if t.untyped_storage().data_ptr() not in params
    )


def test_selective_recompute_keeps_matmul_outputs_only():
    # Split (I/W) stage: F hands I and W the stage input and the matmul
    # outputs only (26,752 -> 5,248 bytes here); I recomputes norms and
    # activations. (With full backward, torch's selective checkpointing keeps
    # the matmul outputs in its own cache, which saved-tensor hooks do not
    # see, so that path is checked for gradients only.)
    plain = _saved_bytes(False)
    selective = _saved_bytes("selective")
    assert selective <= 0.25 * plain, (selective, plain)
