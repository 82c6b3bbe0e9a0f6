"""Hugging Face checkpoints in and out of a pipeline.

`load_hf(path, runner)` fills this rank's stages from a directory that
`save_pretrained` wrote (`model.safetensors`, or shards listed in
`model.safetensors.index.json`). Each rank opens the files lazily with
safetensors and reads only the tensors of its own stages; a tensor sharded
over data parallelism (FSDP) or tensor parallelism (a DTensor) is read as
this rank's slice only. Nothing is ever materialised whole on a rank that
does not hold it whole. Values are converted to the dtype of the runner's
tensors (build the model in the dtype you want, as `from_pretrained`'s
`torch_dtype` does). A tied weight is read under whichever of its names the
file holds (`tie_word_embeddings` checkpoints keep only the embedding).
Non-persistent buffers (RoPE tables) are in no checkpoint: as
`from_pretrained` does, the model's own `_init_weights` computes them on the
modules that hold them; keys `from_pretrained` ignores (older checkpoints'
`rotary_emb.inv_freq`, hf_checks.ignored_on_load) are left out and reported.
A mixture of experts' stacked experts (transformers 5's `experts.gate_up_proj`)
are read from the checkpoint's per-expert keys (`experts.3.gate_proj.weight`),
only those of the experts this rank holds (`hf_experts`). A damaged file or
index fails naming it (`CheckpointError`; `hf_files`).

`save_hf(path, runner)` writes a directory `from_pretrained` loads: every
tensor once under the model's first name for it (a tied weight under its
first name only, as `save_pretrained` does), written by the lowest rank of
the first stage holding it; FSDP and tensor-parallel shards are gathered
whole first (a collective over their mesh). Stacked experts go out as
transformers' per-expert keys, as `save_pretrained` writes them, each
expert by a rank holding it, from its own shard (expert parallelism: no
gather). One safetensors file per
writing rank, the index, and `config.json` (and `generation_config.json`)
from the model's config (or `config=`, checked to describe this model; a
model without one gets a warning). The directory is written beside `path`
and renamed into place once complete, so `path` is never a partial
checkpoint; a path under a file, or the working directory or above it, is
refused before anything is written.

Both are collectives: call them on every rank (with `testing.LocalPipeline`,
on each rank's thread: `lp.on_all_ranks(lambda r: save_hf(path, r))`). A rank's error (a missing or
wrongly shaped tensor, an unwritable path) is raised on every rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from .agree import check_in
from .checks import check_runner
from .errors import describe, own_rank, raise_agreed
from .hf_checks import (
    candidates,
    check_config_names,
    check_target,
    config_to_write,
    ignored_on_load,
    non_persistent,
)
from .hf_experts import converters, expert_pieces, keys_written, write_experts
from .hf_files import INDEX_FILE, SINGLE_FILE, _Files, _safetensors
from .world import joined

if TYPE_CHECKING:
    from ..runtime.runner import PipelineRunner

__all__ = ["HFLoadResult", "load_hf", "save_hf"]


@dataclass(frozen=True, slots=True)
class HFLoadResult:
    """What `load_hf` did on this rank: the local tensors the checkpoint
    lacked and the checkpoint's tensors the model has no place for (both
    empty unless `strict=False`), the bytes read from the files, and the
    checkpoint's tensors left out as `from_pretrained` leaves them (older
    checkpoints' `rotary_emb.inv_freq`, the model's non-persistent buffers,
    its `_keys_to_ignore_on_load_unexpected`)."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    bytes_read: int
    ignored_keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Local:
    """One tensor of this rank's stages, with every name the model gives it."""

    stage: int
    names: list[str]
    tensor: torch.Tensor
    key: str | None = None  # the checkpoint's name for it
    # Stacked experts: (converter, key prefix, the experts this rank writes,
    # whether to gather first): hf_experts.expert_pieces.
    pieces: Any = None


