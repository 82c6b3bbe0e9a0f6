"""Checkpoint saves and loads are collectives that fail every rank alike and
never leave one waiting: a save that only some ranks call fails within its
timeout naming the missing rank (also for the rank that arrives late), a
refusal decided on rank 0 (a directory the save did not write) or `extra`
values that differ between ranks fail every rank before a byte is written,
and a corrupted tensor in rank 1's data file fails the load on every rank
naming that file and the tensor (2 Gloo ranks)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from harness import check_all, run_ranks
from models import square_loss
from torch.distributed.checkpoint.filesystem import FileSystemReader

import torchmpmd as mpmd

ckpt = mpmd.checkpoint


def _trained(seed: int = 0) -> tuple[mpmd.PipelineRunner, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    pipe = mpmd.trace(model, (torch.randn(2, 4),), split_before=["2"])
    runner = mpmd.PipelineRunner(
        pipe, mpmd.schedules.GPipe(2), loss_fn=square_loss, options=mpmd.RunnerOptions(timeout=30)
    )
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-2)
    torch.manual_seed(1)
    opt.zero_grad()
    runner.step(torch.randn(4, 4), target=torch.randn(4, 2))
    opt.step()
    return runner, opt


def _attempt(fn: Any) -> dict[str, Any]:
    """What a call did: its error's type and message, and how long it took."""
    started = time.monotonic()
    try:
        fn()
        return {"error": None, "seconds": time.monotonic() - started}
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - started}


def only_some_ranks_save(rank: int, world: int, tmp: str) -> list[dict[str, Any]]:
    runner, opt = _trained()
    root = Path(tmp)
    out = []
    # Call 1: only rank 0 is on time; rank 1 arrives after rank 0 gave up.
    if rank == 1:
        time.sleep(5)
    out.append(_attempt(lambda: ckpt.save(root / "a", runner, opt, timeout=2)))
    # Call 2: only rank 1 is on time (rank 0 decides, so rank 1 waits longer).
    if rank == 0:
        time.sleep(12)
    out.append(_attempt(lambda: ckpt.save(root / "b", runner, opt, timeout=1)))
    # Call 3: every rank, but with different paths (a rank a step behind).
    out.append(_attempt(lambda: ckpt.save(root / f"step-{rank}", runner, opt, timeout=30)))
    # Call 4: every rank alike: the save works.
    out.append(_attempt(lambda: ckpt.save(root / "d", runner, opt, timeout=30)))
    return out


def test_a_save_not_called_on_every_rank_fails_in_bounded_time(tmp_path: Path) -> None:
    r0, r1 = check_all(run_ranks(only_some_ranks_save, 2, str(tmp_path)))
    late = r"Rank\(s\) \[{}\] did not arrive within {} s"

    # Rank 0 gives up after its timeout; rank 1, arriving late, fails at once.
    assert re.search(late.format(1, 2), r0[0]["error"]) and r0[0]["error"].startswith("Timeout")
    assert "checkpoint.save is a collective: every rank must call it" in r0[0]["error"]
    assert 2 <= r0[0]["seconds"] < 4.5, r0[0]
    assert re.search(late.format(1, 2), r1[0]["error"]) and r1[0]["seconds"] < 2, r1[0]
    # Rank 1 gives up after timeout + 5 s when rank 0 never decides.
    assert re.search(late.format(0, 1), r1[1]["error"]) and 6 <= r1[1]["seconds"] < 10, r1[1]
    assert re.search(late.format(0, 1), r0[1]["error"]) and r0[1]["seconds"] < 2, r0[1]
    for r in (r0, r1):
        assert "did not make the same call" in r[2]["error"] and "step-0" in r[2]["error"]
        assert "step-1" in r[2]["error"]
        assert r[3]["error"] is None
    assert sorted(os.listdir(tmp_path)) == ["d"]


def refused_on_every_rank(rank: int, world: int, tmp: str) -> list[str | None]:
    runner, opt = _trained()
    root = Path(tmp)
    tries = [
        lambda: ckpt.save(root / "ckpt", runner, opt),
        lambda: ckpt.save(root / "ckpt" / "step-3", runner, opt, extra={"step": 3, "seen": rank}),
    ]
    return [_attempt(t)["error"] for t in tries]


