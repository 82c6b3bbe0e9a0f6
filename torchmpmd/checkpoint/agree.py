"""The ranks' check-in at every save and load, and what they must agree on.

`save` and `load` are collectives. Before any collective of DCP's, each rank
posts an entry (the call, the path, what it found) in the process group's
store; rank 0 waits for every rank's entry up to a timeout and posts a
verdict. A rank that does not see a verdict in time posts its own failure in
its place (`compare_set`: the first verdict stands), so every rank acts on
one verdict and a rank that never calls fails the others within the
timeout, naming it, instead of leaving them in a collective. The ranks of a
runner without a process group (`testing.LocalPipeline`) exchange their
entries over the runner's own transport instead (world.py).

This is not the runner's check-in (`runtime/checkin.py`), on purpose: that
one is a fixed-size message between neighbouring ranks of one pipeline (or
replica) group before every step, cheap enough for each call; this one
gathers entries of any size from every rank of the job (ranks of several
pipelines, which share no group of a runner's), names the ranks that never
came from rank 0's verdict alone, and works between runners or with none.

`extra` holds tensors and plain Python data only (it loads without running
code) and, except `extra["per_rank"]`, must be equal on every rank: each rank
posts a digest of its values and a mismatch fails every rank naming the key.
A save's entry also carries what each rank's optimizer groups hold, so that
the whole model's groups are built from the entries, without a collective of
their own.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import itertools
import json
import reprlib
import weakref
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store, _get_default_store

from ..runtime.transport import TransportError
from .world import current, timed_out

PER_RANK = "per_rank"
_PREFIX = "torchmpmd.checkpoint"
_GRACE = 5.0  # extra seconds other ranks wait for rank 0's verdict
_PLAIN = (type(None), bool, int, float, str, bytes)
# The containers `torch.load(weights_only=True)` rebuilds, with the
# subclasses of dict it knows (they read back as themselves).
_SEQUENCES = (list, tuple)
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)
# This process's save and load calls per default process group, alike on
# every rank of it (a group made again, after a failure, counts afresh).
_calls: weakref.WeakKeyDictionary[dist.ProcessGroup, itertools.count[int]] = (
    weakref.WeakKeyDictionary()
)
_show = reprlib.Repr()
_show.maxstring, _show.maxother, _show.maxlist, _show.maxdict = 40, 40, 4, 4


def check_in(call: str, path: object, timeout: float, entry: dict[str, Any]) -> list[Any]:
    """Posts `entry` and returns every rank's, once all ranks called
    `checkpoint.<call>` with the same path; raises TimeoutError naming the
    ranks that did not arrive within `timeout` seconds, on every rank."""
    own = current()
    if own is not None:
        posted = {"call": call, "path": str(path), **entry}
        try:
            entries = own.exchange(posted, timeout, f"the check-in of checkpoint.{call}")
        except TransportError as err:
            raise timed_out(call, err) from None
        _same_call(entries, call, path, own.rank)
        return entries
    if not dist.is_initialized():
        return [entry]
    store = _get_default_store()
    me, world = dist.get_rank(), dist.get_world_size()
    world_group = dist.group.WORLD
    assert world_group is not None
    n = next(_calls.setdefault(world_group, itertools.count(1)))
    keys = [f"{_PREFIX}/{n}/{r}" for r in range(world)]
    verdict_key = f"{_PREFIX}/{n}/verdict"
    store.set(keys[me], json.dumps({"call": call, "path": str(path), **entry}))
    if me == 0:
        # Which ranks are missing is read below.
        with contextlib.suppress(RuntimeError):
            store.wait(keys, datetime.timedelta(seconds=timeout))
        missing = [r for r in range(world) if not store.check([keys[r]])]
        mine = {"ok": not missing, "missing": missing, "by": 0}
    else:
        try:
            store.wait([verdict_key], datetime.timedelta(seconds=timeout + _GRACE))
            mine = {"ok": True}  # not posted: the verdict is rank 0's
        except RuntimeError:
            mine = {"ok": False, "missing": [0], "by": me}
    verdict = json.loads(store.compare_set(verdict_key, "", json.dumps(mine)))
    if not verdict["ok"]:
        raise TimeoutError(
            f"checkpoint.{call} is a collective: every rank must call it. Rank(s) "
            f"{verdict['missing']} did not arrive within {timeout:g} s (rank {verdict['by']} "
            f"waited; this is rank {me}, in its call {n} of checkpoint.save/load, "
            f"checkpoint.{call}({str(path)!r})). Call it on every rank at the same step (a rank "
            "that skipped an earlier save or load is a call behind), or raise timeout= if a "
            "rank is only slow"
        )
    entries = [json.loads(store.get(k)) for k in keys]
    if n > 1:  # every rank has read call n - 1's entries: it is at call n
        _forget(store, f"{_PREFIX}/{n - 1}/{me}")
        if me == 0:
            _forget(store, f"{_PREFIX}/{n - 1}/verdict")
    _same_call(entries, call, path, me)
    return entries


def _same_call(entries: list[Any], call: str, path: object, me: int) -> None:
    for r, other in enumerate(entries):
        if other["call"] != call or other["path"] != str(path):
            raise RuntimeError(
                f"checkpoint.{call}: the ranks did not make the same call: rank {me} called "
                f"checkpoint.{call}({str(path)!r}), rank {r} checkpoint.{other['call']}"
                f"({other['path']!r}). Every rank must save and load the same checkpoint at the "
                "same step"
            )


def _forget(store: Store, key: str) -> None:
    # A store without deletion keeps a few bytes per call.
    with contextlib.suppress(RuntimeError):
        store.delete_key(key)


def check_extra(extra: Mapping[str, Any] | None) -> None:
    """Raises TypeError naming the first value of `extra` that is not a
    tensor or plain Python data."""
    if extra is None:
        return
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"checkpoint.save: extra is a {type(extra).__name__}; pass a dict of named values"
        )
    for key, value in extra.items():
        if not isinstance(key, str):
            raise TypeError(f"checkpoint.save: extra key {key!r} is not a str; name each value")
        bad = _not_plain(value, f"extra[{key!r}]")
        if bad is not None:
            raise TypeError(
                f"checkpoint.save: {bad}: extra holds tensors and plain Python data (None, bool, "
                "int, float, str, bytes, and lists, tuples and dicts of those, OrderedDict and "
                "Counter too), which load without running code from the file. Convert it (a "
                "NumPy array with torch.from_numpy, an object to a dict of its fields)"
            )


def _not_plain(value: Any, where: str) -> str | None:
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return None
    if type(value) in _SEQUENCES:
        for i, item in enumerate(value):
            bad = _not_plain(item, f"{where}[{i}]")
            if bad is not None:
                return bad
        return None
    if type(value) in _MAPPINGS:
        for k, item in value.items():
            if type(k) not in _PLAIN:
                return f"{where} has a key of type {type(k).__name__}"
            bad = _not_plain(item, f"{where}[{k!r}]")
            if bad is not None:
                return bad
        return None
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}"


def empty_like(mapping: Mapping[Any, Any]) -> dict[Any, Any]:
    """An empty mapping of `mapping`'s type where it is one `extra` may hold
    (so that it loads weights-only), else an empty dict."""
    if type(mapping) is collections.OrderedDict:
        return collections.OrderedDict()
    if type(mapping) is collections.Counter:
        return collections.Counter()
    return {}


def digest_extra(extra: Mapping[str, Any] | None) -> dict[str, list[str]]:
    """Per key of `extra` except `per_rank`: an exact fingerprint of its
    value and a short display, to compare between ranks."""
    return {key: _digest(value) for key, value in (extra or {}).items() if key != PER_RANK}


def digest_groups(groups: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Per optimizer parameter group (as `get_state_dict` lists them): the
    names of its parameters and a digest of each setting."""
    if groups is None:
        return None
    return [
        {
            "params": [str(name) for name in group.get("params", [])],
            "settings": {k: _digest(v) for k, v in group.items() if k != "params"},
        }
        for group in groups
    ]


