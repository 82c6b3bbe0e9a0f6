"""A runner's weights: its state dict, loading and initialising them, and
keeping every copy of a weight equal (a tied weight's copies on the ranks
that hold it; data-parallel replicas).

`init_weights` and `load_state_dict` are collectives: afterwards the rank
holding a tie's first stage sends its copy to the tie's other holders, and
each parallelism inside the stages makes its peers' copies equal (data
parallelism: the first replica's to the others, also at the runner's
construction, as DDP does; tensor parallelism: tp rank 0's replicated
tensors), and the ties at its first call, for a real model built apart on
each rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from ..graph.pipe import Pipe, unique_named_parameters
from ..parallel.layout import Layout
from . import rank_rng
from .collective import Collective
from .compiled import CompiledPipe
from .materialize import init_weights
from .transport import recv, send

__all__: list[str] = []

# Tags of the tied weights' copies (one per tie), apart from program
# messages (small), results (1 << 30) and the check-in.
_TIED_TAG = 0x7FFF0200


class Weights:
    """This rank's parameters and buffers (those of the runner's first
    compiled pipe; other shapes' pipes share them)."""

    def __init__(
        self,
        pipe: Pipe,
        first: CompiledPipe,
        collective: Collective,
        layout: Layout,
    ) -> None:
        self._pipe = pipe
        self._first = first
        self._collective = collective
        self._layout = layout
        # Whether a parallelism has peers whose copies init / load make equal.
        self._peers = any(dist.get_world_size(g) > 1 for g in layout.groups())
        self.rank = first.rank
        self.local_stages = first.local_stages

    @property
    def _modules(self) -> list[torch.nn.Module]:
        return [self._first.stages.modules[s] for s in self.local_stages]

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return unique_named_parameters(self._modules)

    def local_state(self) -> list[torch.Tensor]:
        """This rank's parameters and buffers, once each, in stage order (the
        same order on every replica)."""
        seen: set[int] = set()
        out = []
        for module in self._modules:
            for t in [*module.parameters(), *module.buffers()]:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def start_equal(self) -> None:
        """The parallelisms' peers start alike (replicas from the first's
        weights, as DDP's do, before FSDP shards them); tensors allocated for
        a meta model get theirs at init_weights / load_state_dict."""
        allocation = self._first.stages.allocation
        real = [t for t in self.local_state() if not allocation.allocated(t)]
        self._layout.start_equal(real)

    def counted_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters that a global reduction counts: each once,
        a tied one only on the rank that holds its first stage."""
        not_here = set()
        for node, param in self._first.tied_parameters.items():
            if min(self._pipe.plan.tied_stages(node)) not in self.local_stages:
                not_here.add(id(param))
        return [p for _, p in self.named_parameters() if id(p) not in not_here]

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for module in self._modules:
            for name, t in module.state_dict(keep_vars=False).items():
                out.setdefault(name, t)
        return out

    def init_weights(self, fn: Callable[[torch.nn.Module], object] | None) -> None:
        self._collective.refuse_if_failed()
        if fn is not None and not callable(fn):
            raise TypeError(
                "init_weights: fn must be a function of one module (e.g. the model's "
                "_init_weights), or nothing to call the model's own init_weights(); got "
                f"{type(fn).__name__}"
            )
        modules = {s: self._first.stages.modules[s] for s in self.local_stages}
        # Ranks as threads draw from their own generators (rank_rng.py).
        with rank_rng.own_generator():
            called = init_weights(
                fn, modules, self._pipe.source, self._pipe.parameter_aliases, self.rank
            )
        # Stages without parameters or buffers have nothing to initialise.
        holds = any([*m.parameters(), *m.buffers()] for m in modules.values())
        if not called and holds:
            raise ValueError(
                f"init_weights: rank {self.rank} found no module of the model owning a tensor of "
                f"its stages {self.local_stages}"
            )
        self.sync("init_weights")

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
        self._collective.refuse_if_failed()
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"load_state_dict takes a mapping of names to tensors, got "
                f"{type(state_dict).__name__}"
            )
        not_tensors = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
        if not_tensors:
            raise TypeError(
                f"load_state_dict: '{not_tensors[0]}' is a {type(state_dict[not_tensors[0]]).__name__}, "
                "not a tensor"
            )
        aliases = self._pipe.parameter_aliases
        if strict:
            unknown = sorted(k for k in state_dict if k not in aliases)
            if unknown:
                raise KeyError(
                    f"load_state_dict: {unknown[:5]} are not parameters or buffers of the model; "
                    "pass strict=False to ignore them"
                )
        missing = []
        for s in self.local_stages:
            for name, t in self._first.stages.modules[s].state_dict(keep_vars=True).items():
                key = next((a for a in [name, *aliases.get(name, [name])] if a in state_dict), None)
                if key is None:
                    missing.append(name)
                    continue
                value = state_dict[key]
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                if tuple(value.shape) != tuple(t.shape):
                    raise ValueError(
                        f"load_state_dict: '{key}' has shape {tuple(value.shape)}, but stage {s} on "
                        f"rank {self.rank} holds it with shape {tuple(t.shape)}"
                    )
                if isinstance(t, DTensor):  # an FSDP shard: this rank's part of the value
                    value = distribute_tensor(
                        value.to(t.device_mesh.device_type), t.device_mesh, t.placements
                    )
                t.copy_(value)
        if strict and missing:
            raise KeyError(f"load_state_dict: rank {self.rank} found no entry for {missing}")
        self.sync("load_state_dict")

    def sync(self, call: str) -> None:
        """Makes the copies of each tied weight equal, then each
        parallelism's peers': the rank holding a tie's first stage (its
        owner, as `counted_parameters` counts it) sends its copy to every
        other rank holding one; then each parallelism makes the copies its
        peers hold alike (`make_equal`: tensor parallelism tp rank 0's
        replicated tensors, data parallelism the first replica's unsharded
        ones). Collective whenever a tie spans ranks or a parallelism has
        peers (the same on every rank), so every rank checks in.
        """
        if not self._ties_across_ranks() and not self._peers:
            return
        with self._collective.call(call), torch.no_grad():
            self.send_ties()
            # A tensor the first peer left unwritten is garbage on every peer alike.
            with self._first.stages.allocation.copies_only():
                self._layout.make_equal(self.local_state())

    def tie_holders(self) -> list[tuple[int, list[int]]]:
        """(node, holder ranks) of each tie whose copies live on more than
        one pipeline rank, in the plan's order."""
        tied = self._pipe.plan.tied
        return [(tied[i].node, holders) for i, _, holders in self._ties_across_ranks()]

    def _ties_across_ranks(self) -> list[tuple[int, int, list[int]]]:
        """(index, owner rank, holder ranks) of each tie whose copies live on
        more than one rank, in the plan's order (the same on every rank)."""
        placement = self._first.program.placement
        out = []
        for i, tie in enumerate(self._pipe.plan.tied):
            holders = sorted({placement[s] for s in tie.stages})
            if len(holders) > 1:
                out.append((i, placement[min(tie.stages)], holders))
        return out

    @torch.no_grad()
    def send_ties(self) -> None:
        """The owner of each tie sends its copy to the tie's other holders
        (inside a collective call). Blocking sends cannot deadlock: every
        rank walks the ties in the plan's order and, per tie, the owner sends
        to the holders in rank order, so the first unfinished pair always has
        both ends ready."""
        transport, timeout = self._collective.transport, self._collective.timeout
        names = {id(p): n for n, p in self.named_parameters()}
        for i, owner, holders in self._ties_across_ranks():
            if self.rank not in holders:
                continue
            param = self._first.tied_parameters[self._pipe.plan.tied[i].node]
            tag = _TIED_TAG + i
            what = f"the tied weight '{names.get(id(param), '?')}'"
            # A parallelism's DTensor: each rank's copy is its shard.
            local = param.detach()
            local = local.to_local() if isinstance(local, DTensor) else local
            if self.rank == owner:
                for peer in holders:
                    if peer != owner:
                        send(transport, local, peer, tag, timeout, what)
            else:
                value = torch.empty_like(local)
                recv(transport, value, owner, tag, timeout, what)
                local.copy_(value)

    def first_call(self) -> None:
        """At the runner's first collective call: copies of a tied weight
        built apart (each rank's model from its own seed) start equal, as
        replicas do at construction."""
        with self._first.stages.allocation.copies_only():
            self.send_ties()
