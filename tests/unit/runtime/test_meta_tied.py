"""Meta-device models whose weights are tied across ranks: the ranks agree
on the job whichever copies they allocated (a rank holding one copy of a
tied weight describes the same job as one holding none), the copies of a
tied weight are equal on every rank after `init_weights` and
`load_state_dict`, and from the first call for copies built apart (the rank
of the tie's first stage gives its value), and
`init_weights()` runs a torchtitan model's own root `init_weights()`. Each
step equals the unpipelined model holding the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from models import eager_step, hf_llama, lm_loss, tokens
from public_models import GPT, GPTConfig, LayerNorm, Transformer, TransformerModelArgs

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4


# ---- a pre-norm transformer LM with its output tied to its embedding


class PreNormBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.ff(self.norm(h)))


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(PreNormBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h))


def _merged_state(local: LocalPipeline) -> dict[str, torch.Tensor]:
    """Every rank's weights under the model's names, lower ranks first."""
    out: dict[str, torch.Tensor] = {}
    for runner in local.runners:
        for name, t in runner.state_dict().items():
            out.setdefault(name, t.detach().clone())
    return out


def _tied_copies(local: LocalPipeline, names: set[str]) -> list[tuple[int, torch.Tensor]]:
    """Each rank's copy of the tied weight known by `names`."""
    return [
        (r, p.detach())
        for r, runner in enumerate(local.runners)
        for name, p in runner.named_parameters()
        if name in names
    ]


def _check_step(
    local: LocalPipeline,
    ref: nn.Module,
    outs: list[mpmd.StepOutput],
    losses: torch.Tensor,
    tol: float,
) -> None:
    for out in outs:
        torch.testing.assert_close(out.losses, losses, rtol=tol, atol=tol)
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            expected = ref.get_parameter(fqn).grad
            torch.testing.assert_close(p.grad, expected, rtol=tol, atol=tol, msg=fqn)


@pytest.mark.slow
def test_a_tie_held_by_some_ranks_only_describes_the_same_job():
    # 4 stages on 4 ranks: ranks 0 and 3 hold the tied pair, 1 and 2 do not.
    with torch.device("meta"):
        model = TiedLM().double()
    ids = tokens(32, 2, 6)
    pipe = mpmd.trace(model, (ids.to("meta"),), split_before=["blocks.1", "blocks.2", "blocks.3"])
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 4, loss_fn=lm_loss, timeout=60)
    assert [r.local_stages for r in local.runners] == [[0], [1], [2], [3]]
    torch.manual_seed(0)
    ref = TiedLM().double()
    local.load_state_dict(ref.state_dict())
    x, y = tokens(32, 4 * M, 6, seed=1), tokens(32, 4 * M, 6, seed=2)
    outs = local.step(x, target=y)
    losses = eager_step(lambda xb, yb: lm_loss(ref(xb), yb), x, y, M)
    _check_step(local, ref, outs, losses, 1e-10)


def _check_nanogpt_step(local: LocalPipeline, config: GPTConfig) -> None:
    """A step equals the plain nanoGPT holding the runners' weights."""
    ref = GPT(config).double()
    state = _merged_state(local)
    ref.load_state_dict({**state, "lm_head.weight": state["transformer.wte.weight"]}, strict=True)
    x = tokens(config.vocab_size, 4 * M, 8, seed=3)
    y = tokens(config.vocab_size, 4 * M, 8, seed=4)
    outs = local.step(x, targets=y)
    losses = eager_step(lambda xb, yb: ref(xb, targets=yb)[1], x, y, M)
    _check_step(local, ref, outs, losses, 1e-10)


def _nanogpt_meta_pipe(config: GPTConfig) -> tuple[GPT, mpmd.Pipe]:
    with torch.device("meta"):
        model = GPT(config).double()
    idx = tokens(config.vocab_size, 2, 8).to("meta")
    targets = tokens(config.vocab_size, 2, 8, seed=1).to("meta")
    return model, mpmd.trace(model, (idx,), {"targets": targets}, split_before=["transformer.h.1"])