def _local_tensors(runner: PipelineRunner) -> list[_Local]:
    """This rank's parameters and persistent buffers, one entry per tensor
    (a tied one once), in stage order, each with all its names (the model's
    first name first)."""
    aliases = runner.parameter_aliases()
    found: dict[int, _Local] = {}
    for stage, module in zip(runner.local_stages, runner.local_modules(), strict=True):
        for name, t in module.state_dict(keep_vars=True).items():
            names = aliases.get(name, [name])
            entry = found.setdefault(id(t), _Local(stage, [], t))
            entry.names += [n for n in names if n not in entry.names]
    return list(found.values())


def _ignore_missing(source: Any) -> list[re.Pattern[str]]:
    return [re.compile(p) for p in (getattr(source, "_keys_to_ignore_on_load_missing", None) or [])]


def _read_into(files: _Files, key: str, t: torch.Tensor) -> None:
    """Reads `key` into `t`: a plain tensor whole, a DTensor sharded by plain
    `Shard`/`Replicate` placements as its local part only (others, e.g.
    FSDP over tensor parallelism's strided shards, whole, then placed)."""
    if not isinstance(t, DTensor):
        t.copy_(files.read(key))
        return
    mesh, placements = t.device_mesh, t.placements
    if all(type(p) in (Shard, Replicate) for p in placements):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        local = files.read(key, index).to(t.device)
        # Through the DTensor itself (no communication: the same placements),
        # so its version moves and the runner sees it written.
        t.copy_(
            DTensor.from_local(
                local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        )
        return
    t.copy_(distribute_tensor(files.read(key).to(mesh.device_type), mesh, placements))


def _match(files: _Files, local: list[_Local], prefix: str, ignore_missing: list[Any]) -> list[str]:
    """Finds each local tensor's key; returns the names of those with none
    (unless the model says they may be missing)."""
    missing = []
    for entry in local:
        entry.key = next(
            (k for n in entry.names for k in candidates(n, prefix) if files.has(k)), None
        )
        if entry.key is None and not any(p.search(n) for p in ignore_missing for n in entry.names):
            missing.append(entry.names[0])
    return missing


def _unexpected(files: _Files, runner: PipelineRunner, prefix: str) -> tuple[list[str], list[str]]:
    """The checkpoint's keys that name no tensor of the model, and those
    `from_pretrained` ignores (a non-persistent buffer of the model, a key
    the model says to ignore: ignored_on_load)."""
    source = runner.pipe.source
    known = set(runner.parameter_aliases())
    buffers = non_persistent(source)
    ignore = ignored_on_load(source, known | buffers)
    unexpected, ignored = [], []
    consumed = files.consumed()
    for k in sorted([*(set(files.where) - consumed), *files.stacked]):
        names = candidates(k, prefix)
        if any(n in buffers for n in names) or (
            not any(n in known for n in names) and any(p.search(k) for p in ignore)
        ):
            ignored.append(k)
        elif not any(n in known for n in names):
            unexpected.append(k)
    return unexpected, ignored


def _check_shapes(files: _Files, local: list[_Local], rank: int) -> None:
    for entry in local:
        if entry.key is None:
            continue
        stored = files.shape(entry.key)
        if stored != list(entry.tensor.shape):
            raise ValueError(
                f"load_hf: {entry.key!r} has shape {stored} in {files.location(entry.key)}, but "
                f"stage {entry.stage} on rank {rank} holds '{entry.names[0]}' with shape "
                f"{list(entry.tensor.shape)}: the checkpoint was written for a model of other "
                "sizes (check the config)"
            )


def _init_nonpersistent(runner: PipelineRunner) -> None:
    """Computes the non-persistent buffers (RoPE tables) with the model's own
    `_init_weights`, on the modules holding them and no parameter of their own
    (collective: the same decision on every rank, from the model)."""
    source = runner.pipe.source
    init = getattr(source, "_init_weights", None)
    if source is None or not callable(init):
        return
    if not any(m._non_persistent_buffers_set for m in source.modules()):
        return

    def fn(module: torch.nn.Module) -> None:
        if module._non_persistent_buffers_set and not module._parameters:
            init(module)

    runner.init_weights(fn)


def load_hf(
    path: str | os.PathLike[str],
    runner: PipelineRunner,
    *,
    strict: bool = True,
    timeout: float | None = None,
) -> HFLoadResult:
    """Fills this rank's stages from a Hugging Face checkpoint directory
    (collective: call on every rank). Each rank reads only its own stages'
    tensors, and only its shard of a sharded (FSDP or tensor-parallel) one.
    With `strict`, a local tensor the checkpoint lacks or a checkpoint tensor
    the model has no place for is an error naming it; a wrongly shaped
    tensor always is. Keys `from_pretrained` ignores (older checkpoints'
    `rotary_emb.inv_freq`) are left out, listed in the result's
    `ignored_keys`. `path`: the directory, or its `model.safetensors`.
    Returns what was missing, unexpected, ignored and read."""
    check_runner(runner, "load_hf")
    with joined(runner):
        return _load_hf(path, runner, strict, timeout)


def _load_hf(
    path: str | os.PathLike[str], runner: PipelineRunner, strict: bool, timeout: float | None
) -> HFLoadResult:
    seconds = runner.timeout if timeout is None else timeout
    check_in("load_hf", path, seconds, {})
    source = runner.pipe.source
    prefix = str(getattr(source, "base_model_prefix", "") or "")
    problem: Exception | None = None
    files: _Files | None = None
    local: list[_Local] = []
    missing: list[str] = []
    unexpected: list[str] = []
    ignored: list[str] = []
    try:
        files = _Files.open(path)
        files.stack(converters(source))
        local = _local_tensors(runner)
        missing = _match(files, local, prefix, _ignore_missing(source))
        unexpected, ignored = _unexpected(files, runner, prefix)
        if strict and missing:
            stages = {e.names[0]: e.stage for e in local}
            listed = ", ".join(f"'{n}' (stage {stages[n]})" for n in missing[:8])
            raise KeyError(
                f"load_hf: {path} has no tensor for {listed}"
                f"{f' and {len(missing) - 8} more' if len(missing) > 8 else ''} on rank "
                f"{runner.rank}: it was written for another model (pass strict=False to load the "
                "rest and fill these yourself)"
            )
        if strict and unexpected:
            raise KeyError(
                f"load_hf: {path} holds {unexpected[:5]}"
                f"{f' and {len(unexpected) - 5} more' if len(unexpected) > 5 else ''}, which "
                "are not parameters or buffers of the model: it was written for another model "
                "(pass strict=False to ignore them)"
            )
        _check_shapes(files, local, runner.rank)
    except Exception as err:
        problem = err
    entries = check_in("load_hf (checked)", path, seconds, {"error": describe(problem)})
    try:
        raise_agreed([e["error"] for e in entries], problem)
        assert files is not None
        _init_nonpersistent(runner)
        with torch.no_grad():
            for entry in local:
                if entry.key is not None:
                    _read_into(files, entry.key, entry.tensor)
    finally:
        if files is not None:
            files.close()
    return HFLoadResult(missing, unexpected, files.bytes_read, ignored)


# ---- save


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU, contiguous, in its own storage (a DTensor
    is gathered: a collective over its mesh)."""
    value = t.detach()
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.to("cpu", copy=True, memory_format=torch.contiguous_format)


def _shard_names(writers: list[int]) -> dict[int, str]:
    if len(writers) == 1:
        return {writers[0]: SINGLE_FILE}
    n = len(writers)
    return {r: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, r in enumerate(writers)}


def save_hf(
    path: str | os.PathLike[str],
    runner: PipelineRunner,
    config: Any = None,
    *,
    timeout: float | None = None,
) -> None:
    """Writes this pipeline's weights as a Hugging Face checkpoint directory
    that `from_pretrained(path)` loads (collective: call on every rank).
    `config` (a `PretrainedConfig`; default: the model's own `.config`) is
    written as `config.json`; it must describe this model (its type and
    sizes). `path` must be new or an empty directory, not the working
    directory or above it."""
    check_runner(runner, "save_hf")
    with joined(runner):
        _save_hf(path, runner, config, timeout)


def _save_hf(
    path: str | os.PathLike[str], runner: PipelineRunner, config: Any, timeout: float | None
) -> None:
    seconds = runner.timeout if timeout is None else timeout
    target = Path(path).resolve()
    staging = target.parent / f".{target.name}.save_hf-{uuid.uuid4().hex[:8]}"
    source = runner.pipe.source
    me = own_rank()
    problem: Exception | None = None
    local: list[_Local] = []
    first_stage: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    cfg, check_names = None, False
    try:
        if me == 0:  # decides for every rank (the same model and arguments)
            check_target(path, target)
            cfg, check_names = config_to_write(config, source, path)
        local = _local_tensors(runner)
        found = converters(source)
        for entry in local:
            name = entry.names[0]  # the model's first name for it
            shapes[name] = list(entry.tensor.shape)
            entry.pieces = expert_pieces(name, entry.tensor, found)
            # Stacked experts go out as transformers' per-expert keys, each
            # written by a rank holding that expert.
            for key in keys_written(name, entry.pieces):
                first_stage[key] = min(first_stage.get(key, entry.stage), entry.stage)
    except Exception as err:
        problem = err
    entries = check_in(
        "save_hf",
        path,
        seconds,
        {
            "error": describe(problem),
            "stages": first_stage,
            "shapes": shapes,
            "staging": str(staging),
        },
    )
    raise_agreed([e["error"] for e in entries], problem)
    staging = Path(entries[0]["staging"])
    # Each name's writer: the lowest rank among those holding its first stage.
    writer: dict[str, int] = {}
    best: dict[str, int] = {}
    for r, e in enumerate(entries):
        for name, stage in e["stages"].items():
            if name not in best or stage < best[name]:
                best[name], writer[name] = stage, r
    writers = sorted(set(writer.values()))
    file_of = _shard_names(writers)
    problem = None
    try:
        if me == 0:
            if check_names:  # a config given for a model without one of its own
                check_config_names(cfg, {n: s for e in entries for n, s in e["shapes"].items()})
            staging.mkdir(parents=True)
    except Exception as err:
        problem = err
    entries = check_in("save_hf (staged)", path, seconds, {"error": describe(problem)})
    raise_agreed([e["error"] for e in entries], problem)
    problem = None
    written: dict[str, str] = {}
    total = 0
    try:
        mine: dict[str, torch.Tensor] = {}
        # Every rank gathers its DTensors in the same order (their meshes'
        # collectives), writers keep what they write.
        for entry in local:
            name = entry.names[0]  # the model's first name for it
            if entry.pieces is not None:
                write_experts(entry.pieces, entry.tensor, writer, me, mine, _whole)
                continue
            writes = writer.get(name) == me and name not in mine
            if writes or isinstance(entry.tensor, DTensor):
                value = _whole(entry.tensor)
                if writes:
                    mine[name] = value
        if mine:
            save_file = _safetensors("save_hf").torch.save_file
            save_file(mine, str(staging / file_of[me]), metadata={"format": "pt"})
            written = dict.fromkeys(mine, file_of[me])
            total = sum(v.numel() * v.element_size() for v in mine.values())
    except Exception as err:
        problem = err
    entries = check_in(
        "save_hf (written)",
        path,
        seconds,
        {"error": describe(problem), "written": written, "bytes": total},
    )
    problem = None
    try:
        raise_agreed([e["error"] for e in entries], None)
        if me == 0:
            weight_map: dict[str, str] = {}
            for e in entries:
                weight_map.update(e["written"])
            if len(writers) > 1:
                index = {
                    "metadata": {"total_size": sum(e["bytes"] for e in entries)},
                    "weight_map": dict(sorted(weight_map.items())),
                }
                (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            generation = getattr(source, "generation_config", None)
            if cfg is not None:
                cfg.save_pretrained(str(staging))
            if generation is not None and hasattr(generation, "save_pretrained"):
                generation.save_pretrained(str(staging))
            if target.is_dir():
                target.rmdir()  # empty (checked)
            os.replace(staging, target)
    except Exception as err:
        problem = err
        if me == 0:
            shutil.rmtree(staging, ignore_errors=True)
    entries = check_in("save_hf (done)", path, seconds, {"error": describe(problem)})
    raise_agreed([e["error"] for e in entries], problem)
