"""Expert parallelism inside pipeline stages, on 4 Gloo processes: a
(pp 2, ep 2) mesh, each rank holding half of every MoE layer's experts and
its own part of the batch, the routed tokens dispatched to the experts'
ranks by all-to-all and combined back. The loss, every gradient (gathered to
the whole tensors), the clip norm and the parameters after AdamW equal the
unpipelined model's on the whole global batch: a model written the way
torchtitan's MoE is (its for-loop experts, `histc`, `argsort`, a shared
expert, a dense first layer, DeepSeek's expert bias and balance loss) and
Hugging Face's Qwen3-MoE with its own ep plan (float64, its eager experts),
under 1F1B and ZB-H1 (float32: its grouped_mm experts; DeepSeek-V3). The
all-to-all bytes the runner counts are those of the routed tokens; each
rank holds half the experts. Also: FSDP over the other parameters (and the
experts over dp), full recomputation, stages cut by hand, tensor
parallelism beside (8 ranks), meta-device models with DCP and Hugging Face
checkpoints, a stalled peer, and what is refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from harness import check_all, run_ranks, whole_tensor

import torchmpmd as mpmd

PP, EP = 2, 2
M = 4  # microbatches per ep rank
MICROBATCH, SEQ, VOCAB = 2, 8, 64


def _titan(bias: torch.Tensor | None = None) -> torch.nn.Module:
    """The torchtitan-style MoE, its expert bias `bias` (default: small
    random values, so that the bias takes part in the routing)."""
    from titan_moe import MoEArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(MoEArgs(vocab_size=VOCAB)).double()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                generator = torch.Generator().manual_seed(3)
                b.copy_(
                    bias if bias is not None else torch.randn(b.shape, generator=generator) * 0.05
                )
    return model


def _qwen3_moe(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    # float64 runs Hugging Face's eager experts (grouped_mm has no float64
    # kernel); float32 its default grouped_mm ones.
    eager = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    config = T.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        attn_implementation="eager",
        use_cache=False,
        **eager,
    )
    return T.Qwen3MoeForCausalLM(config).to(dtype)


def _deepseek_v3() -> torch.nn.Module:
    """Shared experts, a dense first layer, the router's expert bias
    (`e_score_correction_bias`), multi-head latent attention."""
    import transformers as T

    torch.manual_seed(0)
    config = T.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        attn_implementation="eager",
        use_cache=False,
    )
    model = T.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    return model


def _expert_parallel():
    from titan_moe import ExpertParallel

    return ExpertParallel()


def _titan_loss(out, target):
    from titan_moe import moe_loss

    return moe_loss(out, target)


def _hf_loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


@dataclass(frozen=True)
class Case:
    build: Callable[[], torch.nn.Module]
    loss: Callable[..., torch.Tensor]
    split: list[str]
    # Where the unpipelined model shows the experts each token chose: the
    # module (path suffix) and which of its outputs (a router's), or, with
    # `experts_input`, its call's argument (Hugging Face's experts module).
    chosen_at: str
    index: int
    hidden: int
    tol: float = 1e-10  # loss, gradients, norm; parameters after AdamW: 10x
    experts_input: bool = False
    by_hand: bool = False  # stages cut by hand, the user's parallelize sharding the experts
    plan: bool = False  # a torchtitan user's ep_plan, its ExpertParallel() style


MODELS = {
    "titan": Case(_titan, _titan_loss, ["layers.2"], ".moe.router", 1, 16),
    "titan_by_hand": Case(_titan, _titan_loss, ["layers.2"], ".moe.router", 1, 16, by_hand=True),
    "titan_4_stages": Case(
        _titan, _titan_loss, ["layers.1", "layers.2", "layers.3"], ".moe.router", 1, 16
    ),
    "titan_4_stages_planned": Case(
        _titan,
        _titan_loss,
        ["layers.1", "layers.2", "layers.3"],
        ".moe.router",
        1,
        16,
        plan=True,
    ),
    "qwen3_moe": Case(
        _qwen3_moe, _hf_loss, ["model.layers.2"], ".mlp.experts", 1, 32, experts_input=True
    ),
    "qwen3_moe_f32": Case(
        lambda: _qwen3_moe(torch.float32),
        _hf_loss,
        ["model.layers.2"],
        ".mlp.experts",
        1,
        32,
        tol=1e-5,
        experts_input=True,
    ),
    "deepseek_v3_f32": Case(
        _deepseek_v3,
        _hf_loss,
        ["model.layers.1", "model.layers.2", "model.layers.3"],
        ".mlp.experts",
        1,
        32,
        1e-5,
        True,
    ),
}


def _record_routing(model, case: Case) -> dict[str, list[torch.Tensor]]:
    """Hooks on the unpipelined model: per MoE layer, the experts each token
    chose, microbatch after microbatch."""
    seen: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if name.endswith(case.chosen_at):
            layer = name[: -len(case.chosen_at)]
            seen[layer] = []
            if case.experts_input:
                module.register_forward_pre_hook(
                    lambda _m, args, layer=layer: seen[layer].append(args[case.index].clone())
                )
            else:
                module.register_forward_hook(
                    lambda _m, _i, out, layer=layer: seen[layer].append(
                        out[case.index].detach().clone()
                    )
                )
    return seen


def _check_traffic(
    runner,
    out,
    routing,
    shard: int,
    row_bytes: int,
    what: str,
    passes: int = 2,
    tp: tuple[int, int] = (0, 1),
) -> None:
    """The all-to-all bytes and tokens per expert the runner measured, from
    the unpipelined model's own routing of the same tokens: per MoE layer on
    this rank, the (token, expert) rows this rank sends the other ep rank and
    those it gets from it, each way forward (dispatch, combine) and backward."""
    experts_modules = [p for p in out.metrics["tokens_per_expert"]]
    assert experts_modules, what
    # The data-parallel ranks are (dp, ep) flattened: my ep group's shards.
    ep_rank, first = shard % EP, shard - shard % EP
    rows = 0
    for path in experts_modules:
        layer = next(k for k in routing if path.startswith(k + "."))
        chosen = routing[layer]  # every microbatch of every shard, in order
        shards = [torch.cat(chosen[(first + r) * M : (first + r + 1) * M]) for r in range(EP)]
        experts = out.metrics["tokens_per_expert"][path].numel()
        # Beside tensor parallelism each tp rank sends its slice of each
        # microbatch's tokens (DTensor's Shard(0) chunks).
        tp_rank, tp_size = tp
        mine = [
            torch.cat(
                [c.chunk(tp_size)[tp_rank] for c in chosen[(first + r) * M : (first + r + 1) * M]]
            )
            for r in range(EP)
        ]
        owner = [c.reshape(-1) // (experts // EP) for c in mine]
        rows += int((owner[ep_rank] != ep_rank).sum())  # mine, to the other rank
        rows += sum(int((owner[r] == ep_rank).sum()) for r in range(EP) if r != ep_rank)
        expected = torch.bincount(torch.cat(shards).reshape(-1), minlength=experts)
        assert torch.equal(out.metrics["tokens_per_expert"][path], expected), (what, path)
    expected_bytes = passes * rows * row_bytes  # forward (and R), backward
    assert out.metrics["all_to_all_sent_bytes"] == expected_bytes, (what, out.metrics)
    assert out.metrics["all_to_all_received_bytes"] == expected_bytes, (what, out.metrics)
    _check_timeline(runner, experts_modules, what, recomputed=passes == 3)


def _check_timeline(
    runner, experts_modules: list[str], what: str, recomputed: bool = False
) -> None:
    """The timeline shows each experts module's dispatch and combine, forward
    and backward, of every microbatch, inside the task that ran them."""
    tl = runner.timeline
    tasks = tl.tasks
    for kind in ("dispatch", "combine"):
        events = [e for e in tl.events if e.kind == kind]
        for path in experts_modules:
            for direction in ("", " backward"):
                label = f"ep {kind}{direction} {path}"
                mine = [e for e in events if e.label == label]
                times = 2 if recomputed and not direction else 1  # F, then R
                expected = sorted(list(range(M)) * times)
                assert sorted(e.microbatch for e in mine) == expected, (what, label, mine)
                for e in mine:
                    around = [
                        t
                        for t in tasks
                        if t.start <= e.start
                        and e.end <= t.end
                        and (e.stage, e.microbatch)
                        in {(p.stage, p.microbatch) for p in t.task.parts}
                    ]
                    assert around, (what, e)
                    # A backward: B, or I (a first stage split through
                    # autograd has no input gradient: its whole backward is W).
                    # A fused task (DualPipeV's F&B): the part of its
                    # (stage, microbatch).
                    kinds = ("F", "R") if not direction else ("B", "I", "W")
                    parts = [
                        p.kind
                        for p in around[0].task.parts
                        if (p.stage, p.microbatch) == (e.stage, e.microbatch)
                    ]
                    assert set(parts) & set(kinds), (what, e, around[0])


def _expert_tensors(runner) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: p
        for n, p in runner.named_parameters()
        if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
    }


# Meshes of 4 ranks: (shape, names).
MESHES = {
    "pp_ep": ((PP, EP), ("pp", "ep")),
    # One pipeline rank holding both stages, replicas over dp of ep groups.
    "dp_ep": ((1, 2, EP), ("pp", "dp", "ep")),
    # 8 ranks: tensor parallelism for the attention inside each ep rank.
    "ep_tp": ((PP, EP, 2), ("pp", "ep", "tp")),
}

# The torchtitan-style model's attention and dense MLPs over tp (Megatron's
# column- and row-parallel pairs); the experts stay whole over tp.
TITAN_TP_PLAN = {
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.moe.shared_experts.w1": "colwise",
    "layers.*.moe.shared_experts.w3": "colwise",
    "layers.*.moe.shared_experts.w2": "rowwise",
}

# Qwen3-MoE's attention over tp (its own plan also styles the experts, with
# styles torchmpmd does not run: its experts go over ep instead).
QWEN_TP_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
}


def train_ep(
    rank: int, world: int, combos: list[tuple[str, str, str | None]], layout: str = "pp_ep"
) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    shape, names = MESHES[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    replicas = world // shape[0] // (shape[names.index("tp")] if "tp" in names else 1)
    done = []
    for k, (model_name, schedule_name, data_parallel) in enumerate(combos):
        case = MODELS[model_name]
        loss_fn, tol = case.loss, case.tol
        if "tp" in names and case.experts_input:
            # Hugging Face's RMSNorm computes in float32 even in a float64
            # model: sums a tp shard adds in another order round there (as
            # test_tensor_parallel's Llama, ~1e-7).
            tol = max(tol, 1e-6)
        model, reference = case.build(), case.build()
        dtype = next(model.parameters()).dtype
        routing = _record_routing(reference, case)
        x0 = torch.randint(0, VOCAB, (MICROBATCH, SEQ))
        if case.by_hand:
            from titan_moe import FirstHalf, SecondHalf, experts_over_ep

            pipe = mpmd.from_stages([FirstHalf(model), SecondHalf(model)], (x0,), model=model)
        else:
            pipe = mpmd.trace(model, (x0,), split_before=case.split)
        runner = mpmd.PipelineRunner(
            pipe,
            getattr(mpmd.schedules, schedule_name)(M),
            mesh=mesh,
            loss_fn=loss_fn,
            options=mpmd.RunnerOptions(
                timeout=60,
                data_parallel=data_parallel if data_parallel != "recompute" else None,
                recompute=data_parallel == "recompute",
                parallelize=experts_over_ep if case.by_hand else None,
                tp_plan=(QWEN_TP_PLAN if case.experts_input else TITAN_TP_PLAN)
                if "tp" in names
                else None,
                ep_plan={"layers.*.moe.experts": _expert_parallel()} if case.plan else None,
            ),
        )
        assert runner.dp_size == replicas, runner.dp_size
        shard_rank = dist.get_rank(runner.dp_group)
        opt = torch.optim.AdamW(runner.parameters(), lr=1e-2, weight_decay=0.01)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
        local = dict(runner.named_parameters())
        experts = _expert_tensors(runner)
        assert experts, "no expert parameter is sharded over ep"
        if "tp" in names:  # the attention's projections are sharded over tp
            over_tp = [
                n
                for n, p in local.items()
                if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
            ]
            assert any(n.endswith(("attention.wq.weight", "q_proj.weight")) for n in over_tp), (
                over_tp
            )
            assert not any(".experts." in n for n in over_tp), over_tp
        # Each rank holds experts / ep of every layer's (under FSDP, / dp of that).
        share = replicas if data_parallel == "fsdp" else EP
        for fqn, p in experts.items():
            whole = reference.get_parameter(fqn)
            assert p.to_local().shape[0] * share == whole.shape[0], (fqn, p.to_local().shape)
        generator = torch.Generator().manual_seed(11)
        # Two steps (AdamW's state carried over) for the first combination of
        # a launch, one for the others (CI time).
        for step in range(2 if k == 0 else 1):
            n = MICROBATCH * M * replicas
            x = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
            y = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
            ref_opt.zero_grad(set_to_none=True)
            for chosen in routing.values():
                chosen.clear()
            losses = []
            for xb, yb in zip(x.chunk(M * replicas), y.chunk(M * replicas), strict=True):
                loss = loss_fn(reference(xb), yb)
                (loss / (M * replicas)).backward()
                losses.append(loss.detach())
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()

            opt.zero_grad(set_to_none=True)
            part = slice(shard_rank * MICROBATCH * M, (shard_rank + 1) * MICROBATCH * M)
            out = runner.step(x[part], target=y[part])
            what = f"{layout} {model_name} {schedule_name} step {step} rank {rank}"
            row_bytes = case.hidden * dtype.itemsize
            passes = 3 if data_parallel == "recompute" else 2  # R sends them again
            # Hugging Face's experts take tokens of their own: sliced over tp.
            sliced = "tp" in names and case.experts_input
            tp = (mesh.get_local_rank("tp"), mesh["tp"].size()) if sliced else (0, 1)
            _check_traffic(runner, out, routing, shard_rank, row_bytes, what, passes, tp)
            torch.testing.assert_close(
                out.loss.double(),
                torch.stack(losses).double().mean(),
                rtol=tol,
                atol=tol,
                msg=lambda m, what=what: f"{what}: loss {m}",
            )
            norm = runner.clip_grad_norm_(1.0)
            torch.testing.assert_close(
                norm.double(),
                ref_norm.double(),
                rtol=tol,
                atol=tol,
                msg=lambda m, what=what: f"{what}: {m}",
            )
            for fqn, p in local.items():
                expected = reference.get_parameter(fqn).grad
                got = whole_tensor(p.grad) if p.grad is not None else None
                if expected is None:
                    assert got is None or not got.any(), (what, fqn)
                    continue
                assert got is not None, (what, fqn)
                torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=f"{what}: {fqn}")
            opt.step()
            for fqn, p in local.items():
                torch.testing.assert_close(
                    whole_tensor(p.detach()),
                    reference.get_parameter(fqn).detach(),
                    rtol=10 * tol,
                    atol=10 * tol,
                    msg=f"{what}: {fqn} after AdamW",
                )
        if data_parallel == "fsdp":
            # FSDP2 over every data-parallel rank holds 1 / replicas of every
            # other parameter; the experts 1 / ep, and 1 / dp of that.
            dense = [p for n, p in local.items() if n not in experts]
            held = sum(p.to_local().numel() for p in dense if hasattr(p, "to_local"))
            whole = sum(p.numel() for p in dense)
            assert held <= 1.1 * whole / replicas, (held, whole)
            held = sum(p.to_local().numel() for p in experts.values())
            whole = sum(p.numel() for p in experts.values())
            assert held <= 1.1 * whole / replicas, (held, whole)
        done.append(f"{model_name} {schedule_name}")
    return done


@pytest.mark.slow
def test_pipeline_times_expert_parallel_trains_like_the_unpipelined_model():
    combos = [
        ("titan", "OneFOneB", None),
        ("titan", "ZeroBubbleH1", "fsdp"),  # FSDP2 over ep for the other parameters
        ("titan_4_stages", "Interleaved1F1B", "fsdp"),
        # DualPipeV's fused F&B tasks run their parts' all-to-alls in order.
        ("titan_4_stages_planned", "DualPipeV", None),
        ("titan", "GPipe", None),
        # Stages cut by hand: the user's parallelize shards the experts
        # (shard_experts); split backward through autograd.
        ("titan_by_hand", "ZeroBubbleH1", None),
        # Full recomputation: the all-to-alls run again in R (the torchtitan
        # model's tokens_per_expert buffer would count twice: refused there).
        ("qwen3_moe", "OneFOneB", "recompute"),
        ("qwen3_moe_f32", "OneFOneB", None),
        ("qwen3_moe_f32", "ZeroBubbleH1", None),
        ("deepseek_v3_f32", "Interleaved1F1B", None),
    ]
    reports = check_all(run_ranks(train_ep, PP * EP, combos))
    assert all(len(r) == len(combos) for r in reports)


@pytest.mark.slow
def test_pipeline_times_expert_times_tensor_parallel():
    # (pp 2, ep 2, tp 2), 8 ranks: the attention (the torchtitan-style
    # model's dense first layer and shared expert too) over tp, the routed
    # experts over ep: Qwen3-MoE's experts take each token on its own, so
    # each tp rank dispatches its slice of them; torchtitan's take rows
    # sorted by expert, so each runs all.
    combos = [("titan", "OneFOneB", None), ("qwen3_moe", "ZeroBubbleH1", None)]
    reports = check_all(run_ranks(train_ep, 8, combos, "ep_tp", deadline=300))
    assert all(len(r) == len(combos) for r in reports)


@pytest.mark.slow
def test_expert_parallel_replicas_over_dp_train_like_the_unpipelined_model():
    # (pp 1, dp 2, ep 2): the experts are replicated over dp (their
    # gradients averaged there, divided by ep), the rest over dp and ep.
    combos = [("titan", "Interleaved1F1B", None), ("titan", "ZBV", "fsdp")]
    reports = check_all(run_ranks(train_ep, 4, combos, "dp_ep"))
    assert all(len(r) == len(combos) for r in reports)


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    n = MICROBATCH * M * EP
    x = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    return x, torch.randint(0, VOCAB, (n, SEQ), generator=generator)


def checkpoint_run(
    rank: int,
    world: int,
    ep: int,
    meta: bool,
    load_from: str | None,
    save_to: str | None,
    steps: range,
) -> dict:
    """The torchtitan-style MoE on (pp 2, ep `ep`) (ep 1: a pp 2 group, no
    mesh), built on the meta device and initialised by the runner if
    `meta`; loads `load_from` first, trains `steps`, saving to `save_to`
    after the first. Returns the losses, the whole state after the first
    step and the expert elements this rank holds."""
    import torch.distributed as dist
    from harness import to_bytes
    from titan_moe import MoEArgs, Transformer, moe_loss
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(rank)  # every rank its own init: the runner makes them agree
    if meta:
        with torch.device("meta"):
            model = Transformer(MoEArgs(vocab_size=VOCAB)).double()
    else:
        model = Transformer(MoEArgs(vocab_size=VOCAB)).double()
    x0 = torch.randint(0, VOCAB, (MICROBATCH, SEQ))
    pipe = mpmd.trace(model, (x0,), split_before=["layers.2"])
    mesh = init_device_mesh("cpu", (PP, ep), mesh_dim_names=("pp", "ep")) if ep > 1 else None
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(M * EP // ep),
        mesh=mesh,
        loss_fn=moe_loss,
        options=mpmd.RunnerOptions(timeout=60),
    )
    if meta:
        runner.init_weights()
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-2, weight_decay=0.01)
    if load_from is not None:
        mpmd.checkpoint.load(load_from, runner, opt)
    held = {
        n: (p.to_local() if hasattr(p, "to_local") else p)
        for n, p in runner.named_parameters()
        if ".experts." in n
    }
    assert not any(t.is_meta for t in held.values())
    part = dist.get_rank(runner.dp_group) if runner.dp_group is not None else 0
    size = MICROBATCH * M * EP // runner.dp_size
    losses, state = [], None
    for step in steps:
        x, y = _global_batch(step)
        opt.zero_grad(set_to_none=True)
        out = runner.step(
            x[part * size : (part + 1) * size], target=y[part * size : (part + 1) * size]
        )
        losses.append(float(out.loss))
        opt.step()
        if step == steps.start:
            if save_to is not None:
                mpmd.checkpoint.save(save_to, runner, opt)
            state = to_bytes({k: whole_tensor(v).clone() for k, v in runner.state_dict().items()})
    return {
        "losses": losses,
        "state": state,
        "expert_elements": sum(t.numel() for t in held.values()),
        "expert_rows": {n: t.shape[0] for n, t in held.items()},
    }


@pytest.mark.slow
def test_meta_model_on_pp_ep_checkpoints_into_any_layout_and_the_plain_model(tmp_path):
    import torch.distributed.checkpoint as dcp
    from harness import from_bytes
    from titan_moe import MoEArgs, Transformer
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ckpt = str(tmp_path / "ep")
    # A: a meta model on (pp 2, ep 2); each rank allocates half the experts.
    a = check_all(run_ranks(checkpoint_run, PP * EP, EP, True, None, ckpt, range(3)))
    experts = MoEArgs().num_experts
    for report in a:
        assert report["expert_rows"], report
        assert all(rows == experts // EP for rows in report["expert_rows"].values()), report
    # B: the checkpoint on 2 pipeline ranks without ep (every expert on each),
    # which saves again after its step.
    back = str(tmp_path / "no_ep")
    b = check_all(run_ranks(checkpoint_run, PP, 1, False, ckpt, back, range(1, 3)))
    assert abs(a[0]["losses"][1] - b[0]["losses"][0]) <= 1e-10, (a[0]["losses"], b[0]["losses"])
    # C: B's checkpoint back on (pp 2, ep 2): the step after it as A's.
    c = check_all(run_ranks(checkpoint_run, PP * EP, EP, False, back, None, range(2, 3)))
    assert abs(a[0]["losses"][2] - c[0]["losses"][0]) <= 1e-10, (a[0]["losses"], c[0]["losses"])
    for report_a, report_b in zip(a[:1], b[:1], strict=True):
        # One ep rank of a stage holds half of what the pipeline rank without ep holds.
        assert report_a["expert_elements"] * EP == report_b["expert_elements"]
    saved: dict[str, torch.Tensor] = {}
    for report in a:
        saved.update(from_bytes(report["state"]))
    # The plain model, with DCP's standard calls (no process group).
    model = Transformer(MoEArgs(vocab_size=VOCAB)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert set(model.state_dict()) == set(saved), set(model.state_dict()) ^ set(saved)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)


def stalled_peer(rank: int, world: int) -> str:
    """Global rank 1 (ep rank 1 of the first pipeline rank) stalls in its
    stage's forward: its ep peer, rank 0, waits in the dispatch's
    all-to-all, which must fail within the runner's timeout, naming it."""
    import time

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, EP), mesh_dim_names=("pp", "ep"))
    case = MODELS["titan"]
    model = case.build()
    pipe = mpmd.trace(model, (torch.randint(0, VOCAB, (MICROBATCH, SEQ)),), split_before=case.split)

    def stall(_rank, _stage, forward):
        def run(*args):
            if dist.get_rank() == 1:
                time.sleep(7)
            return forward(*args)

        return run

    import torch.distributed as dist

    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(M),
        mesh=mesh,
        loss_fn=case.loss,
        options=mpmd.RunnerOptions(timeout=4, wrap_stage=stall),
    )
    x = torch.randint(0, VOCAB, (MICROBATCH * M, SEQ))
    start = time.monotonic()
    try:
        runner.step(x, target=x)
    except Exception as err:
        return f"{time.monotonic() - start:.1f}s {err}"
    return "no error"


