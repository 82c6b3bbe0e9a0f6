"""`mpmd.search_cluster`: the layout, schedule, microbatches and recompute
weighed together on `mpmd.project`'s cost model. Checked against
torchtitan's published Llama 3.1 405B layout on 512 H100 (FSDP 8 x TP 8 x
PP 8, 32 sequences of 8192 per replica, full activation checkpointing, 8
microbatches: 1F1B 100 against Interleaved1F1B 128 tokens/s per GPU;
docs/performance.md of pytorch/torchtitan, December 2024), here with the
80 GB H100's memory."""

from __future__ import annotations

import dataclasses
import re

import pytest

import torchmpmd as mpmd
from torchmpmd.planner import cluster_search

LLAMA_405B = mpmd.TransformerShape.from_config(
    {
        "num_hidden_layers": 126,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    }
)
LLAMA_8B = mpmd.TransformerShape(
    layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=128256
)
# Llama 3.2 1B's sizes (untied head).
LLAMA_1B = mpmd.TransformerShape(
    layers=16, hidden=2048, ffn_hidden=8192, heads=32, kv_heads=8, vocab=128256
)

# test_cluster.py's H100 (40% of 989 TFLOP/s; NVLink 450 GB/s in a node of
# 8, 50 GB/s per GPU between nodes) with the 80 GB part's memory.
H100 = mpmd.Machine(
    flops=0.4 * 989e12,
    memory=80e9,
    devices_per_node=8,
    intra_node_bandwidth=450e9,
    intra_node_latency=5e-6,
    inter_node_bandwidth=50e9,
    inter_node_latency=10e-6,
)


@pytest.fixture(scope="module")
def plan_405b() -> mpmd.ClusterPlan:
    return mpmd.search_cluster(LLAMA_405B, H100, 512, global_batch_size=256, seq_len=8192)


def _project(shape, machine, c: mpmd.ClusterCandidate, seq_len: int) -> mpmd.Projection:
    assert c.schedule is not None
    return mpmd.project(
        shape,
        machine,
        c.schedule,
        pp=c.pp,
        tp=c.tp,
        dp=c.dp,
        microbatch_size=c.microbatch_size,
        seq_len=seq_len,
        stages_per_rank=c.stages_per_rank,
        recompute=c.recompute,
    )


def test_405b_choice_fits_and_beats_torchtitans_published_layout(plan_405b):
    c = plan_405b.choice
    assert c.fits_memory and c.memory_per_device <= H100.memory
    assert c.memory_per_device == c.activation_bytes + c.state_bytes
    published = mpmd.project(
        LLAMA_405B,
        H100,
        mpmd.schedules.Interleaved1F1B(8),
        pp=8,
        tp=8,
        dp=8,
        microbatch_size=4,
        seq_len=8192,
        stages_per_rank=2,
        recompute=True,
    )
    assert c.tokens_per_second_per_device >= published.tokens_per_second_per_device
    # Priced as project prices it: the same step, and the same peak.
    again = _project(LLAMA_405B, H100, c, 8192)
    assert c.step_time == pytest.approx(again.step_time, rel=1e-9)
    assert c.tokens_per_second_per_device == pytest.approx(again.tokens_per_second_per_device)
    assert c.activation_bytes in again.peak_activation_bytes
    assert c.pp * c.tp * c.dp == 512 and 256 % c.dp == 0
    assert c.num_microbatches * c.microbatch_size * c.dp == 256
    assert dict(zip(c.mesh_dim_names, c.mesh_shape, strict=True)) == {
        k: v for k, v in (("dp", c.dp), ("pp", c.pp), ("tp", c.tp)) if v > 1
    }
    # Well under 10 s on 2 CPU cores (about 2 s).
    assert plan_405b.seconds_searching < 10