def test_refusals_fail_every_rank_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "notes.txt").write_text("my notes")
    r0, r1 = check_all(run_ranks(refused_on_every_rank, 2, str(tmp_path)))
    for r, errors in enumerate((r0, r1)):
        refusal, differs = errors
        assert refusal is not None and refusal.startswith("FileExistsError: "), refusal
        assert f"{tmp_path / 'ckpt'} exists and it is not a torchmpmd checkpoint" in refusal
        assert ("rank 0: " in refusal) == (r == 1)  # decided on rank 0, raised on both
        assert differs is not None and differs.startswith("ValueError: "), differs
        assert "extra['seen'] differs between ranks: rank 0 has 0, rank 1 has 1" in differs
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["notes.txt"]


def corrupted_on_rank_1(rank: int, world: int, tmp: str) -> dict[str, Any]:
    runner, opt = _trained()
    path = Path(tmp) / "step-1"
    ckpt.async_save(path, runner, opt, extra={"step": 1}).result(timeout=60)
    dist.barrier()  # rank 0 put the checkpoint in place before its future completed
    before = _attempt(lambda: ckpt.load(path, runner, opt))
    if rank == 1:
        # Flip one bit of a value of the last stage's bias, which this rank wrote.
        metadata = FileSystemReader(str(path)).read_metadata()
        info = next(i for k, i in metadata.storage_data.items() if k.fqn == "model.2.bias")
        assert info.relative_path == "__1_0.distcp", info
        data = bytearray((path / info.relative_path).read_bytes())
        values = bytes(runner.state_dict()["2.bias"].detach().clone().untyped_storage())
        data[data.index(values, info.offset, info.offset + info.length) + 3] ^= 0x40
        (path / info.relative_path).write_bytes(bytes(data))
    dist.barrier()
    return {"before": before["error"], "after": _attempt(lambda: ckpt.load(path, runner, opt))}


def test_a_corrupted_tensor_fails_the_load_on_every_rank(tmp_path: Path) -> None:
    results = check_all(run_ranks(corrupted_on_rank_1, 2, str(tmp_path)))
    for r in results:
        assert r["before"] is None
        error = r["after"]["error"]
        assert error is not None and error.startswith("CheckpointError: "), error
        assert f"{tmp_path / 'step-1' / '__1_0.distcp'} fails its checksum for 'model.2.bias'" in (
            error
        )


def fails_on_rank_1_after_the_check_in(rank: int, world: int, tmp: str) -> dict[str, Any]:
    runner, opt = _trained()
    if rank == 1:
        # A parameter that is not the runner's: only this rank cannot build its state.
        stray = nn.Parameter(torch.zeros(3))
        bad = torch.optim.AdamW([*runner.parameters(), stray], lr=1e-2)
    store = dist.distributed_c10d._get_default_store()
    attempt = _attempt(lambda: ckpt.save(Path(tmp) / "a", runner, bad if rank == 1 else opt))
    if rank == 0:
        store.set("rank 0 returned", "1")
    else:
        # Rank 1 lives on (as a training loop that caught the error would): rank
        # 0 must not depend on it exiting to return.
        with contextlib.suppress(RuntimeError):
            store.wait(["rank 0 returned"], datetime.timedelta(seconds=20))
    after = _attempt(lambda: ckpt.save(Path(tmp) / "b", runner, opt))
    # An optimizer on rank 0 only: decided from the check-in, alike on both.
    one_sided = _attempt(lambda: ckpt.save(Path(tmp) / "c", runner, opt if rank == 0 else None))
    return {"failed": attempt, "after": after, "one_sided": one_sided}


def test_a_save_failing_on_one_rank_fails_every_rank_quickly(tmp_path: Path) -> None:
    results = check_all(run_ranks(fails_on_rank_1_after_the_check_in, 2, str(tmp_path)))
    for r in results:
        error = r["failed"]["error"]
        assert error is not None and r["failed"]["seconds"] < 10, r["failed"]
        assert "rank 1's optimizer holds a parameter of shape [3]" in error, error
        assert "not one of the runner's" in error, error
        assert r["after"]["error"] is None, r["after"]
        one_sided = r["one_sided"]["error"]
        assert one_sided is not None and r["one_sided"]["seconds"] < 10, r["one_sided"]
        assert "rank(s) [1] passed no optimizer and the others did" in one_sided, one_sided
    assert sorted(os.listdir(tmp_path)) == ["b"]