@pytest.mark.slow
def test_a_stalled_ep_peer_fails_the_all_to_all_within_the_timeout_naming_it():
    results = check_all(run_ranks(stalled_peer, PP * EP, deadline=120))
    waited, message = results[0].split(" ", 1)
    assert float(waited[:-1]) < 4 + 6, results[0]
    # The first exchange of the layer (its split sizes) is where rank 0 waits.
    assert "expert parallelism: rank 0's all-to-all (split sizes layers.1.moe.experts)" in message
    assert "among ranks [1]" in message, message
    assert "F(stage=0, mb=0)" in message, message
    for other in results[1:]:
        assert other != "no error", results


def refusals(rank: int, world: int) -> dict[str, str]:
    """What expert parallelism does not run, each refused before anything
    runs, with what to do (2 ranks: one pipeline rank, ep 2)."""
    from titan_moe import MoEArgs, Transformer, moe_loss
    from torch.distributed.device_mesh import init_device_mesh

    x0 = torch.randint(0, VOCAB, (MICROBATCH, SEQ))

    def pipe(experts: int = 4):
        torch.manual_seed(0)
        model = Transformer(MoEArgs(vocab_size=VOCAB, num_experts=experts)).double()
        return mpmd.trace(model, (x0,))

    pp_ep = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "ep"))
    ep_dp = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "ep", "dp"))
    tp_ep = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "tp", "ep"))
    cases = {
        "plan without ep": (pipe(), None, {"ep_plan": {"layers.*.moe.experts": "grouped_experts"}}),
        "ep before dp": (pipe(), ep_dp, {}),
        "tp before ep": (pipe(), tp_ep, {}),
        "unknown style": (pipe(), pp_ep, {"ep_plan": {"layers.*.moe.experts": "colwise"}}),
        "names nothing": (pipe(), pp_ep, {"ep_plan": {"layers.*.mlp.experts": "grouped_experts"}}),
        "uneven": (pipe(3), pp_ep, {}),
    }
    errors = {}
    for name, (p, mesh, options) in cases.items():
        try:
            mpmd.PipelineRunner(
                p,
                mpmd.schedules.GPipe(2),
                mesh=mesh,
                loss_fn=moe_loss,
                options=mpmd.RunnerOptions(timeout=30, **options),
            )
            errors[name] = "no error"
        except (ValueError, TypeError) as err:
            errors[name] = str(err)
    return errors


