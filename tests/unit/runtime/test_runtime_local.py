"""The runtime, with ranks as threads of this process (same executor, an
in-memory transport with c10d's matching rules): it must match unpipelined
gradient accumulation, and fail — never hang — with an error naming rank,
peer, stage, microbatch and task when a peer dies, stalls or produces a
tensor unlike the plan."""

import re
import threading
import time

import pytest
import torch
from models import MLP

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4


@pytest.mark.parametrize("schedule", ["GPipe", "OneFOneB"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", ["gpt", "unet"])
@pytest.mark.slow
def test_threads_match_gradient_accumulation(
    name, ranks, schedule, traced_case, reference, local_pipeline
):
    traced = traced_case(name)
    _case, _pipe, batch, target = traced
    ref, ref_loss = reference(traced)
    local = local_pipeline(traced, getattr(mpmd.schedules, schedule)(M), ranks, timeout=30)
    outs = local.step(*batch, target=target)
    for out in outs:
        torch.testing.assert_close(out.loss, ref_loss, rtol=1e-12, atol=1e-12)
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            torch.testing.assert_close(
                p.grad, ref.get_parameter(fqn).grad, rtol=1e-10, atol=1e-10, msg=fqn
            )
    # Evaluation: the whole batch's output on every rank.
    for out in local.eval_step(*batch):
        torch.testing.assert_close(out, ref(*batch), rtol=1e-12, atol=1e-12)


class _Crash(RuntimeError):
    pass


def _on_stage(stage, wrapper):
    """A `wrap_stage` hook: `wrapper(forward)` runs stage `stage` (on the rank holding it)."""
    return lambda _rank, s, forward: wrapper(forward) if s == stage else forward


def test_dead_peer_fails_every_rank_with_context(mlp):
    case, pipe, batch, target = mlp
    calls = 0

    def wrap(rank, stage, module):
        if (rank, stage) != (2, 2):
            return module

        def dies(*args):
            nonlocal calls
            if args[0].shape and calls == 1:  # second microbatch of stage 2
                local.kill(2)
                raise _Crash("rank 2 crashed")
            calls += 1
            return module(*args)

        return dies

    local = LocalPipeline(
        pipe, mpmd.schedules.OneFOneB(M), 4, loss_fn=case.loss, timeout=20, wrap_stage=wrap
    )
    errors = {}

    def run(rank):
        try:
            local.runners[rank].step(*batch, target=target)
        except Exception as err:
            local.kill(rank)  # as its process would exit
            errors[rank] = err

    start = time.monotonic()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    elapsed = time.monotonic() - start
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert elapsed < 10, "peers waited for the timeout instead of failing at once"
    assert isinstance(errors[2], RuntimeError) and "rank 2 crashed" in str(errors[2])
    assert "rank 2: F(stage=2, mb=1) failed" in str(errors[2])
    # Rank 3 waits for stage 2's activation of microbatch 1, rank 1 for its
    # gradient. Each either notices rank 2 is gone itself, naming the message
    # it waited for, or is stopped first by the failure another rank
    # announced (rank 2's crash, or a neighbour noticing), and carries it.
    direct = {
        3: r"torchmpmd: rank 3 failed waiting for the activation '\w+' \(stage 2 -> stage 3\) of "
        r"microbatch 1 from rank 2, needed by F\(stage=3, mb=1\) \(local\): peer rank 2 is gone\. "
        r"Rank 2 may have died or be stuck",
        1: r"torchmpmd: rank 1 failed waiting for the gradient of '\w+' \(stage 2 -> stage 1\) of "
        r"microbatch 0 from rank 2, needed by B\(stage=1, mb=0\)",
    }
    for r in (1, 3):
        text = str(errors[r])
        announced = rf"torchmpmd: rank {r} stopped .*, because rank (2 failed in step: .*rank 2 crashed|\d failed in step: .*peer rank 2 is gone)"
        assert re.match(direct[r], text) or re.match(announced, text), text
    assert isinstance(errors[1], mpmd.PipelineError)


def test_failure_reaches_a_peer_waiting_outside_the_executor():
    """Rank 0 has sent every forward and waits for the outputs the last rank
    shares (a wait in Python, not in the executor) when the last stage fails:
    it stops at once, with its own rank and call and the cause."""
    pipe = mpmd.trace(MLP(8, 4).double(), (torch.randn(2, 8).double(),), split_after=["layers.1"])
    batch = (torch.randn(2 * M, 8).double(),)
    calls = 0

    def wrap(rank, stage, module):
        if (rank, stage) != (1, 1):
            return module

        def fails_last(*args):
            nonlocal calls
            calls += 1
            if calls == M:
                time.sleep(0.2)  # rank 0 is waiting for the outputs by now
                raise OverflowError("activations overflowed")
            return module(*args)

        return fails_last

    # The default 300 s timeout.
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(M), 2, wrap_stage=wrap)
    start = time.monotonic()
    with pytest.raises(OverflowError, match="activations overflowed") as info:
        local.eval_step(*batch)
    assert time.monotonic() - start < 5
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert re.search(
        r"then rank 0: torchmpmd: rank 0 stopped eval_step, because rank 1 failed in eval_step: "
        r"torchmpmd: rank 1: F\(stage=1, mb=3\) failed: OverflowError: activations overflowed",
        notes,
    ), notes
    # Both refuse the next call at once.
    with pytest.raises(mpmd.PipelineError, match="cannot run another step after a failed one"):
        local.eval_step(*batch)


# Bounds a 1 s timeout by 3 s of wall time: nothing beside it (scripts/test.sh).
@pytest.mark.slow
@pytest.mark.alone
def test_stuck_peer_times_out_with_context(mlp):
    case, pipe, batch, target = mlp
    slept = False

    def wrap(rank, stage, module):
        if (rank, stage) != (1, 1):
            return module

        def stuck(*args):
            nonlocal slept
            if not slept:
                slept = True
                time.sleep(4.0)
            return module(*args)

        return stuck

    local = LocalPipeline(
        pipe, mpmd.schedules.GPipe(M), 2, loss_fn=case.loss, timeout=1.0, wrap_stage=wrap
    )
    failed_after = {}
    start = time.monotonic()

    def run():
        with pytest.raises(mpmd.PipelineError) as err:
            local.runners[0].step(*batch, target=target)
        local.kill(0)  # as its process would exit
        failed_after[0] = time.monotonic() - start
        failed_after["error"] = err.value

    thread = threading.Thread(target=run)
    thread.start()
    with pytest.raises(mpmd.PipelineError):
        local.runners[1].step(*batch, target=target)  # its peer has given up
    thread.join()
    msg = str(failed_after["error"])
    assert failed_after[0] < 3.0, "rank 0 did not give up after its 1 s timeout"
    assert re.search(
        r"torchmpmd: rank 0 timed out after 1 s waiting for the activation '\w+' \(stage 1 -> "
        r"stage 2\) of microbatch 0 from rank 1, needed by F\(stage=2, mb=0\)",
        msg,
    ), msg
    assert "raise the timeout" in msg


@pytest.mark.slow
def test_output_unlike_the_plan_is_rejected_before_it_is_sent(mlp):
    case, pipe, batch, target = mlp
    local = LocalPipeline(
        pipe,
        mpmd.schedules.GPipe(M),
        2,
        loss_fn=case.loss,
        timeout=2.0,
        wrap_stage=_on_stage(0, lambda module: lambda *a: tuple(o[:, :3] for o in module(*a))),
    )
    with pytest.raises(mpmd.PipelineError) as err:
        local.step(*batch, target=target)
    assert re.search(
        r"torchmpmd: rank 0: F\(stage=0, mb=0\) produced '\w+' with shape \(2, 3\) Double but the "
        r"stage plan expects \(2, 16\) Double; it was not sent",
        str(err.value),
    ), str(err.value)


def test_loss_must_be_a_scalar(mlp):
    _case, pipe, batch, target = mlp
    local = LocalPipeline(
        pipe, mpmd.schedules.GPipe(M), 2, loss_fn=lambda out, y: out - y, timeout=2
    )
    with pytest.raises(
        RuntimeError, match="the loss of microbatch 0 must be a tensor with one element"
    ):
        local.step(*batch, target=target)


@pytest.mark.slow
def test_state_dict_round_trip_and_keys(gpt):
    case, pipe, _batch, _target = gpt
    model = case.model(torch.float64)
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(M), 2, loss_fn=case.loss)
    keys = set()
    for runner in local.runners:
        keys |= set(runner.state_dict())
    assert keys == set(model.state_dict())
    # Load another model's weights into every rank, from the full state dict
    # (a collective: the ranks holding a tied weight make its copies equal).
    other = case.model(torch.float64, seed=7)
    local.load_state_dict(other.state_dict())
    for runner in local.runners:
        for fqn, p in runner.named_parameters():
            assert torch.equal(p, other.get_parameter(fqn)), fqn
    with pytest.raises(KeyError, match="found no entry for"):
        local.runners[1].load_state_dict({"tok.weight": other.tok.weight})


