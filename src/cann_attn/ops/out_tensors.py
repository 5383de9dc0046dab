"""The rule for tensors an operator writes into (ATB's `out`, FusedInferAttentionScore's ``.out`` overloads): the
expected shape, dtype and device, distinct memory for every element (no stride-0 / expanded view), and no memory
shared with another output or with any input. Checked before anything is written, so a refused call leaves every
tensor as it was (docs/semantics/errors.md, "Output tensors").

Two tensors share memory when they live in one storage and the byte ranges they span intersect; an interleaved
pair of views that spans one range without touching the same bytes is refused too (such layouts are not how any
caller passes outputs, and the NPU kernels write whole rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..errors import ParamInvalidError, ParamNullptrError, require

__all__ = ["check_out_tensor", "tensors_in"]


def _byte_span(t: Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses a non-empty tensor's elements cover (negative strides included)."""
    itemsize = t.element_size()
    low = high = t.data_ptr()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        step = (size - 1) * stride * itemsize
        if step < 0:
            low += step
        else:
            high += step
    return low, high + itemsize


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_low, a_high = _byte_span(a)
    b_low, b_high = _byte_span(b)
    return a_low < b_high and b_low < a_high


def _has_stride_zero(t: Tensor) -> bool:
    """Two elements at one address: a zero stride over a dimension of size > 1, or an overlap torch detects."""
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True)):
        return True
    return t.device.type != "meta" and torch._debug_has_internal_overlap(t) == 1


def tensors_in(named: Mapping[str, Any]) -> Iterable[tuple[str, Tensor]]:
    """The tensors among named arguments, lists of tensors (TensorList inputs) as NAME[i]."""
    for name, value in named.items():
        if isinstance(value, Tensor):
            yield name, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, Tensor):
                    yield f"{name}[{i}]", item


def check_out_tensor(out: Any, param: str, *, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                     inputs: Mapping[str, Any] | None = None, outputs: Mapping[str, Tensor] | None = None) -> Tensor:
    """`out` as output `param`: a tensor of `shape`, `dtype` and `device` whose elements have distinct addresses
    and whose memory no tensor of `inputs` (named arguments; lists as NAME[i]) or `outputs` (the other outputs
    already checked) touches. ParamNullptrError for None, else ParamInvalidError naming `param` (and the tensor it
    shares memory with)."""
    if out is None:
        raise ParamNullptrError(f"{param}: required (the operator writes its result there), got None")
    require(isinstance(out, Tensor) and tuple(out.shape) == tuple(shape) and out.dtype == dtype
            and out.device == device, param, f"a {dtype} tensor of shape {list(shape)} on {device}", out)
    if _has_stride_zero(out):
        raise ParamInvalidError(f"{param}: expected a tensor whose elements are distinct memory, got an expanded or "
                                f"self-overlapping view (strides {list(out.stride())}); pass a contiguous tensor")
    for name, other in (*(outputs or {}).items(), *tensors_in(inputs or {})):
        if _shares_memory(out, other):
            raise ParamInvalidError(f"{param}: shares memory with {name}; an output must not overlap an input or "
                                    "another output (nothing was written)")
    return out
