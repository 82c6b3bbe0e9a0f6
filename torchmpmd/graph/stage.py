"""One interface for the two kinds of stage a `Pipe` holds.

`TracedStage` is a stage `mpmd.trace` cut from the model's graph (a
`torch.fx.GraphModule` whose parameters and buffers sit under the model's
names); `EagerStage` (`graph/eager.py`) is a module the user cut by hand
(`mpmd.from_stages`), run as it is. The runtime, the parallelisms, the
checkpoint and the fingerprint see both through `Stage`: they ask it for
what they use (its graph, if it has one; the user's own modules, if it
holds them), never which kind it is.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.fx as fx

__all__ = ["Stage", "TracedStage", "as_stage"]


class Stage(Protocol):
    """What the runtime, the checkpoint and the fingerprint read of a stage."""

    # Whether the stage is a graph (graph/ only; elsewhere ask for what is
    # used: `graph_module`, `user_module`).
    traced: bool

    @property
    def graph_module(self) -> fx.GraphModule | None:
        """The stage's graph: what a split backward cuts into F/I/W graphs
        and a parallelism may rewrite (None: the stage runs as it is, and
        splits through autograd)."""
        ...

    @property
    def user_module(self) -> torch.nn.Module | None:
        """The user's own module the stage runs (one cut by hand), whose
        submodules an init finds beside the model's; None for a stage cut
        from the model's graph."""
        ...

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
    def graph_module(self) -> fx.GraphModule:
        return self

    @property
    def user_module(self) -> None:
        return None

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