def test_stage_without_a_gradient_path_is_an_error(mlp):
    # A stage whose output the plan differentiates but that comes out without
    # autograd history (a region run without grad, a stray detach) would give
    # every earlier parameter no gradient, silently. It must fail instead.
    case, pipe, batch, target = mlp
    local = LocalPipeline(
        pipe,
        mpmd.schedules.OneFOneB(M),
        2,
        loss_fn=case.loss,
        timeout=2.0,
        wrap_stage=_on_stage(0, lambda module: lambda *a: tuple(o.detach() for o in module(*a))),
    )
    with pytest.raises(mpmd.PipelineError) as err:
        local.step(*batch, target=target)
    assert re.search(
        r"torchmpmd: rank 0: F\(stage=0, mb=0\) produced '\w+' without a gradient path, but the "
        r"stage plan says gradients flow back through it",
        str(err.value),
    ), str(err.value)


def test_loss_without_a_gradient_path_is_an_error(mlp):
    case, pipe, batch, target = mlp
    local = LocalPipeline(
        pipe,
        mpmd.schedules.OneFOneB(M),
        2,
        loss_fn=lambda out, y: case.loss(out, y).detach(),
        timeout=2.0,
    )
    with pytest.raises(mpmd.PipelineError, match=r"produced its loss without a gradient path"):
        local.step(*batch, target=target)


