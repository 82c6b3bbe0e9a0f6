"""Checkpoints must never delete what they did not write, never run code
from the files they load, and never load a corrupted tensor silently: a save
onto anything but a checkpoint of its own is refused before a byte is
written, a crafted `.metadata` or `extra` object fails the load without
running, a flipped bit, a truncated or a deleted data file fails naming the
file and the tensor, and the other bad checkpoints of the catalogue fail with
a first line that says what is wrong (one process, a world of one rank)."""

from __future__ import annotations

import collections
import dataclasses
import fractions
import io
import json
import os
import pathlib
import pickle
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from models import square_loss
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict

import torchmpmd as mpmd
from torchmpmd.checkpoint import CheckpointError, paths, storage

ckpt = mpmd.checkpoint


@pytest.fixture(scope="module", autouse=True)
def world(one_rank_world: None) -> None:
    """Every test here runs in a one-rank process group."""


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _runner(hidden: int = 8, seed: int = 0) -> mpmd.PipelineRunner:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))
    pipe = mpmd.trace(model, (torch.randn(2, 4),), split_before=["2"])
    return mpmd.PipelineRunner(
        pipe, mpmd.schedules.GPipe(2), loss_fn=square_loss, options=mpmd.RunnerOptions(timeout=10)
    )


def _trained(hidden: int = 8) -> tuple[mpmd.PipelineRunner, torch.optim.Optimizer]:
    runner = _runner(hidden)
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-2)
    opt.zero_grad()
    runner.step(torch.randn(4, 4), target=torch.randn(4, 2))
    opt.step()
    return runner, opt


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (hidden ones too) with a file's bytes."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(Path(dirpath, name), root)] = None
        for name in filenames:
            out[os.path.relpath(Path(dirpath, name), root)] = Path(dirpath, name).read_bytes()
    return out


def _item(path: Path, fqn: str) -> tuple[Path, int, int]:
    """The data file, offset and length of the stored item of `fqn`."""
    metadata = FileSystemReader(str(path)).read_metadata()
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn:
            return path / info.relative_path, info.offset, info.length
    raise KeyError(fqn)


# ---- A: save never deletes what it did not write


def test_save_refuses_a_directory_holding_checkpoints_and_notes(in_tmp: Path) -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt)
    Path("ckpt/notes.txt").write_text("my notes")
    before = _tree(in_tmp)
    with pytest.raises(FileExistsError, match=r"'ckpt' .* not a torchmpmd checkpoint .*notes.txt"):
        ckpt.save("ckpt", runner, opt)
    assert _tree(in_tmp) == before  # nothing deleted, nothing left behind


@pytest.mark.parametrize("path", [".", "sub/..", "ckpt/step-1/..", "CWD", "PARENT"])
def test_save_refuses_the_working_directory_and_dot_paths(in_tmp: Path, path: str) -> None:
    runner, opt = _trained()
    Path("sub").mkdir()
    ckpt.save("ckpt/step-1", runner, opt)
    Path("notes.txt").write_text("my notes")
    path = {"CWD": str(in_tmp), "PARENT": str(in_tmp / "sub" / "..")}.get(path, path)
    before = _tree(in_tmp)
    with pytest.raises((ValueError, FileExistsError), match=r"checkpoint.save: .*(\.\.|\.|/)"):
        ckpt.save(path, runner, opt)
    assert _tree(in_tmp) == before


def test_save_refuses_a_file_and_a_symlink(in_tmp: Path) -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt)
    Path("model.pt").write_bytes(b"weights")
    Path("link").symlink_to("ckpt/step-1")
    before = _tree(in_tmp)
    with pytest.raises(FileExistsError, match=r"'model.pt' .*not a directory"):
        ckpt.save("model.pt", runner, opt)
    with pytest.raises(FileExistsError, match=r"'link' is a symbolic link"):
        ckpt.save("link", runner, opt)
    assert _tree(in_tmp) == before


def test_save_replaces_its_own_checkpoint_but_not_a_users_file_in_it(in_tmp: Path) -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt, extra={"step": 1})
    for p in runner.parameters():
        p.data.add_(1.0)
    saved = {k: v.clone() for k, v in runner.state_dict().items()}
    ckpt.save("ckpt/step-1", runner, opt, extra={"step": 2})
    assert sorted(os.listdir(in_tmp / "ckpt")) == ["step-1"]  # no staging or old copy left
    fresh = _runner(seed=1)
    assert ckpt.load("ckpt/step-1", fresh) == {"step": 2}
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)

    Path("ckpt/step-1/README").write_text("best run so far")
    before = _tree(in_tmp)
    with pytest.raises(FileExistsError, match=r"README, which the checkpoint did not write"):
        ckpt.save("ckpt/step-1", runner, opt)
    assert _tree(in_tmp) == before


