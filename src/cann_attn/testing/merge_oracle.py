"""Float64 oracles of RingAttentionUpdate and AttentionUpdate, written from the documented formulas
(docs/operators/ring_attention_update.md, docs/operators/attention_update.md), row by row, independently of
cann_attn.problem.merge and of the operators' layout code.

Empty rows (docs/semantics/invalid-rows.md): a statistic pair with max <= -FLT_MAX or sum == 0, or an lse <= -FLT_MAX
(-inf included), contributes nothing; a row empty in every input is an invalid row (output 0, max -FLT_MAX, sum
FLT_MAX; lse_out the largest lse given).
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch

FLT_MAX = 3.4028234663852886e38


def _seq_ends(actual_seq_qlen) -> list[int]:
    if isinstance(actual_seq_qlen, torch.Tensor):
        return [int(x) for x in actual_seq_qlen.reshape(-1).tolist()]
    return [int(x) for x in actual_seq_qlen]


def _row_positions(input_layout: str, input_softmax_layout: str, attn_shape, stats_shape, actual_seq_qlen):
    """For every attn row key (s, b, n) / (t, n): the index tuple of its statistics (without the lane)."""
    if input_layout == "SBH":
        s_len, b_len, _ = attn_shape
        heads = stats_shape[1]
        return {(s, b, n): (b, n, s) for s in range(s_len) for b in range(b_len) for n in range(heads)}
    t_len, heads, _ = attn_shape
    if input_softmax_layout == "TND":
        return {(t, n): (t, n) for t in range(t_len) for n in range(heads)}
    ends = _seq_ends(actual_seq_qlen)
    bounds = list(pairwise(ends))
    if ends[-1] < t_len:
        bounds.append((ends[-1], t_len))  # end-of-document padding: one more [N, pad] block
    where = {}
    for lo, hi in bounds:
        length = hi - lo
        for n in range(heads):
            for i in range(length):
                flat = lo * heads + n * length + i  # position in the [T * N] rows of the [T, N, 8] memory
                where[(lo + i, n)] = (flat // heads, flat % heads)
    return where


def _empty(m: float, s: float) -> bool:
    return m <= -FLT_MAX or s == 0


def ring_attention_update_oracle(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
                                 cur_softmax_sum, actual_seq_qlen=None, input_layout: str = "SBH",
                                 input_softmax_layout: str = "") -> dict[str, torch.Tensor]:
    """{"attn_out", "softmax_max", "softmax_sum"}, float64, in the inputs' shapes."""
    o_p, o_c = prev_attn_out.double(), cur_attn_out.double()
    m_p, s_p, m_c, s_c = (t.double()[..., 0] for t in (prev_softmax_max, prev_softmax_sum, cur_softmax_max,
                                                         cur_softmax_sum))
    heads = prev_softmax_max.shape[1]
    out = torch.zeros_like(o_p)
    new_m = torch.empty_like(m_p)
    new_s = torch.empty_like(s_p)
    for key, st in _row_positions(input_layout, input_softmax_layout, tuple(o_p.shape), tuple(m_p.shape),
                                  actual_seq_qlen).items():
        if input_layout == "SBH":
            s, b, n = key
            d = o_p.shape[-1] // heads
            cols = (s, b, slice(n * d, (n + 1) * d))
        else:
            cols = key
        mp, sp, mc, sc = (float(x[st]) for x in (m_p, s_p, m_c, s_c))
        if _empty(mp, sp) and _empty(mc, sc):
            new_m[st], new_s[st] = -FLT_MAX, FLT_MAX
            continue
        if _empty(mc, sc):
            out[cols], new_m[st], new_s[st] = o_p[cols], mp, sp
            continue
        if _empty(mp, sp):
            out[cols], new_m[st], new_s[st] = o_c[cols], mc, sc
            continue
        m = max(mp, mc)
        wp, wc = sp * math.exp(mp - m), sc * math.exp(mc - m)
        total = wp + wc
        out[cols] = o_p[cols] * (wp / total) + o_c[cols] * (wc / total)
        new_m[st], new_s[st] = m, total
    lanes = prev_softmax_max.shape[-1]
    return {"attn_out": out, "softmax_max": new_m.unsqueeze(-1).expand(*new_m.shape, lanes).contiguous(),
            "softmax_sum": new_s.unsqueeze(-1).expand(*new_s.shape, lanes).contiguous()}


def attention_update_oracle(lse, local_out, update_type: int) -> dict[str, torch.Tensor]:
    """{"out"} (and {"lse_out"} when update_type == 1), float64."""
    lse64 = torch.stack([t.double() for t in lse])  # [K, R]
    outs = torch.stack([t.double() for t in local_out])  # [K, R, D]
    rows = lse64.shape[1]
    out = torch.zeros(outs.shape[1:], dtype=torch.float64)
    lse_out = torch.empty(rows, dtype=torch.float64)
    for r in range(rows):
        values = [float(x) for x in lse64[:, r]]
        live = [k for k, v in enumerate(values) if v > -FLT_MAX]
        if not live:
            lse_out[r] = max(values)
            continue
        top = max(values[k] for k in live)
        merged = top + math.log(sum(math.exp(values[k] - top) for k in live))
        lse_out[r] = merged
        for k in live:
            out[r] += outs[k, r] * math.exp(values[k] - merged)
    result = {"out": out}
    if update_type == 1:
        result["lse_out"] = lse_out
    return result
