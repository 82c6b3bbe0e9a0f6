"""Collectives of the planner's own (`mpmd.calibrate`, `mpmd.refine`) check
in through the default store before any communication: a rank that does
not call one fails every rank within a timeout instead of leaving them in a
collective, and the ranks' arguments are compared before any work."""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

__all__ = ["check_in"]

_GRACE = 2.0  # extra seconds the other ranks wait for the first rank's verdict
# calls per (collective, group), alike on every rank of the group
_calls: collections.Counter[str] = collections.Counter()


def check_in(
    what: str,
    group: dist.ProcessGroup | None,
    seconds: float,
    entry: dict[str, Any],
    advice: str,
) -> dict[int, dict[str, Any]]:
    """Posts this rank's call of `what` (e.g. "mpmd.refine") and its `entry`
    (JSON) in the default store; the group's first rank waits up to
    `seconds` for every rank's and posts a verdict. A rank that sees no
    verdict in time posts its own failure in its place (the first verdict
    stands), so every rank raises the same TimeoutError, naming the ranks
    that did not call, then `advice`. Returns every rank's entry."""
    store = _get_default_store()
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    name = getattr(group or dist.group.WORLD, "group_name", "-".join(map(str, ranks)))
    _calls[f"{what}/{name}"] += 1
    me, n = dist.get_rank(), _calls[f"{what}/{name}"]
    prefix = f"torchmpmd/{what}/{name}/{n}"
    keys = {r: f"{prefix}/{r}" for r in ranks}
    verdict_key = f"{prefix}/verdict"
    store.set(keys[me], json.dumps(entry))
    mine: dict[str, Any] = {"missing": [], "by": ranks[0]}
    if me == ranks[0]:
        with contextlib.suppress(RuntimeError):  # who is missing is read below
            store.wait(list(keys.values()), datetime.timedelta(seconds=seconds))
        mine["missing"] = [r for r in ranks if not store.check([keys[r]])]
    else:
        try:
            store.wait([verdict_key], datetime.timedelta(seconds=seconds + _GRACE))
        except RuntimeError:
            mine = {"missing": [ranks[0]], "by": me}
    try:
        verdict = json.loads(store.compare_set(verdict_key, "", json.dumps(mine)))
    except RuntimeError:  # the store went with its host's process
        verdict = mine
    if verdict["missing"]:
        raise TimeoutError(
            f"{what} is a collective: every rank of the group must call it. Rank(s) "
            f"{verdict['missing']} did not call it within {seconds:g} s (rank {verdict['by']} "
            f"waited for them; this is rank {me}, in its {what} call {n} on this group). "
            f"{advice}"
        )
    return {r: json.loads(store.get(keys[r])) for r in ranks}