@pytest.mark.slow
def test_what_expert_parallelism_does_not_run_is_refused_with_what_to_do():
    errors = check_all(run_ranks(refusals, 2, deadline=120))[0]
    assert "ep_plan needs a mesh with an 'ep' dimension" in errors["plan without ep"], errors
    assert "'ep' dimension must come after 'dp'" in errors["ep before dp"], errors
    assert "'tp' dimension must come after 'ep'" in errors["tp before ep"], errors
    assert "has style 'colwise'; the styles are" in errors["unknown style"], errors
    assert "['layers.*.mlp.experts'] name no experts module" in errors["names nothing"], errors
    assert "'layers.1.moe.experts'" in errors["names nothing"], errors  # the ones there are
    assert "holds 3 experts" in errors["uneven"] and "2 ep ranks" in errors["uneven"], errors


def hf_round_trip(rank: int, world: int, src: str, out: str) -> dict:
    """Hugging Face's Qwen3-MoE checkpoint (per-expert keys, as the Hub's)
    loaded into a meta-device model on (pp 2, ep 2), one step, AdamW, and
    saved back with save_hf."""
    import torch.distributed as dist
    from harness import to_bytes
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    config = AutoConfig.from_pretrained(src)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    ids = torch.randint(0, VOCAB, (MICROBATCH, SEQ)).to("meta")
    pipe = mpmd.trace(model, (ids,), split_before=["model.layers.2"])
    mesh = init_device_mesh("cpu", (PP, EP), mesh_dim_names=("pp", "ep"))
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.ZeroBubbleH1(M),
        mesh=mesh,
        loss_fn=_hf_loss,
        options=mpmd.RunnerOptions(timeout=60),
    )
    loaded = mpmd.checkpoint.load_hf(src, runner)
    x, y = _global_batch(0)
    part = dist.get_rank(runner.dp_group)
    size = MICROBATCH * M
    out_step = runner.step(
        x[part * size : (part + 1) * size], target=y[part * size : (part + 1) * size]
    )
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-2)
    opt.step()
    after = {n: whole_tensor(p.detach()) for n, p in runner.named_parameters()}
    mpmd.checkpoint.save_hf(out, runner)
    local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for m in runner.local_modules()
        for p in m.state_dict(keep_vars=True).values()
    )
    return {
        "loss": float(out_step.loss),
        "after": to_bytes(after),
        "bytes_read": loaded.bytes_read,
        "local_bytes": local,
        "missing": loaded.missing_keys,
        "experts": {n: list(p.to_local().shape) for n, p in _expert_tensors(runner).items()},
    }