def test_405b_interleaved_ranks_above_1f1b_near_torchtitans_ratio(plan_405b):
    ranked = [plan_405b.choice, *plan_405b.alternatives]
    on_layout = {
        type(c.schedule).__name__: c
        for c in ranked
        if (c.pp, c.tp, c.dp) == (8, 8, 8) and c.recompute and c.num_microbatches == 8
    }
    looped, one = on_layout["Interleaved1F1B"], on_layout["OneFOneB"]
    assert looped.simulated and one.simulated and looped.fits_memory and one.fits_memory
    assert looped.stages_per_rank == 2 and looped.microbatch_size == 4
    assert ranked.index(looped) < ranked.index(one)
    ratio = looped.tokens_per_second_per_device / one.tokens_per_second_per_device
    assert abs(ratio / 1.28 - 1) <= 0.10, ratio
    # Ranked: the alternatives that fit come fastest first, each slower.
    fitting = [a for a in plan_405b.alternatives if a.fits_memory]
    assert [a.step_time for a in fitting] == sorted(a.step_time for a in fitting)
    assert all(re.fullmatch(r"\d\.\d{3}x slower", a.rejected) for a in fitting)


def test_405b_refusals_say_why(plan_405b):
    by_layout = {(c.pp, c.tp, c.dp): c for c in plan_405b.alternatives if c.schedule is None}
    assert "tp=16 does not divide kv_heads=8" in by_layout[1, 16, 32].rejected
    assert by_layout[128, 1, 4].rejected.startswith("pp=128 > 126 layers")
    assert "does not divide into dp=512" in by_layout[1, 1, 512].rejected
    # Simulated over the memory: the figures; refused unsimulated: a bound.
    over = [c for c in plan_405b.alternatives if c.simulated and not c.fits_memory]
    assert over
    for c in over:
        assert c.memory_per_device > H100.memory
        assert c.rejected == f"does not fit: {_gib(c.memory_per_device)} > 74.5 GiB"
    # Without a pipeline, 405B's state alone is over 80 GB on every layout.
    for c in (c for c in plan_405b.alternatives if c.pp == 1 and c.schedule is not None):
        assert re.fullmatch(r"does not fit: at least [\d.]+ GiB > 74.5 GiB \(bound\)", c.rejected)
        assert c.memory_per_device > H100.memory and not c.simulated
    text = repr(plan_405b)
    assert text.startswith("ClusterPlan: pp=") and "choice" in text and "rejected" in text
    assert "more in .alternatives" in text


