"""`mpmd.balance` picks the split with the shortest simulated step: with fixed
unit costs it must agree with a brute-force search over every split (priced by
the public `compile_schedule(...).simulate()`), never lose to the even split,
respect a memory limit, and `mpmd.trace(num_stages=N)` must give a pipe whose
gradients equal the unpipelined model's. No assertion reads a measured time."""

import dataclasses
import itertools
import pickle
import random

import pytest
import torch
import torch.nn as nn
from models import CASES, MLP, DeepUNet, MarkedMLP, TinyGPT
from pipeline_check import check, data

import torchmpmd as mpmd
import torchmpmd.planner.splits as balance_module
from torchmpmd.planner import Profile, profile, search, simulate
from torchmpmd.testing import LocalPipeline

S = mpmd.schedules
M = 4


# --------------------------------------------------------------------------- reference


def _stage_sums(prof, starts):
    bounds = [*starts, len(prof.units)]
    spans = list(itertools.pairwise(bounds))
    return (
        [sum(prof.forward[s:e]) for s, e in spans],
        [sum(prof.backward[s:e]) for s, e in spans],
        [sum(prof.activation_bytes[s:e]) for s, e in spans],
    )


def _sent(prof, starts, schedule, ranks):
    """Per stage of a chain's split, the bytes it sends to another rank (the
    runtime holds them from its forward until its backward)."""
    rank = schedule.placement(len(starts), ranks)
    out = [0] * len(starts)
    for k, start in enumerate(starts[1:], 1):
        if rank[k - 1] != rank[k]:
            out[k - 1] += prof.cut_bytes[start - 1]
    return out


def _public(prof, starts, schedule, ranks):
    """Step and per-rank peak of one split, through the public API only."""
    f, b, a = _stage_sums(prof, starts)
    sent = _sent(prof, starts, schedule, ranks)
    # Each microbatch after a step's first adds its weight gradients into
    # those already there.
    m = schedule.num_microbatches
    bounds = [*starts, len(prof.units)]
    acc = [
        (m - 1) / m * sum((prof.accumulate or [0.0] * e)[s:e])
        for s, e in itertools.pairwise(bounds)
    ]
    costs = mpmd.Costs(
        forward=f,
        backward=[x + y for x, y in zip(b, acc, strict=True)],
        activation_bytes=[x + y for x, y in zip(a, sent, strict=True)],
    )
    timeline = mpmd.compile_schedule(schedule, len(starts), ranks, costs=costs).simulate(costs)
    return timeline.step_time, timeline.peak_activation_bytes


def _all_splits(num_units, num_stages):
    return [(0, *c) for c in itertools.combinations(range(1, num_units), num_stages - 1)]


def _starts(prof, split_before):
    return (0, *(prof.units.index(u) for u in split_before))


def _random_profile(num_units, seed):
    rng = random.Random(seed)
    forward = [
        rng.choice([0.5, 1.0, 1.0, 2.0, 5.0]) * rng.uniform(0.8, 1.2) for _ in range(num_units)
    ]
    return Profile.chain(
        [f"layers.{i}" for i in range(num_units)],
        forward,
        [f * rng.uniform(1.5, 2.5) for f in forward],
        [rng.randint(1, 100) * 1000 for _ in range(num_units)],
    )


# --------------------------------------------------------------------------- the search


