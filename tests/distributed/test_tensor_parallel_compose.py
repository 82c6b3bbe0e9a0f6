"""Tensor parallelism composed with the rest of the runner, on ("pp", "tp")
DeviceMeshes of 4 Gloo processes, the bundled GPT (examples/gpt.py, its own
tp plan, tied embeddings, float64 throughout) against the unpipelined model
in one process:

- every built-in schedule on pp 2 x tp 2: the loss and every gradient
  (gathered whole) equal the unpipelined model's at 1e-10;
- a checkpoint saved on pp 2 x tp 2 loads on pp 4 (no tp) and into the plain
  model with DCP's standard calls: the parameters are the saving run's, and
  the next step's loss and parameters are the unpipelined model's;
- a stage forward that raises on one tp rank fails every rank of the job
  within the timeout, each naming the rank that failed.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gpt import GPT, GPTConfig, lm_loss
from harness import check_all, from_bytes, run_ranks, to_bytes, whole_tensor
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import torchmpmd as mpmd

M = 4  # microbatches
ROWS, SEQ, VOCAB = 8, 12, 96
TOL = {"rtol": 1e-10, "atol": 1e-10}

# Every built-in schedule (torchmpmd/schedules.py) and its number of stages
# on 2 pipeline ranks: the interleaved and V schedules hold two per rank.
SCHEDULES = {
    "GPipe": 2,
    "OneFOneB": 2,
    "Eager1F1B": 2,
    "ZeroBubbleH1": 2,
    "Interleaved1F1B": 4,
    "ZBV": 4,
    "DualPipeV": 4,
    "Combined1F1B": 2,
}


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, dim=32, heads=4, layers=4)).double()


def _split(num_stages: int) -> list[str]:
    return [f"blocks.{4 * s // num_stages}" for s in range(1, num_stages)]


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _plain_step(model: torch.nn.Module, step: int) -> torch.Tensor:
    """The unpipelined model's gradient accumulation over the step's M
    microbatches; the mean loss."""
    idx, target = _tokens(step)
    losses = []
    for xb, yb in zip(idx.chunk(M), target.chunk(M), strict=True):
        loss = lm_loss(model(xb), yb)
        (loss / M).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def _pp_tp_mesh(pp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))


# ---- every built-in schedule on pp 2 x tp 2 ------------------------------------------------------


def every_schedule(rank: int, world: int) -> list[tuple[str, list[int], list[int], list[str]]]:
    """Each schedule's one step against the unpipelined model; per schedule its
    name, this rank's stages, those that ran a split backward (I, W) and the
    parameters checked here."""
    from torch.distributed.tensor import DTensor

    mesh = _pp_tp_mesh(2, 2)
    reference = _gpt()
    ref_loss = _plain_step(reference, 0)
    idx, target = _tokens(0)
    done = []
    for name, num_stages in SCHEDULES.items():
        model = _gpt()
        pipe = mpmd.trace(model, (idx[: ROWS // M],), split_before=_split(num_stages))
        runner = mpmd.PipelineRunner(
            pipe,
            getattr(mpmd.schedules, name)(M),
            mesh=mesh,
            loss_fn=lm_loss,
            options=mpmd.RunnerOptions(timeout=60),
        )
        local = dict(runner.named_parameters())
        # The plan ran: the blocks' projections are tp shards.
        assert any(isinstance(p, DTensor) for p in local.values()), (name, list(local))
        out = runner.step(idx, target=target)
        what = f"{name} on rank {rank}"
        torch.testing.assert_close(out.loss, ref_loss, **TOL, msg=lambda m, w=what: f"{w}: {m}")
        for fqn, p in local.items():
            assert p.grad is not None, f"{what}: {fqn} got no gradient"
            torch.testing.assert_close(
                whole_tensor(p.grad),
                reference.get_parameter(fqn).grad,
                **TOL,
                msg=lambda m, w=f"{what}: {fqn}": f"{w}: {m}",
            )
        split = sorted({e.stage for e in runner.timeline.tasks if e.kind in "IW"})
        done.append((name, sorted(runner.local_stages), split, sorted(local)))
    return done


def test_every_builtin_schedule_with_tensor_parallel_stages():
    reports = check_all(run_ranks(every_schedule, 4, deadline=400))
    model = _gpt()
    assert set(SCHEDULES) == set(mpmd.schedules.__all__), "a built-in schedule is not tested"
    for i, name in enumerate(SCHEDULES):
        # Every parameter of the model is checked on some rank (the tied
        # embedding and head under either name: once on a rank holding both).
        checked = {id(model.get_parameter(n)) for report in reports for n in report[i][3]}
        assert checked == {id(p) for p in model.parameters()}, name
        for rank, report in enumerate(reports):
            got, stages, split, _ = report[i]
            assert got == name
            pp = rank // 2  # mesh (pp, tp): global rank = 2 * pp + tp
            if SCHEDULES[name] == 2:
                assert stages == [pp], (name, rank, stages)
            elif name == "Interleaved1F1B":
                assert stages == [pp, pp + 2], (name, rank, stages)
            else:  # V: stages r and 3 - r
                assert stages == [pp, 3 - pp], (name, rank, stages)
            # The zero-bubble schedules ran split backwards (I, W) on tp stages.
            if name in ("ZeroBubbleH1", "ZBV"):
                assert split == stages, (name, rank, split)


# ---- checkpoints across pipeline and tensor layouts ----------------------------------------------


def _runner(pp: int, tp: int) -> mpmd.PipelineRunner:
    """The GPT cut into `pp` stages under 1F1B, on a pp x tp mesh (tp > 1)
    or on the world (tp == 1)."""
    idx, _ = _tokens(0)
    pipe = mpmd.trace(_gpt(), (idx[: ROWS // M],), split_before=_split(pp))
    return mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(M),
        mesh=_pp_tp_mesh(pp, tp) if tp > 1 else None,
        loss_fn=lm_loss,
        options=mpmd.RunnerOptions(timeout=60),
    )


def _whole_state(runner: mpmd.PipelineRunner) -> bytes:
    return to_bytes({k: whole_tensor(v.detach()).clone() for k, v in runner.state_dict().items()})


def save_then_load(rank: int, world: int, path: str) -> dict:
    """On pp 2 x tp 2: one AdamW step, then a checkpoint (and the next step).
    Then on the same 4 processes as pp 4 without tp: a new runner whose
    parameters are not the checkpoint's loads it and takes that next step.
    Each layout's losses and this rank's parameters, whole."""
    saving = _runner(2, 2)
    opt = _optimizer(saving.parameters())
    idx, target = _tokens(0)
    losses = [float(saving.step(idx, target=target).loss)]
    opt.step()
    mpmd.checkpoint.save(path, saving, opt, extra={"step": 1})
    saved = _whole_state(saving)
    opt.zero_grad(set_to_none=True)
    idx, target = _tokens(1)
    losses.append(float(saving.step(idx, target=target).loss))

    loading = _runner(4, 1)
    with torch.no_grad():  # not the checkpoint's values: a load that read nothing would show
        for p in loading.parameters():
            p.fill_(0.5)
    opt = _optimizer(loading.parameters())
    assert mpmd.checkpoint.load(path, loading, opt) == {"step": 1}
    loaded = _whole_state(loading)
    idx, target = _tokens(1)
    loss = float(loading.step(idx, target=target).loss)
    opt.step()
    return {
        "saving": {"losses": losses, "state": saved, "stages": saving.local_stages},
        "loading": {
            "loss": loss,
            "loaded": loaded,
            "after": _whole_state(loading),
            "stages": loading.local_stages,
        },
    }


def _merged(reports: list[dict], key: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in reports:
        for k, v in from_bytes(r[key]).items():
            if k in out:  # a tied weight, or a tp peer's copy: the same values
                torch.testing.assert_close(v, out[k], rtol=0, atol=0, msg=k)
            out[k] = v
    return out


def _assert_states(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, got.keys() ^ want.keys())
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=lambda m, w=f"{what}: {k}": f"{w}: {m}")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_checkpoint_from_pp2_tp2_loads_on_pp4_and_into_the_plain_model(tmp_path):
    path = str(tmp_path / "step-1")
    reports = check_all(run_ranks(save_then_load, 4, path, deadline=200))
    saved, loaded = [r["saving"] for r in reports], [r["loading"] for r in reports]
    assert mpmd.checkpoint.is_complete(path)
    assert [r["stages"] for r in saved] == [[0], [0], [1], [1]]
    assert [r["stages"] for r in loaded] == [[0], [1], [2], [3]]
    saved_state = _merged(saved, "state")

    # The unpipelined reference: the same two steps in one process.
    reference = _gpt()
    ref_opt = _optimizer(reference.parameters())
    ref_losses = [float(_plain_step(reference, 0))]
    ref_opt.step()
    ref_after_first = copy.deepcopy(reference.state_dict())
    ref_opt.zero_grad(set_to_none=True)
    ref_losses.append(float(_plain_step(reference, 1)))
    ref_opt.step()
    for r in saved:
        gaps = [abs(a - b) for a, b in zip(r["losses"], ref_losses, strict=True)]
        assert max(gaps) <= 1e-10, (r["losses"], ref_losses)
    _assert_states(saved_state, ref_after_first, "saved on pp 2 x tp 2")

    # pp 4, one stage per rank, no tensor parallelism.
    _assert_states(_merged(loaded, "loaded"), saved_state, "loaded on pp 4")
    for r in loaded:
        assert abs(r["loss"] - ref_losses[1]) <= 1e-10, (r["loss"], ref_losses)
    _assert_states(_merged(loaded, "after"), reference.state_dict(), "pp 4 after a step")

    # The plain model, with DCP's standard calls (no process group).
    model = _gpt()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    opt = _optimizer(model.parameters())
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert model.head.weight is model.tok.weight  # still tied
    _assert_states(dict(model.state_dict()), saved_state, "loaded into the plain model")
    loss = float(_plain_step(model, 1))
    opt.step()
    assert abs(loss - ref_losses[1]) <= 1e-10, (loss, ref_losses)
    _assert_states(dict(model.state_dict()), reference.state_dict(), "plain model after a step")


# ---- a failure on one tp rank ---------------------------------------------------------------------

TIMEOUT = 6.0
VICTIM = 1  # global rank 1: pipeline rank 0, tp coordinate 1 (stage 0)
NAMED = "rank 0 (global rank 1) failed in step"  # how the others name it
CAUSE = "ValueError: stage input has NaNs"


def raises_on_one_tp_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    calls = 0

    def wrap(pp_rank: int, stage: int, forward):
        if dist.get_rank() != VICTIM:
            return forward

        def bad(*args):
            nonlocal calls
            calls += 1
            if calls == M + 2:  # microbatch 1 of the second step
                raise ValueError("stage input has NaNs")
            return forward(*args)

        return bad

    idx, target = _tokens(0)
    pipe = mpmd.trace(_gpt(), (idx[: ROWS // M],), split_before=_split(2))
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(M),
        mesh=_pp_tp_mesh(2, 2),
        loss_fn=lm_loss,
        options=mpmd.RunnerOptions(timeout=TIMEOUT, wrap_stage=wrap),
    )
    runner.step(idx, target=target)  # a healthy step first
    idx, target = _tokens(1)
    start = time.monotonic()
    out: dict = {"error": None}
    try:
        runner.step(idx, target=target)
    except Exception as err:
        out = {"error": str(err), "types": [c.__name__ for c in type(err).__mro__]}
    out["after"] = time.monotonic() - start
    # The failed rank lives on (a training loop that caught the error and
    # saves, logs or waits) until the others have failed, or for twice the
    # timeout: its tp peer must not wait for it past the timeout, nor learn
    # of the failure only when its process exits and closes its connections.
    store = dist.distributed_c10d._get_default_store()
    if rank != VICTIM:
        store.add("failed", 1)
    else:
        end = time.monotonic() + 2 * TIMEOUT
        while store.add("failed", 0) < world - 1 and time.monotonic() < end:
            time.sleep(0.05)
    return out


def test_a_failure_on_one_tp_rank_fails_every_rank_naming_it():
    values = check_all(run_ranks(raises_on_one_tp_rank, 4, deadline=120))
    for rank, v in enumerate(values):
        error = v["error"]
        assert error is not None, f"rank {rank} finished a step rank {VICTIM} failed"
        first = error.split("\n", 1)[0]
        # Its tp peer (global rank 0) waits in a DTensor collective for it
        # up to the timeout; the others stop within moments.
        limit = TIMEOUT + 3 if rank == 0 else TIMEOUT / 2
        assert v["after"] < limit, f"rank {rank} took {v['after']:.1f} s to fail: {first}"
        if rank == VICTIM:
            assert "ValueError" in v["types"] and "PipelineError" in v["types"], v
            assert first.startswith(f"torchmpmd: rank 0: F(stage=0, mb=1) failed: {CAUSE}"), first
        else:
            # Its tp peer, the next stage's rank of its tp coordinate (global
            # rank 3) and the other (global rank 2): each names it and its error.
            assert NAMED in first and CAUSE in first, (rank, first)
