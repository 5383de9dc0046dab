"""Operators that torch.compile can trace (docs/design.md: kernels wrapped once as torch.library custom ops).

The eager operators validate their arguments with data-dependent Python (tensor values, `.tolist()`), which a
tracer cannot follow. While torch.compile (or torch.export) traces, `traced_as_custom_op` routes a call to the
operator's `torch.library` custom op in `cann_attn.library` instead: opaque to the tracer, with a fake twin for
shapes, and running this same eager operator when the compiled code executes. Outside tracing the eager operator
runs directly: no dispatch overhead, and its own errors for arguments a custom-op schema would refuse first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def traced_as_custom_op(op: F) -> F:
    """Decorate an eager operator whose custom-op wrapper in `cann_attn.library` has the same name and
    signature."""

    @functools.wraps(op)
    def dispatch(*args, **kwargs):
        if torch.compiler.is_compiling():
            from . import library  # imported late: library wraps the operators defined with this decorator

            return getattr(library, op.__name__)(*args, **kwargs)
        return op(*args, **kwargs)

    return dispatch  # type: ignore[return-value]