def _digest(value: Any) -> list[str]:
    """An exact fingerprint of `value` and a short display of it."""
    text = json.dumps(_canonical(value), sort_keys=True, default=repr)
    return [f"{zlib.crc32(text.encode()):08x}:{len(text)}", _show.repr(value)]


def _canonical(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().clone()
        return ["tensor", str(t.dtype), list(t.shape), zlib.crc32(bytes(t.untyped_storage()))]
    if isinstance(value, float):
        return ["float", value.hex()]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    if isinstance(value, (list, tuple)):
        return ["list", [_canonical(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", sorted(([repr(k), _canonical(v)] for k, v in value.items()), key=str)]
    return [type(value).__name__, value]


def compare_extra(entries: list[Any]) -> None:
    """Raises ValueError (on every rank alike) where an `extra` value differs
    between ranks."""
    first = entries[0]["extra"]
    for r, other in enumerate(entries):
        for key in sorted(set(first) | set(other["extra"])):
            mine, theirs = first.get(key), other["extra"].get(key)
            if mine is None or theirs is None or mine[0] != theirs[0]:
                shown_0 = mine[1] if mine else "no such key"
                shown_r = theirs[1] if theirs else "no such key"
                raise ValueError(
                    f"checkpoint.save: extra[{key!r}] differs between ranks: rank 0 has "
                    f"{shown_0}, rank {r} has {shown_r}. extra values must be equal on every "
                    "rank (every rank loads the same ones); keep values that differ per rank "
                    f"under extra[{PER_RANK!r}]"
                )
