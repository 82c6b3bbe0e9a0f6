"""torch.compile under the in-process harness: ranks as threads, one tracing
its split stages (make_fx sets a process-wide flag) while another runs its
compiled graphs, on a cold compile cache. Dynamo refuses to run an optimized
function while any thread FX-traces, so the two must take turns."""

import pytest
import torch
import torch._dynamo
from pipeline_check import data, reference, traced

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

# Every test here takes over ~2 s on 2 cores.
pytestmark = pytest.mark.slow

M = 4


def test_compile_with_ranks_as_threads_on_a_cold_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    from models import CASES

    case = CASES["gpt"]
    pipe = traced("gpt", 4)
    batch, target = data("gpt", M)
    local = LocalPipeline(
        pipe, mpmd.schedules.ZeroBubbleH1(M), 4, loss_fn=case.loss, compile=True, timeout=300
    )
    loss = local.step(batch, target=target)[0].loss
    want_loss, want = reference("gpt", M)
    # Compiled kernels reduce in another order (and inductor's float64
    # attention is not eager's), so close, not bitwise.
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for runner in local.runners:
        for name, p in runner.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-6)
