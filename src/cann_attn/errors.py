"""Errors carrying Ascend aclnn status codes (docs/semantics/errors.md).

Every validation failure names the parameter (as spelled in the Python API), what was expected and what
was given, so a user can fix the call without reading the operator documentation.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = [
    "AclnnError",
    "ParamInvalidError",
    "ParamNullptrError",
    "caller_stacklevel",
    "describe",
    "keywords_checked",
    "require",
    "require_bool",
    "require_finite",
    "require_int",
    "require_real",
    "unknown_keyword",
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


# The same meaning under another name in a sibling operator or in torch_npu: the spelling a caller most likely meant
# (difflib finds the near misses; these are not near in letters).
_KEYWORD_SYNONYMS: dict[str, tuple[str, ...]] = {
    "scale": ("scale_value", "softmax_scale"),
    "scale_value": ("scale", "softmax_scale"),
    "softmax_scale": ("scale", "scale_value"),
    "num_heads": ("head_num", "num_query_heads"),
    "head_num": ("num_heads", "num_query_heads"),
    "num_query_heads": ("num_heads", "head_num"),
    "layout": ("input_layout", "layout_query"),
    "input_layout": ("layout", "layout_query"),
    "layout_query": ("layout", "input_layout"),
    "actual_seq_lengths": ("actual_seq_qlen", "actual_seq_lengths_query"),
    "actual_seq_qlen": ("actual_seq_lengths", "actual_seq_lengths_query"),
    "actual_seq_kvlen": ("actual_seq_lengths_kv", "actual_seq_klen", "actual_seq_lengths_key"),
    "actual_seq_lengths_kv": ("actual_seq_kvlen", "actual_seq_lengths_key", "actual_seq_klen"),
    "mask": ("atten_mask",),
    "attn_mask": ("atten_mask",),
    "softmax_lse_flag": ("return_softmax_lse",),
    "return_softmax_lse": ("softmax_lse_flag",),
}


def unknown_keyword(function: str, name: str, known: Collection[str], context: str = "") -> TypeError:
    """The TypeError of a call of `function` with keyword `name`, which is not among `known`, naming the keyword
    the caller most likely meant (a parameter of the same meaning elsewhere, else the closest spelling)."""
    meant = [s for s in _KEYWORD_SYNONYMS.get(name, ()) if s in known]
    meant = meant or difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {meant[0]}=?" if meant else ""
    where = f" ({context})" if context else ""
    return TypeError(f"{function}() got an unexpected keyword argument {name!r}{where}{hint}")


_F = TypeVar("_F", bound=Callable[..., Any])


def keywords_checked(function: _F) -> _F:
    """`function`, refusing a keyword it does not take with `unknown_keyword`'s suggestion (the public functions
    of cann_attn and cann_attn.torch_npu go through it). A function with **kwargs is returned as it is."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return function
    names = frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL)

    @functools.wraps(function)
    def call(*args, **kwargs):
        for key in kwargs:
            if key not in names:
                raise unknown_keyword(function.__name__, key, names)
        return function(*args, **kwargs)

    return call  # type: ignore[return-value]
