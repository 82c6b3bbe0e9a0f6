"""What a checkpoint call's ranks agree on, and the save of a runner without
a process group: every rank's state goes to rank 0, which writes the one
checkpoint (world.py)."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ..runtime.transport import TransportError
from .errors import describe, raise_agreed, unwrap
from .paths import Target, abandon, commit
from .storage import ChecksumWriter
from .world import TransportWorld, exchange, single_process_dcp, timed_out

__all__ = ["agree", "save_gathered"]


def agree(problem: BaseException | None, seconds: float, call: str) -> None:
    """Raises the lowest failing rank's error on every rank (a collective,
    bounded by `seconds`)."""
    try:
        problems = exchange(describe(problem), seconds, f"the outcome of checkpoint.{call}")
    except TransportError as err:
        raise timed_out(call, err) from None
    raise_agreed(problems, problem)


def save_gathered(
    world: TransportWorld, target: Target, state: dict[str, Any], seconds: float, checksums: bool
) -> None:
    """A save of a runner without a process group: every rank's state goes
    to rank 0, which writes the checkpoint alone (world.py)."""
    problem: BaseException | None = None
    try:
        states = world.gather(state, seconds, "the state to save")
    except TransportError as err:
        raise timed_out("save", err) from None
    if states is not None:
        try:
            writer = ChecksumWriter(target.staging, checksums=checksums)
            with single_process_dcp():
                dcp_save(_merged(states), storage_writer=writer, no_dist=True)
            commit(target)
        except Exception as err:
            abandon(target)
            problem = (
                unwrap(err, "save", target.path) if isinstance(err, CheckpointException) else err
            )
    agree(problem, seconds, "save")


def _merged(states: list[Any]) -> Any:
    """The ranks' states as one (the model's entries, each once; the
    optimizer's state of every parameter; each rank's `per_rank`): dicts
    merged key by key, the first rank's value kept where several hold one
    (a tied weight, the whole model's parameter groups, `extra`)."""
    first = states[0]
    if not isinstance(first, dict):
        return first
    out: dict[Any, Any] = {}
    for state in states:
        for key, value in state.items():
            if key not in out:
                out[key] = value
            elif isinstance(value, dict):
                out[key] = _merged([out[key], value])
    return out
