"""Checkpoints are DCP directories keyed like the unpipelined model: saved on
4 pipeline ranks (one split, 1F1B), they load on 2 ranks with another split
and ZBV, into the plain model with DCP's standard calls, and back; the steps
after loading equal those of a run that never changed layout (float64,
1e-12), optimizer state included, tied weights still tied."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from harness import check_all, from_bytes, run_ranks, to_bytes
from models import CASES
from pipeline_check import SPLITS
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import torchmpmd as mpmd

M, MICROBATCH = 4, 2
CASE = CASES["gpt"]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    (x,), _ = CASE.inputs(MICROBATCH * M)
    return (x + 3 * step) % 64, CASE.target(MICROBATCH * M).roll(step)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def pipeline_run(
    rank: int,
    world: int,
    num_stages: int,
    schedule: str,
    load_from: str | None,
    save_to: str | None,
    steps: range,
    save_after: int | None,
) -> dict:
    """Trains `steps` on a pipeline (loading first if asked, saving after step
    `save_after`); returns the losses and this rank's final state dict."""
    (example,), _ = CASE.inputs(MICROBATCH)
    pipe = mpmd.trace(CASE.model(torch.float64), (example,), **SPLITS["gpt"](num_stages))
    runner = mpmd.PipelineRunner(
        pipe,
        getattr(mpmd.schedules, schedule)(M),
        loss_fn=CASE.loss,
        options=mpmd.RunnerOptions(timeout=60),
    )
    opt = _optimizer(runner.parameters())
    if load_from is not None:
        extra = mpmd.checkpoint.load(load_from, runner, opt)
        assert extra["step"] == steps.start, extra
        if "per_rank" in extra:  # what the same rank of the saving run kept
            assert extra["per_rank"]["rank"] == rank, extra
    losses = []
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        losses.append(float(runner.step(x, target=y).loss))
        opt.step()
        if save_after is not None and step == save_after:
            assert save_to is not None
            mpmd.checkpoint.save(
                save_to, runner, opt, extra={"step": step + 1, "per_rank": {"rank": rank}}
            )
    state = to_bytes({k: v.clone() for k, v in runner.state_dict().items()})
    return {"losses": losses, "state": state, "stages": runner.local_stages}


def _merge(reports: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in reports:
        out.update(from_bytes(r["state"]))
    return out


def _plain_steps(model, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        per_mb = []
        for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
            loss = CASE.loss(model(xb), yb)
            (loss / M).backward()
            per_mb.append(loss.detach().double())
        losses.append(float(torch.stack(per_mb).mean()))
        opt.step()
    return losses


def test_any_layout_to_any_layout(tmp_path):
    ckpt = str(tmp_path / "step-2")
    # A: 4 ranks, 4 stages, 1F1B; saves after 2 steps and trains 2 more.
    a = check_all(run_ranks(pipeline_run, 4, 4, "OneFOneB", None, ckpt, range(4), 1))
    assert mpmd.checkpoint.is_complete(ckpt)
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name]
    # B: 2 ranks, another split (4 stages, two per rank in a V), ZBV.
    b = check_all(run_ranks(pipeline_run, 2, 4, "ZBV", ckpt, None, range(2, 4), None))
    for la, lb in zip(a[0]["losses"][2:], b[0]["losses"], strict=True):
        assert abs(la - lb) <= 1e-12, (la, lb)
    a_state, b_state = _merge(a), _merge(b)
    assert set(a_state) == set(b_state)
    for k in a_state:
        torch.testing.assert_close(b_state[k], a_state[k], rtol=1e-12, atol=1e-12, msg=k)

    # The plain model, with DCP's standard calls (no process group).
    model = CASE.model(torch.float64)
    opt = _optimizer(model.parameters())
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert model.head.weight is model.tok.weight  # still tied
    plain = _plain_steps(model, opt, range(2, 4))
    for la, lp in zip(a[0]["losses"][2:], plain, strict=True):
        assert abs(la - lp) <= 1e-12, (la, lp)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, a_state[k], rtol=1e-12, atol=1e-12, msg=k)

    # And back: the plain model's checkpoint loads into a pipeline.
    back = str(tmp_path / "plain")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "extra": {"step": 4}}, checkpoint_id=back)
    c = check_all(run_ranks(pipeline_run, 2, 2, "GPipe", back, None, range(4, 5), None))
    plain = _plain_steps(model, opt, range(4, 5))
    assert abs(c[0]["losses"][0] - plain[0]) <= 1e-12
    for k, v in _merge(c).items():
        torch.testing.assert_close(v, model.state_dict()[k], rtol=1e-12, atol=1e-12, msg=k)
