"""Hugging Face models are cut only where they allow: `mpmd.trace(...,
num_stages=N)` and `mpmd.balance` keep every class the model lists in
`_no_split_modules` (its decoder layers) whole on one stage, even when more
stages are asked than the model has layers, and `print(pipe)` says which
layers each stage got."""

from __future__ import annotations

import re

import pytest
import torch
from models import hf_llama, tokens

import torchmpmd as mpmd
from torchmpmd.graph.pipe import module_runs
from torchmpmd.planner import profile

KWARGS = {"input_ids": tokens(96, 2, 8), "use_cache": False}


def _layer_of(name: str) -> str | None:
    match = re.match(r"(model\.layers\.\d+)\.", name)
    return match.group(1) if match else None


@pytest.mark.slow
@pytest.mark.parametrize("num_stages", [2, 3, 5])
def test_trace_num_stages_never_cuts_inside_a_decoder_layer(num_stages):
    torch.manual_seed(0)
    model = hf_llama(num_hidden_layers=6)
    pipe = mpmd.trace(model, (), KWARGS, num_stages=num_stages)
    holder: dict[str, set[int]] = {}
    for s in range(pipe.num_stages):
        for name, _ in pipe.stage(s).named_parameters():
            layer = _layer_of(name)
            if layer is not None:
                holder.setdefault(layer, set()).add(s)
    assert len(holder) == 6
    assert all(len(stages) == 1 for stages in holder.values()), holder
    # The table names each stage's layers.
    table = repr(pipe)
    assert "modules" in table
    for s in range(pipe.num_stages):
        mine = sorted(int(k.rsplit(".", 1)[1]) for k, v in holder.items() if s in v)
        if len(mine) > 1:
            assert f"model.layers.{mine[0]}-{mine[-1]}" in table, table


@pytest.mark.slow
def test_more_stages_than_the_model_allows_is_refused_not_cut_inside_layers():
    model = hf_llama(num_hidden_layers=2)
    # 2 layers with the embedding, rotary table, norm and head: fewer places
    # than stages asked. A plain model would open its largest unit; the
    # decoder layers stay whole (LlamaDecoderLayer in _no_split_modules).
    units = profile(model, (), KWARGS, min_units=9, repeats=1).units
    assert "model.layers.0" in units and "model.layers.1" in units
    assert not any(u.startswith("model.layers.0.") for u in units), units
    with pytest.raises(ValueError, match=r"num_stages=9 but the model has \d unit"):
        mpmd.trace(model, (), KWARGS, num_stages=9)


def test_module_runs_names_a_stack_of_layers_as_a_run():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.2.mlp.up_proj.weight",
        "model.layers.4.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert module_runs(names) == (
        "model.embed_tokens, model.layers.0-2, model.layers.4, model.norm, lm_head"
    )
