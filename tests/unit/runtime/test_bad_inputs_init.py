"""Bad inputs to a runner's construction and initialisation, as a hurried
user gives them: each fails before anything runs, with the exception type a
Python user expects and a message naming the problem (the rank, stage and
parameter involved) and the fix; never a confusing error from a later stage
of the setup, nor a silent success that fails raw at the first step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from catalogue import Case, cases, clear_error, tiny_model, tiny_pipe
from models import square_loss

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

S = mpmd.schedules
M = 2


def _local(num_ranks: int = 2, **kwargs: Any) -> LocalPipeline:
    kwargs.setdefault("loss_fn", square_loss)
    kwargs.setdefault("timeout", 5)
    return LocalPipeline(tiny_pipe(), S.GPipe(M), num_ranks, **kwargs)


def _runner() -> mpmd.PipelineRunner:
    return _local().runners[0]


def _install(weight: Callable[[], torch.Tensor]) -> Callable[[nn.Module], None]:
    """An init function that assigns a new weight instead of writing it."""

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(weight())

    return init


class _PerModuleInit(nn.Module):
    """examples/gpt.py's pattern: `init_weights(m)` initialises one module."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    @staticmethod
    def init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _per_module_runner() -> mpmd.PipelineRunner:
    pipe = mpmd.trace(_PerModuleInit(), (torch.randn(2, 4),), split_before=["b"])
    return LocalPipeline(pipe, S.GPipe(M), 2, timeout=5).runners[0]


# (id, callable, exception type, message pattern)
CASES: list[Case] = [
    # ---- data parallelism
    (
        "fsdp without a mesh, more ranks than stages",
        lambda: _local(4, data_parallel="fsdp"),
        ValueError,
        r"data_parallel='fsdp' needs a mesh with a 'dp' dimension \(mesh=, got none\)",
    ),
    (
        "replicate without a mesh",
        lambda: _local(2, data_parallel="replicate"),
        ValueError,
        r"data_parallel='replicate' needs a mesh with a 'dp' dimension.*init_device_mesh",
    ),
    (
        "data parallel mode misspelt",
        lambda: _local(4, data_parallel="ddp"),
        ValueError,
        r"data_parallel='ddp': use 'replicate' or 'fsdp'",
    ),
    # ---- init_weights
    (
        "init installs a weight of the wrong shape",
        lambda: _runner().init_weights(_install(lambda: torch.empty(3, 3))),
        ValueError,
        r"rank 0: the init function replaced '0\.weight' \(stage 0\) with a tensor of shape "
        r"\(3, 3\).*the stage needs shape \(4, 4\).*in place",
    ),
    (
        "init installs a weight of the wrong dtype",
        lambda: _runner().init_weights(_install(lambda: torch.empty(4, 4, dtype=torch.float64))),
        ValueError,
        r"replaced '0\.weight' \(stage 0\).*dtype torch\.float64.*needs .*dtype torch\.float32",
    ),
    (
        "init installs a weight on the meta device",
        lambda: _runner().init_weights(_install(lambda: torch.empty(4, 4, device="meta"))),
        ValueError,
        r"replaced '0\.weight' \(stage 0\).* on meta, but the stage needs .* on cpu",
    ),
    (
        "init function not callable",
        lambda: _runner().init_weights(3),
        TypeError,
        r"fn must be a function of one module.*got int",
    ),
    (
        "root init on a model without one",
        lambda: _runner().init_weights(),
        TypeError,
        r"rank 0: the model \(Sequential\) has no init_weights\(\) or reset_parameters\(\)"
        r".*runner\.init_weights\(fn\)",
    ),
    (
        "root init that initialises one module",
        lambda: _per_module_runner().init_weights(),
        TypeError,
        r"_PerModuleInit\.init_weights takes \['m'\].*runner\.init_weights\(_PerModuleInit"
        r"\.init_weights\)",
    ),
]


@cases(CASES)
def test_bad_input_gets_a_clear_error(call, kind, pattern):
    clear_error(call, kind, pattern)


def test_a_refused_replacement_leaves_the_stage_and_the_model_as_they_were():
    model = tiny_model()
    local = LocalPipeline(
        mpmd.trace(model, (torch.randn(2, 4),), split_before=["2"]), S.GPipe(M), 2, timeout=5
    )
    runner = local.runners[0]
    before = {n: p.detach().clone() for n, p in runner.named_parameters()}
    held = dict(runner.named_parameters())
    with pytest.raises(ValueError, match=r"replaced '0\.weight'"):
        runner.init_weights(_install(lambda: torch.empty(3, 3)))
    # The same tensor objects, with the same values.
    assert {n: id(p) for n, p in runner.named_parameters()} == {n: id(p) for n, p in held.items()}
    for n, p in runner.named_parameters():
        assert torch.equal(p, before[n]), n
    assert model[0].weight.shape == (4, 4)
    assert model[0].weight is not held["0.weight"]  # the model keeps its own


def test_a_replacement_that_fits_is_taken():
    local = _local()
    local.init_weights(_install(lambda: torch.full((4, 4), 0.5)))
    for runner in local.runners:
        for name, p in runner.named_parameters():
            if name.endswith("weight"):
                assert torch.equal(p, torch.full((4, 4), 0.5)), name
    x = torch.randn(4, 4)
    assert torch.isfinite(local.step(x, target=x)[0].loss)
