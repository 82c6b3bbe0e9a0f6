"""`contention.slowdown`: the factor the planner scales its profile by where
the ranks compute at once, from rates measured alone and together."""

from __future__ import annotations

import pytest

from torchmpmd.planner.contention import slowdown


def test_a_slow_window_together_does_not_raise_the_factor():
    # 2 ranks on 2 cores: barely slower together; one window of three ran
    # in another tenant's slow second (a median there would read 1.08).
    alone = [201.0, 191.0, 200.0]
    together = [184.0, 197.0, 170.0]
    assert slowdown(alone, together) == pytest.approx(201.0 / 197.0)


def test_ranks_sharing_cores_are_slower_together():
    # 4 ranks on 2 cores: each computes about half as fast together.
    assert slowdown([200.0, 202.0, 199.0], [99.0, 101.0, 97.0]) == pytest.approx(2.0)


def test_never_under_one():
    assert slowdown([180.0, 190.0], [200.0, 195.0]) == 1.0
