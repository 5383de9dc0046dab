"""KV anti-quantisation of the inference operators (docs/operators/fused_infer_attention_score.md, "KV antiquant").

int8 key/value are turned back into the query's float dtype before attention: x = (x_int8 + offset) * scale, taken
in fp32 and rounded once to the query dtype (the formula of torch_npu's npu_anti_quant; FIA's documentation calls
this "KV由int8反量化为float16"). Scales and offsets come either combined (`antiquant_scale` / `antiquant_offset`,
index 0 for the key and 1 for the value) or separate (`key_antiquant_*`, `value_antiquant_*`), in one of the modes:

0 per-channel (one value per KV head and channel) or per-tensor (one value);
1 per-token (one value per batch and key position);
2 per-tensor + per-head (one value per KV head);
3 per-token + per-head (one value per batch, KV head and key position);
4 per-token managed by PageAttention: FIA v2 only, `dequantise_paged_tokens` below (scales [blocknum, blocksize]);
5 per-token + per-head managed by PageAttention: not supported yet.

Every factor is returned as an fp32 tensor that broadcasts against the [B, N2, S, D] view of the key. With Q_S = 1 the
separate per-channel factors may also carry a leading 1: (1, KV_N, 1, D), (1, KV_N, D), (1, H) (the Q_S = 1 table
of the FIA pages).

int4 key/value arrive packed in int32 (npu_fused_infer_attention_score(_v2): "8个int4打包存储于一个int32中", the
key's last dim is D/8 or H/8): value j of each int32 sits in bits 4j..4j+3, two's complement in [-8, 7] (op-plugin's
npu_convert_weight_to_int4pack packs it so). `unpack_int4` turns them into int8; the rule above then applies.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

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


# ---- FIA v2 quantised calls (docs/operators/fused_infer_attention_score.md, "Quantised queries and fp8 caches")
#
# Both are computed by dequantising first: every quantised operand becomes (x * scale) in fp32, rounded once to the
# compute dtype (the rope dtype for the int8 MLA query, the query dtype for fp8/int8 caches), and the call then runs
# as the same float call. Scales the pages pin: the int8 query per token and head (query_quant_mode 3, float32,
# the query's shape without D), the int8 latent per tensor (key/value_quant_mode 0, float32, one value); the caches
# per token managed by PageAttention (key/value_quant_mode 4, float32 [blocknum, blocksize]). The int8 MLA score
# is dequant_scale_query * dequant_scale_key * (q8 . k8 + q_rope . k_rope): the kernel accumulates the rope product
# into the int8 one before it dequantises (IncreFlashAttention's MLA full-quant kernel, MM1_RES_ADD), which is why
# MlaProlog's int8 query comes with query_rope * quant_scale_ckv / dequant_scale_q_nope; the query rope is
# dequantised with the query's scale times the key's here.

QUERY_QUANT_MODES = (3,)
PAGED_TOKEN_MODE = 4
MLA_LATENT = 512
NZ_RANK = 5  # [blockNum, N, D/c0, blockSize, c0]
FP8_KV_CALLER = "cann-recipes-infer models/qwen3_moe/models/modeling_qwen3_moe.py:810-822"


@dataclass(frozen=True)
class Dequantised:
    """The float32 operands that replace an int8 MLA call's query / key / value / rope parts, and the dtype its
    output is rounded to (the rope dtype). With `latent` (paged caches), key, value and key_rope are its pool views,
    unfilled until `latent.convert()`."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_rope: torch.Tensor
    key_rope: torch.Tensor
    out_dtype: torch.dtype
    latent: PagedLatent | None = None


