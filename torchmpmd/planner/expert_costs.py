"""What expert parallelism does to a unit's costs, for the layouts with ep.

Over ep ranks each experts module keeps E / ep of its experts; the tokens
each rank routes go to the ranks holding their experts and come back
(dispatch and combine: `all_to_all_single`, the split sizes exchanged
first), in the forward and again in the backward. The ep ranks are
data-parallel for everything else, so each takes its own rows of the batch
and, in expectation, runs as many routed rows through its experts as it
would through all of them without ep: the compute per rank does not
change; the all-to-alls are added, and the experts' parameters, gradients
and optimizer states are divided by ep (`layouts.StageCharges`).

`probe` runs the model once on the example and records, per unit, the
bytes of its experts' parameters and of the rows each experts call
receives: the token rows times the top-k where the call takes the chosen
experts per token (Hugging Face's `ep_dispatch_experts`: tokens, top-k ids,
weights), the rows as given where they are already one per routed token
(torchtitan's `GroupedExperts`: rows sorted by expert, and counts).
`over_ep` adds, per call and per direction, the split sizes' exchange and
two all-to-alls of those bytes, priced by the calibrated links (the runtime
waits for them inside the task: not overlapped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..graph.experts import experts_modules
from .layouts import LinkPrices
from .results import Profile

__all__ = ["ExpertShares", "over_ep", "probe"]


@dataclass(frozen=True, slots=True)
class ExpertShares:
    """Per unit, what its experts hold and receive, measured at `rows` rows."""

    rows: int
    num_experts: tuple[int, ...]  # each experts module's E (ep must divide them)
    parameter_bytes: tuple[int, ...]  # per unit, its experts' parameters
    routed_bytes: tuple[tuple[int, ...], ...]  # per unit, each experts call's routed rows

    def fits(self, ep: int) -> str:
        """'' when ep divides every experts module's experts, else why not."""
        bad = [e for e in self.num_experts if e % ep]
        if not bad:
            return ""
        return f"ep={ep} does not divide an experts module's {bad[0]} experts"


def _unit_of(path: str, units: Sequence[str]) -> int:
    best, size = 0, -1
    for k, u in enumerate(units):
        if (path == u or path.startswith(u + ".")) and len(u) > size:
            best, size = k, len(u)
    return best


def _routed(args: tuple[Any, ...]) -> int:
    """The bytes of the rows one experts call receives (module docstring)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or not tensors[0].is_floating_point():
        return 0
    x = tensors[0]
    k = 1
    for t in tensors[1:]:
        if not t.is_floating_point() and t.dim() == 2 and t.shape[0] == x.shape[0]:
            k = int(t.shape[1])
            break
    return x.numel() * x.element_size() * k


def probe(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    units: Sequence[str],
    rows: int,
) -> ExpertShares | None:
    """The experts of `model`'s units (None: it has none)."""
    found = experts_modules(model)
    if not found:
        return None
    n = len(units)
    routed: list[list[int]] = [[] for _ in range(n)]
    held = [0] * n
    counts = []
    handles = []
    for path, module in found.items():
        k = _unit_of(path, units)
        held[k] += sum(p.numel() * p.element_size() for p in module.parameters())
        count = getattr(module, "num_experts", None)
        if isinstance(count, int) and count > 0:
            counts.append(count)

        def record(_m: torch.nn.Module, inputs: Any, _out: Any, k: int = k) -> None:
            routed[k].append(_routed(tuple(inputs)))

        handles.append(module.register_forward_hook(record))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return ExpertShares(
        rows=rows,
        num_experts=tuple(sorted(set(counts))),
        parameter_bytes=tuple(held),
        routed_bytes=tuple(tuple(r) for r in routed),
    )


def over_ep(
    prof: Profile,
    shares: ExpertShares,
    ep: int,
    links: LinkPrices | None,
    rows: float,
    in_compute: float = 0.0,
) -> Profile:
    """`prof` (at `rows` rows) as one of `ep` expert-parallel ranks runs it:
    its experts' exchanges added to F and to B (and I), its experts'
    parameter bytes noted apart (`Profile.expert_bytes`)."""
    factor = rows / shares.rows

    def exchanges(sizes: tuple[int, ...]) -> float:
        if ep == 1 or links is None:
            return 0.0
        total = 0.0
        for b in sizes:
            counts = links.time("all_to_all", 8.0 * ep, group_size=ep)  # the split sizes
            total += counts + 2 * links.time("all_to_all", b * factor, group_size=ep)
            total += 3 * in_compute
        return total

    extra = [exchanges(s) for s in shares.routed_bytes]

    def add(values: Sequence[float] | None) -> tuple[float, ...] | None:
        if values is None:
            return None
        return tuple(v + e for v, e in zip(values, extra, strict=True))

    selective = prof.selective
    if selective is not None:
        selective = over_ep(selective, shares, ep, links, rows, in_compute)
    forward, backward = add(prof.forward), add(prof.backward)
    assert forward is not None and backward is not None
    return dataclasses.replace(
        prof,
        forward=forward,
        backward=backward,
        input_grad=add(prof.input_grad),
        expert_bytes=shares.parameter_bytes if prof.parameter_bytes is not None else None,
        selective=selective,
    )
