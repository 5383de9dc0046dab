"""Independent float64 oracle for FusedInferAttentionScore and IncreFlashAttention, written from the torch_npu /
ops-transformer documentation as recorded in docs/operators/fused_infer_attention_score.md; nothing imported from
cann_attn but the PromptFlashAttention oracle (`pfa_oracle`: its mask table and its int8 pipeline, which FIA's
documentation shares). Every score matrix is materialised per batch: clarity over speed, small shapes only.

Per batch b (lengths, padding, prefix and rope resolved first):
  K_b = [prefix[:L]; key_b[rows kept]] (+ key_rope on the head dim), V_b likewise; int8 K/V are first turned into
  the query's dtype: dtype((x + offset) * scale) computed in float64;
  S = scale * Q_b K_b^T (+ pse_shift at the same positions as the data), masked (True = hidden);
  lse = log sum exp S over the visible entries; out = softmax(S) V_b.
Rows that see no key: out 0 and lse = +inf ("softmaxLseFlag为True时,数据为inf的代表无效数据",
aclnnFusedInferAttentionScore);
a decode batch (Q_S = 1) without any key: lse = -3.40e38, what the decode kernel writes for it.
learnable_sink (v2): one more logit sink[h] per query head (unscaled, never masked, no value): lse and softmax include
it; a row without visible keys then has lse = sink[h] and out 0.
int4 key/value: eight signed 4-bit values per int32, value j in bits 4j..4j+3 (op-plugin's int4 packing).
Decode (Q_S = 1, no rope): sparse_mode and pre/next_tokens have no effect, a [B, KV_S] mask is batch b's row.
int8 output: round_half_even(out * quant_scale2 + quant_offset2) saturated to int8, 0 on rows that see nothing.
"""

from __future__ import annotations

import math

import torch

from .pfa_oracle import INT_MAX, pfa_oracle, visible_matrix

__all__ = ["fia_oracle"]

_LAYOUTS = {
    "BSH": ("BSH", "BSH"), "BSND": ("BSND", "BSND"), "BNSD": ("BNSD", "BNSD"), "BNSD_BSND": ("BNSD", "BSND"),
    "BSH_NBSD": ("BSH", "NBSD"), "BSND_NBSD": ("BSND", "NBSD"), "BNSD_NBSD": ("BNSD", "NBSD"),
    "BSH_BNSD": ("BSH", "BNSD"), "BSND_BNSD": ("BSND", "BNSD"),
    "TND": ("TND", "TND"), "NTD": ("NTD", "NTD"), "TND_NTD": ("TND", "NTD"), "NTD_TND": ("NTD", "TND"),
}


INVALID_ROW_LSE = math.inf
EMPTY_DECODE_BATCH_LSE = -3.40e38


def _cpu(t):
    return None if t is None else t.detach().to("cpu")