def test_split_stage_without_a_gradient_path_is_an_error(mlp):
    case, pipe, batch, target = mlp
    local = LocalPipeline(pipe, mpmd.schedules.ZBV(M), 2, loss_fn=case.loss, timeout=2.0)
    stage = local.runners[0].local_modules()[0]
    forward = stage.forward
    stage.forward = lambda *a: tuple(o.detach() for o in forward(*a))
    with pytest.raises(ValueError, match=r"stage 0 \(split into I/W\) computes '\w+' without a"):
        local.step(*batch, target=target)


def test_wrap_stage_wraps_each_local_stage_once_per_traced_shape(mlp):
    # The public fault-injection hook: fn(rank, stage, forward) is asked once
    # per local stage when a runner sets up a traced shape, and what it
    # returns runs at every forward of that stage.
    case, pipe, batch, target = mlp
    asked, calls = [], []

    def wrap(rank, stage, forward):
        asked.append((rank, stage))

        def counted(*args):
            calls.append((rank, stage))
            return forward(*args)

        return counted

    local = LocalPipeline(
        pipe, mpmd.schedules.GPipe(M), 2, loss_fn=case.loss, timeout=60, wrap_stage=wrap
    )
    assert sorted(asked) == [(0, 0), (0, 2), (1, 1), (1, 3)]
    local.step(*batch, target=target)
    assert sorted(set(calls)) == sorted(asked) and len(calls) == 4 * M
    (wider,), _ = case.inputs(3 * M)  # 3 rows per microbatch: traced again
    local.step(wider.double(), target=case.target(3 * M).double())
    assert len(asked) == 8 and len(calls) == 8 * M


class _Accumulates(torch.nn.Module):
    """Starts an accumulator from nothing (`h.new_zeros(())`, as a balance
    loss summed over layers is) that crosses stages before anything adds to
    it (made from a value of the first stage, it is sent, not made again):
    it carries no gradient, and the stage plan must not say it does."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        total = h.new_zeros(())
        h = self.b(h)
        return h, total + h.pow(2).mean()


def test_a_value_made_from_nothing_crosses_stages_without_a_gradient():
    torch.manual_seed(0)
    model, ref = _Accumulates().double(), _Accumulates().double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = mpmd.trace(model, (x[:2],), split_before=["b"])

    def loss(out, _y):
        return out[0].sum() + out[1]

    for xb in x.chunk(4):
        (loss(ref(xb), None) / 4).backward()
    # Every way a stage runs its backward: whole (B), split through its
    # traced graphs, split through autograd (a stage cut by hand's way).
    for schedule, split in [("OneFOneB", "auto"), ("ZeroBubbleH1", "auto"), ("OneFOneB", True)]:
        local = LocalPipeline(
            pipe,
            getattr(mpmd.schedules, schedule)(4),
            2,
            loss_fn=loss,
            timeout=30,
            split_backward=split,
        )
        local.step(x)
        for runner in local.runners:
            for name, p in runner.named_parameters():
                torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, msg=name)
