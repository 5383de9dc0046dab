"""Errors carrying Ascend aclnn status codes (docs/semantics/errors.md).

Every validation failure names the parameter (as spelled in the Python API), what was expected and what
was given, so a user can fix the call without reading the operator documentation.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from typing import Any

import numpy as np
import torch

__all__ = [
    "AclnnError",
    "ParamInvalidError",
    "ParamNullptrError",
    "caller_stacklevel",
    "describe",
    "require",
    "require_bool",
    "require_finite",
    "require_int",
    "require_real",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames of these packages sit between a caller and cann_attn (autograd.Function.apply, torch.library custom ops,
# torch.compile): a warning skips them too, to land on the caller's own line.
_PASSED_THROUGH = (_PACKAGE_DIR, os.path.dirname(os.path.abspath(torch.__file__)))


class AclnnError(ValueError):
    """Base class of every documented operator error; `status_code` is the aclnn status."""

    status_code: int = 0

    def __init__(self, message: str) -> None:
        super().__init__(f"[{self.status_code}] {message}")
        self.message = message


class ParamNullptrError(AclnnError):
    """ACLNN_ERR_PARAM_NULLPTR: a required input is missing."""

    status_code = 161001


class ParamInvalidError(AclnnError):
    """ACLNN_ERR_PARAM_INVALID: dtype, shape, layout, mode, range or combination not supported."""

    status_code = 161002


def describe(value: Any) -> str:
    """Short human description of a given value for error messages (tensors by dtype and shape)."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"tensor(dtype={dtype}, shape={list(shape)})"
    return repr(value)


def require_int(value: Any, param: str) -> int:
    """`value` must be an integer, a Python int or a NumPy integer scalar (bool is rejected although it is an int
    subclass, and so are floats such as 8.0); returned as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ParamInvalidError(f"{param}: expected an int, got {value!r}")
    return int(value)


def require_real(value: Any, param: str) -> float:
    """`value` must be a real number, a Python int or float or a NumPy real scalar (bool is rejected); returned as
    a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParamInvalidError(f"{param}: expected a float, got {value!r}")
    return float(value)


def require_finite(value: Any, param: str) -> float:
    """`value` must be a finite real number (as `require_real`): a scale of NaN or +-inf can only produce NaN
    (docs/semantics/errors.md)."""
    number = require_real(value, param)
    if not math.isfinite(number):
        raise ParamInvalidError(f"{param}: expected a finite float, got {number!r}")
    return number


def require_bool(value: Any, param: str) -> bool:
    """`value` must be a flag, a Python bool or a NumPy bool scalar (not 0/1, None or a string such as "no", whose
    truth value would be taken silently); returned as a Python bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise ParamInvalidError(f"{param}: expected a bool, got {value!r}")
    return bool(value)


def require(condition: bool, param: str, expected: str, given: Any) -> None:
    """Raise ParamInvalidError naming `param` unless `condition` holds."""
    if not condition:
        raise ParamInvalidError(f"{param}: expected {expected}, got {describe(given)}")


def caller_stacklevel() -> int:
    """The `warnings.warn` stacklevel of the first frame outside cann_attn (and torch), for the function that calls
    this: the warning names the caller's line (and the default filter shows it once per such line)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PASSED_THROUGH):
        frame, level = frame.f_back, level + 1
    return level
