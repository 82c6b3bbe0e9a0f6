"""Test-wide settings, markers and fixtures.

Under CI (CI=true) property tests replay a fixed sequence of examples, so a
red build is reproducible; locally they explore.

Markers (pyproject.toml): `slow` (over about 2 s on 2 cores),
`multiprocess` (spawns processes: everything under tests/distributed, set
here, and the unit tests marked so) and `alone` (times the machine and
compares: nothing may run beside it). `bash scripts/test.sh` runs the tests
of one process but `alone` on two pytest-xdist workers, then the rest one at
a time; `--fast` leaves out `slow` and `multiprocess`.

Fixtures, over the small model zoo of tests/models.py:

- `traced_case(name, m=4, dtype=torch.float64)`: a zoo case traced with its
  split, with a batch of `m` microbatches and its target (`models.Traced`,
  unpacks as `case, pipe, batch, target`); `gpt` and `mlp` are two of them.
- `reference(traced, m=4, dtype=torch.float64)`: the unpipelined model after
  gradient accumulation over the same microbatches, and its mean loss.
- `local_pipeline(traced_or_pipe, schedule, num_ranks, **options)`: a
  `LocalPipeline` (ranks as threads), with the case's loss and a 60 s
  timeout unless given.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings
from models import Traced, reference_step, trace_case

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI", "").lower() == "true" else "dev")

DISTRIBUTED = Path(__file__).parent / "distributed"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/distributed spawns processes."""
    for item in items:
        if DISTRIBUTED in Path(item.path).parents:
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture
def traced_case() -> Callable[..., Traced]:
    """Factory: `traced_case(name, m=4, dtype=torch.float64)` (models.trace_case)."""
    return trace_case


@pytest.fixture
def gpt() -> Traced:
    """The tied-embedding TinyGPT in float64, cut into 4 stages, with a
    batch of 4 microbatches of 2 sequences and its targets."""
    return trace_case("gpt")


@pytest.fixture
def mlp() -> Traced:
    """The 4-layer MLP in float64, one layer per stage, with a batch of 4
    microbatches of 2 rows and its targets."""
    return trace_case("mlp")


@pytest.fixture
def reference() -> Callable[..., tuple[torch.nn.Module, torch.Tensor]]:
    """Factory: `reference(traced, m=4, dtype=torch.float64)` -> the
    unpipelined model (a fresh copy of the case's) after gradient
    accumulation over `traced`'s batch in `m` microbatches, and its mean
    loss (models.reference_step)."""

    def make(
        traced: Traced, m: int = 4, dtype: torch.dtype = torch.float64
    ) -> tuple[torch.nn.Module, torch.Tensor]:
        return reference_step(traced.case, traced.batch, traced.target, m, dtype)

    return make


@pytest.fixture
def local_pipeline() -> Callable[..., LocalPipeline]:
    """Factory: `local_pipeline(traced_or_pipe, schedule, num_ranks, **options)`,
    a LocalPipeline over a traced zoo case (its loss by default) or a pipe;
    `timeout` defaults to 60 s, so a hung rank fails the test in a minute."""

    def make(
        traced: Traced | mpmd.Pipe, schedule: mpmd.Schedule, num_ranks: int, **options: Any
    ) -> LocalPipeline:
        if isinstance(traced, Traced):
            options.setdefault("loss_fn", traced.case.loss)
            traced = traced.pipe
        options.setdefault("timeout", 60)
        return LocalPipeline(traced, schedule, num_ranks, **options)

    return make


@pytest.fixture(scope="module")
def one_rank_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank Gloo process group for the module's tests (a checkpoint's
    collectives, a DeviceMesh of one rank)."""
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    yield
    dist.destroy_process_group()
