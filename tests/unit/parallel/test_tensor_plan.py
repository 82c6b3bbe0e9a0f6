"""Tensor-parallel plans in Hugging Face's format: which parameter lies how
over the "tp" mesh dimension, the model's own plan when none is given, and
clear errors for styles torchmpmd does not run."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import torchmpmd as mpmd
from torchmpmd.parallel.tensor import TensorPlan


def _llama(**config: Any) -> nn.Module:
    from models import hf_llama

    return hf_llama(**config)


def test_a_hugging_face_model_brings_its_own_plan():
    model = _llama(tie_word_embeddings=False)
    plan = TensorPlan.for_model(None, model)
    place = {n: plan.placement(n, model) for n, _ in model.named_parameters()}
    assert place["model.layers.1.self_attn.q_proj.weight"] == Shard(0)  # colwise
    assert place["model.layers.1.self_attn.o_proj.weight"] == Shard(1)  # rowwise
    assert place["model.layers.0.mlp.down_proj.weight"] == Shard(1)
    assert place["model.embed_tokens.weight"] == Shard(0)  # embedding_rowwise: vocabulary
    assert place["lm_head.weight"] == Shard(0)  # colwise_gather_output
    assert place["model.layers.0.input_layernorm.weight"] == Replicate()
    assert place["model.norm.weight"] == Replicate()


def test_a_base_model_plan_is_read_under_the_base_models_prefix():
    model = _llama()
    model._tp_plan = None  # as a model whose class sets no plan of its own
    plan = TensorPlan.for_model(None, model)
    assert plan.style_of("model.layers.3.mlp.up_proj") == "colwise"
    assert plan.style_of("layers.3.mlp.up_proj") is None


def test_a_given_plan_wins_and_star_is_one_path_component():
    plan = TensorPlan.for_model({"layers.*.up": "colwise", "layers.*.down": "rowwise"}, None)
    assert plan.placement("layers.12.up.weight", None) == Shard(0)
    assert plan.placement("layers.12.up.bias", None) == Shard(0)
    assert plan.placement("layers.12.down.weight", None) == Shard(1)
    assert plan.placement("layers.12.down.bias", None) == Replicate()
    assert plan.placement("layers.1.2.up.weight", None) == Replicate()  # * is one component
    assert plan.placement("head.weight", None) == Replicate()


def test_a_colwise_embedding_shards_its_features():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    plan = TensorPlan.for_model({"0": "colwise", "1": "colwise"}, model)
    assert plan.placement("0.weight", model) == Shard(1)
    assert plan.placement("1.weight", model) == Shard(0)


@pytest.mark.parametrize(
    ("plan", "error", "message"),
    [
        (
            {"layers.*.up": "local_colwise"},
            ValueError,
            r"'layers.\*.up' has style 'local_colwise', which torchmpmd does not run; use "
            r"one of colwise, colwise_rep",
        ),
        ([("layers.*.up", "colwise")], TypeError, r"tp_plan must map module-path patterns"),
        ({"layers.*.up": 1}, TypeError, r"'layers.\*.up' is 1 \(int\); a style is a name"),
    ],
)
def test_bad_plans_are_named(plan, error, message):
    with pytest.raises(error, match=message):
        TensorPlan.for_model(plan, None)


def test_torchs_parallel_styles_are_plans_too():
    # A torchtitan parallelize.py's plan, as it writes it, for a Llama-like
    # model: the same placements as the names.
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    model = nn.ModuleDict(
        {
            "tok": nn.Embedding(16, 8),
            "norm": nn.LayerNorm(8),
            "wq": nn.Linear(8, 8),
            "wo": nn.Linear(8, 8),
            "attention": nn.Identity(),
            "output": nn.Linear(8, 16),
        }
    )
    objects = TensorPlan.for_model(
        {
            "tok": RowwiseParallel(input_layouts=R(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(R(),)
            ),
            "wq": ColwiseParallel(),
            "wo": RowwiseParallel(output_layouts=Shard(1)),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=R()),
        },
        model,
    )
    names = TensorPlan.for_model(
        {
            "tok": "embedding_rowwise",
            "norm": "sequence_parallel",
            "wq": "colwise",
            "wo": "rowwise",
            "output": "colwise_rep",
        },
        model,
    )
    assert objects.sequence_parallel and names.sequence_parallel
    for name, _ in model.named_parameters():
        assert objects.placement(name, model) == names.placement(name, model), name
    assert objects.style_of("attention") is None  # only a layout hint
    assert objects.style_of("output") == "colwise_rep"


def test_a_model_without_a_plan_says_how_to_give_one():
    with pytest.raises(ValueError, match=r"no tensor-parallel plan was given.*tp_plan="):
        TensorPlan.for_model(None, nn.Linear(2, 2))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_one_rank_tp_mesh_runs_the_stage_on_dtensors_exactly(one_rank_world, attention):
    # On the CPU torch.export lowers SDPA to a kernel DTensor has no sharding
    # strategy for (it knows the CUDA ones): torchmpmd registers one.
    from gpt import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model = _llama(use_cache=False, tie_word_embeddings=False).double()
    model.config._attn_implementation = attention
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 96, (4, 10), generator=torch.Generator().manual_seed(0))
    pipe = mpmd.trace(model, (), {"input_ids": idx[:2]})
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "tp"))

    def loss(out, y):
        return lm_loss(out.logits, y)

    runner = mpmd.PipelineRunner(pipe, mpmd.schedules.GPipe(2), mesh=mesh, loss_fn=loss)
    assert all(isinstance(p, DTensor) for p in runner.parameters())
    out = runner.step(input_ids=idx, target=idx)
    ref = sum(loss(reference(input_ids=x), x) / 2 for x in idx.chunk(2))
    ref.backward()
    torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-12, atol=1e-12)
    for name, p in runner.named_parameters():
        torch.testing.assert_close(
            p.grad.full_tensor(), reference.get_parameter(name).grad, rtol=1e-10, atol=1e-12
        )
