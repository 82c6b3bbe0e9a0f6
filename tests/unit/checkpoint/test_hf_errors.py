"""`checkpoint.load_hf` / `save_hf` refuse what they cannot do faithfully,
naming the tensor, stage and rank: a directory without safetensors, a tensor
of another shape, one the checkpoint lacks or one the model has no place for
(both allowed and reported with strict=False), a non-empty save target. A
tied embedding saved once is read by the rank holding only the head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import hf_llama, tokens

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

pytestmark = pytest.mark.slow  # each builds a Llama pipeline on 2 ranks (2-7 s)


def _local(model: torch.nn.Module) -> LocalPipeline:
    ids = tokens(96, 2, 8)
    pipe = mpmd.trace(
        model, (), {"input_ids": ids, "use_cache": False}, split_before=["model.layers.2"]
    )
    return LocalPipeline(
        pipe, mpmd.schedules.OneFOneB(2), 2, loss_fn=lambda o, t: o.logits.sum(), timeout=30
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = hf_llama()
    path = tmp_path_factory.mktemp("hf") / "src"
    model.save_pretrained(path)
    return path, load_file(str(path / "model.safetensors"))


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_load_hf_fills_every_rank_and_follows_the_tie(saved):
    path, tensors = saved
    assert "lm_head.weight" not in tensors  # tied: saved once, as the embedding
    local = _local(hf_llama())
    results = local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(path, r))
    assert all(not r.missing_keys and not r.unexpected_keys for r in results)
    for runner in local.runners:
        for name, p in runner.named_parameters():
            key = "model.embed_tokens.weight" if name == "lm_head.weight" else name
            assert torch.equal(p.detach(), tensors[key]), name


def test_a_directory_without_safetensors_is_refused(tmp_path):
    local = _local(hf_llama())
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor"):
        local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(tmp_path, r))


def test_a_tensor_of_another_shape_is_named(saved):
    path, _ = saved
    local = _local(hf_llama(intermediate_size=48))
    with pytest.raises(ValueError, match=r"'model.layers.\d.mlp.\w+_proj.weight' has shape"):
        local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(path, r))


def test_a_missing_tensor_is_named_unless_not_strict(saved, tmp_path):
    _, tensors = saved
    path = _write(
        tmp_path / "lacks", {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    )
    local = _local(hf_llama())
    # Only rank 1 holds it; rank 0 learns it from rank 1 (across processes the
    # ranks agree first: tests/distributed/test_hf_checkpoint.py).
    with pytest.raises(Exception, match=r"'model.norm.weight' \(stage 1\) on rank 1"):
        local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(path, r))
    local = _local(hf_llama())  # the failed call's runners are done
    results = local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(path, r, strict=False))
    assert [r.missing_keys for r in results] == [[], ["model.norm.weight"]]


def test_an_unexpected_tensor_is_named_unless_not_strict(saved, tmp_path):
    _, tensors = saved
    path = _write(tmp_path / "more", {**tensors, "model.extra.weight": torch.zeros(3)})
    local = _local(hf_llama())
    with pytest.raises(KeyError, match=r"model\.extra\.weight"):
        local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(path, r))
    results = local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(path, r, strict=False))
    assert all(r.unexpected_keys == ["model.extra.weight"] for r in results)


def test_keys_without_the_base_model_prefix_load(saved, tmp_path):
    # A checkpoint of the bare LlamaModel ("layers.0...") fills the causal LM,
    # as from_pretrained does; the head then reads the embedding (tied).
    _, tensors = saved
    bare = {k.removeprefix("model."): v for k, v in tensors.items()}
    path = _write(tmp_path / "bare", bare)
    local = _local(hf_llama())
    local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(path, r))
    head = dict(local.runners[1].named_parameters())["lm_head.weight"]
    assert torch.equal(head.detach(), tensors["model.embed_tokens.weight"])


def test_save_hf_refuses_a_directory_that_holds_files(tmp_path):
    local = _local(hf_llama())
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        local.on_all_ranks(lambda r: mpmd.checkpoint.save_hf(tmp_path / "taken", r))
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_values_take_the_dtype_the_model_was_built_in(saved, dtype):
    # As from_pretrained(torch_dtype=...): a float32 checkpoint into a model
    # built in another dtype holds the checkpoint's values converted.
    path, tensors = saved
    local = _local(hf_llama().to(dtype))
    local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(path, r))
    for runner in local.runners:
        for name, p in runner.named_parameters():
            key = "model.embed_tokens.weight" if name == "lm_head.weight" else name
            assert p.dtype == dtype
            assert torch.equal(p.detach(), tensors[key].to(dtype)), name
