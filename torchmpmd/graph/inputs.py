"""One microbatch's example inputs, as every entry point takes them."""

from __future__ import annotations

from typing import Any

__all__ = ["example_inputs"]


def example_inputs(
    who: str, example_args: Any, example_kwargs: dict[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`example_args` as a tuple of positional arguments (a single value is
    one argument) and `example_kwargs` as a dict; a list is refused, since it
    is ambiguous (one list argument, or the arguments themselves?)."""
    if isinstance(example_args, list):
        raise TypeError(
            f"{who}: example_args is a list; pass the positional arguments of one "
            "microbatch as a tuple, e.g. (x,) or (x, mask); a single list argument is "
            "written ([a, b],)"
        )
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    return args, dict(example_kwargs or {})
