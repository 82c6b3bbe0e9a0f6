"""Pipes from stages cut by hand: ordinary eager modules, for code no trace takes.

`mpmd.from_stages([s0, s1, s2], example_args)` makes a `Pipe` whose stage i
is the module the user wrote, as torch.distributed.pipelining's
`PipelineStage` allows: stage 0 takes the model's inputs, each later stage
the previous stage's output (a tuple is passed as positional arguments), and
the last stage's output goes to the loss. Nothing is traced: every stage runs
as Python, so data-dependent shapes, control flow on values and any operator
work, under the same schedules and executor as a traced pipe.

What the plan needs (the shapes and dtypes of the transfers, which carry
gradients, which stages write buffers, saved-activation bytes) comes from one
forward of the example microbatch, run on copies of the buffers and a forked
random generator, so the model is left as it was. A new input shape runs that
probe again (the runner's per-shape cache counts it in `num_traces`).

Parameters and buffers are named as in `model` when it is given (a tied one
under the name of the module the stage holds, every name an alias), else as
in `nn.Sequential(*stages)` ("0.weight", "1.layers.0.bias"). A parameter
object that several stages hold is tied: its gradients are summed.

Backward runs through autograd: B directly; split I/W (zero-bubble
schedules) as `runtime.autograd_split` describes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .builder import _input_names
from .experts import experts_modules, traced_as_calls
from .inputs import example_inputs
from .names import aliases_of, tensor_names
from .pipe import Pipe, StageSpec, TensorSpec, TransferInfo, place_tensor
from .plan import Plan, StageNodes, TiedParameter, Transfer

__all__ = ["EagerStage", "from_stages"]


class EagerStage(torch.nn.Module):
    """Stage `index` of a hand-cut pipeline: the user's module, run as it is,
    its parameters and buffers registered here under the model's names.

    Called as `stage(*flat_user_inputs, *received)` like a traced stage; it
    returns the flat leaves of the user module's output.
    """

    def __init__(
        self,
        index: int,
        module: torch.nn.Module,
        names: dict[str, str],
        in_spec: pytree.TreeSpec | None,
        num_user_inputs: int,
        recv_spec: pytree.TreeSpec | None,
        written_buffers: frozenset[str],
    ) -> None:
        super().__init__()
        # Not a child module: its state is registered under `names` instead.
        self.__dict__["_mpmd_module"] = module
        self._mpmd_index = index
        self._mpmd_names = names  # the module's own name -> the name here
        self._mpmd_specs = _Specs(in_spec, recv_spec)
        self._mpmd_num_user_inputs = num_user_inputs
        # Names (here) of the buffers its forward writes (BatchNorm statistics).
        self.written_buffers = written_buffers
        self._mirror()

    traced = False

    @property
    def module(self) -> torch.nn.Module:
        """The user's stage module."""
        module: torch.nn.Module = self.__dict__["_mpmd_module"]
        return module

    # ---- the Stage interface (graph/stage.py)

    @property
    def graph_module(self) -> None:
        return None  # runs as it is; splits through autograd

    @property
    def user_module(self) -> torch.nn.Module:
        return self.module

    @property
    def state_root(self) -> torch.nn.Module:
        return self.module

    def refresh_state(self) -> None:
        self._mirror()

    def ops_text(self) -> str:
        return type(self).__name__

    def retarget_devices(self, device: torch.device) -> None:
        pass  # the user's code creates its tensors where it says

    def _mirror(self) -> None:
        """Registers the module's current parameters and buffers under their names."""
        self._modules.clear()
        self._parameters.clear()
        self._buffers.clear()
        self._non_persistent_buffers_set.clear()
        for local, p in self.module.named_parameters(remove_duplicate=False):
            place_tensor(self, self._mpmd_names[local], p, persistent=True)
        for owner_path, owner in self.module.named_modules(remove_duplicate=False):
            for leaf, b in owner._buffers.items():
                if b is None:
                    continue
                local = f"{owner_path}.{leaf}" if owner_path else leaf
                persistent = leaf not in owner._non_persistent_buffers_set
                place_tensor(self, self._mpmd_names[local], b, persistent=persistent)

    def _apply(self, fn: Any, recurse: bool = True) -> EagerStage:
        # .to() / .double() act on the user's module, which forward runs.
        self.module._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self._mirror()
        return self

    def train(self, mode: bool = True) -> EagerStage:
        super().train(mode)
        self.module.train(mode)
        return self

    def forward(self, *flat: Any) -> tuple[Any, ...]:
        n = self._mpmd_num_user_inputs
        in_spec, recv_spec = self._mpmd_specs.inputs, self._mpmd_specs.received
        if in_spec is not None:
            args, kwargs = pytree.tree_unflatten(list(flat[:n]), in_spec)
            out = self.module(*args, **kwargs)
        else:
            assert recv_spec is not None
            prev = pytree.tree_unflatten(list(flat[n:]), recv_spec)
            out = self.module(*prev) if isinstance(prev, tuple) else self.module(prev)
        return tuple(pytree.tree_leaves(out))


