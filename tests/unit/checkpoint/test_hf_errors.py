"""`checkpoint.load_hf` / `save_hf` refuse what they cannot do faithfully,
naming the tensor, stage and rank: a directory without safetensors, a tensor
of another shape, one the checkpoint lacks or one the model has no place for
(both allowed and reported with strict=False), a non-empty save target. A
tied embedding saved once is read by the rank holding only the head. A
damaged file or index is named (not a raw safetensors or JSON error), a
`model.safetensors` path loads as its directory, keys `from_pretrained`
ignores (old checkpoints' `rotary_emb.inv_freq`) load, and a save refuses,
before writing, a path under a file, the working directory, and a config
that is not one or describes another model (warning when there is none)."""

from __future__ import annotations

import json
import os
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


def test_the_model_safetensors_file_loads_as_its_directory(saved, tmp_path):
    path, tensors = saved
    local = _local(hf_llama())
    local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(path / "model.safetensors", r))
    embed = dict(local.runners[0].named_parameters())["model.embed_tokens.weight"]
    assert torch.equal(embed.detach(), tensors["model.embed_tokens.weight"])
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(NotADirectoryError, match=r"notes\.txt is a file, not a checkpoint: pass"):
        local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(tmp_path / "notes.txt", r))


def _sharded(path: Path, tensors: dict[str, torch.Tensor], moved: str | None = None) -> Path:
    """A checkpoint in two shards; `moved` is listed in the first but lies in the second."""
    from safetensors.torch import save_file

    path.mkdir()
    keys = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": keys[:4],
        "model-00002-of-00002.safetensors": keys[4:],
    }
    weight_map = {}
    for name, part in halves.items():
        save_file({k: tensors[k] for k in part}, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    if moved is not None:
        weight_map[moved] = "model-00001-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_a_damaged_file_or_index_is_named(saved, tmp_path):
    source, tensors = saved
    data = (source / "model.safetensors").read_bytes()
    truncated = _write(tmp_path / "truncated", {})
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    bad_header = _write(tmp_path / "header", {})
    (bad_header / "model.safetensors").write_bytes(b"\x10" + bytes(7) + b"{not a header}..")
    not_json = _sharded(tmp_path / "index", tensors)
    (not_json / "model.safetensors.index.json").write_text('{"weight_map": ')
    moved = _sharded(tmp_path / "moved", tensors, moved="model.norm.weight")
    damaged = r"model\.safetensors is not a readable safetensors file .*truncated or damaged"
    cases = [
        (truncated, rf"truncated/{damaged}"),
        (bad_header, rf"header/{damaged}"),
        (not_json, r"the index .*index/model\.safetensors\.index\.json is not valid JSON"),
        (
            moved,
            r"index\.json says model-00001-of-00002\.safetensors holds 'model\.norm\.weight', "
            r"but .*model-00001-of-00002\.safetensors does not: it is in model-00002-of-00002",
        ),
    ]
    local = _local(hf_llama())  # every rank fails alike: the pipeline stays usable
    for path, message in cases:
        with pytest.raises(mpmd.checkpoint.CheckpointError, match=message):
            local.on_all_ranks(lambda r, p=path: mpmd.checkpoint.load_hf(p, r))


def test_keys_from_pretrained_ignores_load_and_are_reported(saved, tmp_path):
    # Older Llama checkpoints hold the RoPE table (per layer, or the model's
    # non-persistent buffer): from_pretrained loads them, and so does load_hf.
    from transformers import LlamaForCausalLM

    source, tensors = saved
    old = ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq"]
    path = _write(tmp_path / "old", {**tensors, **{k: torch.ones(4) for k in old}})
    (path / "config.json").write_text((source / "config.json").read_text())
    LlamaForCausalLM.from_pretrained(path)  # loads
    local = _local(hf_llama())
    results = local.on_all_ranks(lambda r: mpmd.checkpoint.load_hf(path, r))
    assert all(r.ignored_keys == old and not r.unexpected_keys for r in results)
    embed = dict(local.runners[0].named_parameters())["model.embed_tokens.weight"]
    assert torch.equal(embed.detach(), tensors["model.embed_tokens.weight"])


def _tiny_local() -> LocalPipeline:
    """A pipeline of a model that is not a Hugging Face one (no config)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    pipe = mpmd.trace(model, (torch.randn(2, 4),), split_before=["2"])
    return LocalPipeline(pipe, mpmd.schedules.GPipe(2), 2, loss_fn=lambda o, t: o.sum(), timeout=30)


def test_save_hf_refuses_a_path_under_a_file(tmp_path):
    (tmp_path / "weights").write_text("mine")
    local = _tiny_local()
    with pytest.raises(NotADirectoryError, match=r"weights/hf: its parent .*weights is a file"):
        local.on_all_ranks(lambda r: mpmd.checkpoint.save_hf(tmp_path / "weights" / "hf", r))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]  # nothing staged


@pytest.mark.parametrize("where", [".", "CWD"])
def test_save_hf_refuses_the_working_directory(tmp_path, monkeypatch, where):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    target = str(work) if where == "CWD" else where
    local = _tiny_local()
    with pytest.raises(ValueError, match=r"is the working directory or a directory above it"):
        local.on_all_ranks(lambda r: mpmd.checkpoint.save_hf(target, r))
    assert os.path.samefile(os.getcwd(), work) and not any(work.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_save_hf_refuses_a_config_that_is_not_one_and_warns_without_one(tmp_path):
    local = _tiny_local()
    with pytest.raises(TypeError, match=r"config is a str, not a Hugging Face config"):
        local.on_all_ranks(lambda r: mpmd.checkpoint.save_hf(tmp_path / "a", r, config="llama"))
    assert not (tmp_path / "a").exists()
    local = _tiny_local()
    with pytest.warns(UserWarning, match=r"without the config\.json .*Pass config="):
        local.on_all_ranks(lambda r: mpmd.checkpoint.save_hf(tmp_path / "b", r))
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()


def test_save_hf_refuses_the_config_of_another_model(tmp_path):
    from transformers import GPT2Config, LlamaConfig

    own = hf_llama().config
    fewer = LlamaConfig(**{**own.to_dict(), "num_hidden_layers": 2})
    cases = [
        (GPT2Config(n_embd=32, n_layer=2, n_head=4), r"config describes a 'gpt2' model, but the "),
        (
            fewer,
            r"config has num_hidden_layers=2, where the model's own config has num_hidden_layers=4",
        ),
    ]
    local = _local(hf_llama())
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            local.on_all_ranks(lambda r, c=config: mpmd.checkpoint.save_hf(tmp_path / "x", r, c))
        assert not (tmp_path / "x").exists()
    # A model without a config of its own: its tensors' names have no place in a Llama.
    local = _tiny_local()
    with pytest.raises(
        ValueError, match=r"config describes a LlamaModel, which has no place for '0.weight'"
    ):
        local.on_all_ranks(lambda r: mpmd.checkpoint.save_hf(tmp_path / "x", r, own))
    assert not (tmp_path / "x").exists()
