"""Stages cut by hand (`mpmd.from_stages`): the fallback for code no trace
takes (control flow on tensor values, data-dependent shapes). They run
eagerly under every schedule and the same executor, zero-bubble ones
included (I/W split through autograd), with tied weights, buffers that
train and shapes that change; loss and gradients equal eager gradient
accumulation."""

import copy
import re

import pytest
import torch
import torch.nn as nn
from models import eager_step, lm_loss, square_loss, token_pair
from torch.utils._python_dispatch import TorchDispatchMode

import torchmpmd as mpmd
from torchmpmd.runtime.autograd_split import AutogradSplit
from torchmpmd.testing import LocalPipeline

M = 4
V, D = 16, 8


class Routed(nn.Module):
    """Top-1 routing with `nonzero`, and control flow on a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, 2)
        self.experts = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        self.norm = nn.LayerNorm(D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, D)
        choice = self.gate(x).argmax(-1)
        out = x
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(-1)
            out = out.index_add(0, idx, torch.tanh(expert(x[idx])))
        if out.abs().max() > 3:  # control flow on a value: no trace takes it
            out = out / 2
        return self.norm(out).reshape(h.shape)


class RoutedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Routed() for _ in range(3)])
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight  # tied across the first and last stage

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _stages(model: RoutedLM) -> list[nn.Module]:
    return [
        nn.Sequential(model.embed, model.blocks[0]),
        model.blocks[1],
        model.blocks[2],
        model.head,
    ]


def _pair() -> tuple[RoutedLM, RoutedLM]:
    torch.manual_seed(0)
    model = RoutedLM().double()
    ref = RoutedLM().double()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _eager_losses(ref: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    ref.zero_grad()
    return eager_step(lambda xb, yb: lm_loss(ref(xb), yb), x, y, M, torch.tensor_split).double()


def _assert_grads(local: LocalPipeline, ref: nn.Module) -> None:
    names = set()
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            names.add(fqn)
            expected = ref.get_parameter(fqn).grad
            if expected is None:
                assert p.grad is None or not p.grad.any(), fqn
                continue
            torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-10, msg=fqn)
    assert names >= {n for n, _ in ref.named_parameters()}
    assert names <= {n for n, _ in ref.named_parameters(remove_duplicate=False)}


def test_the_model_cannot_be_traced_and_the_error_points_here():
    model, _ = _pair()
    x, _ = token_pair(V, 2, 5)
    with pytest.raises(Exception, match=re.escape("mpmd.from_stages")):
        mpmd.trace(model, (x,), split_before=["blocks.1"])


@pytest.mark.parametrize(
    ("schedule", "ranks"),
    [
        (mpmd.schedules.GPipe(M), 2),
        (mpmd.schedules.OneFOneB(M), 4),
        (mpmd.schedules.Interleaved1F1B(M), 2),
        (mpmd.schedules.ZeroBubbleH1(M), 4),
        (mpmd.schedules.ZBV(M), 2),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, int) else f"{v}ranks",
)
@pytest.mark.slow
def test_hand_cut_stages_train_like_eager(schedule, ranks):
    model, ref = _pair()
    x, y = token_pair(V, 4 * M, 5)
    pipe = mpmd.from_stages(_stages(model), (x[:4],), model=model)
    assert pipe.tied == {"embed.weight": (0, 3)}
    local = LocalPipeline(pipe, schedule, ranks, loss_fn=lm_loss, timeout=60)
    for step in range(2):  # the second step accumulates onto the first
        if step == 0:
            expected = _eager_losses(ref, x, y)
        else:
            before = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
            expected = _eager_losses(ref, x, y)
            for n, p in ref.named_parameters():
                if n in before:
                    p.grad += before[n]
        outs = local.step(x, target=y)
        for out in outs:
            torch.testing.assert_close(out.losses, expected, rtol=1e-12, atol=1e-12)
        _assert_grads(local, ref)
    torch.testing.assert_close(local.eval_step(x)[0], ref(x), rtol=1e-12, atol=1e-12)


def test_names_follow_the_model_or_a_sequential_of_the_stages():
    model, _ = _pair()
    x, _ = token_pair(V, 2, 5)
    named = mpmd.from_stages(_stages(model), (x,), model=model)
    state = {}
    for s in range(named.num_stages):
        state.update(named.stage(s).state_dict())
    assert set(state) == set(model.state_dict())
    assert "head.weight" in dict(named.stage(3).named_parameters())
    plain = mpmd.from_stages(_stages(model), (x,))
    assert "0.0.weight" in dict(plain.stage(0).named_parameters())
    assert "1.gate.weight" in dict(plain.stage(1).named_parameters())
    with pytest.raises(
        ValueError, match=re.escape("stage 0's tensor '0.weight' is not a parameter")
    ):
        mpmd.from_stages(_stages(model), (x,), model=nn.Linear(2, 2))


def test_stage_errors_name_the_stage():
    x = torch.randn(2, D)
    with pytest.raises(TypeError, match="stage 0 returns leaf 1 \\(int\\)"):

        class Pair(nn.Module):
            def forward(self, x):
                return x, 3

        mpmd.from_stages([Pair(), nn.Linear(D, D)], (x,))
    with pytest.raises(RuntimeError, match="stage 1 \\(Linear\\) failed on the example"):
        mpmd.from_stages([nn.Linear(D, 3), nn.Linear(D, D)], (x,))
    with pytest.raises(TypeError, match="non-empty list of stage modules"):
        mpmd.from_stages(nn.Linear(D, D), (x,))


def test_buffers_train_and_the_probe_changes_nothing():
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)).double(), nn.Linear(D, D).double()]
    ref = copy.deepcopy(nn.Sequential(*stages))
    x = torch.randn(4 * M, D, dtype=torch.float64)
    y = torch.randn(4 * M, D, dtype=torch.float64)
    rng = torch.get_rng_state()
    stats = stages[0][1].running_mean.clone()
    pipe = mpmd.from_stages(stages, (x[:4],))
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(stages[0][1].running_mean, stats)
    assert pipe.stage_specs[0].updates_buffers and not pipe.stage_specs[1].updates_buffers

    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=square_loss, timeout=60)
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        (square_loss(ref(xb), yb) / M).backward()
    local.step(x, target=y)
    state = local.runners[0].state_dict()
    torch.testing.assert_close(state["0.1.running_mean"], ref[0][1].running_mean)
    torch.testing.assert_close(state["0.1.running_var"], ref[0][1].running_var)
    assert int(state["0.1.num_batches_tracked"]) == M
    for fqn, p in local.runners[0].named_parameters():
        torch.testing.assert_close(p.grad, ref.get_parameter(fqn).grad, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_shapes_change_and_the_last_batch_is_partial():
    model, ref = _pair()
    x, _ = token_pair(V, 4, 5)
    pipe = mpmd.from_stages(_stages(model), (x[:1],), model=model)
    local = LocalPipeline(pipe, mpmd.schedules.ZBV(M), 2, loss_fn=lm_loss, timeout=60)
    for batch, seq in [(4, 5), (8, 7), (6, 7), (8, 7)]:
        x, y = token_pair(V, batch, seq, seed=batch + seq)
        expected = _eager_losses(ref, x, y)
        for runner in local.runners:
            for p in runner.parameters():
                p.grad = None
        outs = local.step(x, target=y)
        torch.testing.assert_close(outs[0].losses, expected, rtol=1e-12, atol=1e-12)
        _assert_grads(local, ref)
    # (1 x 5) probed by from_stages; (2 x 7) and, for 6 rows, (1 x 7) once each.
    assert local.runners[0].num_traces == 2


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))


@pytest.mark.parametrize("input_takes_grad", [True, False])
def test_split_through_autograd_does_the_work_of_one_backward(input_takes_grad):
    # I computes input gradients only; W continues from where weight paths
    # branch off, so I + W run exactly the matmuls of one B, and gradients
    # equal B's. With no input taking gradient, I is empty and W is all of B.
    x = torch.randn(4, D, dtype=torch.float64)
    grad = torch.randn(4, D, dtype=torch.float64)
    ref = _mlp().double()
    xr = x.clone().requires_grad_(input_takes_grad)
    out = ref(xr)
    with _CountMatmuls() as b:
        out.backward(grad)

    mlp = _mlp().double()
    split = AutogradSplit(list(mlp.parameters()))
    leaf = x.clone().requires_grad_(input_takes_grad)
    split.keep(0, [mlp(leaf)], [leaf] if input_takes_grad else [])
    with _CountMatmuls() as i:
        input_grads = split.input_grad(0, [grad])
    assert all(p.grad is None for p in mlp.parameters())
    if input_takes_grad:
        torch.testing.assert_close(input_grads[0], xr.grad, rtol=0, atol=0)
    with _CountMatmuls() as w:
        split.weight_grad(0)
    assert i.count + w.count == b.count
    assert i.count == (3 if input_takes_grad else 0)
    for p, q in zip(mlp.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-14, atol=1e-14)


def test_split_through_autograd_with_shared_and_output_only_parameters():
    # A weight used twice (its paths branch off at two nodes, one below the
    # other), a second output that only parameters feed, and an input.
    torch.manual_seed(0)
    lin = nn.Linear(D, D).double()
    bias = nn.Parameter(torch.randn(D, dtype=torch.float64))
    params = [*lin.parameters(), bias]

    def stage(x):
        h = lin(torch.tanh(lin(x)))
        return [h * 2 + x, bias.exp()]

    x = torch.randn(3, D, dtype=torch.float64)
    grads = [torch.randn(3, D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)]
    xr = x.clone().requires_grad_(True)
    torch.autograd.backward(stage(xr), grads)
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    split = AutogradSplit(params)
    leaf = x.clone().requires_grad_(True)
    split.keep(0, stage(leaf), [leaf])
    (gx,) = split.input_grad(0, grads)
    torch.testing.assert_close(gx, xr.grad, rtol=1e-14, atol=1e-14)
    split.weight_grad(0)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=1e-14, atol=1e-14)


def test_a_meta_device_mixture_of_experts_cut_by_hand_is_probed():
    # Its experts run routed tokens with data-dependent sizes (`.tolist()`),
    # which meta tensors do not have: the probe asks the experts modules for
    # their output's shape alone, as a trace does.
    from titan_moe import FirstHalf, MoEArgs, SecondHalf, Transformer

    with torch.device("meta"):
        model = Transformer(MoEArgs()).double()
    x = torch.randint(0, 64, (2, 8))
    pipe = mpmd.from_stages([FirstHalf(model), SecondHalf(model)], (x,), model=model)
    shapes = sorted(tuple(t.spec.shape) for t in pipe.transfers)
    assert shapes == [(), (2, 8, 16)], shapes