def _require_float32(t, param: str, shape: tuple[int, ...] | None, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ParamInvalidError(f"{param}: expected a float32 tensor ({what}), got {describe(t)}")
    if t.dtype != torch.float32:
        raise ParamInvalidError(f"{param}: expected dtype float32 ({what}), got {describe(t)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ParamInvalidError(f"{param}: expected shape {list(shape)} ({what}), got {describe(t)}")
    return t


def _per_tensor(t, param: str) -> torch.Tensor:
    _require_float32(t, param, None, "one per-tensor value")
    if t.numel() != 1 or t.dim() > 1:
        raise ParamInvalidError(f"{param}: expected one per-tensor value, shape [1] or [], got {describe(t)}")
    return t.reshape(())


def query_scale_shape(query: torch.Tensor, input_layout: str, num_heads: int) -> tuple[int, ...]:
    """Per token and head: the query's shape without D ([B, S, N] for BSH)."""
    if input_layout.split("_")[0] == "BSH" and query.dim() == 3:
        return (query.shape[0], query.shape[1], num_heads)
    return tuple(query.shape[:-1])


def dequantise_mla_query(query, key, value, *, query_rope, key_rope, dequant_scale_query, dequant_scale_key,
                         dequant_scale_value, key_quant_mode, value_quant_mode, input_layout: str,
                         num_heads: int, block_table=None) -> Dequantised:
    """The int8 MLA call: int8 query [.., 512] (query_quant_mode 3) and the int8 latent cache (ND, or NZ
    [blockNum, N, D/32, blockSize, 32]) with per-tensor key/value scales (modes 0); the query rope carries the
    same dequantisation as the query . key product (dequant_scale_query * dequant_scale_key), the key rope none; all
    scales float32. The operands become float32 (x * scale, one fp32 rounding: the int8 products the NPU
    accumulates exactly, scaled once); an NZ cache becomes the ND cache [blockNum, blockSize, N * D] of the same
    tokens (float32 has no NZ form). A paged cache (`block_table`) is converted only in the blocks the table
    names (`_paged_latent`), and only once the returned `latent` is converted (a decode loop can read the int8
    pages in place instead)."""
    if query_rope is None or key_rope is None:
        raise ParamInvalidError("query_rope: an int8 query (full quantisation) is documented for MLA only (query_rope "
                                "and key_rope with D = 512), got None")
    packs_heads = input_layout.split("_")[0] == "BSH"
    if packs_heads and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0):
        raise ParamInvalidError(f"num_query_heads: expected a positive int, got {num_heads!r}")
    if query.shape[-1] != MLA_LATENT * (num_heads if packs_heads else 1):
        raise ParamInvalidError(f"query: an int8 query (full quantisation) needs D = {MLA_LATENT} (MLA), "
                                f"got {describe(query)}")
    for name, t in (("query_rope", query_rope), ("key_rope", key_rope)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float16, torch.bfloat16):
            raise ParamInvalidError(f"{name}: expected float16 or bfloat16 with an int8 query, got {describe(t)}")
    if key_rope.dtype != query_rope.dtype:
        raise ParamInvalidError(f"key_rope: expected query_rope's dtype {query_rope.dtype}, got {describe(key_rope)}")
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int8:
            raise ParamInvalidError(f"{name}: expected int8 with an int8 query, got {describe(t)}")
    # NZ is read as ND below: key, value and key_rope must agree on it first ("key_rope的数据格式与key一致").
    for name, t in (("value", value), ("key_rope", key_rope)):
        if (t.dim() == NZ_RANK) != (key.dim() == NZ_RANK):
            raise ParamInvalidError(f"{name}: expected the key's format ({'NZ' if key.dim() == NZ_RANK else 'ND'}, "
                                    f"{describe(key)}), got {describe(t)}")
    for name, mode in (("key_quant_mode", key_quant_mode), ("value_quant_mode", value_quant_mode)):
        if isinstance(mode, bool) or mode != 0:
            raise ParamInvalidError(f"{name}: an int8 query takes 0 (per-tensor latent scale), got {mode!r}")
    q_scale = _require_float32(dequant_scale_query, "dequant_scale_query",
                               query_scale_shape(query, input_layout, num_heads), "per token and head")
    k_scale = _per_tensor(dequant_scale_key, "dequant_scale_key")
    v_scale = _per_tensor(dequant_scale_value, "dequant_scale_value")
    f32 = torch.float32
    q = dequant.dequantize_values(query.reshape(*q_scale.shape, -1), q_scale.unsqueeze(-1), f32)
    rope_scale = (q_scale * k_scale).unsqueeze(-1)  # fp32, as the kernel scales the summed scores
    q_rope = dequant.dequantize_values(query_rope.reshape(*q_scale.shape, -1), rope_scale, f32).reshape(
        query_rope.shape)
    same = _same_values(key, value) and (dequant_scale_value is dequant_scale_key or torch.equal(k_scale, v_scale))
    paged = _paged_latent(key, value, key_rope, k_scale, v_scale, block_table, same)
    if paged is not None:
        (k, v, r), latent = paged
        latent = replace(latent, query=Int8Query(query, query_rope, q_scale))
        return Dequantised(q.reshape(query.shape), k, v, q_rope, r, query_rope.dtype, latent)
    k = dequant.dequantize_values(_nd_cache(key), k_scale, f32)
    v = k if same else dequant.dequantize_values(_nd_cache(value), v_scale, f32)
    r = _nd_cache(key_rope).to(f32)
    return Dequantised(q.reshape(query.shape), k, v, q_rope, r, query_rope.dtype,
                       _token_latent(key, value, key_rope, k_scale, v_scale, Int8Query(query, query_rope, q_scale)))


def _token_latent(key, value, key_rope, k_scale, v_scale, query: Int8Query) -> PagedLatent | None:
    """A contiguous single-head ND latent as a PagedLatent of one token per block (key / value / rope rows [tokens,
    1, D], no table: a decode loop reads them through a table of token rows) whose float32 caches are already
    filled; None where the caches are not of that form."""
    if key.dim() == NZ_RANK or key.shape[-1] != MLA_LATENT or value.shape != key.shape:
        return None
    rows = [t.reshape(-1, 1, t.shape[-1]) for t in (key, value, key_rope)]
    if rows[2].shape[0] != rows[0].shape[0]:
        return None
    return PagedLatent(*rows, k_scale, v_scale, None, None, None, query)


# A fresh multi-megabyte tensor comes from mmap and is faulted in page by page on every call (a 47 MB float32
# latent pool measured 19 ms fresh against 3.6 ms reused, one thread): each thread keeps its float32 pools for the
# next call, up to this many bytes each (larger ones are allocated per call).
REUSED_POOL_BYTES = 512 << 20
_reused_pools = threading.local()


def _pool_buffer(name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An uninitialised float32 tensor of `shape`: a view of this thread's buffer `name` where it fits
    REUSED_POOL_BYTES (valid until the thread's next int8 MLA call)."""
    numel = 1
    for n in shape:
        numel *= n
    if numel * 4 > REUSED_POOL_BYTES:
        return torch.empty(shape, dtype=torch.float32, device=device)
    buffers = _reused_pools.__dict__
    buffer = buffers.get(name)
    if buffer is None or buffer.numel() < numel or buffer.device != device:
        buffer = buffers[name] = torch.empty(max(numel, 1), dtype=torch.float32, device=device)
    return buffer[:numel].view(shape)


def _same_values(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether value reads the very elements of key (the same tensor, or a view of the same memory)."""
    return value is key or (value.shape == key.shape and value.stride() == key.stride()
                            and value.data_ptr() == key.data_ptr())


def _latent_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """A single-head MLA cache as token rows (a view, no copy): ND [blockNum, blockSize, D] or [blockNum, 1,
    blockSize, D] as [blockNum, blockSize, D]; NZ [blockNum, 1, D/c0, blockSize, c0] as [blockNum, blockSize,
    D/c0, c0]. None for anything else."""
    if cache.dim() == NZ_RANK and cache.shape[1] == 1:
        return cache[:, 0].permute(0, 2, 1, 3)
    if cache.dim() == 4 and cache.shape[1] == 1:
        return cache[:, 0]
    return cache if cache.dim() == 3 else None


def _row_width(rows: torch.Tensor) -> int:
    return rows.shape[2] * rows.shape[3] if rows.dim() == 4 else rows.shape[2]


def _rows_into(dst: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Copy token rows (`_latent_rows`) into the [blocks, blockSize, D] destination `dst`; returns `dst`."""
    (dst.unflatten(-1, rows.shape[2:]) if rows.dim() == 4 else dst).copy_(rows)
    return dst


# Blocks are converted a few at a time, so that the fp32 multiply finds the converted values still in cache
# (pieces of about 2 MiB of fp32 took ~10% less time than whole runs, one thread).
CONVERT_BYTES = 2 << 20


def _block_runs(block_table: torch.Tensor, block_num: int, most: int) -> list[tuple[int, int]]:
    """The ranges [start, stop) of consecutive block ids that `block_table` names within [0, block_num), at most
    `most` blocks each."""
    named = block_table[(block_table >= 0) & (block_table < block_num)]
    ids = torch.unique(named.to(torch.int64)).tolist()
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i and i - runs[-1][0] < most:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


@dataclass(frozen=True)
class Int8Query:
    """An int8 MLA query as given: latent int8 [.., 512], rope (query_rope, float, unscaled) and scale
    (dequant_scale_query, the query's shape without D: [B, S, N] for BSH)."""

    latent: torch.Tensor
    rope: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class Int8QueryRows:
    """An int8 MLA query's rows as a decode loop scores them: latent [B, N, 1, 512] int8, rope [B, N, 1, Dr] (float,
    unscaled) and factor [B, N, 1, 1] float32 = (softmax_scale * dequant_scale_query) * dequant_scale_key, in that
    order. A score is then ((float)(q8 . k8) + q_rope . k_rope) * factor: the int8 part an exact integer sum
    (docs/operators/fused_infer_attention_score.md, "int8 MLA query")."""

    latent: torch.Tensor
    rope: torch.Tensor
    factor: torch.Tensor

    def loop_rows(self, pairs: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Contiguous (latent [pairs, G, 512] int8, rope [pairs, G, Dr] float32, factor [pairs, G] float32, bias
        [pairs, G] int32: 128 * each latent row's sum, which the integer dot product's unsigned form takes off)."""
        latent = self.latent.reshape(pairs, group, -1).contiguous()
        rope = self.rope.reshape(pairs, group, -1).to(torch.float32).contiguous()
        factor = self.factor.reshape(pairs, group).contiguous()
        return latent, rope, factor, (latent.sum(-1, dtype=torch.int32) * 128).contiguous()


@dataclass(frozen=True)
class PagedLatent:
    """A paged int8 MLA call's caches as given (the int8 latent key / value, ND or NZ, with their per-tensor scales,
    and the unscaled rope cache) beside the float32 pool views `dequantise_mla_query` returned for them, which stay
    unfilled until `convert`: a loop that reads the int8 pages in place (x * scale in fp32 as it reads each row, the
    pool's very products; the rope rows as they are) needs no pool. Whoever reads the pool calls `convert` first."""

    key: torch.Tensor
    value: torch.Tensor
    key_rope: torch.Tensor
    key_scale: torch.Tensor  # [] float32
    value_scale: torch.Tensor
    block_table: torch.Tensor | None  # None: contiguous token rows (_token_latent), the float32 caches filled
    joined: torch.Tensor | None  # [blockNum, blockSize, D + Dr]: key ++ rope rows
    value_pool: torch.Tensor | None  # [blockNum, blockSize, D]; None: the value is the key's columns of `joined`
    query: Int8Query | None = None

    def query_rows(self, softmax_scale: float, rows: Callable[[torch.Tensor], torch.Tensor]) -> Int8QueryRows | None:
        """The int8 query's rows for a decode loop (None: no query kept), `rows` mapping a tensor of the query's
        layout to its [B, N, 1, D] rows."""
        q = self.query
        if q is None:
            return None
        scale = q.scale if q.scale.dim() == q.latent.dim() else q.scale.unsqueeze(-1)  # BSH: [B, S, N] is N x 1
        factor = rows(scale).mul(torch.tensor(softmax_scale, dtype=torch.float32)).mul(self.key_scale)
        return Int8QueryRows(rows(q.latent), rows(q.rope), factor)

    def convert(self) -> None:
        """Fill the pool: only the blocks some table entry names, x * scale in fp32; the others are never read
        (docs/semantics/paged-kv.md: the entries a sequence reads must name existing blocks)."""
        if self.block_table is None:
            return
        k_rows, v_rows, r_rows = _latent_rows(self.key), _latent_rows(self.value), _latent_rows(self.key_rope)
        joined, width = self.joined, _row_width(k_rows)
        most = max(1, CONVERT_BYTES // (joined[0].numel() * joined.element_size()))
        for start, stop in _block_runs(self.block_table, k_rows.shape[0], most):
            blocks = slice(start, stop)
            _rows_into(joined[blocks, :, :width], k_rows[blocks]).mul_(self.key_scale)
            _rows_into(joined[blocks, :, width:], r_rows[blocks])
            if self.value_pool is not None:
                _rows_into(self.value_pool[blocks], v_rows[blocks]).mul_(self.value_scale)

    def loop_caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """key, value and key_rope as a decode loop reads them in place: [blockNum, 1, blockSize, D], or an NZ
        cache [blockNum, 1, D/c0, blockSize, c0] as it is (views, no copy)."""
        return tuple(t.unsqueeze(1) if t.dim() == 3 else t for t in (self.key, self.value, self.key_rope))

    def channel_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-tensor key and value scales repeated over the latent's channels, [1, D] float32 each."""
        width = _row_width(_latent_rows(self.key))
        return tuple(s.reshape(1, 1).expand(1, width).contiguous() for s in (self.key_scale, self.value_scale))


def _paged_latent(key, value, key_rope, k_scale, v_scale, block_table, same: bool
                  ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], PagedLatent] | None:
    """(key, value, key_rope) of a paged single-head MLA call in float32, in the caches' own shapes (an NZ
    cache as ND [blockNum, blockSize, D]), unfilled until the returned latent's `convert`: key and key_rope are the
    two column ranges of one [blockNum, blockSize, D + Dr] buffer, so each key row is already key ++ rope for the
    loops that read the pages in place (ops/paged_infer.py), and value is key's view when it holds the same values.
    None, converting nothing, where the caches or the table are not of that form (the whole-cache conversion then
    applies, and validation reports what is wrong)."""
    if not (isinstance(block_table, torch.Tensor) and block_table.dtype == torch.int32 and block_table.dim() == 2
            and block_table.device == key.device and key.dim() == key_rope.dim() == value.dim()
            and value.shape == key.shape):
        return None
    k_rows, v_rows, r_rows = _latent_rows(key), _latent_rows(value), _latent_rows(key_rope)
    if k_rows is None or v_rows is None or r_rows is None or k_rows.shape[:2] != r_rows.shape[:2]:
        return None
    width = _row_width(k_rows)
    joined = _pool_buffer("key_rope", (*k_rows.shape[:2], width + _row_width(r_rows)), key.device)
    v_f32 = None if same else _pool_buffer("value", (*k_rows.shape[:2], width), key.device)
    latent = PagedLatent(key, value, key_rope, k_scale, v_scale, block_table, joined, v_f32)
    head_axis = key.dim() == 4  # [blockNum, 1, blockSize, D]: the head axis back
    parts = [joined[..., :width], joined if v_f32 is None else v_f32, joined[..., width:]]
    parts[1] = parts[1][..., :width]
    return tuple(p.unsqueeze(1) if head_axis else p for p in parts), latent


def _nd_cache(cache: torch.Tensor) -> torch.Tensor:
    """An NZ cache [blockNum, N, D/c0, blockSize, c0] as the ND cache [blockNum, blockSize, N * D]; others as
    they are."""
    if cache.dim() != NZ_RANK:
        return cache
    return cache.permute(0, 3, 1, 2, 4).flatten(2)


def dequantise_paged_tokens(key, value, *, query_dtype: torch.dtype, block_table, dequant_scale_key,
                            dequant_scale_value, dequant_offset_key, dequant_offset_value, key_quant_mode,
                            value_quant_mode) -> tuple[torch.Tensor, torch.Tensor]:
    """key/value_quant_mode 4: int8 or float8_e4m3fn paged caches ([blockNum, blockSize, H] or [blockNum, N,
    blockSize, D]) with one float32 scale per cached token, [blockNum, blockSize]; x * scale in fp32 rounded once
    to the query dtype. fp8 caches are beyond the pages' dtype list (qwen3_moe's call)."""
    if key_quant_mode != value_quant_mode:
        raise ParamInvalidError(f"key_quant_mode/value_quant_mode: mode 4 needs both 4, got {key_quant_mode} and "
                                f"{value_quant_mode}")
    if block_table is None:
        raise ParamInvalidError("key_quant_mode: 4 (per-token scales managed by PageAttention) needs block_table")
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int8, torch.float8_e4m3fn) or t.dim() not in (3, 4):
            raise ParamInvalidError(f"{name}: key_quant_mode 4 takes an int8 or float8_e4m3fn paged cache "
                                    f"[blockNum, blockSize, H] or [blockNum, N, blockSize, D], got {describe(t)}")
    if value.dtype != key.dtype:
        raise ParamInvalidError(f"value: expected the key's dtype {key.dtype}, got {describe(value)}")
    for name, t in (("dequant_offset_key", dequant_offset_key), ("dequant_offset_value", dequant_offset_value)):
        if t is not None:
            raise ParamInvalidError(f"{name}: key_quant_mode 4 takes scales only, got {describe(t)}")
    if key.dtype == torch.float8_e4m3fn:
        from .policy import beyond_docs

        beyond_docs("key", "a float8_e4m3fn KV cache with key_quant_mode 4", FP8_KV_CALLER)
    slots = key.shape[1] if key.dim() == 3 else key.shape[2]
    shape = (key.shape[0], slots)
    k_scale = _require_float32(dequant_scale_key, "dequant_scale_key", shape, "per token, [blockNum, blockSize]")
    v_scale = _require_float32(dequant_scale_value, "dequant_scale_value", shape, "per token, [blockNum, blockSize]")

    def per_slot(scale: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return scale.unsqueeze(-1) if cache.dim() == 3 else scale.reshape(shape[0], 1, slots, 1)

    return (dequant.dequantize_values(key, per_slot(k_scale, key), query_dtype),
            dequant.dequantize_values(value, per_slot(v_scale, value), query_dtype))
