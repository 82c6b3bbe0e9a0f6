"""Bad inputs at the trace front-end (a batch the model cannot take, a meta
model run or traced against real tensors): each fails with the right
exception type and a message that names the problem and the fix, before any
message is exchanged; never advice to make working code traceable, a raw
device error from inside torch, or a state dict that no longer loads."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from catalogue import Case, cases, clear_error, tiny_model, tiny_pipe
from models import square_loss

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

S = mpmd.schedules
M = 2


def _local() -> LocalPipeline:
    pipe = tiny_pipe()
    return LocalPipeline(pipe, S.GPipe(M), 2, loss_fn=square_loss, timeout=5)


def _meta_pipe() -> mpmd.Pipe:
    with torch.device("meta"):
        model = tiny_model()
    return mpmd.trace(model, (torch.randn(2, 4, device="meta"),), split_before=["2"])


class _OnesOnCpu(nn.Module):
    """Adds a tensor its forward creates without a device: the CPU's."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + torch.ones(4)


def _meta_ones_on_cpu() -> nn.Module:
    with torch.device("meta"):
        return _OnesOnCpu()


class _LegacyParameter(nn.Module):
    """Holds a parameter made by torch.Tensor(n), which ignores torch.device('meta')
    (as Hugging Face's Wav2Vec2 does for masked_spec_embed)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.offset = nn.Parameter(torch.Tensor(4).uniform_())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h[x[:, 0] > 0] = self.offset  # index_put_: "Mismatching ... device between"
        return h + self.offset


def _meta_with_legacy_parameter() -> nn.Module:
    with torch.device("meta"):
        model = _LegacyParameter()
    assert model.offset.device.type == "cpu" and model.proj.weight.is_meta
    return model


x, y = torch.randn(4, 4), torch.randn(4, 4)

# (id, callable, exception type, message pattern)
CASES: list[Case] = [
    (
        "batch with a wrong feature size",
        lambda: _local().step(torch.randn(4, 5), target=y),
        ValueError,
        r"input 'args\[0\]' has shape \(2, 5\) where the pipeline was traced with \(2, 4\).*"
        r"tracing the model for them failed \(.*in module '0' \(Linear\).*\): "
        r"the batch probably does not fit the model",
    ),
    (
        "meta pipe called directly",
        lambda: _meta_pipe()(x[:2]),
        RuntimeError,
        r"parameters and buffers \('0.weight', ...\) are on the meta device: they have shapes "
        r"but no values.*PipelineRunner.*init_weights.*load_state_dict.*trace a model built on "
        r"a real device",
    ),
    (
        "meta model making a CPU tensor in forward",
        lambda: mpmd.trace(_meta_ones_on_cpu(), (x,)),
        RuntimeError,
        r"in the root module \(_OnesOnCpu\).*To fix: the model's tensors are on the meta device "
        r"and forward mixes them with a tensor it creates on a real device.*device=x.device",
    ),
    (
        "meta model holding a tensor built off the meta device",
        lambda: mpmd.trace(_meta_with_legacy_parameter(), (x,)),
        RuntimeError,
        r"in the root module \(_LegacyParameter\).*Mismatching.*To fix: the model is on the meta "
        r"device but 1 of its tensors is not: 'offset' \(cpu\).*model.to\('meta'\)",
    ),
    (
        "real model traced with meta inputs",
        lambda: mpmd.trace(tiny_model(), (x.to("meta"),)),
        RuntimeError,
        r"in module '0' \(Linear\).*To fix: the example inputs are on the meta device and the "
        r"model's tensors on cpu: pass example inputs on the model's device",
    ),
]


@cases(CASES)
def test_bad_input_gets_a_clear_error(call, kind, pattern):
    text = clear_error(call, kind, pattern)
    assert "make that code traceable" not in text, text


def test_a_batch_that_does_not_fit_leaves_the_runner_usable():
    # Every rank refuses the batch while tracing it, before any message.
    local = _local()
    with pytest.raises(ValueError, match="does not fit the model"):
        local.step(torch.randn(4, 5), target=y)
    assert not any(r.communicated for r in local.runners)
    out = local.step(x, target=y)
    assert torch.isfinite(out[0].loss)
    assert [r.num_traces for r in local.runners] == [0, 0]


class _Scaled(nn.Module):
    """Root-level buffers, one of them non-persistent (a constant, a mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)
        self.register_buffer("shift", torch.tensor(0.5))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(v)) * self.scale + self.shift)


def test_a_replicated_pipe_keeps_non_persistent_buffers_out_of_its_state_dict():
    torch.manual_seed(0)
    model = _Scaled()
    pipe = mpmd.trace(model, (torch.randn(2, 4),), split_before=["second"])
    replica = pipe.replicate()
    keys = sorted(k for s in range(replica.num_stages) for k in replica.stage(s).state_dict())
    assert keys == sorted(model.state_dict())
    # Each rank of LocalPipeline holds a replica: a strict load of the
    # model's own state dict works, and the step equals the model's.
    local = LocalPipeline(pipe, S.GPipe(M), 2, loss_fn=square_loss, timeout=5)
    for runner in local.runners:
        runner.load_state_dict(model.state_dict())
    out = local.step(x, target=y)
    expected = torch.stack(
        [square_loss(model(a), b) for a, b in zip(x.chunk(M), y.chunk(M), strict=True)]
    ).mean()
    torch.testing.assert_close(out[0].loss, expected.double(), rtol=1e-6, atol=1e-6)
