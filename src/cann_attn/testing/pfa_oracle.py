"""Independent oracle for PromptFlashAttentionV2, written from docs/semantics/ (layouts, masks,
invalid rows, pse) and docs/operators/prompt_flash_attention.md (int8) only.

Pure torch, nothing imported from the rest of cann_attn. Every score matrix is materialised per batch:
clarity over speed; meant for small shapes.

- Float inputs (fp16 / bf16 / fp32 / fp64): float64 computation, S = scale * Q K^T + pse_shift, masked entries
  excluded, softmax, P V. The golden is returned in float64 (compare after casting to the output dtype). With
  `quant_scale2` the float64 output is quantized: y = o * quant_scale2 + quant_offset2, round half to even,
  saturate to int8.
- int8 inputs: the documented int8 rule applied literally. s32 = Q K^T (exact, int64); s = fp16(s32 * deq1), the
product taken
  in float64 and rounded ONCE to fp16 (torch's float64 -> float16 cast rounds twice, via float32, so the oracle
  rounds by hand); then fp32 steps: s * scale (+ pse_shift), mask, m = row max, l = sum exp(s - m),
  p = exp(s - m), p_q = sat_int8(round_half_even(p * quant_scale1)), o = fp32(p_q V exact) * deq2 / l, and for
  int8 output y = sat_int8(round_half_even(o * quant_scale2 + quant_offset2)) in fp32.
- Rows beyond a batch's actual query length, rows with no visible key and batches with no key are 0 in every
  output dtype.

`pfa_oracle(..., return_prequant=True)` also returns the value just before the final int8 rounding (float64), so
tests can tell a genuine mismatch from a rounding tie. `assert_int8_matches` is that comparison.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

__all__ = [
    "INT_MAX",
    "assert_int8_matches",
    "decode_deq_scale",
    "output_dtype",
    "pfa_oracle",
    "round_half_even_to_fp16",
    "trans_quant_param_oracle",
    "visible_matrix",
]

INT_MAX = 2147483647
_FP16_MAX = 65504.0


# ---------------------------------------------------------------------------------------------------------
# Small exact helpers
# ---------------------------------------------------------------------------------------------------------
def round_half_even_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the nearest fp16 value (ties to even) with ONE rounding; returns float16.

    ulp(x) = 2^(e - 10) for |x| in [2^e, 2^(e+1)), e >= -14 (subnormals share the 2^-24 ulp); x / ulp is exact
    in float64, torch.round rounds half to even. Values beyond the fp16 range become +-inf (IEEE rounding:
    |x| >= 65520 -> inf)."""
    x = x.to(torch.float64)
    _, exponent = torch.frexp(x)  # x = m * 2^exponent, |m| in [0.5, 1)
    e = (exponent.to(torch.int64) - 1).clamp(min=-14)
    ulp = torch.pow(torch.full_like(x, 2.0), (e - 10).to(torch.float64))
    r = torch.round(x / ulp) * ulp
    r = torch.where(x == 0, x, r)
    r = torch.where(r.abs() > _FP16_MAX, torch.copysign(torch.full_like(r, math.inf), x), r)
    return r.to(torch.float16)  # exact: r is an fp16 value (or inf)


def _fp32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _fp32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def decode_deq_scale(scale: torch.Tensor) -> float:
    """A per-tensor deq scale: FLOAT32 used exactly; a UINT64 word (int64 / uint64 tensor) decodes as its low
    32 bits read as fp32."""
    if scale.dtype in (torch.int64, torch.uint64):
        word = int(scale.reshape(-1)[0].item())
        return _fp32_from_bits(word & 0xFFFFFFFF)
    return float(scale.reshape(-1)[0].to(torch.float32).item())


def _scale_high_19_bits(s: float, round_mode: int) -> int:
    """The fp32 scale's sign, exponent and 10 mantissa bits, in place (bits 13..31). round_mode 0 truncates.
    round_mode 1 (TransQuantParamV2 "R_INT") takes the nearest value with 11 significant bits, ties to even, worked
    out on the value (not the bits): zeros and subnormals give a signed zero, inf/NaN stay as truncated, and a
    value that rounds past the largest fp32 becomes inf."""
    bits = _fp32_bits(s)
    if round_mode == 0 or math.isinf(s) or math.isnan(s):
        return bits & 0xFFFFE000
    if (bits >> 23) & 0xFF == 0:
        return bits & 0x80000000
    _, exponent = math.frexp(s)  # |s| = m * 2**exponent, m in [0.5, 1)
    spacing = 2.0 ** (exponent - 11)
    rounded = round(s / spacing) * spacing  # exact quotient; Python's round() is half to even
    if abs(rounded) >= 2.0**128:
        rounded = math.copysign(math.inf, s)
    return _fp32_bits(rounded)


