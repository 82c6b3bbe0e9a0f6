"""Random numbers under tensor parallelism, on ("pp", "tp") meshes of 4 Gloo
processes, each rank seeded on its own (`torch.manual_seed(1234 + rank)`, as
users and examples/train_gpt.py do): dropout on replicated activations, on
sharded ones (between a colwise and a rowwise layer) and in attention over
heads-sharded query/key/value must draw what the unsharded model draws.

The reference is the unpipelined model in one process, run stage by stage:
each pipeline rank draws from the generator of its tp coordinate 0 (the
runner hands it to the tp peers), so the reference runs stage s's part of
the model for every microbatch (1F1B runs a stage's forwards in microbatch
order) from that rank's seed. Loss and every gradient (gathered whole) must
match it in float64, dropout on, on every tp peer; before, the tp peers
drew from their own seeds and disagreed (losses 1.63 / 1.55, replicated
gradients 0.4 apart), and karpathy's nanoGPT with dropout failed in its
first forward ("aten.add.Tensor got mixed torch.Tensor and DTensor")."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from harness import check_all, run_ranks, whole_tensor

import torchmpmd as mpmd

M = 4  # microbatches
TOL = {"rtol": 1e-10, "atol": 1e-10}


class _Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            f(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, c))


class _Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim)
        self.attn = _Attention(dim, 4)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.drop = torch.nn.Dropout(0.5)  # on the up projection's shards
        self.down = torch.nn.Linear(4 * dim, dim)
        self.resid = torch.nn.Dropout(0.3)  # on the replicated residual branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.resid(self.down(self.drop(F.gelu(self.up(self.norm2(x))))))


class _Net(torch.nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(dim) for _ in range(2))
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(x))


_PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.up": "colwise",
    "blocks.*.down": "rowwise",
}


def _by_hand(stage: torch.nn.Module, stage_mesh) -> None:
    """The user's tensor parallelism for a stage cut by hand: torch's styles,
    the colwise outputs kept as DTensors (their dropout and attention run
    sharded by heads)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        name: ColwiseParallel(use_local_output=False)
        if name.endswith(("attn.q", "attn.k", "attn.v", "up"))
        else RowwiseParallel()
        for name, _ in stage.named_modules()
        if name.endswith(("attn.q", "attn.k", "attn.v", "attn.o", "up", "down"))
    }
    parallelize_module(stage, stage_mesh["tp"], plan)


# karpathy's nanoGPT, as a user writing the plan for its MLPs would.
_NANOGPT_PLAN = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}


