"""Tensor parallelism inside pipeline stages on a ("pp", "tp") DeviceMesh of
4 Gloo processes: a Hugging Face Llama (tiny config, float64) runs with its
own tp plan (`_tp_plan`: attention and MLP projections colwise / rowwise, the
embedding by vocabulary rows, the head by columns), and the loss, every
gradient (gathered to whole tensors), the clip norm and the parameters after
optimizer steps equal the unpipelined model on the whole batch, for a schedule
with one stage per rank (1F1B), one with a split backward (ZB-H1) and one
with two stages per rank (Interleaved1F1B). Each rank holds its stages'
sharded parameters only."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import check_all, from_bytes, run_ranks, to_bytes, whole_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import torchmpmd as mpmd

M = 4  # microbatches
ROWS, SEQ, VOCAB = 8, 12, 96


def _llama(tied: bool = False) -> torch.nn.Module:
    # SDPA attention: Hugging Face's eager attention takes its softmax in
    # float32, which turns the last-bit differences of a sharded matmul's
    # sums (added in another order) into 1e-7 ones. SDPA stays in float64
    # (and runs heads-sharded on the CPU kernel's sharding strategy).
    from models import hf_llama

    torch.manual_seed(0)
    return hf_llama("sdpa", tie_word_embeddings=tied, use_cache=False).double()


def _neox() -> torch.nn.Module:
    # GPT-NeoX: Hugging Face's model with its own tp plan (config's
    # base_model_tp_plan: packed q/k/v colwise, vocabulary-parallel input
    # embedding) whose norms (nn.LayerNorm) and SDPA stay in float64.
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


class _Collectives(TorchDispatchMode):
    """Counts the collectives DTensor issues (c10d functional ops), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            name = func._opname
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _over(dim: str, p: torch.Tensor):
    """A parameter's placement over mesh dimension `dim` (Replicate if it is
    not a DTensor over it)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(p, DTensor) and dim in (p.device_mesh.mesh_dim_names or ()):
        return p.placements[p.device_mesh.mesh_dim_names.index(dim)]
    return Replicate()


def _sharded(placement) -> bool:
    """Shard, or FSDP's strided shard over a tp shard."""
    return not (placement.is_replicate() or placement.is_partial())


SPLITS = {2: ["model.layers.2"], 4: ["model.layers.1", "model.layers.2", "model.layers.3"]}


class _Model:
    """A model of the test, as the test calls it: Hugging Face's Llama (its
    own plan, input ids as a keyword, an output object) or the bundled GPT
    (examples/gpt.py: its `_tp_plan` in the model file, packed q/k/v, tied
    embeddings always)."""

    def __init__(self, kind: str, tied: bool) -> None:
        self.kind, self.tied = kind, tied

    def build(self) -> torch.nn.Module:
        if self.kind == "llama":
            return _llama(self.tied)
        if self.kind == "neox":
            return _neox()
        from gpt import GPT, GPTConfig

        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, dim=32, heads=4, layers=4)).double()

    def on_meta(self) -> torch.nn.Module:
        with torch.device("meta"):
            return self.build()

    @property
    def hf(self) -> bool:
        return self.kind in ("llama", "neox")

    def inputs(self, ids: torch.Tensor) -> tuple[tuple, dict]:
        return ((), {"input_ids": ids}) if self.hf else ((ids,), {})

    def split(self, num_stages: int) -> list[str]:
        if self.kind == "llama":
            return SPLITS[num_stages]
        if self.kind == "neox":
            return [f"gpt_neox.layers.{4 * s // num_stages}" for s in range(1, num_stages)]
        return [f"blocks.{4 * s // num_stages}" for s in range(1, num_stages)]

    def loss(self, out, target):
        from gpt import lm_loss

        return lm_loss(out.logits if self.hf else out, target)

    def optimizer(self, params) -> torch.optim.Optimizer:
        # Adam divides by a gradient's magnitude, so a near-zero gradient's
        # last-bit differences can flip an update's sign: the Llama (see
        # `tolerance`) trains with SGD, the GPT with AdamW.
        if self.kind == "llama":
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)

    def tolerance(self) -> dict[str, float]:
        """The GPT and GPT-NeoX are float64 throughout: 1e-10. Hugging Face's Llama in
        float64 still takes its RMSNorm in float32 (`LlamaRMSNorm` casts to
        float32), which turns the last-bit differences of a sharded matmul's
        sums (the same sums added in another order) into differences of a
        float32 rounding, ~1e-7 relative."""
        if self.kind == "llama":
            return {"rtol": 1e-6, "atol": 1e-8}
        return {"rtol": 1e-10, "atol": 1e-10}

    # Parameters the plan shards by output (colwise) and by input (rowwise).
    def sharded_names(self) -> tuple[str, str]:
        return {
            "llama": ("q_proj.weight", "o_proj.weight"),
            "neox": ("query_key_value.weight", "dense_4h_to_h.weight"),
        }.get(self.kind, ("attn.qkv.weight", "mlp.2.weight"))