def trans_quant_param_oracle(scale, offset=None, round_mode: int = 0) -> torch.Tensor:
    """Ascend's UINT64 quant-parameter words, element by element with Python ints, as an int64 tensor.

    word = (the scale's high 19 bits, `_scale_high_19_bits`) | (1 << 46); with offset:
    o = clamp(round(offset), -256, 255) and word |= (o & 0x1FF) << 37. Offsets are rounded half to even (callers
    avoid exact .5 ties: the Ascend docs do not say which rounding). A 1-D scale and offset broadcast to the longer
    of the two."""
    scale_t = torch.as_tensor(scale, dtype=torch.float32)
    scales = [float(v) for v in scale_t.reshape(-1).tolist()]
    shape = list(scale_t.shape)
    offsets = None
    if offset is not None:
        offset_t = torch.as_tensor(offset, dtype=torch.float32)
        offsets = [float(v) for v in offset_t.reshape(-1).tolist()]
        if len(offsets) != len(scales):
            if len(scales) == 1:
                scales = scales * len(offsets)
                shape = list(offset_t.shape)
            elif len(offsets) == 1:
                offsets = offsets * len(scales)
            else:
                raise ValueError("scale and offset sizes do not broadcast")
    words = []
    for k, s in enumerate(scales):
        word = _scale_high_19_bits(s, round_mode) | (1 << 46)
        if offsets is not None:
            o = max(-256, min(255, round(offsets[k])))  # Python round: half to even
            word |= (o & 0x1FF) << 37
        words.append(word)
    return torch.tensor(words, dtype=torch.int64).reshape(shape)


def _lengths(value, batch: int, seq: int) -> list[int]:
    """PFA list rules: None -> S; one value -> every batch; >= B values -> the first B."""
    if value is None:
        return [seq] * batch
    vals = [int(v) for v in (value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else value)]
    if len(vals) == 1:
        return vals * batch
    if len(vals) >= batch:
        return vals[:batch]
    raise ValueError(f"actual length list of {len(vals)} values for B={batch}")


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // heads).permute(0, 2, 1, 3)
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    if layout in ("BNSD", "BNSD_BSND"):
        return t
    raise ValueError(f"layout {layout}")


