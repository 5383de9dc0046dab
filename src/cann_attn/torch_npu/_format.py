"""torch_npu's storage-format calls: ``npu_format_cast``, ``npu_format_cast_``, ``get_npu_format`` and the
``Format`` enum (docs/guides/torch_npu.md, "Storage formats").

On an NPU a tensor carries a storage format beside its logical shape: ``npu_format_cast(x, 29)`` keeps x's shape,
dtype and values and changes only how the device lays the elements out (FRACTAL_NZ), which some kernels read
faster. Off the NPU there is one layout, so the cast keeps the logical tensor as it is and records the format,
which ``get_npu_format`` reads back; operators read the logical tensor, whatever format it records. The values and
their meaning follow torch_npu's format table (op-plugin docs, "(beta) torch_npu.npu_format_cast"); a tensor never
cast has its base format: NCHW for 4 dims, NCDHW for 5, ND otherwise (torch_npu's ``InferFormat::GuessBaseFormat``),
and FRACTAL_NZ asked of a tensor of fewer than 2 dims gives ND, as torch_npu's ``GuessStorageFormat`` does.
"""

from __future__ import annotations

import enum

from torch import Tensor

from ..errors import ParamInvalidError, describe, require
from ._registry import npu_op

_RECORD = "_cann_attn_npu_format"

# torch_npu's own schema (npu_native_functions.yaml, namespace npu); customize_dtype arrived with CANN 9.1.
NPU_FORMAT_CAST_SCHEMAS = {
    ("7.1", "7.2", "7.3", "26.0"): "npu_format_cast(Tensor self, int acl_format) -> Tensor",
    ("current",): "npu_format_cast(Tensor self, int acl_format, int? customize_dtype=None) -> Tensor",
}


class Format(enum.IntEnum):
    """torch_npu.Format: the ACL data formats by their integer values."""

    UNDEFINED = -1
    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    NC1HWC0_C04 = 12
    HWCN = 16
    NDHWC = 27
    FRACTAL_NZ = 29
    NCDHW = 30
    NDC1HWC0 = 32
    FRACTAL_Z_3D = 33
    NC = 35
    NCL = 47


# Listed but not a format a tensor can be cast to: unknown, and C04 ("当前版本不支持").
_NOT_TARGETS = (Format.UNDEFINED, Format.NC1HWC0_C04)


def _base_format(tensor: Tensor) -> Format:
    return {4: Format.NCHW, 5: Format.NCDHW}.get(tensor.dim(), Format.ND)


def get_npu_format(self: Tensor) -> int:
    """The storage format recorded on `self` by a cast, else its base format (NCHW 4-D, NCDHW 5-D, else ND)."""
    require(isinstance(self, Tensor), "self", "a torch.Tensor", self)
    return int(getattr(self, _RECORD, _base_format(self)))


def _target_format(value, param: str, tensor: Tensor) -> Format:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamInvalidError(f"{param}: expected an int or torch_npu.Format, got {describe(value)}")
    try:
        target = Format(value)
    except ValueError:
        raise ParamInvalidError(f"{param}: expected one of torch_npu.Format's values "
                                f"{[int(f) for f in Format if f not in _NOT_TARGETS]}, got {value}") from None
    if target in _NOT_TARGETS:
        raise ParamInvalidError(f"{param}: {target.name} is not a format a tensor can be cast to")
    if target == Format.FRACTAL_NZ and tensor.dim() < 2:
        return Format.ND
    return target


def _check_customize_dtype(customize_dtype) -> None:
    if customize_dtype is not None and (isinstance(customize_dtype, bool) or not isinstance(customize_dtype, int)):
        raise ParamInvalidError(f"customize_dtype: expected None or an int (a ScalarType number), got "
                                f"{describe(customize_dtype)}")


@npu_op(NPU_FORMAT_CAST_SCHEMAS)
def npu_format_cast(self: Tensor, acl_format: int, customize_dtype: int | None = None) -> Tensor:
    """A new tensor with `self`'s shape, dtype and values in the storage format `acl_format` (an int or
    :class:`Format`); `self` itself when it already has that format. `customize_dtype` (the NZ chunk's dtype on
    the NPU) changes no value here."""
    require(isinstance(self, Tensor), "self", "a torch.Tensor", self)
    target = _target_format(acl_format, "acl_format", self)
    _check_customize_dtype(customize_dtype)
    if get_npu_format(self) == target:
        return self
    out = self.clone()
    setattr(out, _RECORD, target)
    return out


def npu_format_cast_(self: Tensor, src: int | Tensor, customize_dtype: int | None = None) -> Tensor:
    """`self`, its storage format set to `src`: an int or :class:`Format`, or a tensor whose format to take."""
    require(isinstance(self, Tensor), "self", "a torch.Tensor", self)
    target = get_npu_format(src) if isinstance(src, Tensor) else _target_format(src, "src", self)
    _check_customize_dtype(customize_dtype)
    setattr(self, _RECORD, Format(target))
    return self