def model_on_pp_tp(
    rank: int,
    world: int,
    combos: list[tuple[str, int]],
    dp: int = 1,
    tied: bool = False,
    kind: str = "llama",
    data_parallel: str = "replicate",
    plan: dict[str, str] | None = None,
) -> list[str]:
    """The model on a (pp 2[, dp], tp 2) mesh against the unpipelined model on
    the whole batch; each data-parallel replica steps on its shard. `plan`:
    the user's tp plan (None: the model's own)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    if dp == 1:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        shard = slice(None)
    else:
        mesh = init_device_mesh("cpu", (2, dp, 2), mesh_dim_names=("pp", "dp", "tp"))
        rows = ROWS  # per replica
        shard = slice(mesh.get_local_rank("dp") * rows, (mesh.get_local_rank("dp") + 1) * rows)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (ROWS * dp, SEQ + 1), generator=g)
    idx, target = tokens[:, :-1], tokens[:, 1:]
    done = []
    for schedule_name, num_stages in combos:
        case = _Model(kind, tied)
        reference = case.build()
        model = copy.deepcopy(reference)
        args, kwargs = case.inputs(idx[: ROWS // M])
        pipe = mpmd.trace(model, args, kwargs, split_before=case.split(num_stages))
        runner = mpmd.PipelineRunner(
            pipe,
            getattr(mpmd.schedules, schedule_name)(M),
            mesh=mesh,
            loss_fn=case.loss,
            options=mpmd.RunnerOptions(
                timeout=60, data_parallel=data_parallel if dp > 1 else None, tp_plan=plan
            ),
        )
        what = f"{schedule_name} rank {rank}"
        local = dict(runner.named_parameters())
        # Each rank holds its stages' shards: the projections split over tp
        # (and with FSDP, everything over dp too).
        over_tp = {n: _over("tp", p) for n, p in local.items()}
        held = sum(
            p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in local.values()
        )
        whole = sum(p.numel() for p in local.values())
        sharded = sum(p.numel() for n, p in local.items() if over_tp[n].is_shard())
        expected = sum(
            p.numel()
            / (2 if over_tp[n].is_shard() else 1)
            / (dp if _over("dp", p).is_shard() else 1)
            for n, p in local.items()
        )
        assert sharded > 0.5 * whole, (what, sharded, whole)
        assert held <= 1.1 * expected, (what, held, expected)
        by_rows, by_columns = case.sharded_names()
        q = [n for n in over_tp if n.endswith(by_rows)]
        o = [n for n in over_tp if n.endswith(by_columns)]
        assert q and all(over_tp[n] == Shard(0) for n in q), (what, over_tp)
        assert o and all(over_tp[n] == Shard(1) for n in o), (what, over_tp)

        ref_opt = case.optimizer(reference.parameters())
        opt = case.optimizer(runner.parameters())
        tol = case.tolerance()
        for step in range(2):
            ref_opt.zero_grad(set_to_none=True)
            losses = []
            for xb, yb in zip(idx.chunk(M * dp), target.chunk(M * dp), strict=True):
                a, k = case.inputs(xb)
                loss = case.loss(reference(*a, **k), yb)
                (loss / (M * dp)).backward()
                losses.append(loss.detach())
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()

            opt.zero_grad(set_to_none=True)
            a, k = case.inputs(idx[shard])
            out = runner.step(*a, target=target[shard], **k)
            msg = f"{what} step {step}"
            torch.testing.assert_close(
                out.loss,
                torch.stack(losses).mean(),
                **tol,
                msg=lambda m, msg=msg: f"{msg}: {m}",
            )
            # Both clipped: the gradients compared are what the optimizer reads.
            norm = runner.clip_grad_norm_(1.0)
            torch.testing.assert_close(norm, ref_norm, **tol, msg=lambda m, msg=msg: f"{msg}: {m}")
            for fqn, p in local.items():
                torch.testing.assert_close(
                    whole_tensor(p.grad),
                    reference.get_parameter(fqn).grad,
                    **tol,
                    msg=lambda m, w=f"{msg}: {fqn}": f"{w}: {m}",
                )
            opt.step()
            for fqn, p in local.items():
                torch.testing.assert_close(
                    whole_tensor(p.detach()),
                    reference.get_parameter(fqn).detach(),
                    **tol,
                    msg=lambda m, w=f"{msg}: {fqn} after the step": f"{w}: {m}",
                )
        if kind == "llama":
            # The plan shards the work, not only the memory: a forward
            # all-reduces after each row-parallel layer and gathers only the
            # head's output; no weight is gathered. Under sequence
            # parallelism each layer instead gathers the sequence twice
            # (into attention and into the MLP) and reduce-scatters twice.
            with _Collectives() as comm:
                runner.eval_step(*case.inputs(idx[shard])[0], **case.inputs(idx[shard])[1])
            counts = dict(comm.counts)
            gathers = sum(n for op, n in counts.items() if "all_gather" in op)
            reduces = sum(n for op, n in counts.items() if "all_reduce" in op)
            scatters = sum(n for op, n in counts.items() if "reduce_scatter" in op)
            layers = 4 * len(runner.local_stages) // num_stages  # of 4
            if plan is not None and "sequence_parallel" in plan.values():
                head = 2 if runner.rank == 1 else 0  # the head's input and output
                assert gathers == (2 * layers + head) * M, (what, counts)
                assert scatters >= 2 * layers * M and reduces == 0, (what, counts)
            else:
                assert gathers <= M, (what, counts)
                assert reduces >= 2 * layers * M, (what, counts)
        # The executor's own count of the last step's message bytes, what
        # one microbatch's transfers hold whole, and the simulator's bytes.
        timeline = runner.timeline
        assert timeline is not None
        predicted = runner.program.simulate()
        done.append(
            (
                f"{schedule_name}: stages {runner.local_stages}",
                timeline.sent_bytes[runner.rank],
                timeline.received_bytes[runner.rank],
                sum(t.spec.nbytes for t in pipe.transfers),
                predicted.sent_bytes[runner.rank],
                predicted.received_bytes[runner.rank],
            )
        )
    return done


@pytest.mark.parametrize(
    ("combos", "tied"),
    [
        ([("OneFOneB", 2), ("ZeroBubbleH1", 2)], False),
        ([("Interleaved1F1B", 4)], True),
    ],
    ids=["one-stage-per-rank", "two-stages-per-rank-tied-embeddings"],
)
def test_llama_with_its_own_tp_plan_matches_the_unpipelined_model(combos, tied):
    # Tied: the embedding (stage 0, rank 0) and the head (stage 3, rank 1)
    # share one weight, sharded alike (vocabulary rows); the pipeline sums
    # their gradients shard by shard.
    results = check_all(run_ranks(model_on_pp_tp, 4, combos, 1, tied, deadline=300))
    assert all(len(r) == len(combos) for r in results), results


def test_hugging_face_gpt_neox_with_its_own_tp_plan_at_1e_10():
    # A Hugging Face model computing in float64 throughout (LayerNorm, SDPA)
    # meets the 1e-10 target with the plan in its config; AdamW.
    results = check_all(
        run_ranks(model_on_pp_tp, 4, [("OneFOneB", 2)], 1, False, "neox", deadline=300)
    )
    assert all(len(r) == 1 for r in results), results


def test_the_bundled_gpt_with_the_plan_in_its_model_file():
    # examples/gpt.py: packed q/k/v split by output features (DTensor
    # gathers it where the heads are split), tied embeddings across stages.
    results = check_all(
        run_ranks(model_on_pp_tp, 4, [("OneFOneB", 2)], 1, True, "gpt", deadline=300)
    )
    assert all(len(r) == 1 for r in results), results


# A user's plan for the bundled GPT: the model file's, and the tied
# embedding and head split by vocabulary rows (both weights Shard(0)).
GPT_PLAN = {
    "blocks.*.attn.qkv": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
    "tok": "embedding_rowwise",
    "head": "colwise_rep",
}


# The Llama's own plan with Megatron's sequence parallelism: the norms run
# on sequence shards, and the residual stream between layers (and between
# stages) stays sharded along the sequence.
LLAMA_SP_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.norm": "sequence_parallel",
    "lm_head": "colwise_rep",
}


def test_sequence_parallel_sends_each_tp_rank_its_slice_of_the_activations():
    # Same model and batch, the plan without and with sequence parallelism:
    # both equal the unpipelined model; with it, the executor's counters
    # show each tp rank sending and receiving half the bytes (its sequence
    # slice of the hidden state and of its gradient), without it the whole,
    # and the simulator charges what the executor sends.
    whole = check_all(run_ranks(model_on_pp_tp, 4, [("OneFOneB", 2)], deadline=300))
    sliced = check_all(
        run_ranks(
            model_on_pp_tp,
            4,
            [("OneFOneB", 2)],
            1,
            False,
            "llama",
            "replicate",
            LLAMA_SP_PLAN,
            deadline=300,
        )
    )
    for rank, (full, sp) in enumerate(zip(whole, sliced, strict=True)):
        (_, sent, received, per_mb, *predicted), (_, sp_sent, sp_received, _, *sp_predicted) = (
            full[0],
            sp[0],
        )
        # pp 2, 1F1B: stage 0 sends each microbatch's hidden state and
        # receives its gradient; stage 1 the other way round.
        assert sent == received == M * per_mb, (rank, sent, received, per_mb)
        assert (sp_sent, sp_received) == (sent // 2, received // 2), (rank, sp_sent, sent)
        assert predicted == [sent, received], (rank, predicted, sent)
        assert sp_predicted == [sp_sent, sp_received], (rank, sp_predicted, sp_sent)


# The GPT's user plan with its norms sequence-parallel.
GPT_SP_PLAN = {
    **GPT_PLAN,
    "blocks.*.ln1": "sequence_parallel",
    "blocks.*.ln2": "sequence_parallel",
    "ln_f": "sequence_parallel",
}


def test_sequence_parallel_with_a_split_backward_and_two_stages_per_rank():
    # The split backward's weight-gradient pass places the norms' partial
    # gradients (all-reduces): every tp rank must issue them in one order.
    results = check_all(
        run_ranks(
            model_on_pp_tp,
            4,
            [("ZeroBubbleH1", 2), ("Interleaved1F1B", 4)],
            1,
            True,
            "gpt",
            "replicate",
            GPT_SP_PLAN,
            deadline=300,
        )
    )
    for r in results:
        for _, sent, received, _, *predicted in r:
            assert predicted == [sent, received], r  # the simulator charges what is sent


def _torchtitan_style_plan() -> dict:
    """GPT_SP_PLAN as a torchtitan parallelize.py writes it: torch's
    ParallelStyle objects, with their layouts and PrepareModuleInput hints."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    enter = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "blocks.*.ln1": SequenceParallel(),
        "blocks.*.attn": enter,
        "blocks.*.attn.qkv": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln2": SequenceParallel(),
        "blocks.*.mlp": enter,
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def test_a_plan_of_torchs_parallel_styles_runs_as_written():
    # A torchtitan user's plan as it is (ParallelStyle objects), sequence
    # parallel, on the bundled GPT with tied embeddings: the unpipelined
    # model's loss and gradients at 1e-10.
    results = check_all(
        run_ranks(
            model_on_pp_tp,
            4,
            [("OneFOneB", 2)],
            1,
            True,
            "gpt",
            "replicate",
            _torchtitan_style_plan(),
            deadline=300,
        )
    )
    assert all(len(r) == 1 for r in results), results


