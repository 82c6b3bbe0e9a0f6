"""GPU correctness checks (run by scripts/gpu_check.sh on a machine with a GPU).

One GPU cannot hold two NCCL ranks, so the checks run the pipeline's ranks as
threads of this process over the in-process transport, with CUDA tensors:
the same executor, its device path (stream-ordered receives, task times from
CUDA events) and every schedule kind. Exits non-zero on the first mismatch.

    python scripts/gpu/check_cuda.py                 # on a GPU
    python scripts/gpu/check_cuda.py --device cpu    # the same checks on the CPU

Plain asserts, no pytest: the lent GPU machine has torch but no test tools.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# The bundled GPT and its loss, and the extension built in place (no install).
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
from gpt import GPT, GPTConfig, lm_loss, split_points  # noqa: E402

import torchmpmd as mpmd  # noqa: E402
from torchmpmd.testing import LocalPipeline  # noqa: E402

S = mpmd.schedules
M = 4  # microbatches


def reference_grads(
    cfg: GPTConfig, device: torch.device, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    """The unpipelined model's gradient accumulation over the same microbatches."""
    torch.manual_seed(0)
    model = GPT(cfg).double().to(device)
    losses = []
    for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
        loss = lm_loss(model(xm), ym)
        (loss / M).backward()
        losses.append(loss.item())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return sum(losses) / M, grads


def check_schedule(
    name: str, cls: type[mpmd.Schedule], ranks: int, stages: int, device: torch.device
) -> str:
    cfg = GPTConfig(vocab_size=64, seq_len=16, dim=32, heads=4, layers=4)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (2 * M, cfg.seq_len), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (2 * M, cfg.seq_len), generator=g).to(device)
    want_loss, want = reference_grads(cfg, device, x, y)

    torch.manual_seed(0)
    model = GPT(cfg).double()
    pipe = mpmd.trace(model, (x[:2].cpu(),), split_before=split_points(cfg, stages))
    local = LocalPipeline(pipe, cls(M), ranks, loss_fn=lm_loss, device=device, timeout=60)
    for _ in range(2):  # the second step reuses every buffer and graph
        for runner in local.runners:
            for p in runner.parameters():
                p.grad = None
        outs = local.step(x, target=y)
    loss = outs[0].loss.item()
    assert abs(loss - want_loss) < 1e-10, f"{name}: loss {loss} != {want_loss}"
    worst = 0.0
    for runner in local.runners:
        aliases = runner.parameter_aliases()
        for n, p in runner.named_parameters():
            assert p.device.type == device.type, f"{name}: {n} on {p.device}"
            ref = want[n] if n in want else want[aliases[n][0]]
            err = (p.grad - ref).abs().max().item()
            worst = max(worst, err)
            assert err < 1e-10, f"{name}: gradient of {n} differs by {err}"
    # Task times come from the device (events), so they lie inside the step.
    for runner in local.runners:
        tl = runner.timeline
        assert tl is not None and tl.tasks, f"{name}: rank {runner.rank} recorded no task"
        for e in tl.tasks:
            assert 0 <= e.start <= e.end, f"{name}: task {e} has a negative span"
    return f"{name:16} {ranks} ranks {stages} stages: loss {loss:.6f}, max grad error {worst:.1e}"


def check_failure_is_bounded(device: torch.device) -> str:
    """A stage that raises on one rank stops every rank at once, not at the timeout."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, dim=32, heads=4, layers=2)
    x = torch.randint(0, cfg.vocab_size, (2 * M, cfg.seq_len)).to(device)
    pipe = mpmd.trace(GPT(cfg).double(), (x[:2].cpu(),), split_before=split_points(cfg, 2))
    calls = {"n": 0}

    def bad_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("bad labels")
        return lm_loss(logits, target)

    local = LocalPipeline(pipe, S.OneFOneB(M), 2, loss_fn=bad_loss, device=device)  # 300 s
    start = time.monotonic()
    try:
        local.step(x, target=x)
    except ValueError as err:
        assert "bad labels" in str(err), err
    else:
        raise AssertionError("the step did not fail")
    took = time.monotonic() - start
    assert took < 5, f"failing took {took:.1f} s"
    return f"failure on one rank: every rank stopped in {took:.2f} s"


def check_memory(device: torch.device) -> str:
    """The activation bytes measured from the device's allocator against the
    simulator's prediction (within 10%), and, on CUDA, against what the
    caching allocator saw at its peak (which also holds gradients and
    workspace, so at least as much)."""
    cfg = GPTConfig(vocab_size=256, seq_len=64, dim=128, heads=4, layers=4)
    m = 8
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (2 * m, cfg.seq_len), generator=g).to(device)
    torch.manual_seed(0)
    pipe = mpmd.trace(GPT(cfg), (x[:2].cpu(),), split_before=split_points(cfg, 2))
    local = LocalPipeline(
        pipe, S.OneFOneB(m), 2, loss_fn=lm_loss, device=device, measure_memory=True
    )
    local.step(x, target=x)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    local.step(x, target=x)
    measured = mpmd.Timeline.merge(r.timeline for r in local.runners if r.timeline)
    costs = mpmd.Costs.from_timeline(measured, pipe.num_stages)
    predicted = local.runners[0].program.simulate(costs).peak_activation_bytes
    ratios = [a / b for a, b in zip(measured.peak_activation_bytes, predicted, strict=True)]
    assert all(0.9 <= q <= 1.1 for q in ratios), f"measured / predicted peak: {ratios}"
    line = "activation memory, measured / predicted per rank: " + ", ".join(
        f"{a / 2**20:.2f} / {b / 2**20:.2f} MiB"
        for a, b in zip(measured.peak_activation_bytes, predicted, strict=True)
    )
    if cuda:
        # The ranks share the device and peak at different times: the device
        # peak is at least the largest rank's.
        seen = torch.cuda.max_memory_allocated(device) - before
        held = max(measured.peak_activation_bytes)
        assert seen >= held, f"the allocator peaked at {seen} bytes above the start, below {held}"
        line += f"; torch.cuda.max_memory_allocated over the step: {seen / 2**20:.2f} MiB"
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    device = torch.device(p.parse_args().device)
    if device.type == "cuda":
        assert torch.cuda.is_available(), "no GPU: pass --device cpu to run the checks on the CPU"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    cases = [
        ("GPipe", S.GPipe, 2, 2),
        ("1F1B", S.OneFOneB, 2, 2),
        ("ZB-H1", S.ZeroBubbleH1, 2, 2),
        ("Interleaved1F1B", S.Interleaved1F1B, 2, 4),
        ("ZBV", S.ZBV, 2, 4),
        ("1F1B x4", S.OneFOneB, 4, 4),
    ]
    for name, cls, ranks, stages in cases:
        print(check_schedule(name, cls, ranks, stages, device), flush=True)
    print(check_memory(device), flush=True)
    print(check_failure_is_bounded(device), flush=True)
    print(f"all GPU checks passed on {device}")


if __name__ == "__main__":
    main()