@pytest.mark.slow
def test_hugging_face_checkpoints_read_and_write_only_a_ranks_own_experts(tmp_path):
    from harness import from_bytes
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = _qwen3_moe(torch.float32)
    src, out = tmp_path / "src", tmp_path / "out"
    model.save_pretrained(src)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        saved_keys = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in saved_keys  # per expert
    results = check_all(run_ranks(hf_round_trip, PP * EP, str(src), str(out)))
    # The unpipelined model from the same checkpoint, one step on the batch.
    ref = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
    x, y = _global_batch(0)
    losses = [
        _hf_loss(ref(xb), yb) for xb, yb in zip(x.chunk(M * EP), y.chunk(M * EP), strict=True)
    ]
    expected = float(torch.stack(losses).mean())
    after: dict[str, torch.Tensor] = {}
    for r in results:
        assert r["missing"] == [], r["missing"]
        assert abs(r["loss"] - expected) <= 1e-5, (r["loss"], expected)
        # Each rank read its own stages' tensors, half of their experts.
        assert r["bytes_read"] <= 1.1 * r["local_bytes"], r
        assert all(shape[0] == 2 for shape in r["experts"].values()), r["experts"]
        after.update(from_bytes(r["after"]))
    # Written as the Hub's layout (per expert), each expert by a rank holding it.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == saved_keys, set(weight_map) ^ saved_keys
    layer0 = "model.layers.0.mlp.experts.{}.gate_proj.weight"
    assert weight_map[layer0.format(0)] == weight_map[layer0.format(1)]
    assert weight_map[layer0.format(0)] != weight_map[layer0.format(2)]
    back = AutoModelForCausalLM.from_pretrained(out)
    for name, value in after.items():
        assert torch.equal(back.get_parameter(name).detach(), value), name


