"""`mpmd.plan` over the whole mesh under torch.distributed (4 Gloo ranks):
the links are calibrated on the job's group, every layout of 4 devices is
weighed (pp 1, 2, 4; dp replicated or FSDP2; tp from the model's own plan),
every rank gets the same plan, and `mpmd.build` runs what it chose, and
what it ranked lower (`Plan.choose`), exactly as the unpipelined model on
the whole batch: a Hugging Face GPT-NeoX in float64 throughout, loss and
every gradient within 1e-10; and a Qwen3-MoE whose experts go over ep (ep 4,
dp 2 x ep 2 under FSDP, pp 2 x ep 2), the same."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import check_all, run_ranks, whole_tensor

import torchmpmd as mpmd

ROWS, SEQ, VOCAB = 16, 12, 96  # the global batch


def _neox() -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return GPTNeoXForCausalLM(config).double()


def _qwen3_moe() -> torch.nn.Module:
    # Float64 runs Hugging Face's eager experts (grouped_mm has none).
    import transformers as T

    torch.manual_seed(0)
    config = T.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        attn_implementation="eager",
        use_cache=False,
        experts_implementation="eager",
    )
    return T.Qwen3MoeForCausalLM(config).double()


def _loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _reference(model, idx, target, m: int):
    """Loss and gradients of the unpipelined model on the whole batch, as
    `m` microbatches of gradient accumulation (the mean loss)."""
    model.zero_grad(set_to_none=True)
    losses = []
    for xb, yb in zip(idx.chunk(m), target.chunk(m), strict=True):
        loss = _loss(model(xb), yb)
        (loss / m).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return torch.stack(losses), grads


def _tp_plan(model) -> dict | None:
    """GPT-NeoX's own tp plan as the user would write it (None: the MoE)."""
    own = getattr(model.config, "base_model_tp_plan", None)
    if not own or not hasattr(model, "gpt_neox"):
        return None
    return {f"gpt_neox.{k}": v for k, v in own.items()}


