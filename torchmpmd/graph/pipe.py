"""`Pipe`: a model split into stages, with the plan of what crosses between them."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .format import human_bytes, table
from .plan import Plan

__all__ = ["Pipe", "StageSpec", "TensorSpec", "TransferInfo"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of one microbatch's tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(value: Any) -> TensorSpec | None:
        """The spec of a tensor; None for anything else."""
        return TensorSpec.of_tensor(value) if isinstance(value, torch.Tensor) else None

    @staticmethod
    def of_tensor(value: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(int(d) for d in value.shape), value.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True, slots=True)
class StageSpec:
    """What one stage reads and writes, in the order its GraphModule uses."""

    index: int
    input_names: tuple[str, ...]  # user inputs first, then received values
    input_specs: tuple[TensorSpec | None, ...]
    num_user_inputs: int
    output_names: tuple[str, ...]  # sent values first, then (last stage) model outputs
    output_specs: tuple[TensorSpec | None, ...]
    num_sends: int
    recv_values: tuple[int, ...]  # value ids of the received inputs, in order
    send_values: tuple[int, ...]  # value ids of the sent outputs, in order
    updates_buffers: bool = False  # its forward writes buffers (BatchNorm statistics)


@dataclass(frozen=True, slots=True)
class TransferInfo:
    """One value (id `value`) sent from `src_stage` directly to each of `dst_stages`."""

    value: int
    name: str
    spec: TensorSpec
    src_stage: int
    dst_stages: tuple[int, ...]
    requires_grad: bool


class Pipe:
    """A model split into pipeline stages by `mpmd.trace`.

    `pipe.stage(i)` is stage i's `torch.fx.GraphModule`; its parameters are the
    model's own (shared, not copied) under their original names. `pipe(...)`
    runs every stage in order in this process and equals `model(...)`.
    """

    def __init__(
        self,
        *,
        stages: Sequence[torch.nn.Module],
        stage_specs: list[StageSpec],
        transfers: list[TransferInfo],
        tied: dict[str, tuple[int, ...]],
        plan: Plan,
        input_names: list[str],
        input_specs: list[Any],
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec,
        kwarg_order: list[str],
        input_node_names: list[str | None],
        output_names: list[str | None],
        constant_outputs: dict[int, Any],
        parameter_aliases: dict[str, list[str]],
        tied_parameters: dict[int, torch.Tensor],
        trace_again: Callable[[tuple[Any, ...], dict[str, Any]], Pipe] | None = None,
        activation_bytes: list[int] | None = None,
        source: torch.nn.Module | None = None,
    ) -> None:
        self._stages = list(stages)
        self._activation_bytes = activation_bytes
        # The model the stages were traced from (its own submodules, for
        # `PipelineRunner.init_weights`); None for stages cut by hand.
        self.source = source
        self.stage_specs = stage_specs
        self.transfers = transfers
        self.tied = tied
        self.plan = plan
        self.input_names = input_names
        self.input_specs = input_specs
        self._in_spec = in_spec
        self.out_spec = out_spec
        self._kwarg_order = kwarg_order
        self.input_node_names = input_node_names
        self.output_names = output_names
        self.constant_outputs = constant_outputs
        self.parameter_aliases = parameter_aliases
        # Tied parameters by their node id in the plan (`plan.tied_stages(id)`).
        self.tied_parameters = tied_parameters
        self._trace_again = trace_again

    def replicate(self) -> Pipe:
        """A copy with its own parameters and buffers (tying within it kept)."""
        memo: dict[int, Any] = {}
        stages = copy.deepcopy(self._stages, memo)
        for original, stage in zip(self._stages, stages, strict=True):
            _keep_buffer_persistence(original, stage)
        clone = copy.copy(self)
        clone._stages = stages
        clone.tied_parameters = {node: memo[id(p)] for node, p in self.tied_parameters.items()}
        return clone

    def retrace(self, flat_inputs: list[Any]) -> Pipe:
        """The same model and split traced again for other example inputs (flat,
        in the order of `input_names`): a pipeline for another shape."""
        if self._trace_again is None:
            raise ValueError("this Pipe was not made by mpmd.trace and cannot be traced again")
        args, kwargs = pytree.tree_unflatten(flat_inputs, self._in_spec)
        return self._trace_again(tuple(args), dict(kwargs))

    def activation_bytes(self) -> list[int]:
        """Per stage, a rough bound on the bytes one microbatch's forward keeps
        for the backward: every floating-point intermediate it computes (a
        pipe of eager stages: what their example forward saved)."""
        if self._activation_bytes is not None:
            return list(self._activation_bytes)
        out = []
        for gm in self._stages:
            total = 0
            assert isinstance(gm, fx.GraphModule)
            for n in gm.graph.nodes:
                val = n.meta.get("val")
                if (
                    n.op == "call_function"
                    and isinstance(val, torch.Tensor)
                    and val.is_floating_point()
                ):
                    total += val.numel() * val.element_size()
            out.append(total)
        return out

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    def stage(self, i: int) -> torch.nn.Module:
        """The module of stage `i` (a GraphModule when traced):
        `stage(*inputs) -> tuple(outputs)`."""
        if not 0 <= i < self.num_stages:
            raise IndexError(f"Pipe has {self.num_stages} stages; stage {i} does not exist")
        return self._stages[i]

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Every parameter once, under its name in the original model."""
        return unique_named_parameters(self._stages)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    # ---- running

    def flatten_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Flattens call arguments like the traced example, checking each against it."""
        flat = self.flatten_structure(args, kwargs)
        for name, expected, value in zip(self.input_names, self.input_specs, flat, strict=True):
            check_input(name, expected, value)
        return flat

    def flatten_structure(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Flattens call arguments like the traced example (structure only)."""
        unknown = sorted(set(kwargs) - set(self._kwarg_order))
        missing = [k for k in self._kwarg_order if k not in kwargs]
        if unknown or missing:
            raise TypeError(
                f"pipeline traced with keyword arguments {self._kwarg_order}; "
                + (f"got unexpected {unknown}" if unknown else f"missing {missing}")
                + ": pass the same arguments as the traced example (trace again to change them)"
            )
        ordered = {k: kwargs[k] for k in self._kwarg_order}
        flat, spec = pytree.tree_flatten((tuple(args), ordered))
        if spec != self._in_spec:
            raise TypeError(
                "pipeline inputs are structured differently from the traced example: "
                f"traced {self._in_spec}, got {spec}"
            )
        return flat

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.flatten_inputs(args, kwargs)
        self._refuse_meta_state(flat)
        # Contiguous, like the traced example: the graphs may view their inputs.
        flat = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in flat]
        env = {n: v for n, v in zip(self.input_node_names, flat, strict=True) if n is not None}
        for gm, spec in zip(self._stages, self.stage_specs, strict=True):
            outputs = gm(*(env[n] for n in spec.input_names))
            env.update(zip(spec.output_names, outputs, strict=True))
        return self.unflatten_outputs(env)

    def _refuse_meta_state(self, flat: list[Any]) -> None:
        """A pipe traced from a model on the meta device holds no values: it
        runs meta inputs (shapes only), never real ones."""
        if all(not isinstance(v, torch.Tensor) or v.is_meta for v in flat):
            return
        for gm in self._stages:
            for name, t in [*gm.named_parameters(), *gm.named_buffers()]:
                if t.is_meta:
                    raise RuntimeError(
                        f"Pipe: the pipe's parameters and buffers ('{name}', ...) are on the meta "
                        "device: they have shapes but no values, so the pipe cannot run real "
                        "inputs; run it with a PipelineRunner (testing.LocalPipeline in one "
                        "process), which allocates each rank's stages, after "
                        "runner.init_weights(fn) or runner.load_state_dict(...), or trace a "
                        "model built on a real device"
                    )

    def unflatten_outputs(self, env: dict[str, Any]) -> Any:
        flat = [
            env[name] if name is not None else self.constant_outputs[i]
            for i, name in enumerate(self.output_names)
        ]
        return pytree.tree_unflatten(flat, self.out_spec)

    # ---- inspection

    def __repr__(self) -> str:
        stage_rows = []
        # Each stage's modules in the model's order (a stage's graph lists
        # its parameters in the order it uses them).
        model_order: dict[str, int] = {}
        if self.source is not None:
            for k, (name, _) in enumerate(self.source.named_parameters(remove_duplicate=False)):
                model_order.setdefault(name, k)
        for i, gm in enumerate(self._stages):
            params = list(gm.parameters())
            n_params = sum(p.numel() for p in params)
            n_bytes = sum(p.numel() * p.element_size() for p in params)
            n_ops: int | str = (
                sum(1 for n in gm.graph.nodes if n.op == "call_function")
                if isinstance(gm, fx.GraphModule)
                else "eager"
            )
            names = sorted(
                (n for n, _ in gm.named_parameters(remove_duplicate=False)),
                key=lambda n: model_order.get(n, len(model_order)),
            )
            stage_rows.append((i, n_params, human_bytes(n_bytes), n_ops, module_runs(names)))
        transfer_rows = [
            (
                t.name,
                str(tuple(t.spec.shape)),
                str(t.spec.dtype).removeprefix("torch."),
                human_bytes(t.spec.nbytes),
                t.src_stage,
                ", ".join(map(str, t.dst_stages)),
                "yes" if t.requires_grad else "no",
            )
            for t in self.transfers
        ]
        tied_rows = [
            (name, ", ".join(self.parameter_aliases.get(name, [name])), ", ".join(map(str, stages)))
            for name, stages in self.tied.items()
        ]
        return "\n\n".join(
            [
                f"Pipe with {self.num_stages} stages",
                table("Stages", ["stage", "params", "bytes", "ops", "modules"], stage_rows),
                table(
                    "Transfers (per microbatch)",
                    ["value", "shape", "dtype", "bytes", "from", "to", "grad"],
                    transfer_rows,
                ),
                table("Tied parameters", ["parameter", "names", "stages"], tied_rows),
            ]
        )