@pytest.mark.parametrize(
    ("schedule", "num_stages", "ranks"),
    [
        (S.OneFOneB(6), 3, 3),
        (S.GPipe(4), 4, 4),
        (S.Interleaved1F1B(4), 4, 2),
        (S.ZeroBubbleH1(4), 3, 3),
        (S.ZBV(4), 4, 2),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, mpmd.Schedule) else str(v),
)
@pytest.mark.parametrize("seed", [0, 1])
def test_search_equals_brute_force(schedule, num_stages, ranks, seed):
    prof = _random_profile(8, seed)
    found = search(prof, num_stages, schedule=schedule, num_ranks=ranks)
    steps = {s: _public(prof, s, schedule, ranks)[0] for s in _all_splits(8, num_stages)}
    best = min(steps.values())
    assert found.method == "exhaustive" and found.splits_simulated == len(steps)
    assert found.predicted_step == pytest.approx(best, rel=1e-12)
    assert steps[_starts(prof, found.split_before)] == pytest.approx(best, rel=1e-12)
    even = _starts(prof, found.even_split_before)
    assert [e - s for s, e in itertools.pairwise([*even, 8])] in (
        [2] * num_stages if num_stages == 4 else [3, 3, 2],
    )
    assert found.even_step == pytest.approx(steps[even], rel=1e-12)
    assert found.predicted_step <= found.even_step
    # Per-stage costs are the unit sums of the chosen split.
    f, b, a = _stage_sums(prof, _starts(prof, found.split_before))
    assert [c.forward for c in found.stage_costs] == pytest.approx(f)
    assert [c.backward for c in found.stage_costs] == pytest.approx(b)
    assert [c.activation_bytes for c in found.stage_costs] == a
    assert found.num_ranks == ranks and found.num_stages == num_stages


def test_local_search_never_worse_than_even(monkeypatch):
    monkeypatch.setattr(balance_module, "EXHAUSTIVE_LIMIT", 0)
    schedule = S.OneFOneB(8)
    for seed in range(4):
        prof = _random_profile(12, seed)
        found = search(prof, 4, schedule=schedule)
        assert found.method == "local search"
        assert found.splits_simulated < len(_all_splits(12, 4))
        step, _ = _public(prof, _starts(prof, found.split_before), schedule, 4)
        assert found.predicted_step == pytest.approx(step, rel=1e-12)
        assert found.predicted_step <= found.even_step
        exhaustive = min(_public(prof, s, schedule, 4)[0] for s in _all_splits(12, 4))
        assert found.predicted_step >= exhaustive - 1e-12


def test_local_search_on_many_units_improves_on_even():
    # 60 units into 6 stages is ~5M splits: the local search runs by itself.
    units = 60
    forward = [10.0 if i in (0, units - 1) else 1.0 for i in range(units)]
    prof = Profile.chain([f"layers.{i}" for i in range(units)], forward)
    found = search(prof, 6, schedule=S.OneFOneB(12))
    assert found.method == "local search"
    assert found.predicted_step < found.even_step
    # The heavy first and last units get stages with fewer light ones.
    sizes = [len(c.units) for c in found.stage_costs]
    assert sizes[0] < 10 and sizes[-1] < 10


def test_transfers_are_priced_with_bandwidth():
    # Equal compute everywhere; the only cheap cut is the one with few bytes.
    prof = Profile.chain(
        [f"layers.{i}" for i in range(6)], [1.0] * 6, cut_bytes=[10**9, 10**9, 10, 10**9, 10**9]
    )
    free = search(prof, 2, schedule=S.OneFOneB(4))
    priced = search(prof, 2, schedule=S.OneFOneB(4), bandwidth=1e9)
    assert free.split_before == ["layers.3"]  # the even split: transfers cost nothing
    assert priced.split_before == ["layers.3"]
    assert (
        priced.predicted_step
        < search(prof, 2, schedule=S.OneFOneB(4), bandwidth=1e9, latency=1.0).predicted_step
    )
    # Ten seconds a message on the even cut: the cut with few bytes wins.
    big = 10**10
    skewed = Profile.chain(
        [f"layers.{i}" for i in range(6)], [1.0] * 6, cut_bytes=[big, 10, big, big, big]
    )
    assert search(skewed, 2, schedule=S.OneFOneB(4), bandwidth=1e9).split_before == ["layers.2"]
    assert search(skewed, 2, schedule=S.OneFOneB(4)).split_before == ["layers.3"]


# --------------------------------------------------------------------------- a real model