def test_pipeline_times_data_times_tensor_parallel():
    # 8 processes: pp 2 x dp 2 x tp 2, replicas averaging their sharded
    # gradients over dp (each tp coordinate its own dp group), tied weights.
    results = check_all(run_ranks(model_on_pp_tp, 8, [("OneFOneB", 2)], 2, True, deadline=400))
    assert all(len(r) == 1 for r in results), results


def test_fsdp_over_dp_on_top_of_tensor_parallel_stages():
    # 8 processes: pp 2 x dp 2 x tp 2 with FSDP2 over dp on tp-sharded
    # stages (2-D DTensor parameters: each rank holds a quarter of a
    # projection), the GPT with a user plan, AdamW, at 1e-10.
    results = check_all(
        run_ranks(
            model_on_pp_tp, 8, [("OneFOneB", 2)], 2, True, "gpt", "fsdp", GPT_PLAN, deadline=400
        )
    )
    assert all(len(r) == 1 for r in results), results


def meta_model_on_pp_tp(rank: int, world: int) -> str:
    """The GPT built on the meta device, on pp 2 x tp 2: each rank allocates
    only its stages' shards; load_state_dict fills them (a step equals the
    unpipelined model's); init_weights draws them with the model's own init,
    leaving the tp peers' replicated weights alike."""
    from gpt import GPT
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    case = _Model("gpt", True)
    reference = case.build()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    idx, target = tokens[:, :-1], tokens[:, 1:]
    pipe = mpmd.trace(case.on_meta(), (idx[: ROWS // M].to("meta"),), split_before=case.split(2))
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(M),
        mesh=mesh,
        loss_fn=case.loss,
        options=mpmd.RunnerOptions(timeout=60),
    )
    local = dict(runner.named_parameters())
    assert not any(p.is_meta for p in local.values()), rank
    held = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in local.values()
    )
    expected = sum(p.numel() / (2 if _over("tp", p).is_shard() else 1) for p in local.values())
    assert held <= 1.1 * expected, (rank, held, expected)
    try:
        runner.step(idx, target=target)
        raise AssertionError("a step on unwritten shards ran")
    except RuntimeError as err:
        assert "allocated but never written" in str(err), err

    runner.load_state_dict(reference.state_dict())
    out = runner.step(idx, target=target)
    losses = []
    for xb, yb in zip(idx.chunk(M), target.chunk(M), strict=True):
        loss = case.loss(reference(xb), yb)
        (loss / M).backward()
        losses.append(loss.detach())
    tol = case.tolerance()
    torch.testing.assert_close(out.loss, torch.stack(losses).mean(), **tol)
    for fqn, p in local.items():
        torch.testing.assert_close(
            whole_tensor(p.grad), reference.get_parameter(fqn).grad, **tol, msg=fqn
        )

    # Each rank draws from its own seed: without the runner's sync, the
    # replicated position embedding would differ between tp peers.
    torch.manual_seed(100 + rank)
    runner.init_weights(GPT.init_weights)
    pos = local.get("pos.weight")  # stage 0's: the tp peers of pp rank 0
    if pos is not None:
        mine = pos.to_local() if isinstance(pos, DTensor) else pos.detach()
        parts = [torch.empty_like(mine) for _ in range(2)]
        torch.distributed.all_gather(parts, mine.contiguous(), group=mesh["tp"].get_group())
        assert torch.equal(parts[0], parts[1]), rank
        assert 0.005 < float(mine.std()) < 0.05, float(mine.std())  # the model's init, drawn
    out = runner.step(idx, target=target)
    assert torch.isfinite(out.loss), out.loss
    return f"stages {runner.local_stages}"


def test_a_meta_device_model_allocates_only_its_shards():
    results = check_all(run_ranks(meta_model_on_pp_tp, 4, deadline=300))
    assert len(results) == 4, results


class _Block(torch.nn.Module):
    """A pre-norm residual MLP, as a user writes one."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.blocks = torch.nn.ModuleList(_Block(32) for _ in range(2))
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _megatron_mlps(stage: torch.nn.Module, stage_mesh) -> None:
    """The user's own tensor parallelism for a stage cut by hand: torch's
    ColwiseParallel / RowwiseParallel on each MLP."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    for name, _ in stage.named_modules():
        if name.endswith("up"):
            plan[name] = ColwiseParallel()
        elif name.endswith("down"):
            plan[name] = RowwiseParallel()
    parallelize_module(stage, stage_mesh["tp"], plan)


def hand_cut_stages_on_pp_tp(rank: int, world: int) -> list[str]:
    """Stages cut by hand (mpmd.from_stages) with the user's own DTensor
    code (`parallelize`), against the unpipelined model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    idx, target = tokens[:, :-1], tokens[:, 1:]
    done = []
    for schedule_name in ("OneFOneB", "ZeroBubbleH1"):
        torch.manual_seed(0)
        reference = _Net().double()
        net = copy.deepcopy(reference)
        stages = [
            torch.nn.Sequential(net.embed, net.blocks[0]),
            torch.nn.Sequential(net.blocks[1], net.head),
        ]
        pipe = mpmd.from_stages(stages, (idx[: ROWS // M],), model=net)
        runner = mpmd.PipelineRunner(
            pipe,
            getattr(mpmd.schedules, schedule_name)(M),
            mesh=mesh,
            loss_fn=_Model("gpt", False).loss,
            options=mpmd.RunnerOptions(timeout=60, parallelize=_megatron_mlps),
        )
        local = dict(runner.named_parameters())
        ups = [n for n in local if n.endswith("up.weight")]
        assert ups and all(_over("tp", local[n]) == Shard(0) for n in ups), (rank, local)
        losses = []
        for xb, yb in zip(idx.chunk(M), target.chunk(M), strict=True):
            loss = _Model("gpt", False).loss(reference(xb), yb)
            (loss / M).backward()
            losses.append(loss.detach())
        out = runner.step(idx, target=target)
        tol = {"rtol": 1e-10, "atol": 1e-10}
        torch.testing.assert_close(out.loss, torch.stack(losses).mean(), **tol)
        for fqn, p in local.items():
            torch.testing.assert_close(
                whole_tensor(p.grad),
                reference.get_parameter(fqn).grad,
                **tol,
                msg=lambda m, w=f"{schedule_name} rank {rank}: {fqn}": f"{w}: {m}",
            )
        done.append(schedule_name)
    return done


def test_stages_cut_by_hand_take_the_users_own_tensor_parallelism():
    results = check_all(run_ranks(hand_cut_stages_on_pp_tp, 4, deadline=300))
    assert all(r == ["OneFOneB", "ZeroBubbleH1"] for r in results), results


def refusals(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    pp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    idx = torch.randint(0, VOCAB, (2, SEQ))
    untied = mpmd.trace(_llama(), (), {"input_ids": idx}, split_before=SPLITS[2])
    net = _Net()
    by_hand = mpmd.from_stages([net.embed, torch.nn.Sequential(*net.blocks, net.head)], (idx,))
    traced = mpmd.trace(_Net(), (idx,), split_before=["blocks.1"])
    tp_4 = init_device_mesh("cpu", (1, 4), mesh_dim_names=("pp", "tp"))

    def plan(tp_plan: dict[str, str]) -> mpmd.RunnerOptions:
        return mpmd.RunnerOptions(tp_plan=tp_plan)

    up = {"blocks.*.up": "colwise"}
    cases = {
        "by hand": (by_hand, pp_tp, None),
        "plan without tp": (untied, pp_dp, mpmd.RunnerOptions(tp_plan={"x": "colwise"})),
        "compile": (untied, pp_tp, mpmd.RunnerOptions(compile=True)),
        "unknown style": (untied, pp_tp, mpmd.RunnerOptions(tp_plan={"lm_head": "isolated"})),
        # Plans that match nothing, or shard nothing.
        "typo": (untied, pp_tp, plan({"model.layers.*.self_attn.q_projj": "colwise"})),
        "regex": (untied, pp_tp, plan({r"model\.layers\.\d+\.mlp\.up_proj": "colwise"})),
        "empty": (untied, pp_tp, plan({})),
        "extra prefix": (traced, pp_tp, plan({"model.blocks.*.up": "colwise"})),
        "missing prefix": (untied, pp_tp, plan({"layers.*.mlp.up_proj": "colwise"})),
        "container": (traced, pp_tp, plan({"blocks.*": "colwise"})),
        "shards nothing": (traced, pp_tp, plan({"blocks.*.norm": "sequence_parallel"})),
        "one typo among good keys": (traced, pp_tp, plan({**up, "blocks.*.dwn": "rowwise"})),
        # Styles and sizes that do not fit.
        "rowwise norm": (traced, pp_tp, plan({**up, "blocks.*.norm": "rowwise"})),
        "heads": (untied, tp_4, None),  # the Llama's own plan, 2 key-value heads on tp 4
    }
    errors = {}
    for name, (pipe, mesh, options) in cases.items():
        try:
            mpmd.PipelineRunner(pipe, mpmd.schedules.GPipe(2), mesh=mesh, options=options)
            errors[name] = "no error"
        except (ValueError, TypeError) as err:
            errors[name] = str(err)
    return errors


def test_what_tensor_parallelism_does_not_run_yet_is_refused_before_anything_runs():
    for errors in check_all(run_ranks(refusals, 4, deadline=120)):
        assert "tp_plan needs a mesh with a 'tp' dimension" in errors["plan without tp"], errors
        assert "torch.compile of tensor-parallel stages" in errors["compile"], errors
        assert "stages [0, 1] were cut by hand" in errors["by hand"], errors
        assert "parallelize=fn" in errors["by hand"], errors
        assert "'lm_head' has style 'isolated'" in errors["unknown style"], errors
        typo = errors["typo"]
        assert "'model.layers.*.self_attn.q_projj' matches no module of the model" in typo, typo
        assert "Closest module paths: 'model.layers.*.self_attn.q_proj'" in typo, typo
        assert "not regular expressions" in errors["regex"], errors["regex"]
        assert "tp_plan is empty: it shards nothing" in errors["empty"], errors["empty"]
        assert "Drop the 'model.' prefix" in errors["extra prefix"], errors["extra prefix"]
        missing = errors["missing prefix"]
        assert "under 'model.': name it 'model.layers.*.mlp.up_proj'" in missing, missing
        container = errors["container"]
        assert "'blocks.*' matches 'blocks.0', 'blocks.1', which hold no parameters" in container
        assert "'blocks.*.up'" in container, container
        nothing = errors["shards nothing"]
        assert "tp_plan shards no parameter of the model" in nothing, nothing
        one = errors["one typo among good keys"]
        assert "'blocks.*.dwn' matches no module" in one and "'blocks.*.down'" in one, one
        norm = errors["rowwise norm"]
        assert "'blocks.0.norm' (LayerNorm) is styled 'rowwise'" in norm, norm
        assert "weight has 1 dimension(s)" in norm, norm
        heads = errors["heads"]
        assert "'model.layers.0.self_attn' (LlamaAttention)" in heads, heads
        assert "config.num_key_value_heads is 2, which 4 tp ranks cannot share" in heads, heads


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_and_checkpoint(rank: int, world: int, tp: int, load: str | None, save: str | None):
    """Two AdamW steps of the bundled GPT (float64 throughout) on pp 2 x
    `tp` (loading before the first, if asked, and saving after it); the
    second step's loss and this rank's parameters after it, whole."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, tp), mesh_dim_names=("pp", "tp")) if tp > 1 else None
    case = _Model("gpt", tied=True)
    idx, _ = _tokens(0)
    pipe = mpmd.trace(case.build(), (idx[: ROWS // M],), split_before=case.split(2))
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(M),
        mesh=mesh,
        loss_fn=case.loss,
        options=mpmd.RunnerOptions(timeout=60),
    )
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-2, weight_decay=0.01)
    if load is not None:
        assert mpmd.checkpoint.load(load, runner, opt) == {"step": 1}
    else:
        idx, target = _tokens(1)
        runner.step(idx, target=target)
        opt.step()
    if save is not None:
        mpmd.checkpoint.save(save, runner, opt, extra={"step": 1})
    opt.zero_grad(set_to_none=True)
    idx, target = _tokens(2)
    loss = runner.step(idx, target=target).loss
    opt.step()
    return float(loss), to_bytes(
        {k: whole_tensor(v.detach()) for k, v in runner.state_dict().items()}
    )


def _gathered(results: list) -> tuple[float, dict[str, torch.Tensor]]:
    state: dict[str, torch.Tensor] = {}
    for _, part in results:
        state.update(from_bytes(part))
    return results[0][0], state


@pytest.mark.parametrize(("save_tp", "load_tp"), [(2, 1), (1, 2)])
def test_checkpoints_move_between_tp_layouts(tmp_path, save_tp, load_tp):
    # The step after loading equals the step of the run that saved (model
    # and optimizer state resharded by DCP between tp 2 and tp 1).
    path = str(tmp_path / "ckpt")
    saved = check_all(run_ranks(train_and_checkpoint, 2 * save_tp, save_tp, None, path))
    loaded = check_all(run_ranks(train_and_checkpoint, 2 * load_tp, load_tp, path, None))
    (loss_a, state_a), (loss_b, state_b) = _gathered(saved), _gathered(loaded)
    assert abs(loss_a - loss_b) < 1e-10, (loss_a, loss_b)
    assert state_a.keys() == state_b.keys()
    for key, value in state_a.items():
        torch.testing.assert_close(state_b[key], value, rtol=1e-9, atol=1e-9, msg=key)