@pytest.mark.slow
def test_nanogpt_tied_weights_are_initialised_equal_on_every_rank():
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    model, pipe = _nanogpt_meta_pipe(config)

    def init(m: nn.Module) -> None:
        model._init_weights(m)
        if isinstance(m, LayerNorm):  # nanoGPT's own LayerNorm starts at ones and zeros
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    local = LocalPipeline(
        pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lambda out, _: out[1], timeout=60
    )
    assert list(pipe.tied.values()) == [(0, 1)]
    local.init_weights(init)
    tie = {"transformer.wte.weight", "lm_head.weight"}
    copies = _tied_copies(local, tie)
    assert [r for r, _ in copies] == [0, 1]
    # Rank 1's copy is rank 0's (the tie's first stage), bit for bit, and it
    # follows the model's init (std 0.02), not some other.
    assert torch.equal(copies[0][1], copies[1][1])
    assert 0.015 < float(copies[0][1].std()) < 0.025

    # The step equals the plain nanoGPT holding the owner's values.
    _check_nanogpt_step(local, config)

    # load_state_dict too: a per-rank state dict whose copies differ ends equal.
    other = GPT(config).double().state_dict()
    local.on_all_ranks(lambda r: r.load_state_dict({k: v + r.rank for k, v in other.items()}))
    copies = _tied_copies(local, tie)
    assert torch.equal(copies[1][1], other["transformer.wte.weight"])
    assert torch.equal(copies[0][1], copies[1][1])


@pytest.mark.slow
def test_real_tied_copies_built_apart_are_equal_from_the_first_call():
    # A real model built on each rank from its own seed gives each rank its
    # own copy of the tied weight: they must not train apart. At the first
    # call the tie's first stage's rank gives its copy, as DDP's replicas
    # take rank 0's weights at construction.
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT(config).double()
    x = tokens(config.vocab_size, 4 * M, 8, seed=3)
    y = tokens(config.vocab_size, 4 * M, 8, seed=4)
    pipe = mpmd.trace(model, (x[:4],), {"targets": y[:4]}, split_before=["transformer.h.1"])
    local = LocalPipeline(
        pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lambda out, _: out[1], timeout=60
    )
    tie = {"transformer.wte.weight", "lm_head.weight"}
    with torch.no_grad():  # rank 1's copy as another seed would have made it
        _tied_copies(local, tie)[1][1].add_(torch.randn(config.vocab_size, config.n_embd))
    outs = local.step(x, targets=y)
    copies = _tied_copies(local, tie)
    assert torch.equal(copies[0][1], copies[1][1])
    assert torch.equal(copies[0][1], model.transformer.wte.weight)
    losses = eager_step(lambda xb, yb: model(xb, targets=yb)[1], x, y, M)
    _check_step(local, model, outs, losses, 1e-10)


@pytest.mark.slow
def test_an_init_that_assigns_new_parameters_keeps_the_tie():
    # An init function may assign a new parameter rather than write the one
    # it finds: its values must reach the tensor the tie map, the executor
    # and data parallelism hold, so the copies still end equal and tied.
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    _, pipe = _nanogpt_meta_pipe(config)
    local = LocalPipeline(
        pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lambda out, _: out[1], timeout=60
    )
    counter = iter(range(1, 10_000))

    def init(m: nn.Module) -> None:
        for name, p in list(m._parameters.items()):
            if p is not None:
                value = float(next(counter)) / 100
                setattr(m, name, nn.Parameter(torch.full_like(p, value)))

    local.init_weights(init)
    tie = {"transformer.wte.weight", "lm_head.weight"}
    copies = _tied_copies(local, tie)
    assert torch.equal(copies[0][1], copies[1][1])
    for runner in local.runners:  # the tie map holds the stage's own tensor
        held = {id(p) for _, p in runner.named_parameters()}
        assert all(id(p) in held for p in runner._traced.tied_parameters.values())
    _check_nanogpt_step(local, config)


def test_a_rank_whose_stages_hold_no_tensor_takes_part_in_init_weights():
    # Stage 1 is parameter-free: its rank has nothing to initialise, but the
    # call is collective (the tie of stages 0 and 2 spans ranks 0 and 2), so
    # it must not refuse alone and leave the others waiting.
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(16, 8)
            self.act = nn.Tanh()
            self.out = nn.Linear(8, 16, bias=False)
            self.out.weight = self.tok.weight

        def forward(self, ids):
            return self.out(self.act(self.tok(ids)))

    with torch.device("meta"):
        model = Tied()
    ids = tokens(16, 2, 4).to("meta")
    pipe = mpmd.trace(model, (ids,), split_before=["act", "out"])
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(M), 3, timeout=30)
    local.init_weights(lambda m: nn.init.normal_(m.weight) if isinstance(m, nn.Embedding) else None)
    copies = _tied_copies(local, {"tok.weight", "out.weight"})
    assert [r for r, _ in copies] == [0, 2]
    assert torch.equal(copies[0][1], copies[1][1])