def module_runs(parameter_names: Iterable[str]) -> str:
    """The modules holding these parameters, in order, a stack's layers as
    runs: 'model.embed_tokens, model.layers.0-3, model.norm' (a layer is the
    path up to its first numeric part)."""
    runs: list[tuple[str, int, int]] = []  # (prefix, first, last); last -1: no index
    seen: set[str] = set()
    for name in parameter_names:
        parts = name.split(".")[:-1]
        at = next((k for k, part in enumerate(parts) if part.isdigit()), None)
        path = ".".join(parts if at is None else parts[: at + 1]) or name
        if path in seen:
            continue
        seen.add(path)
        if at is None:
            runs.append((path, -1, -1))
            continue
        prefix, index = ".".join(parts[:at]), int(parts[at])
        if runs and runs[-1][0] == prefix and runs[-1][2] == index - 1:
            runs[-1] = (prefix, runs[-1][1], index)
        else:
            runs.append((prefix, index, index))
    return ", ".join(
        p if first < 0 else f"{p}.{first}" if first == last else f"{p}.{first}-{last}"
        for p, first, last in runs
    )


def static_numel(value: torch.Tensor) -> int | None:
    """Elements of a traced tensor; None when its shape depends on data (nonzero)."""
    numel = value.numel()
    return numel if isinstance(numel, int) else None


