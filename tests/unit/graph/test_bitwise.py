"""`pipe(x)` runs, stage after stage in this process, the ATen graph
torch.export recorded from `model(x)`: it equals `model(x)` bitwise, except
where the model's own code takes another path while it is exported. Hugging
Face's Qwen3-Next asks `torch.compiler.is_exporting()` and then solves its
gated delta rule's triangular system by forward substitution instead of
`solve_triangular` (4.5e-8 apart on this tiny config), and BEiT builds an
explicit all-attend mask for SDPA (1.5e-8 apart); run along that path, each
model equals the pipe bitwise again."""

from __future__ import annotations

import unittest.mock

import pytest
import torch
import transformers as T
from models import hf_llama

import torchmpmd as mpmd

pytestmark = pytest.mark.slow  # each traces a Hugging Face model (2-10 s)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out["logits"]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_pipe_equals_the_model_bitwise(attention):
    torch.manual_seed(0)
    model = hf_llama(attention)
    kwargs = {"input_ids": torch.randint(0, 96, (2, 12)), "use_cache": False}
    pipe = mpmd.trace(model, (), kwargs, split_before=["model.layers.2"])
    assert torch.equal(_logits(pipe(**kwargs)), model(**kwargs).logits)


def test_beit_differs_only_by_its_own_export_path():
    # Exported, transformers never skips the bidirectional mask: SDPA gets
    # an all-attend (batch, 1, L, L) mask added to the relative position bias
    # where eager passes the bias alone, and takes another kernel path.
    torch.manual_seed(0)
    config = T.BeitConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        use_relative_position_bias=True,
        drop_path_rate=0.0,  # stochastic depth draws differ from call to call
    )
    config._attn_implementation = "sdpa"
    model = T.BeitModel(config)
    x = torch.randn(2, 3, 16, 16)
    pipe = mpmd.trace(model, (x,), split_before=["layers.1"])
    piped = pipe(x)["last_hidden_state"]
    eager = model(x).last_hidden_state
    assert not torch.equal(piped, eager)
    torch.testing.assert_close(piped, eager, rtol=0, atol=1e-6)
    with unittest.mock.patch("torch.compiler.is_exporting", lambda: True):
        along_export = model(x).last_hidden_state
    assert torch.equal(piped, along_export)


def test_qwen3_next_differs_only_by_its_own_export_path():
    torch.manual_seed(0)
    config = T.Qwen3NextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=64,
    )
    model = T.Qwen3NextForCausalLM(config)
    kwargs = {"input_ids": torch.randint(0, 96, (2, 8)), "use_cache": False}
    pipe = mpmd.trace(model, (), kwargs, split_before=["model.layers.2"])
    piped = _logits(pipe(**kwargs))
    eager = model(**kwargs).logits
    assert not torch.equal(piped, eager)  # solve_triangular against forward substitution
    torch.testing.assert_close(piped, eager, rtol=0, atol=1e-6)
    with unittest.mock.patch("torch.compiler.is_exporting", lambda: True):
        along_export = model(**kwargs).logits
    assert torch.equal(piped, along_export)