def test_pure_fsdp_wins_for_a_small_model_on_one_node():
    plan = mpmd.search_cluster(LLAMA_1B, H100, 8, global_batch_size=256, seq_len=2048)
    c = plan.choice
    assert c.pp == 1 and c.fits_memory and c.memory_per_device <= H100.memory
    assert repr(c.schedule) == f"OneFOneB(num_microbatches={c.num_microbatches})"
    piped = [a for a in plan.alternatives if a.pp > 1 and a.fits_memory]
    assert piped and all(a.step_time > c.step_time for a in piped)
    # The model state counted: 4 + 12 / dp bytes per parameter per tp rank.
    h = LLAMA_1B.hidden
    layer = 2 * h * h + 2 * h * 8 * (h // 32) + 3 * h * LLAMA_1B.ffn_hidden
    params = 16 * layer + 2 * LLAMA_1B.vocab * h
    assert c.state_bytes == round((4 + 12 / c.dp) * params / c.tp)
    assert c.step_time == pytest.approx(_project(LLAMA_1B, H100, c, 2048).step_time, rel=1e-9)


def test_skipping_by_bounds_changes_no_choice(monkeypatch):
    """Every candidate simulated, or every one weighed against its bounds
    first: the same choice, and each one skipped is slower or over memory."""
    machine = dataclasses.replace(H100, memory=16e9)

    def run(cheap: int) -> mpmd.ClusterPlan:
        monkeypatch.setattr(cluster_search, "_CHEAP", cheap)
        return mpmd.search_cluster(LLAMA_8B, machine, 32, global_batch_size=32, seq_len=8192)

    every, bounded = run(10**9), run(0)
    best = every.choice
    assert _key(bounded.choice) == _key(best) and bounded.choice.step_time == best.step_time
    assert best.pp > 1 and bounded.candidates_simulated < every.candidates_simulated / 10
    full = {_key(c): c for c in every.alternatives}
    skipped = [c for c in bounded.alternatives if c.rejected.endswith("(bound)")]
    assert any("slower" in c.rejected for c in skipped)
    assert any(c.rejected.startswith("does not fit") for c in skipped)
    for c in skipped:
        truth = full[_key(c)]
        assert not truth.fits_memory or truth.step_time > best.step_time
        if "slower" in c.rejected and truth.simulated:
            bound = float(c.rejected.split("x")[0].removeprefix("at least "))
            assert truth.step_time / best.step_time >= bound - 5e-3
        elif "does not fit: at least" in c.rejected and truth.simulated:
            assert truth.memory_per_device >= c.memory_per_device


def test_bounds_never_exceed_what_the_simulator_finds():
    """The step and memory bounds the search skips candidates by, against
    the simulation of every candidate (of every built-in schedule, with and
    without recompute) of 8B on 32 devices."""
    roomy = dataclasses.replace(H100, memory=1e15)  # every bound computed in full
    search = cluster_search._Search(LLAMA_8B, roomy, 8192)
    classes = [getattr(mpmd.schedules, name) for name in cluster_search._ORDER]
    checked = 0
    for spec in cluster_search._specs(LLAMA_8B, roomy, 32, 32, classes, [False, True]):
        bounds = search.bounds(spec)
        if isinstance(bounds, str):
            continue
        c = search.simulate(spec, bounds, 32 * 8192 / 32)
        if c.simulated:
            checked += 1
            assert bounds.step <= c.step_time * (1 + 1e-9), spec
            need, _ = search.memory_bound(spec, bounds, c.step_time)
            assert need <= c.memory_per_device * (1 + 1e-9), spec
            assert bounds.memory(float("inf")) <= c.memory_per_device
    assert checked > 300


def test_tp_stays_in_a_node():
    machine = dataclasses.replace(H100, devices_per_node=4)
    plan = mpmd.search_cluster(LLAMA_1B, machine, 16, global_batch_size=64, seq_len=2048)
    refused = {c.tp: c.rejected for c in plan.alternatives if c.schedule is None}
    assert refused[8].startswith("tp=8 > 4 devices per node")
    assert refused[16].startswith("tp=16 does not divide kv_heads=8")
    assert all(c.tp <= 4 for c in plan.alternatives if c.simulated)


def test_nothing_fits_names_the_smallest_memory_and_what_to_change():
    with pytest.raises(ValueError, match=r"smallest memory found is at least [\d.]+ GiB") as err:
        mpmd.search_cluster(LLAMA_405B, H100, 64, global_batch_size=64, seq_len=8192)
    assert "use more devices" in str(err.value)


def test_bad_inputs_are_refused_by_name():
    def search(**kwargs):
        args = dict(shape=LLAMA_1B, machine=H100, num_devices=8)
        args |= dict(global_batch_size=64, seq_len=2048)
        return mpmd.search_cluster(**(args | kwargs))

    with pytest.raises(ValueError, match="num_devices must be a positive int, got 0"):
        search(num_devices=0)
    with pytest.raises(ValueError, match=r"num_devices must be a positive int, got 8\.0"):
        search(num_devices=8.0)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        search(seq_len=-1)
    # Two layers: pp <= 2 and tp <= 8 leave dp >= 4 of 64 devices.
    two = dataclasses.replace(LLAMA_1B, layers=2)
    with pytest.raises(ValueError, match=r"global_batch_size=6 .* pass a multiple of 4"):
        search(shape=two, num_devices=64, global_batch_size=6)
    with pytest.raises(TypeError, match=r"schedules must be a list .*OneFOneB"):
        search(schedules=mpmd.schedules.OneFOneB)
    with pytest.raises(TypeError, match=r"schedules\[0\]"):
        search(schedules=[mpmd.schedules.OneFOneB(8)])
    with pytest.raises(ValueError, match="recompute must be"):
        search(recompute="yes")
    with pytest.raises(TypeError, match=r"shape must be an mpmd\.TransformerShape"):
        search(shape={"num_hidden_layers": 2})


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _key(c: mpmd.ClusterCandidate) -> tuple[object, ...]:
    name = type(c.schedule).__name__ if c.schedule is not None else None
    return (c.pp, c.tp, c.dp, name, c.num_microbatches, c.recompute)
