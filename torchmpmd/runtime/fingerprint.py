"""What the runners of a group compare at their check-in (`checkin.py`):
the job each was given (`describe`: versions, the traced graph, the split,
the schedule and its program, the number of microbatches, dtypes), and the
batch of each step (`batch_print`: shapes and a sample of values).
"""

from __future__ import annotations

import functools
import hashlib
import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ..graph.stage import as_stage

if TYPE_CHECKING:
    from ..graph.pipe import Pipe
    from ..schedule.program import Program

__all__: list[str] = []

FIELDS = (
    "torchmpmd version",
    "torch version",
    "traced graph",
    "split into stages",
    "schedule and its program",
    "number of microbatches",
    "dtypes",
)


@functools.lru_cache(maxsize=1024)  # a step's texts repeat from step to step
def stable_hash(text: str) -> int:
    """A hash of `text` equal in every process (56 bits: an int64)."""
    # Object addresses (a function's repr in a graph) differ between processes.
    stable = _ADDRESS.sub("", text)
    return int.from_bytes(hashlib.sha256(stable.encode()).digest()[:7], "little")


def describe(pipe: Pipe, program: Program, version: str) -> list[str]:
    """The configuration this rank was given, one text per field of FIELDS."""
    graphs = [as_stage(pipe.stage(s)).ops_text() for s in range(pipe.num_stages)]
    split = [
        (spec.input_names, spec.output_names, spec.num_user_inputs, spec.num_sends)
        for spec in pipe.stage_specs
    ]
    tasks = [[str(t) for t in program.tasks(r)] for r in range(program.num_ranks)]
    # Each parameter once under its first name in the model, whatever this
    # rank allocated: a rank that holds one copy of a tied weight (the others
    # still meta) must describe the same job as one that holds none.
    params: dict[str, str] = {}
    for s in range(pipe.num_stages):
        for name, p in pipe.stage(s).named_parameters(remove_duplicate=False):
            first = pipe.parameter_aliases.get(name, [name])[0]
            params.setdefault(first, f"{first}:{p.dtype}")
    dtypes = [str(t.spec) for t in pipe.transfers] + list(params.values())
    return [
        version,
        torch.__version__,
        "\n".join(graphs),
        repr(split),
        f"{program.schedule!r} {program.placement} {tasks}",
        str(program.num_microbatches),
        repr(dtypes),
    ]


@dataclass(frozen=True, slots=True)
class BatchPrint:
    """A step's batch as the check-in compares it between the ranks of a
    pipeline, which all pass the same batch: the structure, shapes and
    dtypes of the inputs and of the target (None: no target given), and a
    hash of a sample of their values (inputs, target)."""

    inputs: str
    target: str | None
    values: tuple[int, int]


# Elements sampled per tensor, evenly spaced: a batch from another step of a
# data loader differs in nearly all of them.
_SAMPLED = 64


def batch_print(named: list[tuple[str, Any]], target: Any) -> BatchPrint:
    """The fingerprint of a step's flat inputs (`named`: (name, value) in
    the traced order) and target."""
    inputs = ", ".join(f"{n}: {_describe(v)}" for n, v in named)
    leaves = pytree.tree_leaves(target)
    target_text = None
    if target is not None:
        target_text = ", ".join(_describe(v) for v in leaves)
        if not isinstance(target, torch.Tensor):
            target_text = f"{type(target).__name__} of [{target_text}]"
    values = (
        _values_hash([v for _, v in named]),
        _values_hash(leaves) if target is not None else 0,
    )
    return BatchPrint(inputs, target_text, values)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__} {text[:37]}..."


def _values_hash(values: list[Any]) -> int:
    """A CRC-32 of evenly spaced elements of each tensor (their bytes, so
    NaNs and signed zeros count as written) and of the other values' reprs
    (object addresses left out). Device tensors give their sample to the
    host (64 elements; the check-in reads its messages on the host anyway)."""
    crc = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            data = _sample(v.detach()).view(torch.uint8).cpu().numpy().tobytes()
        else:
            data = _ADDRESS.sub("", repr(v)).encode()
        crc = zlib.crc32(data, crc)
    return crc


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _sample(t: torch.Tensor) -> torch.Tensor:
    """About 64 evenly spaced elements of `t` (in row-major order), contiguous,
    without copying the rest of a non-contiguous tensor."""
    n = t.numel()
    index = torch.arange(0, n, max(n // _SAMPLED, 1), device=t.device)
    if t.is_contiguous():
        sample = t.reshape(-1)[index]
    else:
        sample = t[torch.unravel_index(index, t.shape)] if t.dim() else t.reshape(1)
    if sample.is_complex():
        sample = torch.view_as_real(sample)
    return sample.contiguous().reshape(-1)
