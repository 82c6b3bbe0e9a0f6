"""Bad split specs and untraceable models fail before anything runs, with a
message that names the module, node or input and says how to fix it."""

import re

import pytest
import torch
from models import CASES, MLP

import torchmpmd as mpmd


def _mlp():
    torch.manual_seed(0)
    return MLP(8, 4), (torch.randn(2, 8),)


def test_unknown_module_path_suggests_close_names():
    model, args = _mlp()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "graph: split_before names 'layer.2', which is not a module of the model. "
            "Closest module paths: 'layers.2', 'layers', 'layers.0'."
        ),
    ):
        mpmd.trace(model, args, split_before=["layer.2"])


def test_split_point_listed_twice():
    model, args = _mlp()
    with pytest.raises(ValueError, match=re.escape("split_after lists 'layers.1' twice")):
        mpmd.trace(model, args, split_after=["layers.1", "layers.1"])


def test_never_executed_module():
    class M(MLP):
        def __init__(self):
            super().__init__(8, 4)
            self.unused = torch.nn.Linear(8, 8)

    torch.manual_seed(0)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "graph: split_before names module 'unused', but it never ran in the traced forward"
        ),
    ):
        mpmd.trace(M(), (torch.randn(2, 8),), split_before=["unused"])


def test_module_that_runs_twice():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.a(self.b(self.a(x)))

    with pytest.raises(
        ValueError,
        match=re.escape(
            "split_after names module 'a', which runs 2 times in one forward (calls starting at "
            "nodes 'linear', 'linear_2')"
        ),
    ):
        mpmd.trace(Twice(), (torch.randn(2, 8),), split_after=["a"])


def test_split_points_out_of_order_flow_backwards():
    model, args = _mlp()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "graph: node 'linear_3' (aten.linear.default in module 'layers.3') in stage 1 uses "
            "'tanh_2' (aten.tanh.default in the root module), which stage 2 computes: values must "
            "flow from earlier stages to later ones"
        ),
    ):
        mpmd.trace(model, args, split_before=["layers.3", "layers.1"])


def test_empty_stages():
    model, args = _mlp()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "graph: stage 0 of 2 is empty: no operation runs before split_before 'layers.0'"
        ),
    ):
        mpmd.trace(model, args, split_before=["layers.0"])
    seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with pytest.raises(
        ValueError,
        match=re.escape("graph: stage 1 of 2 is empty: no operation runs after split_after '1'"),
    ):
        mpmd.trace(seq, args, split_after=["1"])

    class Adjacent(MLP):
        def forward(self, x):
            x = mpmd.mark_stage_end(torch.tanh(self.layers[0](x)))
            x = mpmd.mark_stage_end(x)
            return self.layers[1](x)

    torch.manual_seed(0)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "graph: stage 1 of 3 is empty: no operation runs between the 1st mark_stage_end call"
        ),
    ):
        mpmd.trace(Adjacent(8, 2), args)


def test_split_before_and_after_together():
    model, args = _mlp()
    with pytest.raises(ValueError, match="pass split_before or split_after, not both"):
        mpmd.trace(model, args, split_before=["layers.1"], split_after=["layers.2"])


def test_markers_and_split_list_together():
    torch.manual_seed(0)
    case = CASES["marked"]
    with pytest.raises(ValueError, match=re.escape("calls mpmd.mark_stage_end 2 time")):
        mpmd.trace(case.model(), (torch.randn(2, 16),), split_before=["layers.1"])


def test_split_list_given_as_a_string():
    model, args = _mlp()
    with pytest.raises(TypeError, match=re.escape("write ['layers.1']")):
        mpmd.trace(model, args, split_before="layers.1")


def test_untraceable_model_names_module_and_line():
    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(4, 4)

        def forward(self, x):
            if self.gate(x).sum() > 0:  # branches on a tensor value
                return x * 2
            return x

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = torch.nn.Linear(4, 4)
            self.block = DataDependent()

        def forward(self, x):
            return self.block(self.pre(x))

    with pytest.raises(RuntimeError) as err:
        mpmd.trace(Outer(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "in module 'block' (DataDependent)" in msg
    assert "if self.gate(x).sum() > 0" in msg
    assert "control flow depends on tensor values" in msg


def test_pipe_rejects_inputs_unlike_the_trace():
    model, args = _mlp()
    pipe = mpmd.trace(model, args, split_before=["layers.2"])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pipeline input 'args[0]' has shape (3, 8) and dtype torch.float32, but the pipeline was "
            "traced with shape (2, 8) and dtype torch.float32"
        ),
    ):
        pipe(torch.randn(3, 8))

    case = CASES["kwargs"]
    model = case.model()
    args, kwargs = case.inputs(2)
    pipe = mpmd.trace(model, args, kwargs, **case.split)
    with pytest.raises(
        ValueError, match=re.escape("pipeline input 'residual' was True when traced, got False")
    ):
        pipe(*args, **{**kwargs, "residual": False})
    with pytest.raises(TypeError, match=re.escape("got unexpected ['extra']")):
        pipe(*args, **kwargs, extra=1)
    # Keyword order does not matter.
    reordered = dict(reversed(list(kwargs.items())))
    assert torch.equal(pipe(*args, **reordered)["y"], model(*args, **kwargs)["y"])


def test_model_returning_nothing_is_told_to_return_its_output():
    class NoOutput(MLP):
        def forward(self, x):
            super().forward(x)

    model = NoOutput(8, 4)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "NoOutput.forward returns no tensor computed from its inputs (it returned None)"
        ),
    ):
        mpmd.trace(model, (torch.randn(2, 8),), split_before=["layers.2"])


def test_example_args_as_a_list_or_missing_say_what_to_pass():
    model, (x,) = _mlp()
    with pytest.raises(TypeError, match=re.escape("example_args is a list; pass the positional")):
        mpmd.trace(model, [x], split_before=["layers.2"])
    with pytest.raises(
        TypeError,
        match=re.escape(
            "the example inputs do not fit MLP.forward(x): missing a required argument"
        ),
    ):
        mpmd.trace(model, split_before=["layers.2"])