def _titan_args() -> TransformerModelArgs:
    return TransformerModelArgs(
        dim=16,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=64,
        multiple_of=16,
        max_seq_len=16,
    )


def _deterministic_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.nn.init's random fills made a function of (shape, mean, std),
    so that an init that ran on a few tensors of a meta model equals the one
    run on the whole model, exactly; a wrong std (a layer's depth rule not
    followed) shows as a wrong value."""

    def pattern(t: torch.Tensor) -> torch.Tensor:
        n = torch.arange(t.numel(), dtype=torch.float64, device=t.device)
        return torch.sin(n * 0.7 + 0.3 * t.shape[0]).reshape(t.shape)

    def normal_(t, mean=0.0, std=1.0, generator=None):
        with torch.no_grad():
            return t.copy_(mean + std * pattern(t))

    def trunc_normal_(t, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        with torch.no_grad():
            return t.copy_((mean + std * 1.5 * pattern(t)).clamp(a, b))

    monkeypatch.setattr(nn.init, "normal_", normal_)
    monkeypatch.setattr(nn.init, "trunc_normal_", trunc_normal_)


@pytest.mark.slow
def test_torchtitan_model_initialises_from_its_root(monkeypatch):
    _deterministic_init(monkeypatch)
    args = _titan_args()
    with torch.device("meta"):
        model = Transformer(args).double()
    ids = tokens(args.vocab_size, 2, 8).to("meta")
    pipe = mpmd.trace(model, (ids,), split_before=["layers.2"])
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lm_loss, timeout=60)
    local.init_weights()

    ref = Transformer(args).double()
    ref.init_weights()  # again, in float64
    expected = ref.state_dict()
    for runner in local.runners:
        for name, t in runner.state_dict().items():
            torch.testing.assert_close(t, expected[name], rtol=0, atol=0, msg=name)
        for s in runner.local_stages:
            # The RoPE table, which no state dict holds, was recomputed.
            table = runner.local_modules()[runner.local_stages.index(s)].get_buffer("freqs_cis")
            assert torch.equal(table, ref.freqs_cis)
    # Each layer's output projection took its own depth's std.
    stds = [float(ref.layers[str(i)].attention.wo.weight.detach().abs().max()) for i in range(4)]
    assert stds == sorted(stds, reverse=True) and len(set(stds)) == 4
    # The model keeps its meta tensors.
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])

    x = tokens(args.vocab_size, 4 * M, 8, seed=3)
    y = tokens(args.vocab_size, 4 * M, 8, seed=4)
    outs = local.step(x, target=y)
    losses = eager_step(lambda xb, yb: lm_loss(ref(xb), yb), x, y, M)
    _check_step(local, ref, outs, losses, 1e-10)


@pytest.mark.slow
def test_torchtitan_root_init_with_torch_random_numbers():
    # Unpatched: the values are random, so the check is that the step equals
    # the plain model holding the runners' weights, the RoPE table is right,
    # and each rank ran the init of its own layers (depth-dependent std).
    args = _titan_args()
    with torch.device("meta"):
        model = Transformer(args).double()
    pipe = mpmd.trace(model, (tokens(args.vocab_size, 2, 8).to("meta"),), split_before=["layers.2"])
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lm_loss, timeout=60)
    local.init_weights()
    ref = Transformer(args).double()
    state = _merged_state(local)
    ref.load_state_dict(state)
    for runner in local.runners:
        modules = runner.local_modules()
        assert all(torch.equal(m.get_buffer("freqs_cis"), ref.freqs_cis) for m in modules)
    std_0 = float(state["layers.0.feed_forward.w2.weight"].std())
    std_3 = float(state["layers.3.feed_forward.w2.weight"].std())
    # 0.02 / sqrt(2) and 0.02 / sqrt(8): 2x apart, well beyond sampling noise.
    assert 1.6 < std_0 / std_3 < 2.5, (std_0, std_3)
    x = tokens(args.vocab_size, 4 * M, 8, seed=3)
    y = tokens(args.vocab_size, 4 * M, 8, seed=4)
    outs = local.step(x, target=y)
    losses = eager_step(lambda xb, yb: lm_loss(ref(xb), yb), x, y, M)
    _check_step(local, ref, outs, losses, 1e-10)


class TiedInInit(nn.Module):
    """Ties its head to its embedding in its own init_weights, as a torchtitan
    model with weight tying may, not in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.output = nn.Linear(16, 32, bias=False)

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.reset_parameters()
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.output(h)


