"""A model built on the meta device traces like a real one; each runner
allocates only its own stages (another rank's stay meta) and the user fills
them with `init_weights(fn)` (the model's own init, non-persistent buffers
included) or `load_state_dict`. Training then equals the unpipelined model
initialised the same way; a tensor never written is an error at the first
step, never garbage."""

import math

import pytest
import torch
import torch.nn as nn
from models import lm_loss, square_loss, token_pair

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4
V, D = 32, 16


class Rotary(nn.Module):
    """A RoPE-style table in a non-persistent buffer, computed at init."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(D // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            exponents = torch.arange(0, D, 2, device=self.inv_freq.device) / D
            self.inv_freq.copy_(1.0 / (100.0**exponents))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device, dtype=h.dtype)
        angles = pos[:, None] * self.inv_freq.to(h.dtype)[None, :]
        return h * torch.cat([angles.cos(), angles.sin()], dim=-1)


class RotaryLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.rotary = Rotary()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.rotary(self.embed(ids))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


@torch.no_grad()
def init_fn(module: nn.Module) -> None:
    """Deterministic, so that every rank's part equals the unpipelined model's."""
    if isinstance(module, Rotary):
        module.reset_parameters()
    for name, p in module.named_parameters(recurse=False):
        n = p.numel()
        values = torch.sin(torch.arange(n, dtype=torch.float64) * (1 + n % 7) + len(name))
        p.copy_((values / math.sqrt(n)).reshape(p.shape))


def _data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_pair(V, batch, 6)


def _meta_pipe() -> mpmd.Pipe:
    with torch.device("meta"):
        model = RotaryLM().double()
    x, _ = _data(2)
    return mpmd.trace(model, (x,), split_before=["blocks.1", "blocks.2", "blocks.3"])


def _initialised_model() -> RotaryLM:
    ref = RotaryLM().double()
    ref.apply(init_fn)
    return ref


@pytest.mark.parametrize(
    "schedule", [mpmd.schedules.OneFOneB(M), mpmd.schedules.ZBV(M)], ids=lambda s: type(s).__name__
)
@pytest.mark.slow
def test_meta_model_initialised_per_rank_trains_like_eager(schedule):
    pipe = _meta_pipe()
    assert all(p.is_meta for p in pipe.parameters())
    local = LocalPipeline(pipe, schedule, 2, loss_fn=lm_loss, timeout=60)
    for runner, replica in zip(local.runners, local.pipes, strict=True):
        for s in range(pipe.num_stages):
            tensors = [*replica.stage(s).parameters(), *replica.stage(s).buffers()]
            if s in runner.local_stages:
                continue
            # Another rank's stage is never allocated here.
            assert all(t.is_meta for t in tensors), s
        assert not any(p.is_meta for p in runner.parameters())
    local.init_weights(init_fn)  # collective: the tied embedding's copies travel
    ref = _initialised_model()
    for runner in local.runners:
        for name, t in runner.state_dict().items():
            torch.testing.assert_close(t, ref.state_dict()[name], rtol=0, atol=0, msg=name)
        for module in runner.local_modules():
            for name, b in module.named_buffers():
                torch.testing.assert_close(b, ref.get_buffer(name), rtol=0, atol=0, msg=name)
    x, y = _data(4 * M)
    local.step(x, target=y)
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        (lm_loss(ref(xb), yb) / M).backward()
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            torch.testing.assert_close(
                p.grad, ref.get_parameter(fqn).grad, rtol=1e-10, atol=1e-10, msg=fqn
            )


@pytest.mark.slow
def test_unwritten_tensors_are_an_error_naming_them():
    pipe = _meta_pipe()
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(M), 2, loss_fn=lm_loss, timeout=10)
    x, y = _data(4 * M)
    with pytest.raises(RuntimeError, match=r"rank 0: the model was traced on the meta device and"):
        local.step(x, target=y)
    # A state dict fills parameters but not the non-persistent RoPE table.
    ref = _initialised_model()
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(M), 2, loss_fn=lm_loss, timeout=10)
    local.load_state_dict(ref.state_dict())
    with pytest.raises(
        RuntimeError, match=r"'rotary.inv_freq' \(stage 0\) were allocated but never"
    ):
        local.step(x, target=y)
    # (A failed step leaves the in-process world with a dead rank: start anew.)
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(M), 2, loss_fn=lm_loss, timeout=10)
    local.load_state_dict(ref.state_dict())
    local.init_weights(lambda m: m.reset_parameters() if isinstance(m, Rotary) else None)
    out = local.step(x, target=y)
    losses = [lm_loss(ref(xb), yb) for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True)]
    torch.testing.assert_close(out[0].losses, torch.stack(losses), rtol=1e-12, atol=1e-12)


def test_eager_stages_on_the_meta_device():
    with torch.device("meta"):
        stages = [nn.Sequential(nn.Linear(D, D), nn.Tanh()), nn.Linear(D, D)]
    real = nn.Sequential(nn.Sequential(nn.Linear(D, D), nn.Tanh()), nn.Linear(D, D)).double()
    real.apply(init_fn)
    stages = [s.double() for s in stages]
    x = torch.randn(4 * M, D, dtype=torch.float64)
    y = torch.randn(4 * M, D, dtype=torch.float64)
    pipe = mpmd.from_stages(stages, (x[:4].to("meta"),))
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=square_loss)
    local.init_weights(init_fn)
    local.step(x, target=y)
    for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
        (square_loss(real(xb), yb) / M).backward()
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            torch.testing.assert_close(p.grad, real.get_parameter(fqn).grad, msg=fqn)


def test_eager_meta_stages_take_new_shapes_without_allocating_others():
    # A new shape probes the stages again: another rank's stages are still
    # meta there, so the probe runs on meta copies, allocating nothing.
    with torch.device("meta"):
        stages = [nn.Sequential(nn.Linear(D, D), nn.Tanh()), nn.Linear(D, D)]
    stages = [s.double() for s in stages]
    pipe = mpmd.from_stages(stages, (torch.randn(4, D, dtype=torch.float64),))
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=square_loss)
    local.init_weights(init_fn)
    x = torch.randn(3 * M, D, dtype=torch.float64)
    local.step(x, target=torch.zeros_like(x))
    assert [r.num_traces for r in local.runners] == [1, 1]
    assert all(t.is_meta for t in local.pipes[0].stage(1).parameters())


@pytest.mark.slow
def test_meta_example_inputs_trace_the_same_plan():
    with torch.device("meta"):
        model = RotaryLM().double()
    x, _ = _data(2)
    real = mpmd.trace(model, (x,), split_before=["blocks.2"])
    meta = mpmd.trace(model, (x.to("meta"),), split_before=["blocks.2"])
    assert [(t.name, t.spec) for t in meta.transfers] == [(t.name, t.spec) for t in real.transfers]
    local = LocalPipeline(meta, mpmd.schedules.OneFOneB(M), 2, loss_fn=lm_loss, timeout=60)
    ref = _initialised_model()
    local.init_weights(init_fn)
    x, y = _data(4 * M)
    out = local.step(x, target=y)
    losses = [lm_loss(ref(xb), yb) for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True)]
    torch.testing.assert_close(out[0].losses, torch.stack(losses), rtol=1e-12, atol=1e-12)