@dataclass(frozen=True, slots=True)
class _Specs:
    """How a stage's flat inputs fold back into its call (immutable: copies share it)."""

    inputs: pytree.TreeSpec | None  # stage 0: the model's (args, kwargs)
    received: pytree.TreeSpec | None  # later stages: the previous stage's output

    def __deepcopy__(self, memo: dict[int, Any]) -> _Specs:
        return self


@dataclass(frozen=True, slots=True)
class _Probe:
    """What one forward of the example microbatch shows about each stage."""

    outputs: list[list[Any]]  # per stage, its output leaves
    out_specs: list[pytree.TreeSpec]
    written: list[frozenset[str]]  # per stage, local names of buffers it writes
    saved_bytes: list[int]


def _probe(
    stages: Sequence[torch.nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> _Probe:
    devices = sorted(
        {p.device.index or 0 for s in stages for p in s.parameters() if p.device.type == "cuda"}
    )
    # Stages on the meta device (a meta model, or another rank's stages
    # after this rank allocated its own) are probed on meta copies of all.
    on_meta = any(t.is_meta for s in stages for t in [*s.parameters(), *s.buffers()])
    if on_meta:
        args, kwargs = pytree.tree_map(
            lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, (args, kwargs)
        )
    outputs, specs, written, saved = [], [], [], []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        prev: Any = None
        for i, stage in enumerate(stages):
            state = {id(t) for t in stage.parameters()}
            buffers = {name: b.clone() for name, b in stage.named_buffers(remove_duplicate=False)}
            params: dict[str, torch.Tensor] = {}
            if on_meta:
                buffers = {name: b.to("meta") for name, b in buffers.items()}
                params = {
                    name: p.to("meta") for name, p in stage.named_parameters(remove_duplicate=False)
                }
                state |= {id(p) for p in params.values()}
            versions = {name: b._version for name, b in buffers.items()}
            count = [0]

            def pack(t: torch.Tensor, count: list[int] = count, state: set[int] = state) -> Any:
                if id(t) not in state:
                    count[0] += t.numel() * t.element_size()
                return t

            call_args, call_kwargs = (
                (args, kwargs) if i == 0 else ((*prev,) if isinstance(prev, tuple) else (prev,), {})
            )
            # On meta tensors a mixture of experts' routed tokens have no
            # sizes (`.tolist()`): its experts modules answer with their
            # output's shape alone (graph.experts, as in a trace).
            experts = experts_modules(stage) if on_meta else {}
            try:
                with (
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                    traced_as_calls(experts, named=False),
                ):
                    out = torch.func.functional_call(
                        stage, {**buffers, **params}, call_args, call_kwargs, strict=False
                    )
            except Exception as err:
                where = " (probed on the meta device)" if on_meta else ""
                raise RuntimeError(
                    f"mpmd.from_stages: stage {i} ({type(stage).__name__}) failed on the example "
                    f"microbatch{where}: {type(err).__name__}: {err}"
                ) from err
            leaves, spec = pytree.tree_flatten(out)
            if i < len(stages) - 1:
                bad = [
                    f"leaf {j} ({type(v).__name__})"
                    for j, v in enumerate(leaves)
                    if not isinstance(v, torch.Tensor)
                ]
                if bad or not leaves:
                    raise TypeError(
                        f"mpmd.from_stages: stage {i} returns "
                        f"{', '.join(bad) if bad else 'no tensor'}; a stage other than the last "
                        "must return tensors (one, or a tuple), which go to the next stage"
                    )
            outputs.append(leaves)
            specs.append(spec)
            written.append(frozenset(n for n, b in buffers.items() if b._version != versions[n]))
            saved.append(count[0])
            prev = out
    return _Probe(outputs, specs, written, saved)


def _stage_names(
    stages: Sequence[torch.nn.Module], model: torch.nn.Module | None
) -> tuple[list[dict[str, str]], dict[str, list[str]]]:
    """Per stage, its own name -> the pipe's name of each parameter and buffer;
    and every name of each tensor, keyed by each of its names (aliases)."""
    per_stage: list[dict[str, str]] = []
    by_id: dict[int, list[str]] = {}
    if model is not None:
        paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        by_id = tensor_names(model)
    for i, stage in enumerate(stages):
        names: dict[str, str] = {}
        for owner_path, owner in stage.named_modules(remove_duplicate=False):
            for leaf, t in [*owner._parameters.items(), *owner._buffers.items()]:
                if t is None:
                    continue
                local = f"{owner_path}.{leaf}" if owner_path else leaf
                if model is None:
                    name = f"{i}.{local}"
                    by_id.setdefault(id(t), [])
                    if name not in by_id[id(t)]:
                        by_id[id(t)].append(name)
                else:
                    if id(t) not in by_id:
                        raise ValueError(
                            f"mpmd.from_stages: stage {i}'s tensor '{local}' is not a parameter "
                            f"or buffer of the model given as model= ({type(model).__name__}); "
                            "pass the model the stages were cut from, or model=None to name "
                            "them by stage"
                        )
                    owner_in_model = paths.get(id(owner))
                    exact = f"{owner_in_model}.{leaf}" if owner_in_model else leaf
                    name = exact if exact in by_id[id(t)] else by_id[id(t)][0]
                names[local] = name
        per_stage.append(names)
    return per_stage, aliases_of(by_id)


class EagerPipe(Pipe):
    """A `Pipe` of `EagerStage`s: another input shape probes its own stages again."""

    def retrace(self, flat_inputs: list[Any]) -> Pipe:
        args, kwargs = pytree.tree_unflatten(flat_inputs, self._in_spec)
        modules = [self.stage(s) for s in range(self.num_stages)]
        return _build(
            [m.module for m in modules if isinstance(m, EagerStage)],
            tuple(args),
            dict(kwargs),
            [m._mpmd_names for m in modules if isinstance(m, EagerStage)],
            self.parameter_aliases,
        )


def from_stages(
    stages: Sequence[torch.nn.Module],
    example_args: Any = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    model: torch.nn.Module | None = None,
) -> Pipe:
    """A pipe from stages cut by hand, each an ordinary module run eagerly.

    For models `mpmd.trace` cannot take (see the module docstring): stage 0
    is called with one microbatch's `example_args` / `example_kwargs`, each
    later stage with the previous stage's output. `model`, the module the
    stages were cut from, names parameters as in the model (state dicts and
    checkpoints then match it).
    """
    if isinstance(stages, torch.nn.Module) or not stages:
        raise TypeError(
            "mpmd.from_stages: pass a non-empty list of stage modules, e.g. "
            "[nn.Sequential(model.embed, *model.layers[:4]), ...]"
        )
    for i, s in enumerate(stages):
        if not isinstance(s, torch.nn.Module):
            raise TypeError(f"mpmd.from_stages: stage {i} is a {type(s).__name__}, not a Module")
    args, kwargs = example_inputs("mpmd.from_stages", example_args, example_kwargs)
    names, aliases = _stage_names(stages, model)
    return _build(list(stages), args, kwargs, names, aliases)


def _build(
    modules: list[torch.nn.Module],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    names: list[dict[str, str]],
    aliases: dict[str, list[str]],
) -> Pipe:
    probe = _probe(modules, args, kwargs)
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    input_names = _input_names(in_spec, len(flat))
    node_names = [f"input_{k}" for k in range(len(flat))]
    n = len(modules)
    value_ids: list[list[int]] = []
    transfers: list[TransferInfo] = []
    next_id = 0
    for s in range(n - 1):
        ids = []
        for j, t in enumerate(probe.outputs[s]):
            ids.append(next_id)
            transfers.append(
                TransferInfo(
                    value=next_id,
                    name=f"stage{s}_out{j}",
                    spec=TensorSpec.of_tensor(t),
                    src_stage=s,
                    dst_stages=(s + 1,),
                    requires_grad=bool(t.requires_grad),
                )
            )
            next_id += 1
        value_ids.append(ids)
    # Tied: a tensor object held by several stages.
    holders: dict[int, list[int]] = {}
    objects: dict[int, torch.Tensor] = {}
    for s, m in enumerate(modules):
        for p in m.parameters():
            holders.setdefault(id(p), [])
            if s not in holders[id(p)]:
                holders[id(p)].append(s)
            objects[id(p)] = p
    tied_nodes: dict[int, torch.Tensor] = {}
    tied_names: dict[str, tuple[int, ...]] = {}
    plan_tied = []
    for key, stages_of in holders.items():
        if len(stages_of) > 1:
            node = next_id
            next_id += 1
            tied_nodes[node] = objects[key]
            first = modules[stages_of[0]]
            local = next(nm for nm, p in first.named_parameters() if id(p) == key)
            tied_names[names[stages_of[0]][local]] = tuple(stages_of)
            plan_tied.append(TiedParameter(node, tuple(stages_of)))
    stage_modules = []
    stage_specs = []
    for s, module in enumerate(modules):
        recv = tuple(value_ids[s - 1]) if s > 0 else ()
        send = tuple(value_ids[s]) if s < n - 1 else ()
        user = node_names if s == 0 else []
        recv_specs = [TensorSpec.of_tensor(t) for t in probe.outputs[s - 1]] if s > 0 else []
        outs = probe.outputs[s]
        stage_modules.append(
            EagerStage(
                s,
                module,
                names[s],
                in_spec if s == 0 else None,
                len(user),
                probe.out_specs[s - 1] if s > 0 else None,
                frozenset(names[s][b] for b in probe.written[s]),
            )
        )
        out_names = tuple(
            f"stage{s}_out{j}" if s < n - 1 else f"output_{j}" for j in range(len(outs))
        )
        stage_specs.append(
            StageSpec(
                index=s,
                input_names=(*user, *(f"stage{s - 1}_out{j}" for j in range(len(recv)))),
                input_specs=(*(TensorSpec.of(v) for v in flat), *recv_specs)
                if s == 0
                else tuple(recv_specs),
                num_user_inputs=len(user),
                output_names=out_names,
                output_specs=tuple(TensorSpec.of(v) for v in outs),
                num_sends=len(send),
                recv_values=recv,
                send_values=send,
                updates_buffers=bool(probe.written[s]),
            )
        )
    plan = Plan(
        stages=tuple(
            StageNodes(
                inputs=(),
                recvs=spec.recv_values,
                sends=spec.send_values,
                params=(),
                buffers=(),
                compute=(),
                buffer_updates=(),
            )
            for spec in stage_specs
        ),
        transfers=tuple(
            Transfer(t.value, t.src_stage, t.dst_stages, t.spec.nbytes, t.requires_grad)
            for t in transfers
        ),
        tied=tuple(plan_tied),
        outputs=(),
    )
    return EagerPipe(
        stages=stage_modules,
        stage_specs=stage_specs,
        transfers=transfers,
        tied=tied_names,
        plan=plan,
        input_names=input_names,
        input_specs=[TensorSpec.of(v) if isinstance(v, torch.Tensor) else v for v in flat],
        in_spec=in_spec,
        out_spec=probe.out_specs[-1],
        kwarg_order=list(kwargs),
        input_node_names=list(node_names),
        output_names=[f"output_{j}" for j in range(len(probe.outputs[-1]))],
        constant_outputs={},
        parameter_aliases=aliases,
        tied_parameters=tied_nodes,
        activation_bytes=probe.saved_bytes,
    )
