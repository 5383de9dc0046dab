"""int8 quantization rules of PromptFlashAttentionV2 (docs/operators/prompt_flash_attention.md).

Rounding is round-half-to-even with int8 saturation; UINT64 dequantization scales (`trans_quant_param`) are
int64 tensors whose low 32 bits hold an fp32 with its 13 low mantissa bits cleared.
"""

from __future__ import annotations

import torch

from ..errors import ParamInvalidError, describe, require_int

INT8_MIN, INT8_MAX = -128, 127
_MANTISSA_KEEP = 0xFFFFE000
_UINT64_FLAG = 1 << 46
# trans_quant_param's round_mode: 0 truncates the scale to its high 19 bits, 1 rounds it (R_INT).
ROUND_MODES = (0, 1)


def round_to_int8(x: torch.Tensor) -> torch.Tensor:
    """sat_int8(round_half_even(x)) as int8 (torch.round rounds half to even)."""
    return torch.round(x).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


def trans_quant_param(scale: torch.Tensor, offset: torch.Tensor | None = None, round_mode: int = 0) -> torch.Tensor:
    """Encode fp32 scales as Ascend's UINT64 deq-scale words, returned as an int64 tensor of scale's shape.

    word = (the scale's high 19 bits: sign, exponent, 10 mantissa bits, in place) OR (1 << 46); with `offset`, its
    value rounded to an int9 is placed in bits 37..45 (the quantization offset field of the same word).
    round_mode 0 (default) truncates the 13 low mantissa bits (fp32 bits AND 0xFFFFE000,
    docs/operators/prompt_flash_attention.md); round_mode 1 ("R_INT", TransQuantParamV2 / torch_npu's
    npu_trans_quant_param) rounds them instead: `_fp19_rounded`."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(scale, dtype=torch.float32)
    if scale.dtype != torch.float32:
        raise ParamInvalidError(f"scale: expected a float32 tensor, got {describe(scale)}")
    if require_int(round_mode, "round_mode") not in ROUND_MODES:
        raise ParamInvalidError(f"round_mode: expected 0 (truncate) or 1 (round), got {round_mode!r}")
    bits = scale.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = (bits & _MANTISSA_KEEP if round_mode == 0 else _fp19_rounded(bits)) | _UINT64_FLAG
    if offset is not None:
        if not isinstance(offset, torch.Tensor):
            offset = torch.tensor(offset, dtype=torch.float32)
        if offset.dtype != torch.float32:
            raise ParamInvalidError(f"offset: expected a float32 tensor, got {describe(offset)}")
        off = torch.round(offset).clamp_(-256, 255).to(torch.int64) & 0x1FF
        words, off = torch.broadcast_tensors(words, off)
        words = words | (off << 37)
    return words


def _fp19_rounded(bits: torch.Tensor) -> torch.Tensor:
    """round_mode 1: fp32 bit patterns (int64 in [0, 2**32)) rounded to their high 19 bits, in place (bits 13..31).

    Rounding is to nearest, ties to even, on the 10 kept mantissa bits. The ops-nn TransQuantParamV2 kernel also
    sends zeros and subnormals (exponent 0) to a signed zero, keeps inf/NaN (exponent 255) truncated, and lets a
    rounding carry run into the exponent (the largest finite values round up to inf)."""
    sign = bits & 0x80000000
    exponent = (bits >> 23) & 0xFF
    kept = (bits & 0x7FFFFFFF) >> 13  # exponent and 10 mantissa bits: one field, so a carry bumps the exponent
    dropped = bits & 0x1FFF
    halfway = 0x1000
    up = (dropped > halfway) | ((dropped == halfway) & (kept & 1 == 1))
    rounded = sign | ((kept + up.to(torch.int64)) << 13)
    return torch.where(exponent == 0, sign, torch.where(exponent == 0xFF, bits & _MANTISSA_KEEP, rounded))


def decode_deq_scale(scale: torch.Tensor, param: str) -> float:
    """A per-tensor deq scale as a Python float: FLOAT32 exactly as given, UINT64 words (int64 tensors) by their
    low 32 bits read as fp32."""
    if scale.numel() != 1:
        raise ParamInvalidError(f"{param}: expected a per-tensor scale (one element), got {describe(scale)}")
    if scale.dtype == torch.float32:
        return float(scale.reshape(()).item())
    if scale.dtype in (torch.int64, torch.uint64):
        low = int(scale.reshape(()).item()) & 0xFFFFFFFF
        return float(torch.tensor([low], dtype=torch.int64).to(torch.int32).view(torch.float32).item())
    raise ParamInvalidError(
        f"{param}: expected float32 or a UINT64 word (int64 tensor from trans_quant_param), got {describe(scale)}"
    )


def per_tensor_float(scale: torch.Tensor, param: str) -> float:
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ParamInvalidError(f"{param}: expected a float32 per-tensor scale (one element), got {describe(scale)}")
    return float(scale.reshape(()).item())


def output_channel_scale(
    scale: torch.Tensor, param: str, out_layout: str, heads: int, head_dim: int, allowed: tuple[torch.dtype, ...]
) -> torch.Tensor:
    """quant_scale2 / quant_offset2 as an fp32 tensor broadcastable to [B, N, S, D]: per-tensor (one element)
    or per-channel in the documented shapes of the output layout."""
    if scale.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ParamInvalidError(f"{param}: expected dtype in ({names}), got {describe(scale)}")
    values = scale.to(torch.float32)
    if scale.numel() == 1:
        return values.reshape(1, 1, 1, 1)
    shape = tuple(scale.shape)
    hidden = heads * head_dim
    if out_layout == "BSH":
        ok = shape in ((hidden,), (1, 1, hidden))
    elif out_layout == "BNSD":
        ok = shape in ((heads, head_dim), (1, heads, 1, head_dim))
    else:  # BSND, and BNSD_BSND whose output is BSND
        ok = shape in ((heads, head_dim), (1, 1, heads, head_dim))
    if not ok:
        raise ParamInvalidError(
            f"{param}: expected one element or the per-channel shape of output layout {out_layout} "
            f"(N={heads}, D={head_dim}), got {describe(scale)}"
        )
    return values.reshape(1, heads, 1, head_dim)