def _from_bnsd(o: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = o.shape
    if layout == "BSH":
        return o.permute(0, 2, 1, 3).reshape(b, s, n * d)
    if layout in ("BSND", "BNSD_BSND"):
        return o.permute(0, 2, 1, 3).contiguous()
    return o.contiguous()


def output_dtype(query_dtype: torch.dtype, quant_scale2) -> torch.dtype:
    """int8 if quant_scale2 is given, else fp16 for int8 inputs, else the query dtype."""
    if quant_scale2 is not None:
        return torch.int8
    if query_dtype == torch.int8:
        return torch.float16
    return query_dtype


def _user_mask(atten_mask: torch.Tensor, b: int) -> torch.Tensor:
    """[Nm, Q_S, KV_S] bool (True = masked) for batch b from any documented mask shape (Nm = 1 or N)."""
    m = atten_mask
    if m.dim() == 2:
        m = m.unsqueeze(0)
    elif m.dim() == 3:
        m = m[b if m.shape[0] > 1 else 0].unsqueeze(0)
    elif m.dim() == 4:
        m = m[b if m.shape[0] > 1 else 0]
    else:
        raise ValueError(f"atten_mask rank {m.dim()}")
    return m != 0


def visible_matrix(sparse_mode: int, sq: int, skv: int, pre: int, nxt: int, user: torch.Tensor | None):
    """[Nm, sq, skv] bool: True where query row i may see key column j (docs/semantics/masks.md, PFA)."""
    i = torch.arange(sq, dtype=torch.int64).view(-1, 1)
    j = torch.arange(skv, dtype=torch.int64).view(1, -1)
    delta = skv - sq
    if sparse_mode == 0:
        if user is None:
            return torch.ones(1, sq, skv, dtype=torch.bool)
        band = (j >= i - pre) & (j <= i + nxt)
        return ~user[:, :sq, :skv] & band
    if sparse_mode == 1:
        return ~user[:, :sq, :skv]
    if sparse_mode == 2:
        vis = j <= i
    elif sparse_mode == 3:
        vis = j <= i + delta
    elif sparse_mode == 4:
        vis = (j <= i + delta + nxt) & (j >= i + delta - pre)
    else:
        raise ValueError(f"sparse_mode {sparse_mode} is not a PFA mode")
    return vis.unsqueeze(0)


def _channel(t: torch.Tensor | None, heads: int, dim: int, default: float, dtype: torch.dtype) -> torch.Tensor:
    """quant_scale2 / quant_offset2 as [N, 1, D] (per-tensor or per-channel, any documented shape)."""
    if t is None:
        return torch.full((1, 1, 1), default, dtype=dtype)
    values = t.detach().to("cpu").to(torch.float32).to(dtype)  # bf16 -> fp32 is exact
    if values.numel() == 1:
        return values.reshape(1, 1, 1)
    return values.reshape(heads, 1, dim)  # [H], [1,1,H], [N,D], [1,N,1,D], [1,1,N,D] all hold N-major N*D


# ---------------------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------------------
def pfa_oracle(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    deq_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    deq_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    num_heads: int = 1,
    scale_value: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = 0,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    return_prequant: bool = False,
    naive_dtype: torch.dtype | None = None,
) -> Any:
    """Golden output of prompt_flash_attention for a VALID configuration (no validation here).

    Returns the output in the output layout: float64 for float outputs (cast it to the output dtype to compare),
    int8 for int8 outputs. With `return_prequant`, returns (output, prequant) where prequant is the float64 value
    just before the final int8 rounding (None for float outputs; 0 on zeroed rows).

    `naive_dtype` (float inputs only): compute the float path in that dtype instead of float64 (the "naive same
    dtype" run of the flash-attn precision rule); the result is still returned as float64."""
    query, key, value = (t.detach().to("cpu") for t in (query, key, value))
    heads = num_heads
    heads_kv = num_key_value_heads or num_heads
    group = heads // heads_kv
    kv_layout = "BNSD" if input_layout == "BNSD_BSND" else input_layout
    out_layout = "BSND" if input_layout == "BNSD_BSND" else input_layout
    q = _to_bnsd(query, input_layout, heads)
    k = _to_bnsd(key, kv_layout, heads_kv)
    v = _to_bnsd(value, kv_layout, heads_kv)
    batch, _, seq_q, dim = q.shape
    seq_kv = k.shape[2]
    int8_in = query.dtype == torch.int8
    int8_out = quant_scale2 is not None
    out = torch.zeros(batch, heads, seq_q, dim, dtype=torch.float64)
    pre_out = torch.zeros(batch, heads, seq_q, dim, dtype=torch.float64)
    if query.numel() == 0:
        return _finish(out, pre_out, out_layout, int8_out, return_prequant)
    act_q = _lengths(actual_seq_lengths, batch, seq_q)
    act_kv = _lengths(actual_seq_lengths_kv, batch, seq_kv)
    kv_index = torch.arange(heads) // group
    calc = torch.float32 if int8_in else torch.float64
    scale2 = _channel(quant_scale2, heads, dim, 1.0, calc)
    offset2 = _channel(quant_offset2, heads, dim, 0.0, calc)

    for b in range(batch):
        sq, skv = act_q[b], act_kv[b]
        if sq == 0 or skv == 0:
            continue
        user = None if atten_mask is None else _user_mask(atten_mask.detach().to("cpu"), b)
        vis = visible_matrix(sparse_mode, sq, skv, pre_tokens, next_tokens, user).expand(heads, sq, skv)
        qb = q[b, :, :sq]  # [N, sq, D]
        kb = k[b, kv_index, :skv]  # [N, skv, D]
        vb = v[b, kv_index, :skv]
        pse = None
        if pse_shift is not None:
            src = pse_shift.detach().to("cpu")
            pse = src[b if src.shape[0] > 1 else 0, :, :sq, :skv]
        if int8_in:
            o, valid = _int8_rows(qb, kb, vb, vis, pse, scale_value, deq_scale1, quant_scale1, deq_scale2)
        else:
            o, valid = _float_rows(qb, kb, vb, vis, pse, scale_value, naive_dtype or torch.float64)
        if int8_out:
            y = o * scale2 + offset2  # fp32 for int8 inputs, float64 otherwise
            y = torch.where(valid.unsqueeze(-1), y, torch.zeros_like(y))
            pre_out[b, :, :sq] = y.to(torch.float64)
            out[b, :, :sq] = torch.round(y).clamp(-128, 127).to(torch.float64)
        else:
            out[b, :, :sq] = torch.where(valid.unsqueeze(-1), o, torch.zeros_like(o)).to(torch.float64)
    return _finish(out, pre_out, out_layout, int8_out, return_prequant)


def _finish(out, pre_out, out_layout, int8_out, return_prequant):
    result = _from_bnsd(out, out_layout)
    if int8_out:
        result = result.to(torch.int8)
    if not return_prequant:
        return result
    return result, (_from_bnsd(pre_out, out_layout) if int8_out else None)


def _float_rows(qb, kb, vb, vis, pse, scale_value, dtype):
    """softmax(scale * q k^T + pse, masked) v in `dtype`; returns ([N, sq, D] float64, valid [N, sq])."""
    x = qb.to(dtype) @ kb.to(dtype).transpose(-1, -2)
    s = scale_value * x
    if pse is not None:
        s = s + pse.to(dtype)
    s = s.masked_fill(~vis, -math.inf)
    valid = vis.any(-1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(valid.unsqueeze(-1), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    p = e / torch.where(l > 0, l, torch.ones_like(l))
    return (p @ vb.to(dtype)).to(torch.float64), valid


def _int8_rows(qb, kb, vb, vis, pse, scale_value, deq_scale1, quant_scale1, deq_scale2):
    """docs/operators/prompt_flash_attention.md literally; returns (o in fp32 [N, sq, D], valid [N, sq])."""
    deq1 = decode_deq_scale(deq_scale1)
    deq2 = torch.tensor(decode_deq_scale(deq_scale2), dtype=torch.float32)
    quant1 = torch.tensor(float(quant_scale1.reshape(-1)[0].item()), dtype=torch.float32)
    s32 = qb.to(torch.int64) @ kb.to(torch.int64).transpose(-1, -2)  # exact
    s = round_half_even_to_fp16(s32.to(torch.float64) * deq1).to(torch.float32)  # exact float64 product
    s = s * torch.tensor(scale_value, dtype=torch.float32)
    if pse is not None:
        s = s + pse.to(torch.float32)
    s = s.masked_fill(~vis, -math.inf)
    valid = vis.any(-1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(valid.unsqueeze(-1), m, torch.zeros_like(m))
    p = torch.exp(s - m)  # fp32, masked -> 0
    l = p.to(torch.float64).sum(-1, keepdim=True).to(torch.float32)  # the fp32 value of the exact sum
    p_q = torch.round(p * quant1).clamp(-128, 127).to(torch.int64)
    acc = p_q @ vb.to(torch.int64)  # exact
    o = acc.to(torch.float32) * deq2 / torch.where(l > 0, l, torch.ones_like(l))
    return o, valid


# ---------------------------------------------------------------------------------------------------------
# int8 comparison
# ---------------------------------------------------------------------------------------------------------
def assert_int8_matches(
    actual: torch.Tensor,
    expected: torch.Tensor,
    prequant: torch.Tensor,
    *,
    tie_tol: float = 2e-3,
    max_fraction: float = 1e-3,
    name: str = "output",
) -> None:
    """int8 outputs must match exactly, except elements whose oracle pre-rounding value lies within `tie_tol`
    (plus 1e-5 relative) of a rounding tie (x.5), which may be off by one; at most `max_fraction` of the elements
    (and at least one element) may be such near-tie mismatches."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != torch.int8:
        raise AssertionError(f"{name}: dtype {actual.dtype}, expected torch.int8")
    a = actual.detach().to("cpu").to(torch.int64)
    e = expected.to(torch.int64)
    diff = (a - e).abs()
    bad = diff != 0
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    frac = prequant - torch.floor(prequant)
    near_tie = (frac - 0.5).abs() <= tie_tol + 1e-5 * prequant.abs()
    saturated = (prequant > 127.5 + tie_tol) | (prequant < -128.5 - tie_tol)
    excusable = bad & (diff == 1) & near_tie & ~saturated
    n_excused = int(excusable.sum())
    allowed = max(1, int(max_fraction * a.numel()))
    if n_excused == n_bad and n_bad <= allowed:
        return
    idx = torch.nonzero(bad & ~excusable)
    first = idx[0].tolist() if len(idx) else torch.nonzero(bad)[0].tolist()
    t = tuple(first)
    raise AssertionError(
        f"{name}: {n_bad} of {a.numel()} int8 elements differ ({n_excused} near a rounding tie, allowed "
        f"{allowed} such); max |diff| = {int(diff.max())}; first unexplained at {t}: actual {int(a[t])}, "
        f"expected {int(e[t])}, oracle pre-rounding value {float(prequant[t]):.6f}"
    )