def unchosen_experts(rank: int, world: int) -> list[str]:
    """Every token chooses the experts of ep rank 0 (a router biased to
    them): ep rank 1 receives no token, and must still run its reverse
    all-to-alls in the backward (its peer waits for them), exactly."""
    import torch.distributed as dist
    from gpt import GPT, GPTConfig, lm_loss
    from titan_moe import moe_loss
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, EP), mesh_dim_names=("pp", "ep"))
    favour = torch.tensor([10.0, 10.0, -10.0, -10.0], dtype=torch.float64)

    def titan() -> torch.nn.Module:
        return _titan(favour)

    def gpt() -> torch.nn.Module:  # Hugging Face's calling convention
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, dim=16, heads=2, layers=2, experts=4))
        for block in model.blocks:
            block.mlp.router = torch.nn.Linear(16, 4)
            with torch.no_grad():
                block.mlp.router.bias.copy_(favour.float())
        return model.double()

    done = []
    for build, loss_fn in ((titan, moe_loss), (gpt, lm_loss)):
        model, reference = build(), build()
        x0 = torch.randint(0, VOCAB, (MICROBATCH, SEQ))
        runner = mpmd.PipelineRunner(
            mpmd.trace(model, (x0,)),
            mpmd.schedules.GPipe(2),
            mesh=mesh,
            loss_fn=loss_fn,
            options=mpmd.RunnerOptions(timeout=20),
        )
        x, y = _global_batch(5)
        x, y = x[: 4 * MICROBATCH], y[: 4 * MICROBATCH]
        for xb, yb in zip(x.chunk(4), y.chunk(4), strict=True):
            (loss_fn(reference(xb), yb) / 4).backward()
        part = dist.get_rank(runner.dp_group)
        half = slice(part * 2 * MICROBATCH, (part + 1) * 2 * MICROBATCH)
        out = runner.step(x[half], target=y[half])
        counts = torch.cat(list(out.metrics["tokens_per_expert"].values()))
        assert counts.reshape(-1, 4)[:, 2:].sum() == 0, counts  # nobody chose 2 or 3
        for fqn, p in runner.named_parameters():
            expected = reference.get_parameter(fqn).grad
            got = whole_tensor(p.grad) if p.grad is not None else None
            if expected is None:
                assert got is None or not got.any(), fqn
                continue
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10, msg=fqn)
        done.append(type(model).__name__)
    return done


@pytest.mark.slow
def test_an_ep_rank_no_token_chose_still_runs_its_backward():
    results = check_all(run_ranks(unchosen_experts, EP, deadline=120))
    assert all(len(r) == 2 for r in results), results
