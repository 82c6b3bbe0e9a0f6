"""One interface for the two kinds of stage a `Pipe` holds.

`TracedStage` is a stage `mpmd.trace` cut from the model's graph (a
`torch.fx.GraphModule` whose parameters and buffers sit under the model's
names); `EagerStage` (`graph/eager.py`) is a module the user cut by hand
(`mpmd.from_stages`), run as it is. The runtime, the checkpoint and the
fingerprint see both through `Stage`, never by asking which one it is.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.fx as fx

__all__ = ["Stage", "TracedStage", "as_stage"]


class Stage(Protocol):
    """What the runtime, the checkpoint and the fingerprint read of a stage."""

    # Whether the stage is a graph (split backward cuts it into F/I/W graphs;
    # an eager stage splits through autograd instead).
    traced: bool

    @property
    def state_root(self) -> torch.nn.Module:
        """The module whose submodules own the stage's parameter and buffer
        slots: where a meta tensor is replaced by an allocated one, and
        where init functions find their modules."""
        ...

    def refresh_state(self) -> None:
        """Called after tensors in `state_root`'s slots were replaced."""
        ...

    def ops_text(self) -> str:
        """The stage's computation as text, equal on every process that
        traced the same model the same way (the job's fingerprint)."""
        ...

    def retarget_devices(self, device: torch.device) -> None:
        """Makes the stage create its tensors on `device`."""
        ...


def as_stage(module: torch.nn.Module) -> Stage:
    """`module` (a pipe's stage, moved, compiled or sharded) as a `Stage`."""
    if not hasattr(module, "ops_text"):
        raise TypeError(
            f"{type(module).__name__} is not a pipeline stage (made by mpmd.trace or "
            "mpmd.from_stages)"
        )
    return cast(Stage, module)


class TracedStage(fx.GraphModule):
    """A stage traced from the model: a GraphModule called as
    `stage(*user_inputs, *received) -> tuple(outputs)`."""

    traced = True

    @property
    def state_root(self) -> torch.nn.Module:
        return self

    def refresh_state(self) -> None:
        pass

    def ops_text(self) -> str:
        # Ops and their wiring, not their keyword arguments: a runner
        # retargets the devices of its own stages' graphs.
        return repr(
            [(n.op, str(n.target), [str(a) for a in n.all_input_nodes]) for n in self.graph.nodes]
        )

    def retarget_devices(self, device: torch.device) -> None:
        """The trace baked the device it saw (`arange(..., device=meta)` for a
        meta model, `cpu` for a model traced on the CPU) into the graph; every
        such device (those of the stage's inputs, parameters and buffers when
        traced) becomes `device`. Devices the model named otherwise are left
        alone."""
        traced: set[torch.device] = set()
        for node in self.graph.nodes:
            val = node.meta.get("val")
            if node.op in ("placeholder", "get_attr") and isinstance(val, torch.Tensor):
                traced.add(val.device)
        traced |= {t.device for t in [*self.parameters(), *self.buffers()]} - {device}
        traced.add(torch.device("meta"))
        changed = False
        for node in self.graph.nodes:
            value = node.kwargs.get("device")
            if isinstance(value, torch.device) and value in traced and value != device:
                node.kwargs = {**node.kwargs, "device": device}
                changed = True
        if changed:
            self.recompile()