class BigEnds(nn.Module):
    """A language model whose vocabulary dwarfs its width: the embedding and
    head cost far more than each small middle layer."""

    def __init__(self, vocab: int = 16384, dim: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


@pytest.fixture
def one_thread():
    # Two intra-op threads on a loaded machine make tiny ops wait for a
    # descheduled thread; one thread keeps each op's time its own.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_big_embedding_and_head_move_the_split(one_thread):
    torch.manual_seed(0)
    model = BigEnds()
    ids = torch.randint(0, 16384, (4, 32))
    # The head alone outweighs the rest many times over, so the last stage
    # is the bottleneck of every split and the even one adds a layer to it.
    found = mpmd.balance(model, (ids,), 3, repeats=7)
    assert found.profile.units == ("tok", *(f"layers.{i}" for i in range(6)), "head")
    assert found.even_split_before == ["layers.2", "layers.5"]
    assert found.split_before != found.even_split_before
    assert "head" in found.split_before  # the head is a stage of its own
    assert found.predicted_step < found.even_step
    # The prediction is the simulator's for the profile it measured.
    prof = found.profile
    step, peak = _public(prof, _starts(prof, found.split_before), S.OneFOneB(6), 3)
    assert found.predicted_step == pytest.approx(step, rel=1e-12)
    assert found.peak_activation_bytes == peak
    text = repr(found)
    assert "split_before=" in text and "predicted step" in text and "head" in text


@pytest.mark.slow
def test_units_of_common_layouts():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    gpt = profile(TinyGPT(), (ids,), repeats=1)
    assert gpt.units == ("tok", "pos", *(f"blocks.{i}" for i in range(4)), "ln_f", "head")
    # The head's weight is the embedding's: its gradient crosses between them.
    assert gpt.tied == (((0, 7), 64 * 32 * 4),)

    class Wrapped(nn.Module):  # a wrapper around a stack expands through it
        def __init__(self) -> None:
            super().__init__()
            self.inner = TinyGPT()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.inner(ids)

    assert profile(Wrapped(), (ids,), repeats=1).units == tuple(f"inner.{u}" for u in gpt.units)

    # Too few units for the stages asked: the largest unit opens up.
    class Pair(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.a = nn.Linear(8, hidden)
            self.b = nn.Linear(hidden, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    # A layer of a stack stays whole, even a Sequential one.
    layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    assert profile(Stack(), (torch.randn(2, 8),), repeats=1).units == (
        "layers.0",
        "layers.1",
        "layers.2",
    )
    two = nn.Sequential(Pair(4), Pair(16))
    x = torch.randn(2, 8)
    assert profile(two, (x,), repeats=1).units == ("0", "1")
    assert profile(two, (x,), min_units=3, repeats=1).units == ("0", "1.a", "1.b")


def test_profile_measures_saved_activations_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.BatchNorm1d(16), nn.Dropout(0.5))
    model.train()
    x = torch.randn(4, 16, dtype=torch.float64)
    model = model.double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    prof = profile(model, (x,), repeats=2)
    assert prof.units == ("0", "1", "2", "3")
    # As the traced graph the runtime runs saves them: Linear its input (x),
    # tanh its output, batch norm its batch mean and inverse std and the
    # copies of its running statistics it updates functionally (its input is
    # tanh's output, counted once), dropout its mask; never a parameter or
    # buffer.
    row = 4 * 16 * 8
    assert prof.activation_bytes[:3] == (row, row, 4 * 16 * 8)
    assert prof.activation_bytes[3] > 0
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    # Each cut carries one activation (4 x 16 float64).
    assert prof.cut_bytes == (row, row, row)
    assert all(f >= 0 for f in prof.forward) and all(b >= 0 for b in prof.backward)


def test_loss_is_part_of_the_last_unit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh()).double()
    x, y = torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    calls = []

    def loss_fn(out, target):
        calls.append(target)
        return nn.functional.mse_loss(out, target)

    plain = profile(model, (x,), repeats=2)
    with_loss = profile(model, (x,), repeats=2, loss_fn=loss_fn, example_target=y)
    # Recording pass, bytes pass, two timed passes, the traced graphs' bytes
    # pass; the target reaches it.
    assert len(calls) == 5 and all(t is y for t in calls)
    # mse_loss saves its target for the backward: bytes of the last unit.
    assert with_loss.activation_bytes[-1] == plain.activation_bytes[-1] + 4 * 16 * 8
    assert with_loss.activation_bytes[:-1] == plain.activation_bytes[:-1]
    with pytest.raises(ValueError, match=r"example_target is only read by loss_fn; pass loss_fn"):
        profile(model, (x,), example_target=y)
    with pytest.raises(TypeError, match=r"loss_fn must be callable, got str"):
        profile(model, (x,), loss_fn="mse", example_target=y)


def test_skip_connections_cross_every_cut_they_span():
    prof = profile(DeepUNet(), (torch.randn(2, 8),), repeats=1)
    assert prof.units == (*(f"enc.{i}" for i in range(4)), *(f"dec.{i}" for i in range(4)))
    row = 2 * 8 * 4
    # enc.0's output skips to the cat before the last decoder layer (code
    # between modules belongs to the unit before it: dec.2).
    outermost = [t for t in prof.transfers if t.src == 0]
    assert [(t.dst, t.bytes) for t in outermost] == [((1, 6), row)]
    # Between encoder and decoder: three skips and the first cat's result.
    assert prof.cut_bytes[3] == 3 * row + 2 * row


# --------------------------------------------------------------------------- memory


def _memory_case():
    # Activation-heavy first units: the fastest split keeps them on rank 0,
    # which holds the most microbatches in flight under 1F1B.
    prof = Profile.chain(
        [f"layers.{i}" for i in range(7)],
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        activation_bytes=[900, 800, 100, 100, 100, 100, 100],
    )
    schedule = S.OneFOneB(6)
    peaks = {s: max(_public(prof, s, schedule, 3)[1]) for s in _all_splits(7, 3)}
    steps = {s: _public(prof, s, schedule, 3)[0] for s in _all_splits(7, 3)}
    return prof, schedule, peaks, steps


def test_memory_limit_picks_a_split_that_fits():
    prof, schedule, peaks, steps = _memory_case()
    fastest = search(prof, 3, schedule=schedule)
    fastest_peak = max(fastest.peak_activation_bytes)
    limit = sorted(set(peaks.values()))[1]  # only a few splits fit
    assert limit < fastest_peak, "the limit must exclude the fastest split"
    fits = {s for s, p in peaks.items() if p <= limit}
    assert 0 < len(fits) < len(peaks)
    found = search(prof, 3, schedule=schedule, memory_limit=limit)
    chosen = _starts(prof, found.split_before)
    assert chosen in fits
    assert max(found.peak_activation_bytes) <= limit
    assert found.predicted_step == pytest.approx(min(steps[s] for s in fits), rel=1e-12)
    assert found.predicted_step > fastest.predicted_step


def test_memory_limit_in_local_search(monkeypatch):
    monkeypatch.setattr(balance_module, "EXHAUSTIVE_LIMIT", 0)
    prof, schedule, peaks, _ = _memory_case()
    limit = sorted(set(peaks.values()))[1]
    found = search(prof, 3, schedule=schedule, memory_limit=limit)
    assert max(found.peak_activation_bytes) <= limit


def test_impossible_memory_limit_names_the_smallest_peak():
    prof, schedule, peaks, _ = _memory_case()
    smallest = min(peaks.values())
    with pytest.raises(ValueError) as err:
        search(prof, 3, schedule=schedule, memory_limit=smallest - 1)
    text = str(err.value)
    assert "no split into 3 stages keeps the simulated peak activation memory" in text
    assert f"the smallest peak is {smallest / 1024:.1f} KiB ({smallest} bytes" in text
    assert "raise memory_limit" in text
    # The limit that allows exactly that peak is met.
    search(prof, 3, schedule=schedule, memory_limit=smallest)


# --------------------------------------------------------------------------- trace


def _check_against_model(name, pipe, schedule, ranks):
    batch, target = data(name, M)
    local = LocalPipeline(pipe, schedule, ranks, loss_fn=CASES[name].loss, timeout=60)
    outs = local.step(batch, target=target)
    seen = set()
    for out, runner in zip(outs, local.runners, strict=True):
        seen |= check(name, out.loss, runner, M)
    # every parameter, tied ones once
    assert {n for n, _ in CASES[name].model(torch.float64).named_parameters()} <= seen


@pytest.mark.parametrize(
    ("name", "num_stages", "schedule", "ranks"),
    [
        ("gpt", 2, None, 2),
        ("unet", 3, None, 3),
        ("gpt", 4, S.ZBV(M), 2),
    ],
)
@pytest.mark.slow
def test_trace_num_stages_matches_the_model(name, num_stages, schedule, ranks):
    case = CASES[name]
    model = case.model(torch.float64)
    args, kwargs = case.inputs(2)
    args = tuple(a.double() if a.is_floating_point() else a for a in args)
    pipe = mpmd.trace(model, args, kwargs, num_stages=num_stages, schedule=schedule)
    assert pipe.num_stages == num_stages
    _check_against_model(name, pipe, schedule or S.OneFOneB(M), ranks)


def test_simulate_prices_one_split_like_search():
    prof = _random_profile(8, 3)
    for kwargs in ({}, {"bandwidth": 1e3, "latency": 0.5}):
        found = search(prof, 4, schedule=S.ZBV(4), **kwargs)
        assert found.num_ranks == 2  # two stages per rank: half as many ranks
        again = simulate(prof, found.split_before, schedule=S.ZBV(4), **kwargs)
        assert again.step_time == found.predicted_step
        assert again.peak_activation_bytes == found.peak_activation_bytes
        assert found.timeline.step_time == found.predicted_step
    with pytest.raises(ValueError, match=r"'layers.0' is not a unit a stage can start at"):
        simulate(prof, ["layers.0"])
    with pytest.raises(ValueError, match=r"must name units once each, in the model's order"):
        simulate(prof, ["layers.5", "layers.2"])
    with pytest.raises(TypeError, match=r"split_before must be a list, write \['layers.2'\]"):
        simulate(prof, "layers.2")


def test_ranks_sharing_cores_are_predicted_faster_in_the_bubbles():
    prof = _random_profile(8, 2)
    schedule = S.OneFOneB(4)
    plain = search(prof, 4, schedule=schedule, num_ranks=4)
    # 4 ranks on 2 cores: the profile's times are those of every rank at
    # work; where fewer compute they run faster, never faster than alone.
    shared = search(prof, 4, schedule=schedule, num_ranks=4, sharing=(2.0, 1.0))
    assert shared.split_before == plain.split_before
    assert plain.predicted_step / 2 <= shared.predicted_step < 0.95 * plain.predicted_step
    assert shared.timeline.step_time == shared.predicted_step
    again = simulate(prof, shared.split_before, schedule=schedule, num_ranks=4, sharing=(2.0, 1.0))
    assert again.step_time == shared.predicted_step
    assert shared.even_step < plain.even_step
    # As many cores as ranks (or each rank standing for 2 on 8): nothing changes.
    for sharing in ((4.0, 1.0), (8.0, 2.0)):
        roomy = search(prof, 4, schedule=schedule, num_ranks=4, sharing=sharing)
        assert roomy.predicted_step == plain.predicted_step


def test_balance_pickles():
    found = search(_random_profile(5, 0), 2)
    # What rank 0 broadcasts to the other ranks under torch.distributed.
    again = pickle.loads(pickle.dumps(found))
    assert repr(again) == repr(found) and again.split_before == found.split_before
    assert again.profile == found.profile and again.timeline.step_time == found.predicted_step


# --------------------------------------------------------------------------- bad input


def _gpt():
    torch.manual_seed(0)
    return TinyGPT(), (torch.randint(0, 64, (2, 16)),)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_stages": 0}, ValueError, "num_stages must be at least 1, got 0"),
        ({"num_stages": "2"}, TypeError, "num_stages must be an int, got '2'"),
        ({"num_stages": 2.0}, TypeError, "num_stages must be an int"),
        (
            {"num_stages": 2, "schedule": S.OneFOneB},
            TypeError,
            "schedule is the class OneFOneB; pass an instance",
        ),
        ({"num_stages": 2, "schedule": "1f1b"}, TypeError, "must be an mpmd.Schedule"),
        (
            {"num_stages": 3, "schedule": S.ZBV(4)},
            ValueError,
            "ZBV(num_microbatches=4) cannot run 3 stages on 3 ranks: ZBV places two stages",
        ),
        (
            {"num_stages": 3, "num_ranks": 2},
            ValueError,
            "cannot run 3 stages on 2 ranks: OneFOneB places stages round-robin",
        ),
        ({"num_stages": 2, "num_ranks": 0}, ValueError, "num_ranks must be a positive int"),
        ({"num_stages": 2, "memory_limit": -1}, ValueError, "memory_limit is bytes per rank"),
        ({"num_stages": 2, "bandwidth": -1.0}, ValueError, "bandwidth must be a non-negative"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    model, args = _gpt()
    num_stages = kwargs.pop("num_stages")
    with pytest.raises(error) as err:
        mpmd.balance(model, args, num_stages, **kwargs)
    assert message in str(err.value)
    assert str(err.value).startswith("mpmd.balance: ")


def test_too_many_stages_lists_the_units_and_the_fix():
    # Four Linear layers: no unit opens up into smaller ones.
    with pytest.raises(ValueError) as err:
        mpmd.balance(MLP(16, 4), (torch.randn(2, 16),), 5)
    text = str(err.value)
    assert text.startswith("mpmd.balance: num_stages=5 but the model has 4 unit(s)")
    assert "('layers.0', 'layers.1', 'layers.2', 'layers.3')" in text
    assert "use num_stages <= 4" in text and "split_before" in text


def test_bad_models_and_inputs():
    model, args = _gpt()
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got function"):
        mpmd.balance(lambda x: x, args, 2)
    with pytest.raises(TypeError, match=r"example_args is a list"):
        mpmd.balance(model, list(args), 2)
    with pytest.raises(TypeError, match=r"do not fit TinyGPT.forward"):
        mpmd.balance(model, (args[0], args[0]), 2)
    with torch.device("meta"):
        meta = TinyGPT()
    with pytest.raises(ValueError, match=r"on the meta device, so nothing can be timed"):
        mpmd.balance(meta, args, 2)
    with pytest.raises(ValueError, match=r"calls mpmd.mark_stage_end 2 time\(s\)"):
        mpmd.balance(MarkedMLP(16, 4), (torch.randn(2, 16),), 2)
    with pytest.raises(ValueError, match=r"Profile.forward gives 1 values for 2 units"):
        Profile(
            units=("a", "b"),
            forward=(1.0,),
            backward=(1.0, 1.0),
            activation_bytes=(0, 0),
            transfers=(),
        )


def test_trace_rejects_num_stages_with_explicit_splits():
    model, args = _gpt()
    with pytest.raises(ValueError, match=r"pass num_stages or split_before/split_after, not both"):
        mpmd.trace(model, args, num_stages=2, split_before=["blocks.2"])
    with pytest.raises(ValueError, match=r"pass num_stages or split_before/split_after, not both"):
        mpmd.trace(model, args, num_stages=2, split_after=["blocks.1"])
    with pytest.raises(ValueError, match=r"schedule and num_ranks only tell num_stages"):
        mpmd.trace(model, args, schedule=S.OneFOneB(4))
    with pytest.raises(ValueError, match=r"calls mpmd.mark_stage_end"):
        mpmd.trace(MarkedMLP(16, 4), (torch.randn(2, 16),), num_stages=2)


def test_gradients_added_into_earlier_microbatches_are_measured_and_charged():
    # Each unit's parameters: the time to add one microbatch's gradients
    # into those already there, measured; more for more parameters.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1024), nn.Linear(1024, 1024))
    prof = profile(model, (torch.randn(4, 8),), repeats=3)
    assert prof.accumulate is not None and len(prof.accumulate) == 3
    assert prof.accumulate[2] > prof.accumulate[0] > 0
    # The simulator charges (m - 1) of them per stage and step: none with
    # one microbatch, the same time per step at any split of the work.
    chain = Profile.chain(["a", "b", "c", "d"], [1.0, 1.0, 1.0, 1.0])
    added = dataclasses.replace(chain, accumulate=(0.25, 0.25, 0.25, 0.25))
    for m in (1, 4):
        plain = search(chain, 2, schedule=S.GPipe(m), num_ranks=1)
        charged = search(added, 2, schedule=S.GPipe(m), num_ranks=1)
        assert charged.predicted_step == pytest.approx(plain.predicted_step + (m - 1) * 1.0)
