"""KV anti-quantisation of the inference operators (docs/operators/fused_infer_attention_score.md, "KV antiquant").

int8 key/value are turned back into the query's float dtype before attention: x = (x_int8 + offset) * scale, taken
in fp32 and rounded once to the query dtype (the formula of torch_npu's npu_anti_quant; FIA's documentation calls
this "KV由int8反量化为float16"). Scales and offsets come either combined (`antiquant_scale` / `antiquant_offset`,
index 0 for the key and 1 for the value) or separate (`key_antiquant_*`, `value_antiquant_*`), in one of the modes:

0 per-channel (one value per KV head and channel) or per-tensor (one value);
1 per-token (one value per batch and key position);
2 per-tensor + per-head (one value per KV head);
3 per-token + per-head (one value per batch, KV head and key position);
4, 5 per-token (+ per-head) managed by PageAttention: not supported yet (PageAttention is not).

Every factor is returned as an fp32 tensor that broadcasts against the [B, N2, S, D] view of the key. With Q_S = 1 the
separate per-channel factors may also carry a leading 1: (1, KV_N, 1, D), (1, KV_N, D), (1, H) (the Q_S = 1 table
of the FIA pages).

int4 key/value arrive packed in int32 (npu_fused_infer_attention_score(_v2): "8个int4打包存储于一个int32中", the
key's last dim is D/8 or H/8): value j of each int32 sits in bits 4j..4j+3, two's complement in [-8, 7] (op-plugin's
npu_convert_weight_to_int4pack packs it so). `unpack_int4` turns them into int8; the rule above then applies.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..errors import ParamInvalidError, describe
from . import dequant

PAGED_MODES = (4, 5)
MODES = (0, 1, 2, 3, 4, 5)
PER_TOKEN_MODES = (1, 3)
INT4_PER_INT32 = 8


@dataclass(frozen=True)
class KvFactors:
    """scale and offset (None: symmetric) of one of key / value, broadcastable to [B, N2, S, D]."""

    scale: torch.Tensor
    offset: torch.Tensor | None
    mode: int


@dataclass(frozen=True)
class KvAntiquant:
    key: KvFactors
    value: KvFactors

    @property
    def per_token(self) -> bool:
        return self.key.mode in PER_TOKEN_MODES or self.value.mode in PER_TOKEN_MODES

    @property
    def has_offset(self) -> bool:
        return self.key.offset is not None or self.value.offset is not None

    def channel_scales(self, heads_kv: int, dim_k: int, dim_v: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Key and value scales as [N2, D] fp32 when they depend on neither batch nor token and no offset is given
        (per-channel, per-tensor, per-head): what a loop that anti-quantises rows as it reads them needs."""
        if self.per_token or self.has_offset:
            return None
        return tuple(f.scale.expand(1, heads_kv, 1, d).reshape(heads_kv, d).contiguous()
                     for f, d in ((self.key, dim_k), (self.value, dim_v)))

    def batches(self, rows: slice) -> KvAntiquant:
        """The factors of the sequences `rows` (per-batch factors sliced; shared ones as they are)."""
        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or t.shape[0] == 1 else t[rows]

        return KvAntiquant(*(KvFactors(part(f.scale), part(f.offset), f.mode) for f in (self.key, self.value)))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 values of int4 packed eight to an int32 (value j in bits 4j..4j+3, signed): the last dim grows 8x."""
    # Byte k of a little-endian int32 holds values 2k (low nibble) and 2k + 1 (high nibble); arithmetic shifts of
    # the bytes as int8 sign-extend each nibble.
    low_first = packed.contiguous().view(torch.int8)
    if sys.byteorder == "big":  # the bytes of each int32 in reverse order
        low_first = low_first.unflatten(-1, (-1, 4)).flip(-1).flatten(-2)
    low = torch.bitwise_left_shift(low_first, 4) >> 4
    high = low_first >> 4
    return torch.stack((low, high), -1).flatten(-2)


def dequantize(x: torch.Tensor, factors: KvFactors, dtype: torch.dtype) -> torch.Tensor:
    """(x + offset) * scale of an int8 [B, N2, S, D] view, in fp32, rounded once to `dtype` (a new tensor; the rule
    of problem/dequant.py `dequantize_values`)."""
    seq = x.shape[2]
    offset = None if factors.offset is None else _first_tokens(factors.offset, seq)
    return dequant.dequantize_values(x, _first_tokens(factors.scale, seq), dtype, offset)


def _first_tokens(t: torch.Tensor, seq: int) -> torch.Tensor:
    """Per-token factors may cover more positions than the key has: the first `seq` are used."""
    return t[:, :, :seq] if t.shape[2] > 1 else t


def _check_mode(mode, param: str, decode: bool) -> int:
    if isinstance(mode, bool) or not isinstance(mode, int) or mode not in MODES:
        raise ParamInvalidError(f"{param}: expected 0..5, got {mode!r}")
    if mode in PAGED_MODES:
        raise ParamInvalidError(
            f"{param}: mode {mode} (per-token scales managed by PageAttention) is not supported yet"
        )
    if not decode and mode not in (0, 1):
        raise ParamInvalidError(f"{param}: Q_S > 1 supports modes 0 and 1 only, got {mode}")
    return mode


def _factor(t: torch.Tensor, param: str, mode: int, dims: tuple[int, int, int, int],
            allowed: tuple[torch.dtype, ...], leading_one: bool = False) -> torch.Tensor:
    """One key or value factor in mode `mode` as fp32, shaped to broadcast to [B, N2, S, D] = `dims`."""
    batch, heads_kv, seq_kv, dim = dims
    if not isinstance(t, torch.Tensor):
        raise ParamInvalidError(f"{param}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ParamInvalidError(f"{param}: expected dtype in ({names}) for mode {mode}, got {describe(t)}")
    shape = tuple(t.shape)
    values = t.to(torch.float32)
    if mode == 0:
        if t.numel() == 1 and t.dim() == 1:
            return values.reshape(1, 1, 1, 1)
        channel_shapes = ((heads_kv, 1, dim), (heads_kv, dim), (heads_kv * dim,))
        if leading_one:
            channel_shapes += tuple((1, *c) for c in channel_shapes)
        if shape in channel_shapes:
            return values.reshape(1, heads_kv, 1, dim)
        expected = f"per-tensor [1] or per-channel {', '.join(str(list(c)) for c in channel_shapes)}"
    elif mode == 1:
        if len(shape) in (2, 3) and shape[-2] == batch and shape[-1] >= seq_kv and (len(shape) == 2 or shape[0] == 1):
            return values.reshape(batch, 1, shape[-1], 1)
        expected = f"per-token [1, B={batch}, >= KV_S={seq_kv}] or [B, >= KV_S]"
    elif mode == 2:
        if shape == (heads_kv,):
            return values.reshape(1, heads_kv, 1, 1)
        expected = f"per-head [KV_N={heads_kv}]"
    else:
        if len(shape) == 3 and shape[:2] == (batch, heads_kv) and shape[2] >= seq_kv:
            return values.reshape(batch, heads_kv, shape[2], 1)
        expected = f"per-token per-head [B={batch}, KV_N={heads_kv}, >= KV_S={seq_kv}]"
    raise ParamInvalidError(f"{param}: mode {mode} expects {expected}, got {describe(t)}")


def _pair(scale, offset, scale_name: str, offset_name: str, mode: int, dims, allowed,
          leading_one: bool = False) -> KvFactors:
    s = _factor(scale, scale_name, mode, dims, allowed, leading_one)
    o = None
    if offset is not None:
        if not isinstance(offset, torch.Tensor) or offset.shape != scale.shape or offset.dtype != scale.dtype:
            raise ParamInvalidError(
                f"{offset_name}: expected {scale_name}'s dtype and shape {describe(scale)}, got {describe(offset)}"
            )
        o = _factor(offset, offset_name, mode, dims, allowed, leading_one)
    return KvFactors(s, o, mode)


def combined(antiquant_scale, antiquant_offset, antiquant_mode, *, query_dtype: torch.dtype, decode: bool,
             dims: tuple[int, int, int, int]) -> KvAntiquant:
    """`antiquant_scale` / `antiquant_offset` with their leading axis of 2 (key, value). Mode 0 (per-channel or
    per-tensor, dtype of the query) and, for Q_S = 1 only, mode 1 (per-token, float32, [2, B, KV_S]); with Q_S > 1
    `antiquant_mode` has no effect and the factors must be per-channel or per-tensor."""
    if decode:
        if isinstance(antiquant_mode, bool) or antiquant_mode not in (0, 1):
            raise ParamInvalidError(
                f"antiquant_mode: expected 0 (per-channel) or 1 (per-token), got {antiquant_mode!r}"
            )
        mode = antiquant_mode
    else:
        mode = 0
    allowed = (torch.float32,) if mode == 1 else (query_dtype,)
    for name, t in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != 2):
            raise ParamInvalidError(f"{name}: expected a leading axis of 2 (key, value), got {describe(t)}")
    if antiquant_offset is not None and (antiquant_offset.shape != antiquant_scale.shape
                                         or antiquant_offset.dtype != antiquant_scale.dtype):
        raise ParamInvalidError(
            f"antiquant_offset: expected antiquant_scale's dtype and shape {describe(antiquant_scale)}, "
            f"got {describe(antiquant_offset)}"
        )

    def half(i: int) -> KvFactors:
        scale = antiquant_scale[i].reshape(1) if antiquant_scale.dim() == 1 else antiquant_scale[i]
        offset = None
        if antiquant_offset is not None:
            offset = antiquant_offset[i].reshape(1) if antiquant_offset.dim() == 1 else antiquant_offset[i]
        if mode == 1:
            scale = scale.unsqueeze(0)
            offset = None if offset is None else offset.unsqueeze(0)
        return _pair(scale, offset, "antiquant_scale", "antiquant_offset", mode, dims, allowed)

    return KvAntiquant(half(0), half(1))


def separate(key_scale, key_offset, value_scale, value_offset, key_mode, value_mode, *, query_dtype: torch.dtype,
             decode: bool, dims: tuple[int, int, int, int]) -> KvAntiquant:
    """`key_antiquant_*` / `value_antiquant_*` (errors name them so; FIA v2 renames its own spelling). Both scales
    or neither, both offsets or neither; the modes must agree except key 0 with value 1. Factors are float32 or
    the query's dtype."""
    ks, ko, vs, vo = "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset"
    km, vm = "key_antiquant_mode", "value_antiquant_mode"
    if (key_scale is None) != (value_scale is None):
        raise ParamInvalidError(f"{ks}/{vs}: must be given together, got only {ks if key_scale is not None else vs}")
    if (key_offset is None) != (value_offset is None):
        raise ParamInvalidError(f"{ko}/{vo}: must be given together, got only {ko if key_offset is not None else vo}")
    key_mode = _check_mode(key_mode, km, decode)
    value_mode = _check_mode(value_mode, vm, decode)
    if key_mode != value_mode and (key_mode, value_mode) != (0, 1):
        raise ParamInvalidError(
            f"{km}/{vm}: must be equal except key 0 with value 1, got {key_mode} and {value_mode}"
        )
    allowed = (query_dtype, torch.float32)
    return KvAntiquant(_pair(key_scale, key_offset, ks, ko, key_mode, dims, allowed, decode),
                       _pair(value_scale, value_offset, vs, vo, value_mode, dims, allowed, decode))
