"""How a failed step reaches the caller: the executor's error as one that is
also an instance of the exception a stage raised (`except KeyError` still
matches), a KeyboardInterrupt kept one, and the first line a peer is told."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from .. import _C
from .stages import Step

__all__: list[str] = []

PipelineError = _C.runtime.PipelineError


@contextlib.contextmanager
def original_errors(step: Step, note: str = "") -> Iterator[None]:
    """Re-raises the executor's PipelineError (with `note` appended) as one
    that is also an instance of the exception a stage callable raised (so
    `except KeyError` still matches), chained to it."""
    try:
        yield
    except PipelineError as err:
        failed = PipelineError(f"{err}{note}")
        if not step.errors:
            # Ctrl-C can land as a callable is entered, before its own
            # handler records it: the executor's message still names it.
            if _INTERRUPTED.search(str(err)):
                raise KeyboardInterrupt from failed
            raise failed from err
        cause = step.errors[0]
        if not isinstance(cause, Exception):
            # KeyboardInterrupt, SystemExit: `except Exception` must not
            # swallow Ctrl-C; it stays what it was.
            raise cause from failed
        raise as_type(failed, type(cause)) from cause


_INTERRUPTED = re.compile(r"\) failed: KeyboardInterrupt\b")


# A failed training step leaves what its finished microbatches accumulated.
GRADS_NOTE = (
    ". The gradients (.grad) now hold the part of this step that finished before the failure: "
    "zero them (optimizer.zero_grad()) before the next step"
)


def first_line(err: BaseException) -> str:
    """The error's message for a peer: its first line, without the note on
    gradients (each rank adds its own) or a traceback."""
    text = err.args[0] if err.args and isinstance(err.args[0], str) else str(err)
    text = text.split("\n", 1)[0].replace(GRADS_NOTE, "")
    if not isinstance(err, PipelineError):
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text


def as_type(err: Exception, kind: type[BaseException]) -> Exception:
    if not issubclass(kind, Exception) or issubclass(PipelineError, kind):
        return err
    name = f"PipelineError[{kind.__name__}]"
    combined = _COMBINED.get(kind)
    if combined is None:
        try:
            # The message as PipelineError shows it (KeyError's str is a repr).
            combined = type(
                name,
                (PipelineError, kind),
                {"__module__": "torchmpmd", "__str__": BaseException.__str__},
            )
        except TypeError:  # a builtin whose layout cannot be combined
            return err
        _COMBINED[kind] = combined
    out: Exception = combined(*err.args)
    return out


_COMBINED: dict[type[BaseException], type[Exception]] = {}