def saves_twice_with_an_empty_rank(rank: int, world: int, tmp: str) -> list[str]:
    # Stage 1 (rank 1) holds no tensor: DCP still writes an empty __1_0.distcp.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2), nn.Tanh())
    pipe = mpmd.trace(model, (torch.randn(2, 4),), split_before=["1"])
    runner = mpmd.PipelineRunner(
        pipe, mpmd.schedules.GPipe(2), loss_fn=square_loss, options=mpmd.RunnerOptions(timeout=30)
    )
    path = Path(tmp) / "latest"
    # No extra: DCP would give its entry to rank 1 (the smaller plan takes what is shared).
    ckpt.save(path, runner)
    ckpt.save(path, runner)  # the same path every N steps
    assert ckpt.load(path, runner) == {}
    listed = sorted(os.listdir(path))
    # With an optimizer: rank 1's holds an empty group, with rank 0's settings.
    params = list(runner.parameters())
    opt = torch.optim.AdamW(params if params else [{"params": []}], lr=1e-2)
    ckpt.save(Path(tmp) / "with-optimizer", runner, opt, extra={"step": 3})
    opt.param_groups[0]["lr"] = 0.5
    assert ckpt.load(Path(tmp) / "with-optimizer", runner, opt) == {"step": 3}
    assert opt.param_groups[0]["lr"] == 1e-2
    return listed


def test_saving_twice_to_one_path_with_a_rank_that_writes_nothing(tmp_path: Path) -> None:
    r0, r1 = check_all(run_ranks(saves_twice_with_an_empty_rank, 2, str(tmp_path)))
    assert r0 == r1
    assert "__1_0.distcp" in r0 and (tmp_path / "latest" / "__1_0.distcp").stat().st_size == 0
    manifest = json.loads((tmp_path / "latest" / ".torchmpmd.json").read_text())
    assert manifest["files"]["__1_0.distcp"] == {"size": 0, "items": []}
    assert sorted(os.listdir(tmp_path)) == ["latest", "with-optimizer"]


def async_saves_in_a_row(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from torchmpmd.checkpoint import storage

    runner, opt = _trained()
    root = Path(tmp)
    out: dict[str, Any] = {}
    # A second async_save right after the first waits for it: both land.
    first = ckpt.async_save(root / "a", runner, opt, extra={"step": 1})
    second = ckpt.async_save(root / "b", runner, opt, extra={"step": 2})
    out["both"] = _attempt(lambda: (first.result(timeout=30), second.result(timeout=30)))
    # A slow disk on rank 1: a save that comes while the previous one still
    # writes gives up after its timeout, on every rank, naming the save it
    # waited for; the one writing lands.
    original = storage.ChecksumWriter.write_data
    if rank == 1:

        def slow(self: Any, plan: Any, planner: Any) -> Any:
            time.sleep(8)
            return original(self, plan, planner)

        storage.ChecksumWriter.write_data = slow  # type: ignore[method-assign]
    writing = ckpt.async_save(root / "c", runner, opt)
    out["meanwhile"] = _attempt(lambda: ckpt.async_save(root / "d", runner, opt, timeout=2))
    out["writing"] = _attempt(lambda: writing.result(timeout=60))
    storage.ChecksumWriter.write_data = original  # type: ignore[method-assign]
    # The process group lives on: a step, a save, a load.
    torch.manual_seed(2)
    runner.step(torch.randn(4, 4), target=torch.randn(4, 2))
    ckpt.save(root / "e", runner, opt)
    out["loaded"] = ckpt.load(root / "b", runner, opt)
    return out


def test_an_async_save_before_the_last_one_is_written_waits_for_it(tmp_path: Path) -> None:
    # Before: the second async_save's collectives met the first's on the
    # default group; both hung until its timeout, neither checkpoint was
    # written and the group was dead ("lost rank 1 ... may have died").
    for r in check_all(run_ranks(async_saves_in_a_row, 2, str(tmp_path))):
        assert r["both"]["error"] is None and r["both"]["seconds"] < 20, r["both"]
        meanwhile = r["meanwhile"]
        assert meanwhile["error"] is not None and meanwhile["seconds"] < 6, meanwhile
        assert meanwhile["error"].startswith("TimeoutError: "), meanwhile
        assert f"the previous async_save({str(tmp_path / 'c')!r})" in meanwhile["error"], meanwhile
        assert "is still writing after 2 s" in meanwhile["error"], meanwhile
        assert r["writing"]["error"] is None, r["writing"]
        assert r["loaded"] == {"step": 2}, r
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c", "e"]
    assert all(ckpt.is_complete(tmp_path / name) for name in "abce")
