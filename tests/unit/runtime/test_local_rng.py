"""LocalPipeline's ranks draw random numbers as separate processes would: each
from a generator state of its own, started from the caller's. Ranks as
threads used to share torch's one global generator, so which thread drew
first (dropout in a forward, a selective recompute replaying its saved state)
decided every mask, and identical seeded runs differed (1 in 3 with
recompute='selective', exact under torchrun); a full recompute (R) set the
shared generator from the native executor while another rank drew. Compared with the unpipelined
model in one process, each stage drawing from a generator seeded as its
rank's process would be."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn
from models import square_loss

import torchmpmd as mpmd
from torchmpmd.runtime.rank_rng import RankGenerators, own_generator
from torchmpmd.testing import LocalPipeline

S = mpmd.schedules
M = 4
SEED = 7


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.Dropout(0.5),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.Dropout(0.5),
        nn.Linear(32, 8),
    ).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * M, 8, generator=g, dtype=torch.float64)
    return x, torch.randn(2 * M, 8, generator=g, dtype=torch.float64)


def _pipe() -> mpmd.Pipe:
    # Stage 0 (rank 0) and stage 1 (rank 1) both draw.
    example = torch.randn(2, 8, dtype=torch.float64)
    return mpmd.trace(_model(), (example,), split_before=["3"])


def _run(schedule: mpmd.Schedule, steps: int, **kwargs) -> tuple[torch.Tensor, dict]:
    """Losses of `steps` steps seeded once, and the gradients they summed."""
    x, y = _data()
    local = LocalPipeline(_pipe(), schedule, 2, loss_fn=square_loss, timeout=60, **kwargs)
    torch.manual_seed(SEED)
    losses = torch.stack([local.step(x, target=y)[0].loss for _ in range(steps)])
    grads = {n: p.grad.clone() for r in local.runners for n, p in r.named_parameters()}
    return losses, grads


def _as_two_processes(steps: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The same steps unpipelined: stage 0's forwards draw from one generator
    and stage 1's from another, both seeded SEED, as two processes seeded
    alike; each keeps its state from step to step. Also rank 0's state after."""
    model = _model()
    first, second = model[:3], model[3:]
    x, y = _data()
    torch.manual_seed(SEED)
    states = [torch.get_rng_state(), torch.get_rng_state()]
    losses = []
    for _ in range(steps):
        step = []
        for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
            torch.set_rng_state(states[0])
            h = first(xb)
            states[0] = torch.get_rng_state()
            torch.set_rng_state(states[1])
            loss = square_loss(second(h), yb)
            states[1] = torch.get_rng_state()
            (loss / M).backward()
            step.append(loss.detach())
        losses.append(torch.stack(step).mean())
    grads = {n: p.grad for n, p in model.named_parameters()}
    return torch.stack(losses), grads, states[0]


@pytest.mark.parametrize("recompute", [False, "selective", True])
@pytest.mark.parametrize("cls", [S.OneFOneB, S.GPipe], ids=lambda c: c.__name__)
@pytest.mark.slow
def test_seeded_runs_give_what_seeded_processes_give(cls, recompute):
    ref_losses, ref_grads, rank0_state = _as_two_processes(steps=2)
    losses, grads = _run(cls(M), steps=2, recompute=recompute)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    # The caller continues from rank 0's generator, as rank 0's process would.
    assert torch.equal(torch.get_rng_state(), rank0_state)


@pytest.mark.parametrize("recompute", [False, "selective", True])
@pytest.mark.parametrize("cls", [S.OneFOneB, S.ZeroBubbleH1], ids=lambda c: c.__name__)
@pytest.mark.slow
def test_identical_seeded_runs_are_bitwise_identical(cls, recompute):
    # ZB-H1's split stages also draw while tracing their F/I/W graphs at the
    # first step, on the rank's thread.
    runs = [_run(cls(M), steps=2, recompute=recompute) for _ in range(4)]
    losses, grads = runs[0]
    for other_losses, other_grads in runs[1:]:
        assert torch.equal(other_losses, losses)
        for name, g in grads.items():
            assert torch.equal(other_grads[name], g), name


def test_a_call_after_seeding_starts_every_rank_from_the_seed():
    # Seeded before each step, every step draws the same masks (each rank
    # restarts from the caller's new state); unseeded, the ranks continue.
    x, y = _data()
    local = LocalPipeline(_pipe(), S.OneFOneB(M), 2, loss_fn=square_loss, timeout=60)
    seeded = []
    for _ in range(2):
        torch.manual_seed(SEED)
        seeded.append(local.step(x, target=y)[0].loss)
    assert torch.equal(seeded[0], seeded[1])
    unseeded = local.step(x, target=y)[0].loss
    assert not torch.equal(unseeded, seeded[0])
    ref_losses, _, _ = _as_two_processes(steps=2)
    torch.testing.assert_close(unseeded, ref_losses[1], rtol=1e-12, atol=1e-12)


# Bounds a wait by 3 s of wall time: nothing beside it (scripts/test.sh).
@pytest.mark.alone
def test_a_rank_stuck_while_drawing_holds_the_others_up_to_the_timeout_only():
    # Ranks take turns at drawing; one that never finishes its turn (a hung
    # stage or loss) must fail the others after the timeout, naming it, as
    # a receive from it would, not hang them.
    gens = RankGenerators(2)
    gens.start_call(timeout=0.5)
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    waited: list[float] = []

    def rank(r: int) -> None:
        if r == 1:
            with own_generator():
                inside.set()
                release.wait(10)
            return
        inside.wait(10)
        start = time.monotonic()
        try:
            with own_generator():
                pass
        except RuntimeError as err:
            errors.append(err)
        waited.append(time.monotonic() - start)

    threads = [threading.Thread(target=gens.in_rank(rank), args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    threads[0].join(10)
    release.set()
    threads[1].join(10)
    assert len(errors) == 1 and waited[0] < 3
    assert "rank 0 waited 0.5 s for rank 1 to finish its forward" in str(errors[0])


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        for row in module.weight:  # many small draws, the GIL passed between them
            nn.init.normal_(row)
            time.sleep(0)
        nn.init.zeros_(module.bias)


def test_init_weights_on_ranks_as_threads_draws_as_processes_would():
    # Each rank initialises its own modules from its own generator, started
    # from the caller's seed, as a process seeded alike would; before, the
    # rank threads drew one after the other from the shared generator.
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    pipe = mpmd.trace(model, (torch.randn(2, 16, device="meta"),), split_before=["2"])
    local = LocalPipeline(pipe, S.OneFOneB(M), 2, loss_fn=square_loss, timeout=60)
    torch.manual_seed(SEED)
    local.init_weights(_init)
    for rank, layers in enumerate([(0, 1), (2, 3)]):
        reference = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
        torch.manual_seed(SEED)
        for i in layers:
            _init(reference[i])
        held = dict(local.runners[rank].named_parameters())
        for i in layers:
            for leaf in ("weight", "bias"):
                name = f"{i}.{leaf}"
                assert torch.equal(held[name], getattr(reference[i], leaf)), (rank, name)
