"""Hugging Face checkpoints in and out of a pipeline, on Gloo ranks.

A tiny Llama (tied embeddings) saved with `save_pretrained` is loaded with
`checkpoint.load_hf` into a meta-device pipeline: one step's losses and
gradients equal the `from_pretrained` model's (float32, 1e-5), each rank
reading no more than 1.1 x its own stages' bytes. After an optimizer step,
`save_hf` writes a directory `from_pretrained` loads with bitwise the
runner's parameters. Also from a sharded checkpoint, and from 2 x 2 jobs with FSDP (pp x dp)
and with tensor parallelism (pp x tp), whose ranks read only their shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import check_all, from_bytes, run_ranks, to_bytes, whole_tensor
from models import eager_step, hf_llama, tokens

import torchmpmd as mpmd

pytestmark = pytest.mark.multiprocess

M, MICROBATCH, SEQ, VOCAB = 4, 2, 12, 96


def _loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out["logits"]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(VOCAB, M * MICROBATCH, SEQ, seed=1), tokens(VOCAB, M * MICROBATCH, SEQ, seed=2)


def _meta_runner(src: str, mesh=None, data_parallel=None) -> mpmd.PipelineRunner:
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(src)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = tokens(VOCAB, MICROBATCH, SEQ).to("meta")
    pipe = mpmd.trace(
        model, (), {"input_ids": ids, "use_cache": False}, split_before=["model.layers.2"]
    )
    options = mpmd.RunnerOptions(timeout=60, data_parallel=data_parallel)
    return mpmd.PipelineRunner(
        pipe, mpmd.schedules.ZeroBubbleH1(M), loss_fn=_loss, mesh=mesh, options=options
    )


def _local_bytes(runner: mpmd.PipelineRunner) -> int:
    seen, total = set(), 0
    for module in runner.local_modules():
        for t in module.state_dict(keep_vars=True).values():
            if id(t) not in seen:
                seen.add(id(t))
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size()
    return total


def _pipeline(rank: int, world: int, src: str, out: str | None, dp: int, tp: int = 1) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = None
    if dp > 1:
        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
    elif tp > 1:  # the model's own tp plan (_tp_plan): projections sharded over tp
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("pp", "tp"))
    runner = _meta_runner(src, mesh, "fsdp" if dp > 1 else None)
    loaded = mpmd.checkpoint.load_hf(src, runner)
    x, y = _batch()
    result = runner.step(input_ids=x, use_cache=False, target=y)
    grads = {n: whole_tensor(p.grad) for n, p in runner.named_parameters()}
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-2)
    opt.step()
    after = {n: whole_tensor(p.detach()) for n, p in runner.named_parameters()}
    if out is not None:
        mpmd.checkpoint.save_hf(out, runner)
    return {
        "losses": to_bytes({"losses": result.losses}) if result.losses is not None else None,
        "grads": to_bytes(grads),
        "after": to_bytes(after),
        "bytes_read": loaded.bytes_read,
        "local_bytes": _local_bytes(runner),
        "missing": loaded.missing_keys,
    }


def _reference(src: str) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(src, attn_implementation="eager")
    x, y = _batch()
    losses = eager_step(lambda xb, yb: _loss(ref(input_ids=xb, use_cache=False), yb), x, y, M)
    return ref, losses


def _saved(tmp_path: Path, **kwargs) -> str:
    torch.manual_seed(0)
    model = hf_llama()
    src = tmp_path / "src"
    model.save_pretrained(src, **kwargs)
    return str(src)


def _check(results: list[dict], src: str, out: str | None) -> None:
    ref, losses = _reference(src)
    got = [from_bytes(r["losses"])["losses"] for r in results if r["losses"] is not None]
    assert got, "no rank reported the losses"
    for g in got:
        torch.testing.assert_close(g.to(losses.dtype), losses, rtol=1e-5, atol=1e-5)
    after: dict[str, torch.Tensor] = {}
    for r in results:
        assert r["missing"] == []
        # Each rank read its own stages' tensors (its shards), not the model.
        assert r["bytes_read"] <= 1.1 * r["local_bytes"], r
        for name, g in from_bytes(r["grads"]).items():
            expected = ref.get_parameter(name).grad
            torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-5, msg=name)
        after.update(from_bytes(r["after"]))
    if out is None:
        return
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(out)
    assert type(back).__name__ == "LlamaForCausalLM"
    for name, value in after.items():
        assert torch.equal(back.get_parameter(name).detach(), value), name
    # Tied as the source was: the head is the embedding.
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


def test_load_hf_step_equals_from_pretrained_and_save_hf_round_trips(tmp_path):
    src = _saved(tmp_path)
    out = str(tmp_path / "out")
    results = check_all(run_ranks(_pipeline, 2, src, out, 1))
    _check(results, src, out)
    index = Path(out) / "model.safetensors.index.json"
    # Two writing ranks: two shards and the index, and the config.
    assert json.loads(index.read_text())["weight_map"]
    assert (Path(out) / "config.json").is_file()


def test_load_hf_from_a_sharded_checkpoint(tmp_path):
    src = _saved(tmp_path, max_shard_size="20KB")
    assert (Path(src) / "model.safetensors.index.json").is_file()
    results = check_all(run_ranks(_pipeline, 2, src, None, 1))
    _check(results, src, None)


def test_hf_round_trip_from_a_pp_by_fsdp_job(tmp_path):
    src = _saved(tmp_path)
    out = str(tmp_path / "out")
    results = check_all(run_ranks(_pipeline, 4, src, out, 2))
    _check(results, src, out)


def test_hf_round_trip_from_a_pp_by_tp_job(tmp_path):
    src = _saved(tmp_path)
    out = str(tmp_path / "out")
    results = check_all(run_ranks(_pipeline, 4, src, out, 1, 2))
    _check(results, src, out)


def _load_lacking(rank: int, world: int, src: str) -> str:
    runner = _meta_runner(src)
    try:
        mpmd.checkpoint.load_hf(src, runner)
    except KeyError as err:
        return str(err)
    return "loaded"


def test_a_tensor_one_rank_lacks_fails_every_rank_alike(tmp_path):
    from safetensors.torch import load_file, save_file

    src = Path(_saved(tmp_path))
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.norm.weight"]  # held by the last stage only
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    errors = check_all(run_ranks(_load_lacking, 2, str(src)))
    assert all("'model.norm.weight' (stage 1) on rank 1" in e for e in errors), errors
