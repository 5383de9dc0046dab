"""int8 quantization rules of PromptFlashAttentionV2 (SEMANTICS.md section 7).

Rounding is round-half-to-even with int8 saturation; UINT64 dequantization scales (`trans_quant_param`) are
int64 tensors whose low 32 bits hold an fp32 with its 13 low mantissa bits cleared.
"""

from __future__ import annotations

import torch

from ..errors import ParamInvalidError, describe

INT8_MIN, INT8_MAX = -128, 127
_MANTISSA_KEEP = 0xFFFFE000
_UINT64_FLAG = 1 << 46


def round_to_int8(x: torch.Tensor) -> torch.Tensor:
    """sat_int8(round_half_even(x)) as int8 (torch.round rounds half to even)."""
    return torch.round(x).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


def round_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the nearest fp16, ties to even, in ONE rounding (a plain float64 -> float16 cast
    goes through fp32 and can round twice). Returns float16."""
    x = x.to(torch.float64)
    _, exponent = torch.frexp(x)  # |x| = m * 2**exponent with m in [0.5, 1)
    # fp16 has 10 fraction bits; below 2**-14 the spacing is fixed at 2**-24 (subnormals).
    spacing = torch.exp2((exponent - 1).clamp(min=-14).to(torch.float64) - 10)
    return (torch.round(x / spacing) * spacing).to(torch.float16)


def trans_quant_param(scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Encode fp32 scales as Ascend's UINT64 deq-scale words, returned as an int64 tensor of scale's shape.

    word = (fp32 bits of scale AND 0xFFFFE000) OR (1 << 46); with `offset`, its value rounded to an int9 is
    placed in bits 37..45 (the quantization offset field of the same word)."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(scale, dtype=torch.float32)
    if scale.dtype != torch.float32:
        raise ParamInvalidError(f"scale: expected a float32 tensor, got {describe(scale)}")
    bits = scale.contiguous().view(torch.int32).to(torch.int64) & _MANTISSA_KEEP
    words = bits | _UINT64_FLAG
    if offset is not None:
        if not isinstance(offset, torch.Tensor):
            offset = torch.tensor(offset, dtype=torch.float32)
        if offset.dtype != torch.float32:
            raise ParamInvalidError(f"offset: expected a float32 tensor, got {describe(offset)}")
        off = torch.round(offset).clamp_(-256, 255).to(torch.int64) & 0x1FF
        words, off = torch.broadcast_tensors(words, off)
        words = words | (off << 37)
    return words


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