def test_save_refuses_a_parent_it_cannot_write(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, opt = _trained()
    Path("readonly").mkdir()
    real_access = os.access
    # As a non-root user on a read-only directory (root passes any access check).
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode, **kw: False if Path(p).name == "readonly" else real_access(p, mode, **kw),
    )
    with pytest.raises(PermissionError, match=r"directory .*readonly is not writable"):
        ckpt.save("readonly/step-1", runner, opt)
    with pytest.raises(NotADirectoryError, match=r"notes.txt is not a directory"):
        Path("notes.txt").write_text("x")
        ckpt.save("notes.txt/step-1", runner, opt)
    assert sorted(os.listdir(in_tmp)) == ["notes.txt", "readonly"]
    assert os.listdir("readonly") == []


def test_failed_save_leaves_nothing_behind(in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner, opt = _trained()

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(
        torch.distributed.checkpoint.filesystem._FileSystemWriter, "write_data", full
    )
    with pytest.raises(OSError, match=r"^checkpoint.save: .*step-1: rank 0 failed: .*No space"):
        ckpt.save("new/dir/step-1", runner, opt)
    assert os.listdir(in_tmp) == []  # no staging directory, no parents it made


# ---- B: loading runs no code


class _Marker:
    """An object whose unpickling writes a file (what an attacker's would run)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.path)!r}, 'w').write('ran')",))


def test_crafted_metadata_runs_nothing(in_tmp: Path) -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt)
    marker = in_tmp / "ran"
    Path("ckpt/step-1/.metadata").write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(
        pickle.UnpicklingError, match=r"\.metadata refers to builtins.exec.*weights_only=False"
    ):
        ckpt.load("ckpt/step-1", runner, opt)
    assert not marker.exists()


def test_crafted_extra_runs_nothing(in_tmp: Path) -> None:
    runner, _ = _trained()
    marker = in_tmp / "ran"
    model_sd, _ = get_state_dict(ckpt.local_model(runner), [])
    dcp.save({"model": model_sd, "extra": {"step": 3, "evil": _Marker(marker)}}, checkpoint_id="c")
    assert not marker.exists()
    with pytest.raises(
        pickle.UnpicklingError, match=r"entry 'extra.evil' is not tensors and plain"
    ):
        ckpt.load("c", runner)
    assert not marker.exists()


def test_objects_load_only_when_trusted(in_tmp: Path) -> None:
    runner, _ = _trained()
    model_sd, _ = get_state_dict(ckpt.local_model(runner), [])
    third = fractions.Fraction(1, 3)
    dcp.save({"model": model_sd, "extra": {"share": third}}, checkpoint_id=Path("c"))
    with pytest.raises(pickle.UnpicklingError, match=r"'extra.share'.*fractions.Fraction"):
        ckpt.load("c", runner)
    assert ckpt.load("c", runner, weights_only=False) == {"share": third}


def test_save_refuses_extra_that_is_not_plain_data() -> None:
    runner, opt = _trained()
    with pytest.raises(TypeError, match=r"extra\['cfg'\] is a types.SimpleNamespace"):
        ckpt.save("ckpt/step-1", runner, opt, extra={"cfg": SimpleNamespace(lr=1)})
    with pytest.raises(TypeError, match=r"extra\['per_rank'\]\['rng'\]\[1\] is a fractions"):
        ckpt.save("ckpt/step-1", runner, extra={"per_rank": {"rng": [1, fractions.Fraction(1)]}})
    assert not Path("ckpt").exists()
    extra = {"step": 3, "data": {"epoch": 1, "seen": [1, 2.5, None, b"x"]}, "t": torch.ones(2)}
    ckpt.save("ckpt/step-1", runner, opt, extra=extra)
    loaded = ckpt.load("ckpt/step-1", runner, opt)
    assert loaded["data"] == extra["data"] and torch.equal(loaded["t"], extra["t"])


# ---- C: corruption is named


def test_flipped_bit_names_the_file_and_the_tensor() -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt)
    bias = runner.state_dict()["2.bias"]
    path, offset, length = _item(Path("ckpt/step-1"), "model.2.bias")
    data = bytearray(path.read_bytes())
    at = data.index(bytes(bias.detach().clone().untyped_storage()), offset, offset + length)
    data[at + 3] ^= 0x40  # the first value's exponent: 0.1 becomes ~3e37
    path.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"__0_0.distcp fails its checksum for 'model.2.bias'"
    ):
        ckpt.load("ckpt/step-1", _runner(seed=1))


def test_truncated_and_deleted_data_files_are_named() -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt)
    path = Path("ckpt/step-1/__0_0.distcp")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=rf"__0_0.distcp has {len(data) // 2} bytes, it had {len(data)}"
    ):
        ckpt.load("ckpt/step-1", runner, opt)
    path.unlink()
    with pytest.raises(FileNotFoundError, match=r"__0_0.distcp is missing \(it holds .*model.0"):
        ckpt.load("ckpt/step-1", runner, opt)


def test_checkpoints_without_checksums_load_and_their_truncation_is_named() -> None:
    runner, opt = _trained()
    ckpt.save("unsummed", runner, opt, extra={"step": 1}, checksums=False)
    assert ckpt.load("unsummed", _runner(seed=1)) == {"step": 1}
    # Plain DCP (no manifest): loads through the safe unpickler, sizes still checked.
    model_sd, _ = get_state_dict(ckpt.local_model(runner), [])
    dcp.save({"model": model_sd, "extra": {"step": 2}}, checkpoint_id=Path("plain"))
    assert ckpt.load("plain", _runner(seed=1)) == {"step": 2}
    path = Path("plain/__0_0.distcp")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has 100 bytes, it had at least"):
        ckpt.load("plain", runner)


# ---- the catalogue's weaker checkpoint errors


def test_load_of_latest_when_there_is_none() -> None:
    runner, opt = _trained()
    Path("ckpt").mkdir()
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint to load \(latest\('ckpt'\) found none\)"
    ):
        ckpt.load(ckpt.latest("ckpt"), runner, opt)


@pytest.mark.parametrize(
    "content, message",
    [(b"", r"\.metadata is empty"), (b"\x80\x04garbage", r"\.metadata is not readable DCP")],
)
def test_empty_or_garbage_metadata(content: bytes, message: str) -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt)
    Path("ckpt/step-1/.metadata").write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"^checkpoint ckpt/step-1: .*{message}"):
        ckpt.load("ckpt/step-1", runner, opt)


def test_wrong_shapes_name_the_entry() -> None:
    runner, opt = _trained(hidden=8)
    ckpt.save("ckpt/step-1", runner, opt)
    other = _runner(hidden=16)
    with pytest.raises(ValueError, match=r"'model.0.weight' has shape \[8, 4\] .* and \[16, 4\]"):
        ckpt.load("ckpt/step-1", other)


def test_missing_optimizer_state() -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner)
    with pytest.raises(KeyError, match=r"holds no optimizer state .*optimizer=None"):
        ckpt.load("ckpt/step-1", runner, opt)


def test_another_optimizer_names_the_settings_that_differ() -> None:
    # An AdamW checkpoint into SGD used to say "has 1 optimizer parameter
    # groups, this rank's optimizer 1": the settings' keys differ, not the groups.
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt)
    sgd = torch.optim.SGD(runner.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(
        ValueError,
        match=r"^checkpoint ckpt/step-1 was saved with another optimizer or other optimizer "
        r"settings: its parameter group 0 has the settings amsgrad, betas, .*which this rank's "
        r"SGD lacks, and lacks dampening, momentum, nesterov, which it has \(the settings of "
        r"torch\.optim\.Adam or AdamW\)\. Build the optimizer .*optimizer=None",
    ):
        ckpt.load("ckpt/step-1", runner, sgd)
    params = list(runner.parameters())
    two = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    with pytest.raises(ValueError, match=r"has 1 optimizer parameter group\(s\), this rank's .* 2"):
        ckpt.load("ckpt/step-1", runner, two)


# ---- a manifest or metadata is not trusted to name paths


def _edit_manifest(path: Path, edit: Any) -> None:
    manifest_path = path / ".torchmpmd.json"
    manifest = json.loads(manifest_path.read_text())
    edit(manifest)
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../victim.txt", "ABSOLUTE", "sub/../../victim.txt", ".."])
def test_save_refuses_a_manifest_naming_paths_outside_the_checkpoint(
    in_tmp: Path, name: str
) -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt)
    Path("ckpt/victim.txt").write_text("keep me")
    Path("elsewhere.txt").write_text("keep me too")
    name = str(in_tmp / "elsewhere.txt") if name == "ABSOLUTE" else name
    _edit_manifest(Path("ckpt/step-1"), lambda m: m["files"].update({name: {"size": 7}}))
    before = _tree(in_tmp)
    with pytest.raises(FileExistsError, match=rf"\.torchmpmd\.json .*{re.escape(repr(name))}"):
        ckpt.save("ckpt/step-1", runner, opt)
    assert _tree(in_tmp) == before
    with pytest.raises(CheckpointError, match=r"\.torchmpmd\.json names .*not a plain file name"):
        ckpt.load("ckpt/step-1", runner, opt)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(version="1"), r"version '1'"),
        (lambda m: m.update(version=None), r"version None"),
        (lambda m: m["files"]["__0_0.distcp"].update(items=[[0, 8]]), r"items of '__0_0.distcp'"),
        (lambda m: m["files"]["__0_0.distcp"].update(items=7), r"items of '__0_0.distcp'"),
        (lambda m: m["files"]["__0_0.distcp"].update(size="8"), r"size of '__0_0.distcp'"),
        (lambda m: m["files"].update({"__0_0.distcp": [1]}), r"'__0_0.distcp'"),
    ],
)
def test_a_malformed_manifest_is_named(edit: Any, message: str) -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt)
    _edit_manifest(Path("ckpt/step-1"), edit)
    with pytest.raises(
        CheckpointError, match=rf"^checkpoint ckpt/step-1: .*\.torchmpmd\.json.*{message}"
    ):
        ckpt.load("ckpt/step-1", runner, opt)
    with pytest.raises(FileExistsError, match=rf"\.torchmpmd\.json.*{message}"):
        ckpt.save("ckpt/step-1", runner, opt)


def test_removing_a_replaced_checkpoint_deletes_only_its_regular_files(in_tmp: Path) -> None:
    old = in_tmp / "old"
    old.mkdir()
    (old / "__0_0.distcp").write_bytes(b"data")
    (old / ".metadata").write_bytes(b"meta")
    (old / "sub").mkdir()
    (old / "sub" / "kept").write_text("kept")
    (in_tmp / "outside").write_text("kept")
    (old / "link").symlink_to(in_tmp / "outside")
    files = {n: {"size": 4, "items": []} for n in ("__0_0.distcp", "sub", "link", "gone")}
    manifest = {"format": "torchmpmd.checkpoint", "version": 1, "checksum": None, "files": files}
    (old / ".torchmpmd.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match=r"holds files it did not write"):
        paths._remove_checkpoint(old)
    assert sorted(os.listdir(old)) == ["link", "sub"]
    assert (old / "sub" / "kept").read_text() == "kept"
    assert (in_tmp / "outside").read_text() == "kept"


def _relocated(path: Path, where: str) -> None:
    """Rewrites `.metadata` so that every item is read from `where`."""
    metadata = FileSystemReader(str(path)).read_metadata()
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = dataclasses.replace(info, relative_path=where)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("where", ["../outside.distcp", "ABSOLUTE"])
def test_load_refuses_metadata_naming_files_outside_the_checkpoint(
    in_tmp: Path, where: str
) -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt)
    shutil.copy("ckpt/step-1/__0_0.distcp", "ckpt/outside.distcp")
    where = str(in_tmp / "ckpt" / "outside.distcp") if where == "ABSOLUTE" else where
    _relocated(Path("ckpt/step-1"), where)
    with pytest.raises(
        CheckpointError, match=rf"\.metadata places .* in {re.escape(repr(where))}, .*outside"
    ):
        ckpt.load("ckpt/step-1", runner, opt)


# ---- paths of other Python versions


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
@pytest.mark.parametrize(
    "name, expected",
    [
        ("PosixPath", pathlib.PurePosixPath("a")),
        ("PurePosixPath", pathlib.PurePosixPath("a")),
        ("WindowsPath", pathlib.PureWindowsPath("a")),
        ("PureWindowsPath", pathlib.PureWindowsPath("a")),
    ],
)
def test_metadata_paths_load_under_either_pathlib_spelling(
    module: str, name: str, expected: pathlib.PurePath
) -> None:
    # Python 3.13 moved pathlib's classes to pathlib._local: a pickle names
    # the module of the Python that wrote it.
    crafted = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X\x01\x00\x00\x00a\x85R."
    loaded = storage._MetadataUnpickler(io.BytesIO(crafted)).load()
    assert type(loaded).__name__ in (name, "Pure" + name.removeprefix("Pure"))
    assert str(loaded) == str(expected) and isinstance(loaded, type(expected))


@pytest.mark.parametrize("module", [b"pathlib", b"pathlib._local"])
def test_a_checkpoint_of_another_python_loads(module: bytes) -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt, extra={"step": 1})
    metadata = FileSystemReader("ckpt/step-1").read_metadata()
    raw = pickle.dumps(metadata, protocol=2)  # GLOBAL opcodes: the module name in plain text
    spelled = re.subn(rb"cpathlib(\._local)?\nPosixPath\n", b"c" + module + b"\nPosixPath\n", raw)
    assert spelled[1] == 1
    Path("ckpt/step-1/.metadata").write_bytes(spelled[0])
    assert ckpt.load("ckpt/step-1", _runner(seed=1)) == {"step": 1}


# ---- replacing a checkpoint


def test_a_replaced_checkpoint_that_cannot_be_removed_is_a_warning(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, opt = _trained()
    ckpt.save("ckpt/step-1", runner, opt, extra={"step": 1})
    real_unlink = os.unlink

    def refused(p: Any, *args: Any, **kwargs: Any) -> None:
        if ".old-" in os.fspath(p):
            raise PermissionError(13, "Permission denied", os.fspath(p))
        real_unlink(p, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(os, "unlink", refused)
        patched.setattr(Path, "unlink", lambda self, missing_ok=False: refused(self))
        with pytest.warns(
            UserWarning, match=r"the replaced checkpoint, renamed to .*\.step-1\.old-.*Permission"
        ):
            ckpt.save("ckpt/step-1", runner, opt, extra={"step": 2})
    assert ckpt.load("ckpt/step-1", _runner(seed=1)) == {"step": 2}


def test_save_onto_a_checkpoint_without_a_manifest_says_what_it_is(in_tmp: Path) -> None:
    runner, _ = _trained()
    model_sd, _ = get_state_dict(ckpt.local_model(runner), [])
    dcp.save({"model": model_sd}, checkpoint_id=Path("plain"))
    before = _tree(in_tmp)
    with pytest.raises(
        FileExistsError,
        match=r"'plain' .* is a DCP checkpoint without a torchmpmd manifest .*older torchmpmd "
        r"or by dcp.save.*delete it .*or save to a new path",
    ):
        ckpt.save("plain", runner)
    assert _tree(in_tmp) == before


def _same(a: Any, b: Any, where: str = "extra") -> None:
    """`a` equals `b` with the same container types and key types throughout."""
    assert type(a) is type(b), (where, a, b)
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, a, b)
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_extra_accepts_the_containers_weights_only_loading_reads() -> None:
    runner, opt = _trained()
    extra = {
        "order": collections.OrderedDict(b=2, a=1),
        "counts": collections.Counter("abca"),
        "nested": [collections.OrderedDict(x=1.5), collections.Counter("zz"), (1, "a")],
        # DCP stores these entry by entry (extra.rng.0, extra.keys.1): load
        # rebuilds the lists, the keys' types and the empty dict.
        "rng": [torch.ones(2), torch.arange(3)],
        "keys": {1: torch.zeros(1), "e": {}, None: [torch.ones(1), {"a": 2}], b"k": 3},
        "t": (torch.ones(1), [2]),
        "per_rank": [torch.full((2,), 7.0), collections.OrderedDict(seed=3)],
    }
    ckpt.save("ckpt/step-1", runner, opt, extra=extra)
    loaded = ckpt.load("ckpt/step-1", runner, opt)
    _same(loaded, extra)
    point = collections.namedtuple("point", "x y")
    for refused, shown in [
        (collections.defaultdict(int), "collections.defaultdict"),
        (point(1, 2), "point"),
        ([collections.UserDict()], "collections.UserDict"),
    ]:
        with pytest.raises(TypeError, match=rf"extra\['v'\].* is a .*{shown}"):
            ckpt.save("ckpt/step-2", runner, opt, extra={"v": refused})
