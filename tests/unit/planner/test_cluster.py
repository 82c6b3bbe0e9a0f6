"""Projection at cluster scale (`mpmd.project`): the FLOPs it charges a layer
are those torch counts on a Hugging Face Llama, and the schedules it ranks
rank as a published figure nobody here made ranks them: torchtitan's Llama
3.1 405B on 512 H100 (FSDP 8 x TP 8 x PP 8, local batch 32, sequence 8192,
full activation checkpointing, default 8 microbatches and 2 stages per rank
for the looped schedule), 1F1B 100 against Interleaved1F1B 128 tokens/s per
GPU (docs/performance.md of pytorch/torchtitan, December 2024)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import torchmpmd as mpmd

LLAMA_405B = {
    "num_hidden_layers": 126,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}

# H100 SXM (Grand Teton): 989 TFLOP/s dense bf16, of which a large matmul
# sustains about 40%; NVLink 450 GB/s per direction inside a node of 8, RDMA
# 400 Gb/s (50 GB/s) per GPU between nodes.
H100 = mpmd.Machine(
    flops=0.4 * 989e12,
    memory=96 * 2**30,
    devices_per_node=8,
    intra_node_bandwidth=450e9,
    intra_node_latency=5e-6,
    inter_node_bandwidth=50e9,
    inter_node_latency=10e-6,
)


def _project(schedule: mpmd.Schedule, stages_per_rank: int) -> mpmd.Projection:
    return mpmd.project(
        mpmd.TransformerShape.from_config(LLAMA_405B),
        H100,
        schedule,
        pp=8,
        tp=8,
        dp=8,
        microbatch_size=4,
        seq_len=8192,
        stages_per_rank=stages_per_rank,
        recompute=True,
    )


def test_405b_interleaved_over_1f1b_within_10_percent_of_torchtitans_figure():
    one = _project(mpmd.schedules.OneFOneB(8), 1)
    looped = _project(mpmd.schedules.Interleaved1F1B(8), 2)
    ratio = looped.tokens_per_second_per_device / one.tokens_per_second_per_device
    assert abs(ratio / 1.28 - 1) <= 0.10, ratio
    assert len(one.split_before) == 7 and len(looped.split_before) == 15
    # The layers are spread evenly: 126 over 16 stages is 8 or 7 each.
    starts = [0, *(int(s.split(".")[1]) for s in looped.split_before), 126]
    assert {b - a for a, b in itertools.pairwise(starts)} == {7, 8}
    # Per device, each of the 8 data-parallel replicas' tokens over 512 GPUs.
    tokens = 8 * 4 * 8192 * 8
    assert one.tokens_per_second_per_device == pytest.approx(tokens / one.step_time / 512)


def test_a_layers_flops_are_what_torch_counts_on_a_hugging_face_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config)
    batch, seq = 2, 24
    ids = torch.randint(0, 96, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(ids)
    counts = counter.get_flop_counts()
    layer = sum(counts["LlamaForCausalLM.model.layers.0"].values())
    head = sum(counts["LlamaForCausalLM.lm_head"].values())
    # Eager attention multiplies the whole score matrix (masked, not skipped).
    shape = mpmd.TransformerShape.from_config(config)
    noncausal = dataclasses.replace(shape, causal=False)
    assert noncausal.layer_flops(batch * seq, seq) == layer
    assert shape.head_flops(batch * seq) == head
    assert shape.layer_flops(batch * seq, seq) < layer  # causal: half the scores


def test_bad_descriptions_are_refused_by_name():
    with pytest.raises(ValueError, match=r"Machine\.flops"):
        mpmd.Machine(
            flops=0,
            memory=1,
            devices_per_node=8,
            intra_node_bandwidth=1,
            intra_node_latency=0,
            inter_node_bandwidth=1,
            inter_node_latency=0,
        )
    with pytest.raises(ValueError, match="intermediate_size"):
        mpmd.TransformerShape.from_config({"num_hidden_layers": 2, "hidden_size": 8})
    shape = mpmd.TransformerShape.from_config(LLAMA_405B)
    with pytest.raises(ValueError, match="pp must be a positive int"):
        mpmd.project(shape, H100, mpmd.schedules.OneFOneB(8), pp=0, microbatch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="256 stages for 126 layers"):
        mpmd.project(
            shape,
            H100,
            mpmd.schedules.OneFOneB(8),
            pp=128,
            stages_per_rank=2,
            microbatch_size=1,
            seq_len=8,
        )
