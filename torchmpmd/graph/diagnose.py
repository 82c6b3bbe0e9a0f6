"""What `mpmd.trace` says when a model cannot be traced as it runs: where the
trace failed and what to do, and forward code whose values a graph would
freeze (random numbers drawn with numpy or Python's `random`)."""

from __future__ import annotations

import contextlib
import random
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "ModuleTracker",
    "host_random_message",
    "trace_failure_message",
    "unsupported_input_message",
]


def _host_rng_state() -> tuple[Any, ...]:
    """The state of the random generators torch does not trace: Python's
    `random` and numpy's global one (numpy only when something imported it)."""
    numpy = sys.modules.get("numpy")
    np_state: Any = None
    if numpy is not None:
        _, keys, pos, has_gauss, gauss = numpy.random.get_state()
        np_state = (keys.tobytes(), pos, has_gauss, gauss)
    return random.getstate(), np_state


class ModuleTracker:
    """Knows which module calls are in progress, to say where tracing failed,
    and which module drew random numbers outside torch while it was traced."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.stack: list[tuple[str, str]] = []
        # The first module whose forward moved a host generator, with the
        # generator's name.
        self.host_random: tuple[str, str, str] | None = None
        self._rng = _host_rng_state()

    def _check_rng(self) -> None:
        if self.host_random is not None:
            return
        state = _host_rng_state()
        if state != self._rng:
            path, cls = self.stack[-1] if self.stack else ("", "")
            which = "Python's random" if state[0] != self._rng[0] else "numpy.random"
            self.host_random = (path, cls, which)
        self._rng = state

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        # A draw between two hooks belongs to the module on top of the stack
        # then: the parent before a child's call, the child before its return.
        def pre(module: torch.nn.Module, _args: Any) -> None:
            if id(module) in self._names:
                self._check_rng()
                self.stack.append((self._names[id(module)], type(module).__name__))

        def post(module: torch.nn.Module, _args: Any, _out: Any) -> None:
            if id(module) in self._names and self.stack:
                self._check_rng()
                self.stack.pop()

        handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(pre),
            torch.nn.modules.module.register_module_forward_hook(post),
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        self._check_rng()


def _where(path: str, cls: str) -> str:
    return f"module '{path}' ({cls})" if path else f"the root module ({cls})"


def host_random_message(path: str, cls: str, which: str) -> str:
    """Why a forward that draws with numpy or `random` cannot be traced."""
    return (
        f"mpmd.trace: {_where(path, cls)} draws random numbers with {which} in forward; "
        "torch.export runs that Python once, so the pipeline would replay the numbers drawn "
        "while tracing at every step, where the model draws new ones (a training-time mask "
        "or layer drop would be the same every step). To fix: draw them with torch "
        "(torch.rand, torch.bernoulli), which the traced graph draws anew at each call; or "
        "turn the feature off for the pipelined run (Hugging Face speech models: "
        "mask_time_prob=0.0 and mask_feature_prob=0.0 in the config); or cut the model into "
        "stage modules by hand and run them eagerly: mpmd.from_stages([stage0, stage1, ...], "
        "example_args)"
    )


def unsupported_input_message(node: fx.Node, kind: str, value: Any) -> str:
    """Why the traced graph's input `node` (neither a tensor nor a parameter,
    buffer or constant) cannot be pipelined."""
    if not isinstance(value, torch.Generator):
        return (
            f"mpmd.trace: the model takes a {kind} input ('{node.name}'); "
            "pipelines support tensors, parameters, buffers and constants"
        )
    user = next(iter(node.users), None)
    stack = list((user.meta.get("nn_module_stack") or {}).values()) if user else []
    path, cls = stack[-1] if stack else ("", "")
    return (
        f"mpmd.trace: {_where(path, cls.rpartition('.')[2])} draws random numbers from its own "
        f"torch.Generator ({user.target if user else 'an op'} with generator=...); a "
        "pipeline's stages draw from each rank's default generator, and cannot carry another "
        "generator's state between stages and steps. To fix: drop generator=... and seed "
        "torch's default generator (torch.manual_seed), or cut the model into stage modules "
        "by hand and run them eagerly: mpmd.from_stages([stage0, stage1, ...], example_args)"
    )


def _device_hint(model: torch.nn.Module) -> str:
    """What to do when an op met tensors on two devices, one of them meta."""
    named: list[tuple[str, torch.Tensor]] = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    devices = {str(t.device) for _, t in named}
    if "meta" in devices:
        real = [f"'{name}' ({t.device})" for name, t in named if not t.is_meta]
        if real:
            listed = ", ".join(real[:3]) + (f" and {len(real) - 3} more" if len(real) > 3 else "")
            return (
                f"the model is on the meta device but {len(real)} of its tensors "
                f"{'is' if len(real) == 1 else 'are'} not: "
                f"{listed}, made outside the meta device (a legacy constructor such as "
                "torch.Tensor(n), or a tensor built on a device given by hand); move them "
                "before tracing with model.to('meta'), or build them on the meta device"
            )
        return (
            "the model's tensors are on the meta device and forward mixes them with a tensor "
            "it creates on a real device (torch.ones(n) or torch.tensor([...]) without "
            "device=...); create it on the device of an input (device=x.device). Example "
            "inputs on any device are traced as meta tensors of their shape and dtype"
        )
    where = ", ".join(sorted(devices)) or "a real device"
    return (
        f"the example inputs are on the meta device and the model's tensors on {where}: "
        "pass example inputs on the model's device, or build the model under "
        "torch.device('meta') too to trace it without memory"
    )


def _mixes_meta(exc: Exception, text: str) -> bool:
    """Whether `exc` says an op met a meta tensor and a real one."""
    if "meta" not in text:
        return False
    return "DeviceMismatch" in type(exc).__name__ or any(
        s in text
        for s in (
            "two devices",
            "same device",
            "expected device",
            "different devices",
            "device between",
        )
    )


def trace_failure_message(
    exc: Exception, stack: list[tuple[str, str]], model: torch.nn.Module
) -> str:
    """The error `mpmd.trace` raises for `exc`: where it happened, then what to do."""
    where = "in " + _where(*stack[-1]) if stack else "outside any module call"
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if f.line and "/torch/" not in f.filename and "/torchmpmd/" not in f.filename
    ]
    line = f" at {frames[-1].filename}:{frames[-1].lineno} `{frames[-1].line}`" if frames else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = str(exc)
    if "which is not a known type" in text or "register a pytree" in text:
        hint = (
            "the model returns or takes an object torch cannot flatten into tensors; return "
            "only tensors (for Hugging Face models pass use_cache=False)"
        )
    elif _mixes_meta(exc, text):
        hint = _device_hint(model)
    elif "data-dependent" in text or "GuardOnDataDependent" in text:
        hint = (
            "control flow depends on tensor values; make it depend on shapes or constants, "
            "or use torch.cond"
        )
        if "skip_the_layer" in line or "layerdrop" in line:
            hint += " (this is layer drop in training mode: set layerdrop=0.0 in the config)"
    else:
        hint = "make that code traceable by torch.export (non-strict), or move it out of forward"
    hint += (
        "; or cut the model into stage modules by hand and run them eagerly: "
        "mpmd.from_stages([stage0, stage1, ...], example_args)"
    )
    return (
        f"mpmd.trace could not trace the model {where}{line}: {type(exc).__name__}: {first}. "
        f"To fix: {hint}."
    )
