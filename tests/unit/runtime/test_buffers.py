"""Modules that update buffers in forward (BatchNorm in training mode) must
train under a pipeline: every step failed with an autograd in-place error
(the stage wrote the running statistics in place after batch norm saved
them), the failed step had already advanced the statistics, and split (I/W)
stages refused such modules. Gradients and running statistics must equal
eager gradient accumulation's with full and split backward; a schedule that
would apply an update twice (recompute) is refused."""

import pytest
import torch
import torch.nn as nn
from models import square_loss
from pipeline_check import trains_like_eager

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.bn(self.a(x))))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * M, 8, generator=g, dtype=torch.float64)
    return x, torch.randn(4 * M, 8, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(
    "cls", [mpmd.schedules.GPipe, mpmd.schedules.OneFOneB, mpmd.schedules.ZeroBubbleH1]
)
def test_batch_norm_trains_like_gradient_accumulation(cls):
    x, y = _data()
    local, ref = trains_like_eager(
        lambda: NormedMLP().double(), x, y, square_loss, ["c"], cls(M), 2, steps=2
    )
    state = local.runners[0].state_dict()
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(state[name], ref.get_buffer(name), rtol=0, atol=0, msg=name)


def test_recomputing_a_stage_that_updates_buffers_is_refused():
    x, _ = _data()
    pipe = mpmd.trace(NormedMLP().double(), (x[:4],), split_before=["c"])
    schedule = mpmd.schedules.GPipe(M).with_recompute()
    with pytest.raises(ValueError, match=r"stage 0 \(rank 0\) updates buffers in its forward"):
        LocalPipeline(pipe, schedule, 2, loss_fn=square_loss)