def _nanogpt_stages(model):
    """nanoGPT's forward (model.py) cut where the pipeline cuts it."""
    t = model.transformer

    def first(idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = t.drop(t.wte(idx) + t.wpe(pos))
        return t.h[0](x)

    def second(x, targets):
        logits = model.lm_head(t.ln_f(t.h[1](x)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    return first, second


def _reference(stages, inputs, targets, seeds):
    """The unpipelined model over M microbatches, stage s drawing from
    seeds[s] (each stage's rank draws from its own generator, its
    forwards in microbatch order); the mean loss (gradients accumulated)."""
    values = list(inputs)
    for s, stage in enumerate(stages):
        torch.manual_seed(seeds[s])
        last = s == len(stages) - 1
        values = [stage(v, t) if last else stage(v) for v, t in zip(values, targets, strict=True)]
    loss = torch.stack(values).mean()
    loss.backward()
    return loss.detach()


def _tp_equal(value: torch.Tensor, group) -> bool:
    parts = [torch.empty_like(value) for _ in range(2)]
    torch.distributed.all_gather(parts, value.contiguous(), group=group)
    return torch.equal(parts[0], parts[1])


def _check(runner, reference, loss, expected, what: str) -> None:
    torch.testing.assert_close(loss, expected, **TOL, msg=lambda m: f"{what}: loss: {m}")
    for name, p in runner.named_parameters():
        torch.testing.assert_close(
            whole_tensor(p.grad),
            reference.get_parameter(name).grad,
            **TOL,
            msg=lambda m, n=name: f"{what}: {n}: {m}",
        )


def dropout_under_tp(rank: int, world: int) -> list[str]:
    from public_models import GPT, GPTConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp_group = mesh["tp"].get_group()
    seeds = [1234, 1234 + 2]  # global ranks 0 and 2: tp coordinate 0 of each pp rank
    done = []

    # Our model: dropout on shards, on the replicated stream, in attention;
    # traced, then traced with full recompute (R replays F's draws), then
    # cut by hand with the user's own DTensor code.
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, 16, generator=g).double(), torch.randn(8, 6, 4, generator=g).double()
    for how in ("traced", "recompute", "by hand"):
        torch.manual_seed(0)
        reference = _Net().double()
        model = copy.deepcopy(reference)
        if how == "by hand":
            b = model.blocks
            stages = [b[0], torch.nn.Sequential(b[1], model.drop, model.head)]
            pipe = mpmd.from_stages(stages, (x[:2],), model=model)
        else:
            pipe = mpmd.trace(model, (x[:2],), split_before=["blocks.1"])
        runner = mpmd.PipelineRunner(
            pipe,
            mpmd.schedules.OneFOneB(M),
            mesh=mesh,
            loss_fn=F.mse_loss,
            options=mpmd.RunnerOptions(
                timeout=60,
                tp_plan=None if how == "by hand" else _PLAN,
                parallelize=_by_hand if how == "by hand" else None,
                recompute=how == "recompute",
            ),
        )
        torch.manual_seed(1234 + rank)
        out = runner.step(x, target=y)
        b = reference.blocks

        def head(h, t, b=b, reference=reference):
            return F.mse_loss(reference.head(reference.drop(b[1](h))), t)

        expected = _reference([b[0], head], x.chunk(M), y.chunk(M), seeds)
        _check(runner, reference, out.loss, expected, f"rank {rank}, dropout under tp, {how}")
        done.append(how)

    # A second step from other per-rank seeds: the tp peers still agree.
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-2)
    opt.step()
    opt.zero_grad()
    torch.manual_seed(99 * rank)
    out = runner.step(x, target=y)
    assert _tp_equal(out.loss, tp_group), rank
    for name, p in runner.named_parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if not hasattr(p, "placements") or p.placements[0].is_replicate():
            assert _tp_equal(grad, tp_group), (rank, name)

    # nanoGPT (code we did not write) with dropout 0.1, the plan on its MLPs.
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
    reference = GPT(config).double()
    tokens = torch.randint(0, 64, (8, 17), generator=g)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    pipe = mpmd.trace(
        copy.deepcopy(reference),
        (idx[:2],),
        {"targets": targets[:2]},
        split_before=["transformer.h.1"],
    )
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(M),
        mesh=mesh,
        loss_fn=lambda out, target=None: out[1],
        options=mpmd.RunnerOptions(timeout=60, tp_plan=_NANOGPT_PLAN),
    )
    torch.manual_seed(1234 + rank)
    out = runner.step(idx, targets=targets)
    expected = _reference(_nanogpt_stages(reference), idx.chunk(M), targets.chunk(M), seeds)
    _check(runner, reference, out.loss, expected, f"rank {rank}, nanoGPT with dropout")
    # It trains: AdamW steps lower the loss on the batch.
    opt = torch.optim.AdamW(runner.parameters(), lr=3e-2)
    first = float(out.loss)
    for step in range(4):
        opt.step()
        opt.zero_grad()
        torch.manual_seed(1000 * step + rank)
        out = runner.step(idx, targets=targets)
        assert _tp_equal(out.loss, tp_group), (rank, step)
    assert float(out.loss) < first, (first, float(out.loss))
    done.append("nanogpt")
    return done


def test_tp_peers_draw_the_unsharded_models_random_numbers_whatever_each_rank_seeded():
    results = check_all(run_ranks(dropout_under_tp, 4, deadline=300))
    assert all(r == ["traced", "recompute", "by hand", "nanogpt"] for r in results), results
