"""Inputs that used to give wrong results without a word: a target with
other rows than the batch (split on its own and broadcast in the loss), a
rank given another batch than its peers (a skipped batch: wrong losses
reported as successes), evaluation outputs that cannot be rebuilt from
microbatches (a sum, a number computed from a shape: returned from one
microbatch). Each is now right, or refused before any message is
exchanged, leaving the runner usable; results are compared with the
unpipelined model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from models import square_loss

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

M = 4


class Net(nn.Module):
    """A tiny model whose forward returns what the test asks for."""

    def __init__(self, outputs: str = "tensor") -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)
        self.outputs = outputs

    def forward(self, x: torch.Tensor):
        o = self.b(torch.tanh(self.a(x)))
        if self.outputs == "tensor":
            return o
        if self.outputs == "sum and rows":  # the model
            return o, o.sum(), o.shape[0]
        if self.outputs == "per row":
            return o, o.sum(-1), None
        raise AssertionError(self.outputs)


def _local(outputs: str = "tensor", **kwargs) -> tuple[nn.Module, LocalPipeline]:
    torch.manual_seed(0)
    model = Net(outputs).double()
    pipe = mpmd.trace(model, (torch.randn(2, 4, dtype=torch.float64),), split_before=["b"])
    kwargs.setdefault("loss_fn", square_loss)
    return model, LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, timeout=10, **kwargs)


def _batch(rows: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, 4, dtype=torch.float64, generator=g),
        torch.randn(rows, 3, dtype=torch.float64, generator=g),
    )


def _plain_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.stack(
        [
            square_loss(model(a), b)
            for a, b in zip(x.tensor_split(M), y.tensor_split(M), strict=True)
        ]
    ).mean()


@pytest.mark.slow
def test_a_target_with_other_rows_than_the_batch_is_refused_naming_both_shapes():
    model, local = _local()
    x, y = _batch(8)
    # Before: the 6-row target split into 2, 2, 1, 1 rows against inputs of
    # 2, 2, 2, 2, and the loss broadcast them.
    with pytest.raises(ValueError, match=r"target has shape \(6, 3\) but input .* \(8, 4\)"):
        local.step(x, target=y[:6])
    assert not any(r.communicated for r in local.runners)
    out = local.step(x, target=y)  # the runner is still usable, and right
    torch.testing.assert_close(out[0].loss, _plain_loss(model, x, y), rtol=1e-12, atol=1e-12)


def test_a_target_given_as_a_list_of_numbers_is_refused_before_running():
    _, local = _local(loss_fn=lambda out, y: nn.functional.cross_entropy(out, y))
    x, _ = _batch(8)
    labels = [0, 1, 2, 0, 1, 2, 0, 1]
    with pytest.raises(TypeError, match=r"target is a list of 8 Python numbers.*torch.tensor"):
        local.step(x, target=labels)
    out = local.step(x, target=torch.tensor(labels))
    assert torch.isfinite(out[0].loss)


def test_a_batch_of_another_dtype_is_refused_before_running():
    _, local = _local()
    x, y = _batch(8)
    with pytest.raises(
        TypeError, match=r"has dtype torch.float32, but the pipeline was traced with"
    ):
        local.step(x.float(), target=y)
    assert not any(r.communicated for r in local.runners)
    local.step(x, target=y)


def test_a_rank_given_another_batch_fails_every_rank_naming_both():
    # Rank 1's loop skipped a batch: same shapes, other values. Before, the
    # step returned rank 0's batch's inputs paired with rank 1's (wrong loss,
    # reported as a success).
    _, local = _local()
    (x0, y0), (x1, _) = _batch(8, seed=1), _batch(8, seed=2)
    runners = local.runners
    with pytest.raises(mpmd.PipelineError) as err:
        local.on_all_ranks(lambda r: r.step(*((x0,) if r is runners[0] else (x1,)), target=y0))
    text = str(err.value)
    assert "were given different batches for call 1 (step): the same shapes" in text, text
    assert "rank 0" in text and "rank 1" in text, text


@pytest.mark.slow
def test_batches_of_other_shapes_on_two_ranks_fail_naming_both_shapes():
    _, local = _local()
    (x0, y0), (x1, y1) = _batch(8), _batch(12)
    runners = local.runners
    with pytest.raises(mpmd.PipelineError) as err:
        local.on_all_ranks(
            lambda r: r.step(x0 if r is runners[0] else x1, target=y0 if r is runners[0] else y1)
        )
    text = str(err.value)
    assert "were given different batches" in text, text
    assert "(8, 4) float64" in text and "(12, 4) float64" in text, text


def test_a_target_passed_only_where_the_loss_is_computed_is_accepted():
    model, local = _local()
    x, y = _batch(8)
    runners = local.runners
    outs = local.on_all_ranks(lambda r: r.step(x, target=y if r is runners[1] else None))
    torch.testing.assert_close(outs[0].loss, _plain_loss(model, x, y), rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_eval_step_refuses_outputs_it_cannot_rebuild_from_microbatches():
    # The model returns (o, o.sum(), o.shape[0]): eval_step on 8
    # rows returned a 4-vector for the sum and 2 for the row count.
    _, local = _local("sum and rows")
    x, _ = _batch(8)
    with pytest.raises(ValueError, match=r"model output .* is a 0-d tensor per microbatch"):
        local.eval_step(x)
    assert not any(r.communicated for r in local.runners)


def test_eval_step_refuses_a_number_computed_from_a_microbatch():
    class Rows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            o = self.b(self.a(x))
            return o, o.shape[0]

    pipe = mpmd.trace(Rows(), (torch.randn(2, 4),), split_before=["b"])
    local = LocalPipeline(pipe, mpmd.schedules.GPipe(M), 2, timeout=10)
    with pytest.raises(ValueError, match=r"model output 1 is the number 2.*depend on the batch"):
        local.eval_step(torch.randn(8, 4))


def test_eval_step_rebuilds_per_row_outputs_like_the_model():
    model, local = _local("per row")
    x, _ = _batch(8)
    for o, s, none in local.eval_step(x):
        ref_o, ref_s, _ = model(x)
        torch.testing.assert_close(o, ref_o, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s, ref_s, rtol=1e-12, atol=1e-12)
        assert none is None


def test_a_refused_call_after_a_step_leaves_the_runners_usable():
    # LocalPipeline used to report "peer rank 0 is gone" after a locally
    # refused call once any earlier call had exchanged messages, and after
    # clip_grad_norm_(None).
    _, local = _local()
    x, y = _batch(8)
    local.step(x, target=y)
    with pytest.raises(ValueError, match="at least one row"):
        local.step(x[:1], target=y[:1])
    with pytest.raises(TypeError, match=r"max_norm must be a number, got None"):
        local.clip_grad_norm_(None)  # type: ignore[arg-type]
    local.step(x, target=y)
    norms = local.clip_grad_norm_(1.0)
    torch.testing.assert_close(norms[0], norms[1])


def test_a_keyboard_interrupt_inside_a_step_stays_one():
    # Ctrl-C in a step used to become PipelineError("KeyboardInterrupt:
    # <EMPTY MESSAGE>"), which `except Exception` swallows.
    def interrupted(out, y):
        raise KeyboardInterrupt

    _, local = _local(loss_fn=interrupted)
    x, y = _batch(8)
    with pytest.raises(KeyboardInterrupt):
        local.step(x, target=y)


def test_targets_given_on_both_sides_of_a_rank_without_one_are_compared():
    # Rank 1 (a middle stage) passes no target; ranks 0 and 2 pass different
    # ones. The chain of neighbour check-ins must still see it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    pipe = mpmd.trace(
        model.double(), (torch.randn(2, 4, dtype=torch.float64),), split_before=["2", "4"]
    )
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 3, loss_fn=square_loss, timeout=10)
    x, y = _batch(8)
    y = torch.randn(8, 4, dtype=torch.float64)
    targets = {0: y, 1: None, 2: y + 1}
    with pytest.raises(mpmd.PipelineError, match=r"given different batches.*passing on rank 0's"):
        local.on_all_ranks(lambda r: r.step(x, target=targets[r.rank]))


@pytest.mark.slow
def test_a_flattened_target_splits_with_its_examples():
    # A (batch * seq,) target of a (batch, seq, features) batch: each
    # microbatch takes its own examples' rows, also when the batch does not
    # divide evenly (10 examples in 4 microbatches: 3, 3, 2, 2).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(10, 5, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (10, 5))

    def loss(out, t):
        return nn.functional.cross_entropy(out.reshape(-1, 3), t)

    pipe = mpmd.trace(model, (x[:3],), split_before=["2"])
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(M), 2, loss_fn=loss, timeout=10)
    out = local.step(x, target=y.reshape(-1))
    ref = torch.stack(
        [
            loss(model(a), b.reshape(-1))
            for a, b in zip(x.tensor_split(M), y.tensor_split(M), strict=True)
        ]
    ).mean()
    torch.testing.assert_close(out[0].loss, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"target has shape \(49,\).*same number of rows"):
        local.step(x, target=y.reshape(-1)[:49])


def test_eval_step_with_one_microbatch_refuses_an_output_of_no_tensor():
    # A stage cut by hand that returns a Python number per microbatch: with
    # one microbatch the refusal used to be a bare AssertionError inside the
    # exchange, which left the runner unusable.
    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x)

    class Last(First):
        def forward(self, x):
            y = self.l(x)
            return y, float(y.sum())

    pipe = mpmd.from_stages([First(), Last()], (torch.randn(2, 4),))
    local = LocalPipeline(pipe, mpmd.schedules.OneFOneB(1), 2, timeout=10)
    for _ in range(2):  # refused before any message: the runner stays usable
        with pytest.raises(TypeError, match=r"model output .* is not a tensor"):
            local.eval_step(torch.randn(2, 4))
    assert not any(r.communicated for r in local.runners)
