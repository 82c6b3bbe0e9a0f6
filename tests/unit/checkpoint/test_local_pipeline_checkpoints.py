"""Checkpoints of `testing.LocalPipeline` (ranks as threads of one process,
no process group) hold the whole model: every rank thread used to act as
rank 0 of a world of one, so `on_all_ranks(save)` left one rank's data file
(and a load then said "written for another model"), and `save_hf` raised
"Directory not empty" on one rank, leaving the other's tensors only, which
`from_pretrained` loaded with half the layers freshly initialised. The ranks
now coordinate over the pipeline's own transport: the DCP checkpoint loads
into the plain model with DCP's standard calls (parameters and optimizer
state equal the runners'), into a new LocalPipeline (the next step equals
the first pipeline's), and `from_pretrained` loads the Hugging Face one
whole. With or without a process group in the process."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import hf_llama, tokens
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

pytestmark = [
    pytest.mark.slow,  # a Llama pipeline on 2 ranks, a few steps (5-8 s)
    # The test's own DCP load into the plain model, in one process.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

M = 2


def _loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _pipeline(model: torch.nn.Module) -> tuple[LocalPipeline, list[torch.optim.Optimizer]]:
    ids = tokens(96, 2, 8)
    pipe = mpmd.trace(model, (), {"input_ids": ids}, split_before=["model.layers.2"])
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=_loss, timeout=30)
    opts = [torch.optim.AdamW(r.parameters(), lr=1e-2) for r in local.runners]
    return local, opts


def _train(local: LocalPipeline, opts: list[torch.optim.Optimizer], seed: int) -> float:
    ids = tokens(96, 4, 8, seed=seed)
    for o in opts:
        o.zero_grad()
    out = local.step(input_ids=ids, target=ids)
    for o in opts:
        o.step()
    return float(out[0].loss)


def _parameters(local: LocalPipeline) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for runner in local.runners:
        merged.update({n: p.detach() for n, p in runner.named_parameters()})
    return merged


@pytest.fixture(params=["no process group", "a process group"])
def world(request, tmp_path_factory):
    """The harness with and without a (one-rank) process group in the
    process: its ranks never take that group for theirs."""
    if request.param == "no process group":
        yield
        return
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_save_holds_every_rank_and_loads_anywhere(world, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = hf_llama(use_cache=False)
    plain = copy.deepcopy(model)
    local, opts = _pipeline(model)
    _train(local, opts, seed=1)
    path = tmp_path / "ckpt" / "step-1"
    extra = {"step": 1}
    local.on_all_ranks(
        lambda r: mpmd.checkpoint.save(
            path, r, opts[r.rank], extra={**extra, "per_rank": {"rank": r.rank}}
        )
    )
    assert mpmd.checkpoint.is_complete(path)

    # The plain model, loaded with DCP's own calls, holds every rank's part.
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(plain, plain_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_state_dict(
        plain, plain_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    saved = _parameters(local)
    assert {n for n, _ in plain.named_parameters()} <= saved.keys() | {"lm_head.weight"}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), saved.get(name, saved.get("lm_head.weight")))
    by_name = dict(plain.named_parameters(remove_duplicate=False))
    for r, opt in enumerate(opts):
        for name, p in local.runners[r].named_parameters():
            mine = opt.state[p]["exp_avg"]
            theirs = plain_opt.state[by_name[name]]["exp_avg"]
            torch.testing.assert_close(theirs, mine, msg=name)

    # A new pipeline loads it; its next step is the first pipeline's.
    torch.manual_seed(5)
    other, other_opts = _pipeline(hf_llama(use_cache=False))
    loaded = other.on_all_ranks(lambda r: mpmd.checkpoint.load(path, r, other_opts[r.rank]))
    assert loaded == [{**extra, "per_rank": {"rank": 0}}, {**extra, "per_rank": {"rank": 1}}]
    assert _train(other, other_opts, seed=2) == _train(local, opts, seed=2)
    for name, p in _parameters(other).items():
        assert torch.equal(p, _parameters(local)[name]), name

    # async_save writes before it returns: its future is done, the
    # checkpoint complete.
    again = tmp_path / "ckpt" / "step-2"
    done = local.on_all_ranks(lambda r: mpmd.checkpoint.async_save(again, r, opts[r.rank]))
    assert all(f.done() and f.exception() is None for f in done)
    assert mpmd.checkpoint.is_complete(again)


def test_save_hf_writes_every_ranks_tensors(world, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    local, opts = _pipeline(hf_llama(use_cache=False))
    _train(local, opts, seed=1)
    out = tmp_path / "hf"
    local.on_all_ranks(lambda r: mpmd.checkpoint.save_hf(out, r))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    trained = _parameters(local)
    for name, p in loaded.named_parameters():
        key = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        assert torch.equal(p.detach(), trained[key]), name
