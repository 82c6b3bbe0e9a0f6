"""Projecting a step at cluster scale: a decoder-only transformer's shape
(from its config) on a described machine, weighed on the same simulator as
a profiled model, with nothing run.

A `Machine` gives what one device sustains (FLOP/s on the model's matmuls,
memory) and the links inside a node and between nodes. A `TransformerShape`
gives the layer sizes from a Hugging Face style config. `project` turns
them into a `Profile` (one unit per decoder layer, the embedding and the
head apart), with each unit's forward time = its FLOPs per tensor-parallel
rank / the device's FLOP/s + its tensor-parallel collectives (Megatron's
sequence-parallel all-gathers and reduce-scatters, on the link inside a
node while tp fits in one), backward = twice the FLOPs with the same
collectives, and the activation crossing each stage boundary priced on the
link between nodes; then simulates the schedule on `pp` ranks and adds the
FSDP gather of each rank's stages before the step and their gradient
reduce-scatter after it (over `dp`, between nodes).

What it leaves out (so what a projection cannot say): overlap of the
tensor-parallel collectives with compute (async TP), kernels that reach a
different fraction of the peak at different shapes, the optimizer step,
memory outside activations (parameters, gradients, optimizer states),
contention between the pipeline's sends and the data-parallel collectives,
and stragglers. So memory is checked against `Machine.memory` on the
activations alone: a layout whose simulated peak exceeds it is projected
with a warning and `Projection.fits_memory` False. Its use is to rank
schedules and layouts, as the published figures it is checked against
rank them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..graph.format import human_bytes
from ..schedule.program import Lowering
from ..schedule.task import Schedule, require_schedule
from ..schedule.timeline import Timeline
from .results import Profile, UnitTransfer
from .splits import simulate

__all__ = ["Machine", "Projection", "TransformerShape", "project"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """One device and its links. `flops`: FLOP/s the device sustains on the
    model's matmuls (peak x the fraction its kernels reach); bandwidths in
    bytes/s per device, latencies in seconds per message."""

    flops: float
    memory: float  # bytes per device
    devices_per_node: int
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float

    def __post_init__(self) -> None:
        for name in (
            "flops",
            "memory",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"Machine.{name} must be a positive number, got {value!r}")
        for name in ("intra_node_latency", "inter_node_latency"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Machine.{name} must be a non-negative number, got {value!r}")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ValueError(
                f"Machine.devices_per_node must be a positive int, got {self.devices_per_node!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerShape:
    """A decoder-only transformer (Llama-like: grouped-query attention, a
    gated MLP of three matrices unless `gated=False`), by its sizes."""

    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    vocab: int
    gated: bool = True
    causal: bool = True
    bytes_per_value: int = 2  # activations and parameters (bf16)

    def __post_init__(self) -> None:
        sizes = ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "bytes_per_value")
        for name in sizes:
            _check_size(f"TransformerShape.{name}", getattr(self, name))
        for name in ("gated", "causal"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"TransformerShape.{name} must be True or False, got {getattr(self, name)!r}"
                )
        if self.hidden % self.heads:
            raise ValueError(
                f"TransformerShape: heads={self.heads} does not divide hidden={self.hidden}; "
                "a head is hidden / heads wide, so give the model's own sizes"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"TransformerShape: kv_heads={self.kv_heads} does not divide heads={self.heads}; "
                "each key-value head serves a whole group of query heads (kv_heads=heads "
                "without grouped-query attention)"
            )

    @staticmethod
    def from_config(config: Any) -> TransformerShape:
        """From a Hugging Face config (an object or a dict with
        num_hidden_layers, hidden_size, intermediate_size,
        num_attention_heads, num_key_value_heads, vocab_size)."""

        def get(key: str) -> Any:
            if isinstance(config, Mapping):
                return config.get(key)
            return getattr(config, key, None)

        needed = [
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "vocab_size",
        ]
        missing = [k for k in needed if get(k) is None]
        if missing:
            raise ValueError(
                f"TransformerShape.from_config: the config has no {', '.join(missing)}; "
                "build TransformerShape(layers=..., hidden=..., ...) by hand"
            )
        heads = int(get("num_attention_heads"))
        return TransformerShape(
            layers=int(get("num_hidden_layers")),
            hidden=int(get("hidden_size")),
            ffn_hidden=int(get("intermediate_size")),
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            vocab=int(get("vocab_size")),
        )

    def layer_flops(self, tokens: int, seq_len: int) -> float:
        """Forward FLOPs of one decoder layer on `tokens` tokens in sequences
        of `seq_len` (matmuls: 2 per multiply-add; attention scores and
        their product with V, halved when causal)."""
        h, head_dim = self.hidden, self.hidden // self.heads
        projections = h * h * 2 + 2 * h * self.kv_heads * head_dim  # q, o; k, v
        mlp = (3 if self.gated else 2) * h * self.ffn_hidden
        attention = 2 * seq_len * h * (0.5 if self.causal else 1.0)  # QK^T and AV per token
        return 2.0 * tokens * (projections + mlp) + 2.0 * tokens * attention

    def head_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.hidden * self.vocab


@dataclass(frozen=True, kw_only=True, slots=True)
class Projection:
    """A projected step: `step_time` seconds (the pipeline's simulated step
    plus the exposed FSDP collectives), tokens per second per device, and
    the simulated timeline of the pipeline ranks."""

    schedule: Schedule
    split_before: list[str]
    step_time: float
    pipeline_time: float
    fsdp_time: float
    tokens_per_second_per_device: float
    peak_activation_bytes: list[int]
    # Whether the largest peak fits Machine.memory (activations alone).
    fits_memory: bool
    timeline: Timeline = dataclasses.field(repr=False, compare=False)


def project(
    shape: TransformerShape,
    machine: Machine,
    schedule: Schedule,
    *,
    pp: int,
    tp: int = 1,
    dp: int = 1,
    microbatch_size: int,
    seq_len: int,
    stages_per_rank: int | None = None,
    recompute: bool = False,
    split_before: Sequence[str] | None = None,
) -> Projection:
    """The step of `shape` trained with `schedule` on pp x tp x dp devices
    of `machine` (see the module docstring). Each data-parallel replica
    runs `schedule.num_microbatches` microbatches of `microbatch_size`
    sequences of `seq_len` tokens. `recompute`: full activation
    checkpointing (each stage's forward again before its backward).
    `split_before` defaults to an even split by layers, the embedding with
    the first stage and the head with the last (torchtitan's default).
    A layout whose activations alone exceed `machine.memory` on some rank
    is projected with a warning and `fits_memory=False`. `stages_per_rank`
    defaults to the schedule's own (`Schedule.stages_per_rank`)."""
    _check_arguments(shape, machine, schedule, recompute)
    if stages_per_rank is None:
        stages_per_rank = schedule.stages_per_rank
    sizes = {"pp": pp, "tp": tp, "dp": dp, "stages_per_rank": stages_per_rank}
    sizes |= {"microbatch_size": microbatch_size, "seq_len": seq_len}
    for name, value in sizes.items():
        _check_size(f"mpmd.project: {name}", value)
    for field, heads in (("heads", shape.heads), ("kv_heads", shape.kv_heads)):
        if heads % tp:
            fit = [t for t in range(1, shape.kv_heads + 1) if shape.kv_heads % t == 0]
            raise ValueError(
                f"mpmd.project: tp={tp} does not divide TransformerShape.{field}={heads}: each "
                f"tensor-parallel rank computes whole heads (query and key-value); pick tp "
                f"among {', '.join(map(str, fit))}"
            )
    num_stages = pp * stages_per_rank
    if num_stages > shape.layers:
        raise ValueError(
            f"mpmd.project: {num_stages} stages for {shape.layers} layers; a stage holds a layer"
        )
    _check_schedule(schedule, shape.layers, pp, stages_per_rank)
    prof = _profile(shape, machine, tp=tp, microbatch_size=microbatch_size, seq_len=seq_len)
    split = list(split_before) if split_before is not None else _even(shape.layers, num_stages)
    link = _link(machine, tp, pp)
    simulated = schedule.with_recompute() if recompute else schedule
    timeline = simulate(
        prof, split, schedule=simulated, num_ranks=pp, bandwidth=link[0], latency=link[1]
    )
    fsdp = _fsdp_time(shape, machine, tp=tp, pp=pp, dp=dp)
    step = timeline.step_time + fsdp
    tokens = schedule.num_microbatches * microbatch_size * seq_len * dp
    peak = max(timeline.peak_activation_bytes, default=0)
    if peak > machine.memory:
        rank = list(timeline.peak_activation_bytes).index(peak)
        more = "" if recompute else "recompute=True, "
        warnings.warn(
            f"mpmd.project: the layout does not fit Machine.memory: pipeline rank {rank} holds "
            f"{human_bytes(peak)} of activations per device at its simulated peak, over the "
            f"machine's {human_bytes(machine.memory)} (parameters, gradients and optimizer "
            f"states not counted); to fit, raise pp or tp, {more}or lower microbatch_size "
            "(Projection.fits_memory is False)",
            stacklevel=2,
        )
    return Projection(
        schedule=schedule,
        split_before=split,
        step_time=step,
        pipeline_time=timeline.step_time,
        fsdp_time=fsdp,
        tokens_per_second_per_device=tokens / step / (pp * tp * dp),
        peak_activation_bytes=list(timeline.peak_activation_bytes),
        fits_memory=peak <= machine.memory,
        timeline=timeline,
    )


def _check_size(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_arguments(shape: Any, machine: Any, schedule: Any, recompute: Any) -> None:
    if not isinstance(shape, TransformerShape):
        raise TypeError(
            f"mpmd.project: shape must be an mpmd.TransformerShape (e.g. "
            f"TransformerShape.from_config(config)), got {type(shape).__name__}"
        )
    if not isinstance(machine, Machine):
        raise TypeError(f"mpmd.project: machine must be an mpmd.Machine, got {machine!r}")
    require_schedule(schedule, "mpmd.project")
    if not isinstance(recompute, bool):
        raise TypeError(f"mpmd.project: recompute must be True or False, got {recompute!r}")


def _lowering_error(schedule: Schedule, num_stages: int, pp: int) -> ValueError | None:
    try:
        Lowering(schedule, num_stages, pp).compile(num_stages)
    except ValueError as err:
        return err
    return None


def _check_schedule(schedule: Schedule, layers: int, pp: int, stages_per_rank: int) -> None:
    """Refuses a schedule that cannot run pp x stages_per_rank stages on pp
    ranks, naming the stages_per_rank that fits (ZBV: 2)."""
    error = _lowering_error(schedule, pp * stages_per_rank, pp)
    if error is None:
        return
    fits = [
        k
        for k in range(1, 5)
        if k != stages_per_rank
        and pp * k <= layers
        and _lowering_error(schedule, pp * k, pp) is None
    ]
    advice = f"pass stages_per_rank={fits[0]}" if fits else "pass a schedule that fits"
    raise ValueError(
        f"mpmd.project: {schedule!r} cannot run {pp * stages_per_rank} stages on pp={pp} ranks "
        f"(stages_per_rank={stages_per_rank}): {error}; {advice}"
    )


def _ring(nbytes: float, group: int, bandwidth: float, latency: float) -> float:
    """A ring all-gather or reduce-scatter of `nbytes` (the whole tensor)."""
    if group <= 1:
        return 0.0
    return (group - 1) * (latency + nbytes / group / bandwidth)


def _tp_link(machine: Machine, tp: int) -> tuple[float, float]:
    if tp <= machine.devices_per_node:
        return machine.intra_node_bandwidth, machine.intra_node_latency
    return machine.inter_node_bandwidth, machine.inter_node_latency


def _link(machine: Machine, tp: int, pp: int) -> tuple[float, float]:
    """The link a stage boundary crosses: between nodes once a node holds
    fewer than tp x pp devices (pipeline ranks are outside tp groups)."""
    if tp * pp <= machine.devices_per_node:
        return machine.intra_node_bandwidth, machine.intra_node_latency
    return machine.inter_node_bandwidth, machine.inter_node_latency


def _profile(
    shape: TransformerShape, machine: Machine, *, tp: int, microbatch_size: int, seq_len: int
) -> Profile:
    tokens = microbatch_size * seq_len
    activation = tokens * shape.hidden * shape.bytes_per_value
    bandwidth, latency = _tp_link(machine, tp)
    # Sequence parallelism: two all-gathers and two reduce-scatters of the
    # activation per layer, each way.
    # The head gathers its input once (its output stays sharded by vocab).
    gather = _ring(activation, tp, bandwidth, latency)
    compute = [
        0.0,  # the embedding: a lookup
        *([shape.layer_flops(tokens, seq_len) / tp / machine.flops] * shape.layers),
        shape.head_flops(tokens) / tp / machine.flops,
    ]
    comm = [0.0, *([4 * gather] * shape.layers), gather]
    forward = [c + m for c, m in zip(compute, comm, strict=True)]
    backward = [2 * c + m for c, m in zip(compute, comm, strict=True)]
    # What autograd keeps per layer (bytes per tp rank; Korthikanti et al.'s
    # count for sequence parallelism, attention scores left to a fused kernel).
    per_layer = 34 * tokens * shape.hidden // tp
    units = ("embed", *(f"layers.{i}" for i in range(shape.layers)), "head")
    n = len(units)
    return Profile(
        units=units,
        forward=tuple(forward),
        backward=tuple(backward),
        activation_bytes=(0, *([per_layer] * shape.layers), 4 * tokens * shape.vocab // tp),
        transfers=tuple(
            UnitTransfer(src=i, dst=(i + 1,), bytes=activation // tp) for i in range(n - 1)
        ),
    )


def _even(layers: int, num_stages: int) -> list[str]:
    """Equal numbers of layers per stage; the first `layers % num_stages`
    stages take one more."""
    base, extra = divmod(layers, num_stages)
    starts, at = [], 0
    for s in range(num_stages - 1):
        at += base + (1 if s < extra else 0)
        starts.append(f"layers.{at}")
    return starts


def _fsdp_time(shape: TransformerShape, machine: Machine, *, tp: int, pp: int, dp: int) -> float:
    """The gather of a rank's parameters before its first forward and the
    reduce-scatter of its gradients after its last backward (both exposed:
    nothing runs beside them), over dp ranks on the link between nodes."""
    if dp <= 1:
        return 0.0
    h, head_dim = shape.hidden, shape.hidden // shape.heads
    per_layer = (
        2 * h * h
        + 2 * h * shape.kv_heads * head_dim
        + (3 if shape.gated else 2) * h * shape.ffn_hidden
    )
    params = shape.layers * per_layer + 2 * shape.vocab * h
    nbytes = params * shape.bytes_per_value / tp / pp
    gather = _ring(nbytes, dp, machine.inter_node_bandwidth, machine.inter_node_latency)
    return 2 * gather
