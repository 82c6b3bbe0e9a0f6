"""Fused forward + backward tasks whose two sides run at once
(`RunnerOptions.overlap`), on 4 Gloo processes: Hugging Face's Qwen3-MoE
(float64, its eager experts) in 4 stages over (pp 2, ep 2), DualPipeV's F&B
pairs, each side's all-to-alls on a process group of its own. The loss and
every gradient equal those of the same schedule run part by part bit for
bit, and the unpipelined model's on the whole global batch within 1e-10;
the timeline shows the sides running at once. Also with full recomputation
(the recompute joins the backward's side), selective recomputation
(torch's checkpoint replaying the generator in the backward), FSDP2 over ep
for the other parameters, a user's schedule fusing F with I (W kept
apart, later), and a stage failing inside a fused task (every rank's error
names both parts' task)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from harness import check_all, run_ranks, whole_tensor
from test_expert_parallel import MICROBATCH, MODELS, SEQ, VOCAB

import torchmpmd as mpmd

M = 4  # microbatches per ep rank (DualPipeV: at least the 4 stages)
SPLIT = ["model.layers.1", "model.layers.2", "model.layers.3"]


def _fused_with_input_grad() -> mpmd.Schedule:
    """DualPipeV's task lists with each fused F&B made F&I, its W right after
    the fused task (a user's schedule: split backward inside a fused task)."""
    base = mpmd.schedules.DualPipeV(M)
    rows = []
    for rank in base.tasks(4, 2, M):
        row: list[mpmd.Task] = []
        for t in rank:
            if t.is_fused:
                f, b = t.parts
                row.append(mpmd.Task.fused(f, mpmd.Task("I", b.stage, b.microbatch)))
                row.append(mpmd.Task("W", b.stage, b.microbatch))
            else:
                row.append(t)
        rows.append([str(t) for t in row])
    return mpmd.Schedule.from_lists(rows, base.placement(4, 2))


CASES = {
    "plain": {},
    "full recompute": {"recompute": True},
    # torchtitan's overlap did not compose with it. DualPipeV's tail splits
    # the backward, which an ep stage does through autograd: two backward
    # passes, which selective checkpointing refuses; so its whole backward.
    "selective recompute": {"recompute": "selective"},
    "fsdp": {"data_parallel": "fsdp"},
    "fused F and I, W later": {},
    "combined 1F1B": {},  # Megatron's: one stage per rank, 2 stages
}


@functools.cache
def _traced(split: tuple[str, ...]) -> mpmd.Pipe:
    x = torch.zeros(MICROBATCH, SEQ, dtype=torch.long)
    return mpmd.trace(MODELS["qwen3_moe"].build(), (x,), split_before=list(split))


def _pipe(split: list[str]) -> mpmd.Pipe:
    """A fresh copy of the model traced at `split` (tracing once per split:
    CI time), its own parameters."""
    return copy.deepcopy(_traced(tuple(split)))


def _runner(mesh, schedule, split=SPLIT, **options) -> mpmd.PipelineRunner:
    """A runner of a fresh copy of Qwen3-MoE cut at `split`, over `mesh`."""
    return mpmd.PipelineRunner(
        _pipe(split),
        schedule,
        mesh=mesh,
        loss_fn=MODELS["qwen3_moe"].loss,
        options=mpmd.RunnerOptions(**options),
    )


def _grads(runner: mpmd.PipelineRunner) -> dict[str, torch.Tensor]:
    return {
        n: whole_tensor(p.grad).clone() for n, p in runner.named_parameters() if p.grad is not None
    }


def _ran_at_once(runner: mpmd.PipelineRunner) -> bool:
    """Whether some fused task's two sides ran at the same time."""
    for e in runner.timeline.events:
        sides = {lane: (a, b) for a, b, lane in e.part_spans}
        if 0 in sides and 1 in sides:
            (a0, b0), (a1, b1) = sides[0], sides[1]
            if min(b0, b1) > max(a0, a1):
                return True
    return False


def overlap_cases(rank: int, world: int) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    case = MODELS["qwen3_moe"]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    ep_rank = dist.get_rank(mesh.get_group("ep"))
    generator = torch.Generator().manual_seed(5)
    n = MICROBATCH * M * 2
    x = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    y = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    part = slice(ep_rank * MICROBATCH * M, (ep_rank + 1) * MICROBATCH * M)
    # The unpipelined model on the whole global batch.
    reference = case.build()
    losses = []
    for xb, yb in zip(x.chunk(2 * M), y.chunk(2 * M), strict=True):
        loss = case.loss(reference(xb), yb)
        (loss / (2 * M)).backward()
        losses.append(loss.detach())
    expected_loss = torch.stack(losses).mean()
    done = []
    for name, options in CASES.items():
        schedule = (
            _fused_with_input_grad()
            if name.startswith("fused F and I")
            else mpmd.schedules.Combined1F1B(M)
            if name == "combined 1F1B"
            else mpmd.schedules.DualPipeV(M).with_full_backward(range(4))
            if name == "selective recompute"
            else mpmd.schedules.DualPipeV(M)
        )
        split = ["model.layers.2"] if name == "combined 1F1B" else SPLIT
        got = {}
        for overlap in (False, True):
            runner = _runner(mesh, schedule, split, timeout=60, overlap=overlap, **options)
            out = runner.step(x[part], target=y[part])
            got[overlap] = (out.loss.detach().clone(), _grads(runner))
            if overlap:
                # Whether a rank ran some fused task's sides at once depends
                # on when its inputs came (checked over every rank).
                at_once = _ran_at_once(runner)
                hidden, total = runner.timeline.hidden_communication()
                assert total > 0 and 0 <= hidden <= total, (name, hidden, total)
            if name == "full recompute":
                # The recompute runs on the backward's side of the fused task.
                fused = [t for t in runner.program.tasks(runner.rank) if t.is_fused]
                assert fused and all(any(p.kind == "R" for p in t.parts) for t in fused), fused
        (l0, g0), (l1, g1) = got[False], got[True]
        what = f"{name} rank {rank}"
        assert torch.equal(l0, l1), (what, l0, l1)
        assert g0.keys() == g1.keys(), what
        for fqn in g0:
            assert torch.equal(g0[fqn], g1[fqn]), (what, fqn)
        torch.testing.assert_close(l1.double(), expected_loss, rtol=1e-10, atol=1e-10)
        for fqn, g in g1.items():
            torch.testing.assert_close(
                g,
                reference.get_parameter(fqn).grad,
                rtol=1e-10,
                atol=1e-10,
                msg=f"{what}: {fqn}",
            )
        done.append((name, at_once))
    # Selective recompute of a stage whose I and W are two backward passes
    # through autograd: refused, saying what to run instead.
    runner = _runner(mesh, mpmd.schedules.DualPipeV(M), timeout=20, recompute="selective")
    with pytest.raises(Exception, match=r"is recomputed selectively.*with_full_backward"):
        runner.step(x[part], target=y[part])
    done.append("selective with I and W refused")
    # Last: a failed step leaves the mesh's groups aborted.
    done.append(_fail_inside_fused_task(mesh, x[part], y[part]))
    return done


def _fail_inside_fused_task(mesh, x, y) -> str:
    # Pipeline rank 1 (global ranks 2, 3) runs stage 2's forward of
    # microbatch 2 inside the fused task (2F2;1B0): its third call raises.
    calls = {"n": 0}

    def wrap(pp_rank, stage, forward):
        if (pp_rank, stage) != (1, 2):
            return forward

        def failing(*args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected failure")
            return forward(*args)

        return failing

    runner = _runner(mesh, mpmd.schedules.DualPipeV(M), timeout=20, wrap_stage=wrap)
    with pytest.raises(Exception) as err:
        runner.step(x, target=y)
    text = str(err.value)
    # Every rank's error names the failed part and its fused task.
    assert "F(stage=2, mb=2) (part of fused (2F2;1B0)OVERLAP_F_B)" in text, text
    assert "injected failure" in text, text
    return "failure"


@pytest.mark.slow
def test_fused_sides_at_once_equal_the_parts_in_order_and_the_plain_model():
    reports = check_all(run_ranks(overlap_cases, 4, deadline=400))
    for r in reports:
        assert [c if isinstance(c, str) else c[0] for c in r] == [
            *CASES,
            "selective with I and W refused",
            "failure",
        ], reports
    for i, name in enumerate(CASES):
        assert any(r[i][1] for r in reports), f"{name}: no rank ran a fused task's sides at once"