@pytest.mark.slow
def test_a_tie_made_in_init_after_tracing_is_refused_naming_both():
    # Traced untied, the head on rank 1 would take the model's meta embedding
    # (rank 1 holds none): refused, naming both parameters and the fix.
    with torch.device("meta"):
        model = TiedInInit()
    pipe = mpmd.trace(model, (tokens(32, 2, 6).to("meta"),), split_before=["layers.1"])
    assert not pipe.tied
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lm_loss, timeout=30)
    with pytest.raises(
        ValueError, match=r"assigns 'tok_embeddings.weight' in place of 'output.weight' \(stage 1\)"
    ):
        local.init_weights()
    # The fix it gives: the model's own init on the meta model, then trace.
    with torch.device("meta"):
        model = TiedInInit().double()
    model.init_weights()
    pipe = mpmd.trace(model, (tokens(32, 2, 6).to("meta"),), split_before=["layers.1"])
    assert list(pipe.tied.values()) == [(0, 1)]
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lm_loss, timeout=30)
    local.init_weights()
    copies = _tied_copies(local, {"tok_embeddings.weight", "output.weight"})
    assert torch.equal(copies[0][1], copies[1][1])
    ref = TiedInInit().double()
    ref.load_state_dict({**_merged_state(local), "output.weight": copies[0][1]})
    ref.output.weight = ref.tok_embeddings.weight
    x, y = tokens(32, 4 * M, 6, seed=1), tokens(32, 4 * M, 6, seed=2)
    outs = local.step(x, target=y)
    losses = eager_step(lambda xb, yb: lm_loss(ref(xb), yb), x, y, M)
    _check_step(local, ref, outs, losses, 1e-10)


@pytest.mark.slow
def test_a_meta_tensor_in_a_stage_is_named_before_the_first_step():
    # Whatever put it there, a stage holding a meta tensor fails at the
    # step's checks naming it, not inside the forward.
    with torch.device("meta"):
        model = TiedLM()
    pipe = mpmd.trace(model, (tokens(32, 2, 6).to("meta"),), split_before=["blocks.2"])
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=lm_loss, timeout=30)
    local.init_weights(lambda m: [nn.init.zeros_(p) for p in m.parameters(recurse=False)])
    stage = local.runners[1].local_modules()[0]
    stage.get_submodule("norm").weight = nn.Parameter(torch.empty(16, device="meta"))
    x, y = tokens(32, 4 * M, 6, seed=1), tokens(32, 4 * M, 6, seed=2)
    with pytest.raises(RuntimeError, match=r"'norm.weight' \(stage 1\) is on the meta device"):
        local.step(x, target=y)


def _logits_loss(out: object, y: torch.Tensor) -> torch.Tensor:
    logits = out["logits"] if isinstance(out, dict) else out.logits  # type: ignore[attr-defined]
    return lm_loss(logits, y)


@pytest.mark.slow
@pytest.mark.parametrize("marked", [False, True], ids=["fresh", "initialised-on-meta"])
def test_hugging_face_root_init_writes_every_rank(marked):
    # Hugging Face marks each module it initialises (_is_hf_initialized) and
    # skips it afterwards: the ranks sharing this process's model, or a model
    # whose own init ran on the meta device first, must still be initialised.
    with torch.device("meta"):
        model = hf_llama().double()
    if marked:
        model.init_weights()
    kwargs = {"use_cache": False}
    ids = tokens(96, 2, 8).to("meta")
    pipe = mpmd.trace(model, (ids,), kwargs, split_before=["model.layers.2"])
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=_logits_loss, timeout=60)
    local.init_weights()
    ref = hf_llama().double()
    ref.load_state_dict(_merged_state(local))  # strict: every tensor came from a rank
    for runner in local.runners:
        for name, t in runner.state_dict().items():
            assert torch.isfinite(t).all(), name
    # Each rank ran the model's init: std 0.02 weights, and RoPE's inverse frequencies.
    assert 0.01 < float(ref.model.layers[3].mlp.down_proj.weight.detach().std()) < 0.03
    x = tokens(96, 2 * M, 8, seed=3)
    y = tokens(96, 2 * M, 8, seed=4)
    outs = local.step(x, target=y, **kwargs)
    losses = eager_step(lambda xb, yb: _logits_loss(ref(xb, **kwargs), yb), x, y, M)
    _check_step(local, ref, outs, losses, 1e-10)