def _step_and_compare(plan: mpmd.Plan, reference, idx, target, rank: int) -> str:
    layout = plan.mesh_layout
    # This rank's replica (of dp x ep; the same on every pipeline rank).
    dp_rank = (rank // layout.tp) % layout.replicas
    rows = ROWS // layout.replicas
    shard = slice(dp_rank * rows, (dp_rank + 1) * rows)
    model = copy.deepcopy(reference)
    runner = mpmd.build(
        plan,
        model,
        idx[shard],
        loss_fn=_loss,
        # The tp plan given for every layout, as a user passes it once
        # (build leaves it out where the layout has no tp).
        options=mpmd.RunnerOptions(timeout=60, tp_plan=_tp_plan(reference)),
    )
    out = runner.step(idx[shard], target=target[shard])
    m = plan.num_microbatches
    ref_losses, ref_grads = _reference(reference, idx, target, m * layout.replicas)
    # The step's loss: the mean over every replica's microbatches.
    ref_loss = ref_losses.mean()
    what = f"{layout} {plan.schedule!r} rank {rank}"
    if out.loss is not None:  # the last stage's ranks hold the loss
        loss = out.loss.detach()
        assert abs(loss.item() - ref_loss.item()) < 1e-10, (what, loss, ref_loss)
    held = dict(runner.named_parameters())
    assert held, what
    for name, p in held.items():
        grad = whole_tensor(p.grad)
        assert torch.allclose(grad, ref_grads[name], atol=1e-10, rtol=0), (what, name)
    return str(layout)


def plan_and_build(rank: int, world: int) -> dict:
    reference = _neox()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    idx, target = tokens[:, :-1], tokens[:, 1:]
    seeded = torch.random.get_rng_state()
    found = mpmd.plan(
        reference,
        (idx[:2],),
        world,
        batch_size=ROWS,
        loss_fn=_loss,
        example_target=target[:2],
        repeats=2,
        schedules=[mpmd.schedules.OneFOneB],
    )
    # Planning steps the model on the job; the user's random state is as it was.
    assert torch.equal(torch.random.get_rng_state(), seeded), f"rank {rank}: the RNG moved"
    ran = [c for c in found.alternatives if c.schedule is not None]
    layouts = {str(found.mesh_layout)} | {str(c.layout) for c in ran}
    # The plan's own choice, and the best of a few other layouts it ranked.
    built = [_step_and_compare(found, reference, idx, target, rank)]
    wanted = ("dp 4 (fsdp)", "pp 2 x dp 2 (replicate)", "pp 2 x tp 2", "dp 2 x tp 2 (fsdp)")
    for want in [w for w in wanted if w != str(found.mesh_layout)][:3]:
        best = next(c for c in ran if str(c.layout) == want)
        built.append(_step_and_compare(found.choose(best), reference, idx, target, rank))
    # mpmd.refine measures the close rivals of every layout on the job (each
    # replica its share of the global batch) and keeps the fastest measured.
    refined = mpmd.refine(
        found,
        copy.deepcopy(reference),
        idx,
        target=target,
        loss_fn=_loss,
        rounds=1,
        warmup=0,
        slack=1.5,
    )
    measured = [c for c in refined.alternatives if c.measured_step_time is not None]
    built.append(_step_and_compare(refined, reference, idx, target, rank))
    # Experts: expert parallelism weighed (ep 2, ep 4) and built.
    moe = _qwen3_moe()
    experts = mpmd.plan(
        moe,
        (idx[:2],),
        world,
        batch_size=ROWS,
        loss_fn=_loss,
        example_target=target[:2],
        repeats=1,
        schedules=[mpmd.schedules.OneFOneB],
        layouts=[{"ep": 4}, {"dp": 2, "ep": 2, "data_parallel": "fsdp"}, {"pp": 2, "ep": 2}],
    )
    seen = {str(experts.mesh_layout)}
    built.append(_step_and_compare(experts, moe, idx, target, rank))
    for c in experts.alternatives:  # the best of each other layout
        if c.schedule is not None and str(c.layout) not in seen:
            seen.add(str(c.layout))
            built.append(_step_and_compare(experts.choose(c), moe, idx, target, rank))
    return {
        "refined": repr(refined),
        "refined layouts": sorted({str(c.layout) for c in measured} | {str(refined.mesh_layout)}),
        "plan": repr(found),
        "moe": repr(experts),
        "layouts": sorted(layouts),
        "notes": found.notes,
        "built": built,
        "seconds": found.seconds_planning,
    }


@pytest.mark.slow
def test_the_plan_weighs_every_layout_and_what_it_builds_trains_like_the_model():
    results = check_all(run_ranks(plan_and_build, 4, deadline=400))
    first = results[0]
    assert all(r["plan"] == first["plan"] for r in results), [r["plan"] for r in results]
    # Everything weighed: no note says a layout was left out (others may
    # name a close rival, or the measured slowdown of 4 ranks on 2 cores).
    assert not any("not weighed" in n for n in first["notes"]), first["notes"]
    # Pure SPMD (pp 1) weighed beside the pipelines, FSDP beside replicas,
    # tp from GPT-NeoX's own plan.
    for want in ("dp 4 (replicate)", "dp 4 (fsdp)", "pp 2 x dp 2 (fsdp)", "pp 4", "tp 4"):
        assert want in first["layouts"], (want, first["layouts"])
    # tp priced from runs on the job, each tp size weighed, beside a run without tp.
    for tp in (2, 4):
        assert any(n.startswith(f"tp {tp} measured on the job") for n in first["notes"]), first[
            "notes"
        ]
    # CPU ranks of one host: the fastest candidates with and without a
    # pipeline were stepped on the job and set their kinds' levels.
    levels = [n for n in first["notes"] if n.startswith("levels measured on the job")]
    assert len(levels) == 1 and "without a pipeline is predicted" in levels[0], first["notes"]
    built = first["built"]
    assert len(built) == 4 + 1 + 3, built
    # The plan's choice and three other layouts, among them FSDP and tp.
    assert len(set(built[:4])) == 4, built
    assert any("tp" in b for b in built[:4]) and any("fsdp" in b for b in built[:4]), built
    assert set(built[5:]) == {"ep 4 (replicate)", "dp 2 x ep 2 (fsdp)", "pp 2 x ep 2 (replicate)"}
    # refine measured rivals of more than one layout; every rank took rank 0's medians.
    assert all(r["refined"] == first["refined"] for r in results)
    assert len(first["refined layouts"]) >= 2, first["refined"]
    assert first["seconds"] < 60, first["seconds"]
