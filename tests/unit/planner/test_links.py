"""`mpmd.Links` without processes: a link's time, the ring model that
prices another group size, the links of a described machine (the same
collectives `mpmd.project` charges), the least-squares fit `calibrate`
uses, and the errors `calibrate` raises before any communication."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

import torchmpmd as mpmd
from torchmpmd.planner import cluster, links

MACHINE = mpmd.Machine(
    flops=400e12,
    memory=80 * 2**30,
    devices_per_node=8,
    intra_node_bandwidth=450e9,
    intra_node_latency=5e-6,
    inter_node_bandwidth=50e9,
    inter_node_latency=10e-6,
)
MiB = 1 << 20


def _measured(latency: float = 100e-6, bandwidth: float = 2e9) -> mpmd.Links:
    """Links as calibrate would give them on 2 ranks, every kind alike."""
    link = mpmd.Link(latency, bandwidth)
    return mpmd.Links(**dict.fromkeys(links.KINDS, link), group_size=2)


def test_a_link_is_latency_plus_bytes_over_bandwidth():
    link = mpmd.Link(latency=50e-6, bandwidth=1e9)
    assert link.time(1e6) == pytest.approx(50e-6 + 1e-3)
    assert link.time(0) == 0.0  # nothing to move: no call
    assert mpmd.Link(0.0, math.inf).time(1e12) == 0.0


@pytest.mark.parametrize(
    ("latency", "bandwidth"), [(-1e-6, 1e9), (math.nan, 1e9), (1e-6, 0), (1e-6, -1), (True, 1e9)]
)
def test_a_link_refuses_what_is_not_a_link(latency, bandwidth):
    with pytest.raises(ValueError, match=r"Link\.(latency|bandwidth) must be"):
        mpmd.Link(latency, bandwidth)


def test_a_link_refuses_negative_bytes():
    with pytest.raises(ValueError, match="nbytes must be a non-negative number"):
        mpmd.Link(0.0, 1e9).time(-1)


def test_links_price_each_kind_with_its_own_link():
    measured = mpmd.Links(
        send=mpmd.Link(10e-6, 10e9),
        all_reduce=mpmd.Link(200e-6, 1e9),
        all_gather=mpmd.Link(100e-6, 2e9),
        reduce_scatter=mpmd.Link(100e-6, 2e9),
        all_to_all=mpmd.Link(50e-6, 4e9),
        group_size=2,
    )
    assert measured.time("send", 1e6) == pytest.approx(10e-6 + 1e-4)
    assert measured.time("all_reduce", 1e6) == pytest.approx(200e-6 + 1e-3)
    with pytest.raises(ValueError, match="unknown kind 'broadcast'; pick one of send, "):
        measured.time("broadcast", 1e6)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        mpmd.Links(**dict.fromkeys(links.KINDS, mpmd.Link(0, 1)), group_size=0)
    with pytest.raises(TypeError, match=r"Links.send must be an mpmd.Link"):
        mpmd.Links(**dict.fromkeys(links.KINDS, (0, 1)), group_size=2)


def test_the_ring_model_prices_four_ranks_from_two():
    two = _measured(latency=100e-6, bandwidth=2e9)
    four = two.scaled_to(4)
    assert four.group_size == 4
    # On 2 ranks a collective moves 1/2 of its tensor per link (all-reduce:
    # twice); on 4, 3/4: latency x 3 (3 steps for 1), bandwidth x 2/3.
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert four.link(kind).latency == pytest.approx(300e-6), kind
        assert four.link(kind).bandwidth == pytest.approx(2e9 * 2 / 3), kind
    assert four.send == two.send
    assert two.time("all_reduce", 8 * MiB, group_size=4) == four.time("all_reduce", 8 * MiB)
    assert two.scaled_to(2) is two
    # Back again: the same links.
    assert four.scaled_to(2).all_gather.latency == pytest.approx(100e-6)
    assert four.scaled_to(2).all_gather.bandwidth == pytest.approx(2e9)


def test_on_one_rank_collectives_are_free_but_not_a_send():
    one = _measured().scaled_to(1)
    assert one.group_size == 1
    assert one.time("all_reduce", MiB) == one.time("all_to_all", MiB) == 0.0
    assert one.send == _measured().send
    with pytest.raises(ValueError, match="for a group of 1 rank, where collectives cost nothing"):
        one.scaled_to(2)


def test_free_links_stay_free_at_any_size():
    free = mpmd.Links.free()
    assert free.group_size == 1
    for size in (1, 2, 64):
        for kind in links.KINDS:
            assert free.time(kind, 1e9, group_size=size) == 0.0
    assert "inf" in repr(free)


def test_links_of_a_machine_are_what_project_charges():
    # mpmd.project prices a sequence-parallel all-gather with cluster._ring:
    # the same collective as Links.from_machine's.
    nbytes = 64 * MiB
    for size, bandwidth, latency in (
        (8, MACHINE.intra_node_bandwidth, MACHINE.intra_node_latency),
        (32, MACHINE.inter_node_bandwidth, MACHINE.inter_node_latency),
    ):
        described = mpmd.Links.from_machine(MACHINE, size)
        ring = cluster._ring(nbytes, size, bandwidth, latency)
        assert described.time("all_gather", nbytes) == pytest.approx(ring)
        assert described.time("reduce_scatter", nbytes) == pytest.approx(ring)
        assert described.time("all_reduce", nbytes) == pytest.approx(2 * ring)
        assert described.send == mpmd.Link(latency, bandwidth)


def test_machine_links_scale_as_the_machine_would_describe_them():
    two = mpmd.Links.from_machine(MACHINE, 2)
    for size in (1, 4, 8):
        direct = mpmd.Links.from_machine(MACHINE, size)
        scaled = two.scaled_to(size)
        for kind in links.KINDS:
            assert scaled.time(kind, 4 * MiB) == pytest.approx(direct.time(kind, 4 * MiB))


def test_from_machine_picks_the_link_the_group_spans():
    inside = mpmd.Links.from_machine(MACHINE, 8)
    across = mpmd.Links.from_machine(MACHINE, 8, within_node=False)
    assert inside.send.bandwidth == MACHINE.intra_node_bandwidth
    assert across.send.bandwidth == MACHINE.inter_node_bandwidth
    with pytest.raises(ValueError, match="a group of 16 does not fit in a node of 8 devices"):
        mpmd.Links.from_machine(MACHINE, 16, within_node=True)
    with pytest.raises(TypeError, match=r"machine must be an mpmd\.Machine"):
        mpmd.Links.from_machine("h100", 8)  # type: ignore[arg-type]


def test_repr_is_a_table_of_latency_and_bandwidth():
    text = repr(mpmd.Links.from_machine(MACHINE, 8))
    lines = text.splitlines()
    assert lines[0].startswith("Links on a group of 8")
    assert lines[1].split() == ["kind", "latency", "(us)", "bandwidth", "(GB/s)"]
    assert lines[3].split() == ["send", "5", "450"]
    assert lines[4].split() == ["all_reduce", "70", "257"]  # 14 steps; 450 x 8 / 14


def test_the_fit_recovers_a_line_and_clamps_what_is_not_one():
    sizes = [4096.0, 262144.0, 4194304.0]
    fitted = links._fit(sizes, [30e-6 + n / 3e9 for n in sizes])
    assert fitted.latency == pytest.approx(30e-6)
    assert fitted.bandwidth == pytest.approx(3e9)
    # Larger messages no slower: no time per byte seen.
    flat = links._fit(sizes, [50e-6, 45e-6, 40e-6])
    assert flat.bandwidth == math.inf and 40e-6 <= flat.latency <= 50e-6
    # A line through below zero: no latency, the bandwidth through the points.
    steep = links._fit(sizes, [1e-9, 100e-6, 2e-3])
    assert steep.latency == 0.0 and 0 < steep.bandwidth < math.inf


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sizes": [4096]}, "at least 2 distinct message sizes"),
        ({"sizes": [4096, 4096]}, "at least 2 distinct message sizes"),
        ({"sizes": [0, 4096]}, "sizes must be a sequence of positive ints"),
        ({"sizes": "4096"}, "sizes must be a sequence of positive ints"),
        ({"sizes": [4096.0, 8192]}, "sizes must be a sequence of positive ints"),
        ({"repeats": 0}, "repeats must be a positive int"),
        ({"timeout": -1}, "timeout must be a positive number of seconds"),
    ],
)
def test_calibrate_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mpmd.calibrate(**kwargs)


def test_calibrate_outside_torchrun_says_how_to_call_it():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="call it on every rank under torchrun"):
        mpmd.calibrate()