def _int4_values(packed: torch.Tensor) -> torch.Tensor:
    """The int4 values of int32 words, value j of a word from bits 4j..4j+3 (signed), as int8."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty((*packed.shape, 8), dtype=torch.int64)
    for j in range(8):
        nibble = (words >> (4 * j)) & 0xF
        out[..., j] = nibble - 16 * (nibble >= 8).to(torch.int64)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 8).to(torch.int8)


def _per_batch(t: torch.Tensor, layout: str, heads: int, ends: list[int] | None) -> list[torch.Tensor]:
    """[N, S, D] per batch (float64 unless int8)."""
    if layout in ("TND", "NTD"):
        tnd = t if layout == "TND" else t.permute(1, 0, 2)
        starts = [0, *ends[:-1]]
        return [tnd[s:e].permute(1, 0, 2) for s, e in zip(starts, ends, strict=True)]
    if layout == "BSH":
        b, s, h = t.shape
        t = t.reshape(b, s, heads, h // heads).permute(0, 2, 1, 3)
    elif layout == "BSND":
        t = t.permute(0, 2, 1, 3)
    return list(t)


def _assemble(rows: list[torch.Tensor], layout: str) -> torch.Tensor:
    """Per-batch [N, S, D] -> the output layout."""
    if layout in ("TND", "NTD"):
        tnd = torch.cat([r.permute(1, 0, 2) for r in rows], 0)
        return tnd if layout == "TND" else tnd.permute(1, 0, 2).contiguous()
    bnsd = torch.stack(rows)
    if layout == "BSH":
        b, n, s, d = bnsd.shape
        return bnsd.permute(0, 2, 1, 3).reshape(b, s, n * d)
    if layout == "BSND":
        return bnsd.permute(0, 2, 1, 3).contiguous()
    if layout == "NBSD":
        return bnsd.permute(1, 0, 2, 3).contiguous()
    return bnsd


def _lengths(value, batch: int, seq: int) -> list[int]:
    if value is None:
        return [seq] * batch
    vals = [int(v) for v in (value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else value)]
    return vals * batch if len(vals) == 1 else vals[:batch]


def _ends_to_lengths(ends: list[int]) -> list[int]:
    return [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]


def _factor_for(t: torch.Tensor | None, mode: int, b: int, heads_kv: int, dim: int) -> torch.Tensor | None:
    """One anti-quantisation factor as [N2 or 1, S or 1, D or 1] float64 for batch b."""
    if t is None:
        return None
    t = t.to(torch.float64)
    if mode == 0:
        return t.reshape(1, 1, 1) if t.numel() == 1 else t.reshape(heads_kv, 1, dim)
    if mode == 1:
        return t.reshape(t.shape[-2], t.shape[-1])[b].reshape(1, t.shape[-1], 1)
    if mode == 2:
        return t.reshape(heads_kv, 1, 1)
    return t[b].reshape(heads_kv, t.shape[-1], 1)


def _dequant(x: torch.Tensor, scale, offset, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(torch.float64)
    seq = y.shape[1]
    if offset is not None:
        y = y + offset[:, :seq] if offset.shape[1] > 1 else y + offset
    y = y * (scale[:, :seq] if scale.shape[1] > 1 else scale)
    return y.to(dtype).to(torch.float64)


def fia_oracle(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
               actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
               quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
               key_antiquant_scale=None, key_antiquant_offset=None, value_antiquant_scale=None,
               value_antiquant_offset=None, query_padding_size=None, kv_padding_size=None, key_shared_prefix=None,
               value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None, key_rope=None,
               num_heads=1, scale=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
               num_key_value_heads=0, sparse_mode=0, antiquant_mode=0, key_antiquant_mode=0,
               value_antiquant_mode=0, softmax_lse_flag=False, learnable_sink=None, naive_dtype=None):
    """(attention_out, softmax_lse or None) for a VALID call (no validation). attention_out is float64 in the output
    layout (int8 with quant_scale2); softmax_lse float64 in its documented shape. `naive_dtype` (float inputs
    only): the attention computed in that dtype instead of float64 (the naive reference of the flash-attn rule,
    docs/semantics/precision.md)."""
    compute = naive_dtype or torch.float64
    q_layout, out_layout = _LAYOUTS[input_layout]
    query, key, value = _cpu(query), _cpu(key), _cpu(value)
    if key.dtype == torch.int32:
        key, value = _int4_values(key), _int4_values(value)
    sink = None if learnable_sink is None else _cpu(learnable_sink).to(torch.float64)
    heads = num_heads
    heads_kv = num_key_value_heads or heads
    group = heads // heads_kv
    if query.dtype == torch.int8:  # full quantisation: PromptFlashAttention's pipeline
        out = pfa_oracle(query, key, value, pse_shift=pse_shift, atten_mask=atten_mask,
                         actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
                         deq_scale1=dequant_scale1, quant_scale1=quant_scale1, deq_scale2=dequant_scale2,
                         quant_scale2=quant_scale2, quant_offset2=quant_offset2, num_heads=num_heads,
                         scale_value=scale, pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
                         num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode)
        return out, None
    packed = q_layout in ("TND", "NTD")
    q_ends = None if not packed else [int(x) for x in actual_seq_lengths]
    kv_ends = None if not packed else [int(x) for x in actual_seq_lengths_kv]
    qs = _per_batch(query, q_layout, heads, q_ends)
    ks = _per_batch(key, q_layout, heads_kv, kv_ends)
    vs = _per_batch(value, q_layout, heads_kv, kv_ends)
    qrs = None if query_rope is None else _per_batch(_cpu(query_rope), q_layout, heads, q_ends)
    krs = None if key_rope is None else _per_batch(_cpu(key_rope), q_layout, heads_kv, kv_ends)
    batch = len(qs)
    seq_q, seq_kv = qs[0].shape[1], ks[0].shape[1]
    dim, dim_v = qs[0].shape[-1], vs[0].shape[-1]
    decode = not packed and seq_q == 1
    if packed:
        act_q, act_kv = _ends_to_lengths(q_ends), _ends_to_lengths(kv_ends)
    else:
        act_q = [1] * batch if decode else _lengths(actual_seq_lengths, batch, seq_q)
        act_kv = _lengths(actual_seq_lengths_kv, batch, seq_kv)
    mode, pre, nxt = sparse_mode, pre_tokens, next_tokens
    rope = query_rope is not None
    if decode and not rope:
        mode, pre, nxt = 0, INT_MAX, INT_MAX
    q_pad = None if query_padding_size is None else max(0, int(query_padding_size.reshape(-1)[0]))
    kv_pad = None if kv_padding_size is None else max(0, int(kv_padding_size.reshape(-1)[0]))
    if (q_pad is not None or kv_pad is not None) and mode == 0:
        pre, nxt = INT_MAX, INT_MAX

    # Anti-quantisation factors: combined [2, ...] (index 0 key, 1 value) or separate.
    dt = query.dtype
    k_mode = v_mode = 0
    k_s = k_o = v_s = v_o = None
    if antiquant_scale is not None:
        k_mode = v_mode = antiquant_mode if decode else 0
        sc, of = _cpu(antiquant_scale), _cpu(antiquant_offset)
        k_s, v_s = sc[0], sc[1]
        k_o, v_o = (None, None) if of is None else (of[0], of[1])
    elif key_antiquant_scale is not None:
        k_mode, v_mode = key_antiquant_mode, value_antiquant_mode
        k_s, v_s, k_o, v_o = (_cpu(t) for t in (key_antiquant_scale, value_antiquant_scale, key_antiquant_offset,
                                                 value_antiquant_offset))

    prefix_len = 0
    pk = pv = None
    if key_shared_prefix is not None:
        pk = _per_batch(_cpu(key_shared_prefix), q_layout, heads_kv, None)[0]
        pv = _per_batch(_cpu(value_shared_prefix), q_layout, heads_kv, None)[0]
        prefix_len = pk.shape[1] if actual_shared_prefix_len is None else int(next(iter(actual_shared_prefix_len)))
        pk, pv = pk[:, :prefix_len], pv[:, :prefix_len]

    int8_out = quant_scale2 is not None
    outs, lses = [], []
    for b in range(batch):
        sq_b, skv_b = act_q[b], act_kv[b]
        rows_q = qs[b].shape[1]
        o_full = torch.zeros(heads, rows_q, dim_v, dtype=torch.float64)
        lse_full = torch.full((heads, rows_q), INVALID_ROW_LSE, dtype=torch.float64)
        q0 = (seq_q - q_pad - sq_b) if q_pad is not None else 0
        kv0 = (seq_kv - kv_pad - skv_b) if kv_pad is not None else 0
        if kv0 < 0 or (kv_pad is not None and seq_kv - kv_pad < 0):
            outs.append(o_full)
            lses.append(torch.full_like(lse_full, EMPTY_DECODE_BATCH_LSE) if decode else lse_full)
            continue
        k_b, v_b = ks[b].to(compute), vs[b].to(compute)
        if key.dtype == torch.int8:
            k_b = _dequant(ks[b], _factor_for(k_s, k_mode, b, heads_kv, dim),
                           _factor_for(k_o, k_mode, b, heads_kv, dim), dt)
            v_b = _dequant(vs[b], _factor_for(v_s, v_mode, b, heads_kv, dim_v),
                           _factor_for(v_o, v_mode, b, heads_kv, dim_v), dt)
        k_b, v_b = k_b[:, kv0 : kv0 + skv_b], v_b[:, kv0 : kv0 + skv_b]
        q_b = qs[b][:, q0 : q0 + sq_b].to(compute)
        if rope:
            q_b = torch.cat([q_b, qrs[b][:, q0 : q0 + sq_b].to(compute)], -1)
            k_b = torch.cat([k_b, krs[b][:, kv0 : kv0 + skv_b].to(compute)], -1)
        if pk is not None:
            pk_b, pv_b = pk.to(compute), pv.to(compute)
            if key.dtype == torch.int8:
                pk_b = _dequant(pk, _factor_for(k_s, k_mode, b, heads_kv, dim),
                                _factor_for(k_o, k_mode, b, heads_kv, dim), dt)
                pv_b = _dequant(pv, _factor_for(v_s, v_mode, b, heads_kv, dim_v),
                                _factor_for(v_o, v_mode, b, heads_kv, dim_v), dt)
            k_b, v_b = torch.cat([pk_b, k_b], 1), torch.cat([pv_b, v_b], 1)
        skv_all = k_b.shape[1]
        if decode and skv_all == 0:
            outs.append(o_full)
            lses.append(torch.full_like(lse_full, EMPTY_DECODE_BATCH_LSE))
            continue
        if sq_b == 0 or (skv_all == 0 and sink is None):
            outs.append(o_full)
            lses.append(lse_full)
            continue
        user = None
        if atten_mask is not None and mode in (0, 1):
            m = _cpu(atten_mask)
            if decode and m.dim() == 2 and m.shape[0] == batch:
                m = m[b].reshape(1, 1, -1)
            elif m.dim() == 2:
                m = m.unsqueeze(0)
            elif m.dim() == 3:
                m = m[b if m.shape[0] > 1 else 0].unsqueeze(0)
            else:
                m = m[b if m.shape[0] > 1 else 0]
            user = (m != 0)[:, q0 : q0 + sq_b, kv0 : kv0 + skv_all]
        if atten_mask is None and mode == 0:
            vis = torch.ones(1, sq_b, skv_all, dtype=torch.bool)
        else:
            vis = visible_matrix(mode, sq_b, skv_all, pre, nxt, user)
        vis = vis.expand(heads, sq_b, skv_all)
        kv_index = torch.arange(heads) // group
        s = scale * (q_b @ k_b[kv_index].transpose(-1, -2))
        if pse_shift is not None:
            src = _cpu(pse_shift).to(compute)
            s = s + src[b if src.shape[0] > 1 else 0, :, q0 : q0 + sq_b, kv0 : kv0 + skv_all]
        s = s.masked_fill(~vis, -math.inf)
        valid = vis.any(-1)
        if sink is not None:  # the sink column: in the softmax's denominator, without a value
            with_sink = torch.cat([s, sink.view(heads, 1, 1).expand(heads, sq_b, 1)], -1)
            lse = torch.logsumexp(with_sink, -1)
            o = torch.exp(s - lse.unsqueeze(-1)) @ v_b[kv_index]
            valid = torch.ones_like(valid)
        else:
            lse = torch.logsumexp(s, -1)
            lse = torch.where(valid, lse, torch.full_like(lse, INVALID_ROW_LSE))
            p = torch.exp(s - torch.where(valid, lse, torch.zeros_like(lse)).unsqueeze(-1))
            o = torch.where(valid.unsqueeze(-1), p @ v_b[kv_index], torch.zeros(1, dtype=compute))
        if int8_out:
            sc2 = _cpu(quant_scale2).to(torch.float64)
            of2 = None if quant_offset2 is None else _cpu(quant_offset2).to(torch.float64)
            sc2 = sc2.reshape(1, 1, 1) if sc2.numel() == 1 else sc2.reshape(heads, 1, dim_v)
            y = o * sc2
            if of2 is not None:
                y = y + (of2.reshape(1, 1, 1) if of2.numel() == 1 else of2.reshape(heads, 1, dim_v))
            o = torch.where(valid.unsqueeze(-1), torch.round(y).clamp(-128, 127), torch.zeros(1, dtype=torch.float64))
        o_full[:, q0 : q0 + sq_b] = o
        lse_full[:, q0 : q0 + sq_b] = lse
        outs.append(o_full)
        lses.append(lse_full)
    out = _assemble(outs, out_layout)
    if int8_out:
        out = out.to(torch.int8)
    if not softmax_lse_flag:
        return out, None
    if packed:
        return out, torch.cat([x.permute(1, 0) for x in lses], 0).unsqueeze(-1)
    return out, torch.stack(lses).unsqueeze(-1)
