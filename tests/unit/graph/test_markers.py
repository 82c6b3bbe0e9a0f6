"""`mark_stage_end` is an identity in eager mode, so a pipeline cut there must
give the model's own values and gradients wherever the marker stands: inside
`torch.no_grad()` (the gradient still flows through it) and right before an
operation that export records only as a metadata check (a dtype cast)."""

import pytest
import torch
import torch.nn as nn

import torchmpmd as mpmd


class Marked(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.where == "no_grad":
            with torch.no_grad():
                h = mpmd.mark_stage_end(h)
        else:
            h = mpmd.mark_stage_end(h)
            h = h.to(torch.float32)  # export keeps only an assert for this cast
        return self.b(h).tanh()


def _compare(where: str) -> None:
    torch.manual_seed(0)
    model = Marked(where)
    x = torch.randn(2, 4)
    model(x).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pipe = mpmd.trace(model, (x,))
    assert pipe.num_stages == 2
    assert all(t.requires_grad for t in pipe.transfers)
    out = pipe(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    out.sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0, msg=name)


def test_marker_under_no_grad_keeps_the_gradient():
    _compare("no_grad")


@pytest.mark.slow
def test_marker_before_a_checked_cast():
    _compare("cast")
