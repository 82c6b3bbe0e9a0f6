"""Split (I/W) stages must train what full backward trains: keep backward
formulas that write in place (adaptive average pooling of a non-contiguous
input writes its gradient with `copy_` into a view of a fresh buffer, a node
nothing reads; cut by dataflow it was dropped and ZB-H1 gave zero gradients
on Swin while 1F1B was exact), and take a step without a target."""

import pytest
import torch
import torch.nn as nn
from models import square_loss
from pipeline_check import trains_like_eager

import torchmpmd as mpmd

M = 4


class PooledMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.pool = nn.AdaptiveAvgPool1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c(self.b(self.a(x)))
        return self.pool(h.transpose(1, 2)).flatten(1)  # as Swin pools its tokens


@pytest.mark.parametrize("cls", [mpmd.schedules.OneFOneB, mpmd.schedules.ZeroBubbleH1])
@pytest.mark.slow
def test_in_place_backward_formulas_survive_the_split(cls):
    x = torch.randn(2 * M, 5, 8, dtype=torch.float64)
    y = torch.randn(2 * M, 8, dtype=torch.float64)
    local, ref = trains_like_eager(
        lambda: PooledMLP().double(), x, y, square_loss, ["b", "c"], cls(M), 3
    )
    checked = {n for r in local.runners for n, _ in r.named_parameters()}
    assert checked == {n for n, _ in ref.named_parameters()}


@pytest.mark.slow
def test_split_stages_step_without_a_target():
    x = torch.randn(2 * M, 5, 8, dtype=torch.float64)
    # No target: the loss function gets None.
    trains_like_eager(
        lambda: PooledMLP().double(),
        x,
        None,
        lambda out, _: out.square().mean(),
        ["b", "c"],
        mpmd.schedules.ZeroBubbleH1(M),
        3,
    )


class BiasAndWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.bias) @ self.weight


def test_weight_gradients_never_alias_what_w_was_given():
    # d/d(bias) is W's input passed straight through (the gradient of x + bias):
    # it must be copied into .grad, while the weight's fresh gradient may be
    # taken as it is; either way later microbatches accumulate exactly.
    from torchmpmd.graph.split import SplitStage

    module = torch.fx.symbolic_trace(BiasAndWeight())
    names = [n for n, _ in module.named_parameters()]

    def fn(params, buffers, xs):
        return [
            torch.func.functional_call(module, dict(zip(names, params, strict=True)), tuple(xs))
        ]

    x = torch.randn(3, 4, dtype=torch.float64)
    split = SplitStage(module, fn, [x], [0], None)
    w_graph, w_outputs = split._weight_grad, []

    def recorded(*args):
        out = w_graph(*args)
        w_outputs.append(out)
        return out

    split._weight_grad = recorded
    expected = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    given = []
    for _ in range(2):
        x, g = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
        saved = split.forward([x])[1:]
        _, for_w = split.input_grad(saved, [g])
        split.weight_grad(for_w)
        given += [t for t in for_w if isinstance(t, torch.Tensor)]
        leaf = {n: p.detach().requires_grad_() for n, p in module.named_parameters()}
        out = torch.func.functional_call(module, leaf, (x,))
        for n, grad in zip(leaf, torch.autograd.grad(out, list(leaf.values()), g), strict=True):
            expected[n] += grad
    params = dict(module.named_parameters())
    pointers = {t.untyped_storage().data_ptr() for t in [*given, *params.values()]}
    for n, p in params.items():
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=1e-12)
        assert p.grad.untyped_storage().data_ptr() not in pointers, n
    # The weight's gradient (a fresh matmul) was taken from W without a copy.
    weight_from_w = w_outputs[0][names.index("weight")]
    assert params["weight"].grad.untyped_storage().data_ptr() == (
        weight_from_w.untyped_storage().data_ptr()
    )


def test_w_starts_from_what_i_computed_last():
    # I runs the backward from the last layer to the first, so the first
    # layer's output gradient is the freshest tensor I hands to W. W starts
    # there (still in cache when W follows I) and its gradients are exact.
    from torchmpmd.graph.split import SplitStage

    model = nn.Sequential(*(nn.Linear(8, 8, dtype=torch.float64) for _ in range(3)))
    module = torch.fx.symbolic_trace(model)
    names = [n for n, _ in module.named_parameters()]

    def fn(params, buffers, xs):
        return [
            torch.func.functional_call(module, dict(zip(names, params, strict=True)), tuple(xs))
        ]

    x, g = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    split = SplitStage(module, fn, [x], [0], None)
    w_graph = split.joint.weight_grad
    mms = [n for n in w_graph.graph.nodes if n.target is torch.ops.aten.mm.default]
    returned = list(w_graph.graph.output_node().args[0])
    # Each mm's gradient goes to one weight; the first mm W runs is layer 0's.
    weight_of = {}
    for i, out in enumerate(returned):
        node = out
        while node.target is not torch.ops.aten.mm.default and node.all_input_nodes:
            node = node.all_input_nodes[0]
        if node.target is torch.ops.aten.mm.default:
            weight_of[node] = names[split.joint.grad_params[i]]
    assert [weight_of[n] for n in mms] == ["0.weight", "1.weight", "2.weight"]
    saved = split.forward([x])[1:]
    _, for_w = split.input_grad(saved, [g])
    split.weight_grad(for_w)
    leaf = {n: p.detach().requires_grad_() for n, p in module.named_parameters()}
    out = torch.func.functional_call(module, leaf, (x,))
    for n, grad in zip(leaf, torch.autograd.grad(out, list(leaf.values()), g), strict=True):
        assert torch.equal(dict(module.named_parameters())[n].grad, grad), n


class TransposedHandoff(nn.Module):
    """Stage 0 ends in a transposed view (as ConvNeXt's layers end in a
    permute): its output, and the gradient it was traced with, are not
    contiguous; the gradient stage 1 sends back is."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(5, 4)
        self.c = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).transpose(1, 2)  # (batch, 6, 5), strided (30, 1, 6)
        return self.c(torch.tanh(self.b(h)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule", [mpmd.schedules.ZeroBubbleH1(M), mpmd.schedules.ZBV(M)], ids=["zbh1", "zbv"]
)
def test_a_stage_whose_output_is_a_transposed_view_splits(schedule):
    x = torch.randn(2 * M, 5, 8, dtype=torch.float64)
    y = torch.randn(2 * M, 6, 3, dtype=torch.float64)
    trains_like_eager(
        lambda: TransposedHandoff().double(),
        x,
        y,
        square_loss,
        ["b"],
        schedule,
        2 if isinstance(schedule, mpmd.schedules.ZeroBubbleH1) else 1,
    )
