"""One call's batch: split into microbatches, each with the compiled pipe for
its input signature (traced once more on first sight), and fingerprinted for
the check-in. Every check here is local, before any message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..graph.pipe import Pipe, TensorSpec
from ..parallel.layout import Layout
from ..parallel.protocol import Parallelism
from .checks import check_dtypes
from .compiled import CompiledPipe, PipeSettings, signature_of, traced_signature
from .fingerprint import BatchPrint, batch_print
from .stages import Step

__all__ = ["Batch", "Batches"]


@dataclass(frozen=True, slots=True)
class Batch:
    """One call's microbatches: flat inputs and targets, compiled pipe,
    transfer shapes, and the batch's fingerprint for the check-in."""

    inputs: list[list[Any]]
    targets: list[Any]  # per microbatch (None without a target)
    per_mb: list[CompiledPipe]
    # (value, microbatch) -> shape, where a microbatch's differ from the first's
    shapes: dict[tuple[int, int], list[int]]
    fingerprint: BatchPrint

    def prepare(self, step: Step, parallelism: Parallelism, local_stages: Sequence[int]) -> None:
        """Starts the step's parallelisms and prepares each compiled pipe the
        batch uses for the first time (traces its split stages, on gathered
        parameters: the program's UNSHARD is a no-op then)."""
        firsts = self.first_uses()
        parallelism.start_step()
        for s in local_stages if firsts else ():
            parallelism.unshard(s)
        for mb, c in firsts:
            c.stages.prepare(step, mb)

    def first_uses(self) -> list[tuple[int, CompiledPipe]]:
        """Each distinct compiled pipe with the first microbatch it runs."""
        seen: dict[int, tuple[int, CompiledPipe]] = {}
        for mb, c in enumerate(self.per_mb):
            seen.setdefault(id(c), (mb, c))
        return list(seen.values())


class Batches:
    """Splits the batches of a runner's calls; holds one compiled pipe per
    microbatch input signature, the traced one first."""

    def __init__(
        self,
        pipe: Pipe,
        first: CompiledPipe,
        settings: PipeSettings,
        layout: Layout,
    ) -> None:
        self.pipe = pipe
        self.first = first
        self.settings = settings
        self.layout = layout
        self.compiled = {traced_signature(pipe): first}
        self.num_traces = 0  # signatures traced after the first

    def compiled_for(self, row: list[Any]) -> CompiledPipe:
        """The compiled pipe for one microbatch's inputs (traced on first sight)."""
        signature = signature_of(row)
        compiled = self.compiled.get(signature)
        if compiled is not None:
            return compiled
        refused = self.layout.new_shapes_refused()
        if refused is not None:
            raise ValueError(
                f"{refused} (got {[s for s in signature if isinstance(s, TensorSpec)]}); pass "
                "batches that split into microbatches like the traced example"
            )
        compiled = CompiledPipe.retraced(self.pipe, row, self.settings, shared=self.first)
        self.compiled[signature] = compiled
        self.num_traces += 1
        return compiled

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, call: str) -> Batch:
        """The call's microbatches (flat inputs and targets), per microbatch
        the compiled pipe for its signature (a batch that does not divide
        evenly has two), and the batch's fingerprint."""
        try:
            flat = self.pipe.flatten_structure(args, kwargs)
        except TypeError as err:
            if call == "step" and target is None and args:
                raise TypeError(
                    f"{err}; if the last positional argument is the target, pass it as "
                    "step(..., target=y)"
                ) from None
            raise
        check_dtypes(self.pipe, flat)
        microbatcher = self.first.microbatcher
        rows = microbatcher.split(flat)
        targets = microbatcher.targets(target, flat)
        per_mb = [self.compiled_for(row) for row in rows]
        shapes: dict[tuple[int, int], list[int]] = {}
        for i, (row, compiled) in enumerate(zip(rows, per_mb, strict=True)):
            compiled.microbatcher.check(i, row)
            if compiled is not per_mb[0]:
                shapes.update(per_mb[0].shapes_of(compiled, i))
        fingerprint = batch_print(list(zip(self.pipe.input_names, flat, strict=True)), target)
        return Batch(rows, targets, per_mb, shapes, fingerprint)