def unique_named_parameters(
    modules: Iterable[torch.nn.Module],
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Each parameter of the modules once (a tied one under its first name)."""
    seen: set[int] = set()
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p


def place_tensor(
    root: torch.nn.Module, name: str, value: torch.Tensor, *, persistent: bool
) -> None:
    """Registers `value` on `root` under the dotted `name` (a parameter or a
    buffer, with its persistence), making plain container modules for the
    path; the tensor object itself is shared, not copied."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = torch.nn.Module()
            module._modules[part] = child
        module = child
    if isinstance(value, torch.nn.Parameter):
        module._parameters[leaf] = value
    else:
        module._buffers[leaf] = value
        if not persistent:
            module._non_persistent_buffers_set.add(leaf)


def _keep_buffer_persistence(original: torch.nn.Module, copied: torch.nn.Module) -> None:
    # GraphModule's deepcopy registers the root's buffers as persistent; keep
    # the model's choice, so that state_dict keys match the unpipelined model.
    modules = dict(copied.named_modules())
    for name, module in original.named_modules():
        if name in modules:
            modules[name]._non_persistent_buffers_set = set(module._non_persistent_buffers_set)


def check_input(name: str, expected: Any, value: Any) -> None:
    """Rejects an input whose shape, dtype or constant value differs from the trace."""
    if isinstance(expected, TensorSpec):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"pipeline input '{name}' was a tensor {expected} when traced, got {type(value).__name__}"
            )
        got = TensorSpec.of_tensor(value)
        if got != expected:
            raise ValueError(
                f"pipeline input '{name}' has shape {tuple(got.shape)} and dtype {got.dtype}, but the "
                f"pipeline was traced with shape {tuple(expected.shape)} and dtype {expected.dtype}: "
                "pass microbatches like the traced example, or trace again with this shape"
            )
    elif isinstance(value, torch.Tensor) or not _same_constant(expected, value):
        raise ValueError(
            f"pipeline input '{name}' was {expected!r} when traced, got {value!r}: non-tensor inputs "
            "are baked into the traced graph; trace again with the new value"
        )


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return a is b
