"""Independent float64 oracle for FlashAttentionScore / FlashAttentionVarLenScore (forward).

Written from ``docs/semantics/`` (layouts, masks, invalid rows, pse, dropout, softmax statistics) and nothing else: it
imports nothing from ``cann_attn``
(pure PyTorch), materialises the full score matrix of every sequence, and states each rule as literally as
possible so that it can serve as the independent truth in tests. It validates almost nothing: feed it valid
inputs.

It is differentiable w.r.t. query, key, value and a pse tensor through ``torch.autograd`` (only
differentiable torch ops are used; masked logits are replaced by a finite very negative number *before* the
exponential and the probabilities of masked entries are zeroed explicitly, so fully masked rows give zero
gradients, never NaN).

Conventions (docs/semantics/index.md): B batch, N1 query heads, N2 kv heads, G = N1 // N2 (query head n uses kv head
n // G), i query row and j key column (0-based inside the sequence), delta = Skv - Sq, "masked" = excluded
from the softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "FLT_MAX",
    "INT_MAX",
    "LAYOUTS",
    "cum_to_lengths",
    "fa_forward_oracle",
    "make_compressed_mask",
    "naive_same_dtype_forward",
    "pack_drop_mask",
    "unpack_drop_mask",
]

FLT_MAX = float(torch.finfo(torch.float32).max)  # 3.4028234663852886e38, written 3.4028235e38 in the docs
INT_MAX = 2147483647
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


# ----------------------------------------------------------------------------------------------------
# Small helpers written independently of the library: compressed masks and drop-mask bit packing.
# ----------------------------------------------------------------------------------------------------
def make_compressed_mask(mode: int = 2) -> torch.Tensor:
    """The compressed atten_mask Ascend expects for sparse modes 2, 3, 4, 7, 8 (and 6).

    Modes 2/3/4/7/8: the strict upper triangle of a 2048x2048 ones matrix (True where col > row).
    Mode 6: that triangle stacked on a [1024, 2048] block whose left 1024 columns are 0 and right 1024 are 1.
    """
    rows = torch.arange(2048).unsqueeze(1)
    cols = torch.arange(2048).unsqueeze(0)
    triangle = cols > rows
    if mode != 6:
        return triangle
    block = torch.zeros(1024, 2048, dtype=torch.bool)
    block[:, 1024:] = True
    return torch.cat([triangle, block], dim=0)


def pack_drop_mask(keep: torch.Tensor) -> torch.Tensor:
    """Pack bool keep flags (flattened row-major) into uint8, LSB first: element e -> bit e%8 of byte e//8."""
    flat = keep.reshape(-1).to(torch.bool).to("cpu")
    numel = flat.numel()
    nbytes = (numel + 7) // 8
    out = []
    for byte_index in range(nbytes):
        value = 0
        for bit in range(8):
            e = byte_index * 8 + bit
            if e < numel and bool(flat[e]):
                value |= 1 << bit
        out.append(value)
    return torch.tensor(out, dtype=torch.uint8)


def unpack_drop_mask(drop_mask: torch.Tensor, numel: int) -> torch.Tensor:
    """Keep flags of the first ``numel`` elements: element e is bit (e & 7) of byte (e >> 3); 1 = keep."""
    e = torch.arange(numel)
    byte = drop_mask.reshape(-1).to("cpu").to(torch.int64)[e >> 3]
    return ((byte >> (e & 7)) & 1).to(torch.bool)


def _ints(values) -> list[int]:
    if values is None:
        return []
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    if isinstance(values, int):
        return [values]
    return [int(v) for v in values]


def cum_to_lengths(cumulative: Sequence[int] | torch.Tensor) -> list[int]:
    """TND cumulative ends (no leading 0) -> per-sequence lengths: [2, 4, 6] -> [2, 2, 2]."""
    ends = _ints(cumulative)
    return [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]


# ----------------------------------------------------------------------------------------------------
# Layouts: any layout -> list of per-sequence [N, S_b, D] tensors (and back)
# ----------------------------------------------------------------------------------------------------
def _bnsd(t: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    """Non-TND tensor -> [B, N, S, D] view."""
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, n, h // n).permute(0, 2, 1, 3)
    if layout == "SBH":
        s, b, h = t.shape
        return t.reshape(s, b, n, h // n).permute(1, 2, 0, 3)
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    if layout == "BNSD":
        return t
    raise ValueError(f"oracle: unknown layout {layout!r}")


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N, S, D] -> the given non-TND layout."""
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.permute(0, 2, 1, 3).reshape(b, s, n * d)
    if layout == "SBH":
        return t.permute(2, 0, 1, 3).reshape(s, b, n * d)
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    return t


def _kv_heads(layout: str, query: torch.Tensor, key: torch.Tensor, head_num: int) -> int:
    if layout in ("BSH", "SBH"):
        d_qk = query.shape[-1] // head_num
        return key.shape[-1] // d_qk
    if layout == "BNSD":
        return key.shape[1]
    return key.shape[-2]  # BSND [B,S,N,D] and TND [T,N,D]


# ----------------------------------------------------------------------------------------------------
# Masks (docs/semantics/masks.md): the set of masked (i, j) of one sequence, as a bool [1 or N1, Sq, Skv]
# ----------------------------------------------------------------------------------------------------
def _user_mask(atten_mask: torch.Tensor, b: int, sq: int, skv: int) -> torch.Tensor:
    """The given mask for sequence b (True/nonzero = masked); TND uses the top-left [Sq_b, Skv_b] block."""
    m = atten_mask.to("cpu") != 0
    if m.dim() == 2:  # [Sq, Skv]
        block = m.unsqueeze(0)
    elif m.dim() == 3:  # [1, Sq, Skv]
        block = m[b if m.shape[0] > 1 else 0].unsqueeze(0)
    else:  # [B, 1, Sq, Skv], [1, 1, Sq, Skv], [B, N, Sq, Skv]
        block = m[b if m.shape[0] > 1 else 0]
    return block[:, :sq, :skv]


def _masked(
    sparse_mode: int,
    atten_mask: torch.Tensor | None,
    b: int,
    band_batch: int | None,
    sq: int,
    skv: int,
    pre: int,
    nxt: int,
    prefix: list[int],
) -> torch.Tensor:
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(skv).unsqueeze(0)
    delta = skv - sq
    if atten_mask is None:  # FA family: no mask -> full attention, whatever sparse_mode / pre / next say
        return torch.zeros(1, sq, skv, dtype=torch.bool)
    if sparse_mode == 0:
        masked = _user_mask(atten_mask, b, sq, skv) | (j > i + nxt) | (j < i - pre)
    elif sparse_mode in (1, 5):  # the given full mask's content decides
        masked = _user_mask(atten_mask, b, sq, skv)
    elif sparse_mode == 2:
        masked = j > i
    elif sparse_mode == 3:
        masked = j > i + delta
    elif sparse_mode == 4:
        masked = (j > i + delta + nxt) | (j < i + delta - pre)
    elif sparse_mode == 6:
        masked = (j > i + delta) & (j >= prefix[b])
    elif sparse_mode == 7:
        masked = (j > i + delta + nxt) if b == band_batch else (j > i + delta)
    elif sparse_mode == 8:
        masked = (j > i + delta + nxt) if b == band_batch else (j > i)
    else:
        raise ValueError(f"oracle: sparse_mode {sparse_mode} not in 0..8")
    return masked if masked.dim() == 3 else masked.unsqueeze(0)


# ----------------------------------------------------------------------------------------------------
# pse (docs/semantics/pse.md): the bias of one sequence, [N1 or 1, Sq, Skv]
# ----------------------------------------------------------------------------------------------------
def _compressed_pse(p: torch.Tensor, sq: int, skv: int) -> torch.Tensor:
    """p: [N1, 1024, Skv] = last 1024 rows of a Toeplitz pse.

    value(i, j) = C[r, j + (Sq - 1024) + r - i], r = i - (Sq - 1024) if i >= Sq - 1024 else i mod 1024.
    Column indices only leave [0, Skv) for j > i, entries that the allowed modes always mask; they are clamped
    so the gather stays in bounds, and those entries never reach the softmax.
    """
    i = torch.arange(sq, device=p.device).unsqueeze(1)
    j = torch.arange(skv, device=p.device).unsqueeze(0)
    r = torch.where(i >= sq - 1024, i - (sq - 1024), i % 1024)
    col = (j + (sq - 1024) + r - i).clamp(0, skv - 1)
    return p[:, r.expand(sq, skv), col]


def _pse_bias(
    pse: torch.Tensor,
    pse_type: int,
    b: int,
    sq: int,
    skv: int,
    tnd: bool,
    q_start: int,
    kv_start: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    if pse_type in (2, 3):  # ALiBi generated inside; pse = slopes [B, N1] or [N1]
        slopes = pse.to(dtype)
        slope = slopes[b] if slopes.dim() == 2 else slopes
        i = torch.arange(sq, device=pse.device).unsqueeze(1)
        j = torch.arange(skv, device=pse.device).unsqueeze(0)
        dist = ((j + kv_start) - (i + q_start)).abs().to(dtype)
        if pse_type == 3:
            dist = dist.sqrt()
        return -slope.reshape(-1, 1, 1) * dist.unsqueeze(0)
    p = pse[b if pse.shape[0] > 1 else 0].to(dtype)  # [N1, Hp, Wp]
    hp, wp = p.shape[1], p.shape[2]
    if tnd:  # bottom-right [Sq_b, Skv_b] block of the sequence's slice
        if hp < sq:  # 1024-row compressed pse, Sq_b == Skv_b > 1024: compressed rule on the last Skv_b cols
            return _compressed_pse(p[:, :, wp - skv :], sq, skv)
        return p[:, hp - sq :, wp - skv :]
    if wp != skv:
        raise ValueError(f"oracle: pse last dim {wp} != Skv {skv}")
    if hp == sq:
        return p
    if hp == 1:  # [.., 1, Skv] broadcast over rows
        return p.expand(-1, sq, -1)
    if hp == 1024 and sq == skv and sq > 1024:
        return _compressed_pse(p, sq, skv)
    raise ValueError(f"oracle: unsupported pse shape {tuple(pse.shape)} for Sq={sq}, Skv={skv}")


# ----------------------------------------------------------------------------------------------------
# One sequence: full score matrix, softmax with stats, dropout, P V
# ----------------------------------------------------------------------------------------------------
def _attend(q, k, v, masked, bias, pse_type, scale, keep, keep_prob, stats_dtype, sink=None):
    """q [N1,Sq,D], k [N2,Skv,D], v [N2,Skv,Dv], masked bool [1|N1,Sq,Skv], bias None or [1|N1,Sq,Skv],
    sink None or [N1] (one extra logit per query head, docs/semantics/sinks.md).

    Returns out [N1,Sq,Dv], softmax_max [N1,Sq], softmax_sum [N1,Sq] (stats in stats_dtype).
    """
    n1, sq, _ = q.shape
    skv, dv = v.shape[1], v.shape[2]
    if sink is not None:
        # The sink as the gpt-oss formula states it: one more score column per row, sink[h] whatever the mask, pse
        # and scale; it joins the softmax and is dropped before P V (it has no value row). A -inf sink is no column.
        k = torch.cat([k.repeat_interleave(n1 // k.shape[0], dim=0), q.new_zeros(n1, 1, k.shape[2])], dim=1)
        v = torch.cat([v.repeat_interleave(n1 // v.shape[0], dim=0), q.new_zeros(n1, 1, dv)], dim=1)
        sink_col = sink.to(device=q.device, dtype=q.dtype).view(n1, 1, 1).expand(n1, sq, 1)
        masked = torch.cat([masked.to(q.device).expand(n1, sq, skv), (sink_col == float("-inf"))], dim=-1)
        if bias is not None:
            bias = torch.cat([bias.expand(n1, sq, skv), bias.new_zeros(n1, sq, 1)], dim=-1)
        if keep is not None:
            keep = torch.cat([keep.to(q.device), keep.new_ones(n1, sq, 1).to(q.device)], dim=-1)
        out, m, l, _ = _attend_columns(q, k, v, masked, bias, pse_type, scale, keep, keep_prob, stats_dtype,
                                       sink_col)
        return out, m, l
    if skv == 0 or sq == 0:  # no key at all: every row is invalid (or there is no row)
        out = q.new_zeros(n1, sq, dv)
        m = torch.full((n1, sq), -FLT_MAX, dtype=stats_dtype, device=q.device)
        return out, m, torch.full((n1, sq), FLT_MAX, dtype=stats_dtype, device=q.device)
    out, m, l, _ = _attend_columns(q, k, v, masked, bias, pse_type, scale, keep, keep_prob, stats_dtype, None)
    return out, m, l


def _attend_columns(q, k, v, masked, bias, pse_type, scale, keep, keep_prob, stats_dtype, sink_col):
    """The dense softmax attention of `_attend`; with `sink_col` [N1,Sq,1] the last key column's logit is replaced by
    it (k and v carry a zero row there, so the column adds nothing to P V)."""
    n1, sq, _ = q.shape
    skv = k.shape[1]
    masked = masked.to(q.device)
    group = n1 // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # query head n uses kv head n // G
    v = v.repeat_interleave(group, dim=0)
    x = q @ k.transpose(-1, -2)
    if bias is None:
        s = scale * x
    elif pse_type == 1:
        s = scale * (x + bias)
    else:  # pse_type 0, 2, 3
        s = scale * x + bias
    if sink_col is not None:
        s = torch.cat([s[..., :-1], sink_col], dim=-1)
    visible = (~masked).expand(n1, sq, skv)
    row_valid = visible.any(dim=-1, keepdim=True)
    very_negative = torch.finfo(s.dtype).min
    s_fill = torch.where(visible, s, torch.full_like(s, very_negative))
    m = s_fill.amax(dim=-1, keepdim=True)
    m_safe = torch.where(row_valid, m, torch.zeros_like(m)).detach()  # softmax is invariant to the shift
    e = torch.where(visible, torch.exp(s_fill - m_safe), torch.zeros_like(s))
    l = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(row_valid, l, torch.ones_like(l))  # invalid rows: p = 0 -> output 0
    if keep is not None:
        p = p * keep.to(device=p.device, dtype=p.dtype) / keep_prob
    out = p @ v
    m_out = torch.where(row_valid, m.to(stats_dtype), torch.full_like(m, -FLT_MAX, dtype=stats_dtype))
    l_out = torch.where(row_valid, l.to(stats_dtype), torch.full_like(l, FLT_MAX, dtype=stats_dtype))
    return out, m_out.squeeze(-1), l_out.squeeze(-1), p


def _forward(
    query,
    key,
    value,
    head_num,
    input_layout,
    *,
    pse,
    drop_mask,
    atten_mask,
    prefix,
    actual_seq_qlen,
    actual_seq_kvlen,
    q_start_idx,
    kv_start_idx,
    scale_value,
    keep_prob,
    pre_tokens,
    next_tokens,
    sparse_mode,
    pse_type,
    softmax_layout,
    dtype,
    stats_dtype,
    sink=None,
):
    layout = input_layout
    tnd = layout == "TND"
    n1 = int(head_num)
    n2 = _kv_heads(layout, query, key, n1)
    q_all = query.to(dtype)
    k_all = key.to(dtype)
    v_all = value.to(dtype)

    # per-sequence [N, S_b, D] views
    if tnd:
        sq_list = cum_to_lengths(actual_seq_qlen)
        skv_list = cum_to_lengths(actual_seq_kvlen)
        q_ends, kv_ends = _ints(actual_seq_qlen), _ints(actual_seq_kvlen)
        qs = [q_all[e - n : e].permute(1, 0, 2) for e, n in zip(q_ends, sq_list, strict=True)]
        ks = [k_all[e - n : e].permute(1, 0, 2) for e, n in zip(kv_ends, skv_list, strict=True)]
        vs = [v_all[e - n : e].permute(1, 0, 2) for e, n in zip(kv_ends, skv_list, strict=True)]
        dv = value.shape[-1]
    else:
        q4 = _bnsd(q_all, layout, n1)
        k4 = _bnsd(k_all, layout, n2)
        v4 = _bnsd(v_all, layout, n2)
        batch = q4.shape[0]
        sq_list = [q4.shape[2]] * batch
        skv_list = [k4.shape[2]] * batch
        qs, ks, vs = list(q4), list(k4), list(v4)
        dv = v4.shape[-1]
    nseq = len(sq_list)

    # sparse-mode helpers
    prefix_list = _ints(prefix)
    nonempty = [b for b in range(nseq) if sq_list[b] > 0]
    band_batch = None
    if sparse_mode == 7 and nonempty:
        band_batch = nonempty[-1]
    elif sparse_mode == 8 and nonempty:
        band_batch = nonempty[0]

    q_start = _ints(q_start_idx)[0] if _ints(q_start_idx) else 0
    kv_start = _ints(kv_start_idx)[0] if _ints(kv_start_idx) else 0

    # dropout: one flat LSB-first bit stream over [B, N1, Sq, Skv] (TND: per-sequence [N1, Sq_b, Skv_b])
    sizes = [n1 * sq_list[b] * skv_list[b] for b in range(nseq)]
    use_dropout = keep_prob < 1.0
    if use_dropout:
        if drop_mask is None:
            raise ValueError("oracle: keep_prob < 1 needs a drop_mask")
        keep_all = unpack_drop_mask(drop_mask, sum(sizes))
    offsets = [sum(sizes[:b]) for b in range(nseq)]

    outs, maxes, sums = [], [], []
    for b in range(nseq):
        sq, skv = sq_list[b], skv_list[b]
        masked = _masked(
            sparse_mode, atten_mask, b, band_batch, sq, skv, int(pre_tokens), int(next_tokens), prefix_list
        )
        bias = None
        if pse is not None and sq > 0 and skv > 0:
            bias = _pse_bias(pse, pse_type, b, sq, skv, tnd, q_start, kv_start, dtype)
        keep = None
        if use_dropout:
            keep = keep_all[offsets[b] : offsets[b] + sizes[b]].reshape(n1, sq, skv)
        out, m, l = _attend(
            qs[b], ks[b], vs[b], masked, bias, pse_type, scale_value, keep, keep_prob, stats_dtype,
            None if sink is None else sink.to(dtype),
        )
        outs.append(out)
        maxes.append(m)
        sums.append(l)

    if tnd:
        if nseq == 0 or sum(sq_list) == 0:
            attention_out = q_all.new_zeros(0, n1, dv)
            empty = torch.zeros(0, n1, 8, dtype=stats_dtype, device=query.device)
            return attention_out, empty, empty.clone()
        attention_out = torch.cat([o.permute(1, 0, 2) for o in outs], dim=0)  # [T, N1, Dv]
        total = attention_out.shape[0]
        if softmax_layout == "TND":
            softmax_max = torch.cat([m.transpose(0, 1) for m in maxes], dim=0).unsqueeze(-1).expand(-1, -1, 8)
            softmax_sum = torch.cat([s.transpose(0, 1) for s in sums], dim=0).unsqueeze(-1).expand(-1, -1, 8)
        else:  # "": per-sequence [N1, Sq_b, 8] blocks concatenated in memory, viewed as [T, N1, 8]
            softmax_max = torch.cat([m.unsqueeze(-1).expand(-1, -1, 8).reshape(-1) for m in maxes])
            softmax_sum = torch.cat([s.unsqueeze(-1).expand(-1, -1, 8).reshape(-1) for s in sums])
            softmax_max = softmax_max.reshape(total, n1, 8)
            softmax_sum = softmax_sum.reshape(total, n1, 8)
        return attention_out, softmax_max.contiguous(), softmax_sum.contiguous()

    sq = (
        sq_list[0]
        if nseq
        else (query.shape[0] if layout == "SBH" else query.shape[2 if layout == "BNSD" else 1])
    )
    if nseq == 0:
        out4 = q_all.new_zeros(0, n1, sq, dv)
        stat4 = torch.zeros(0, n1, sq, dtype=stats_dtype, device=query.device)
        attention_out = _from_bnsd(out4, layout)
        return (
            attention_out,
            stat4.unsqueeze(-1).expand(-1, -1, -1, 8),
            stat4.unsqueeze(-1).expand(-1, -1, -1, 8),
        )
    out4 = torch.stack(outs)  # [B, N1, Sq, Dv]
    attention_out = _from_bnsd(out4, layout).contiguous()
    softmax_max = torch.stack(maxes).unsqueeze(-1).expand(-1, -1, -1, 8).contiguous()
    softmax_sum = torch.stack(sums).unsqueeze(-1).expand(-1, -1, -1, 8).contiguous()
    return attention_out, softmax_max, softmax_sum


def fa_forward_oracle(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    drop_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    q_start_idx=None,
    kv_start_idx=None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    sparse_mode: int = 0,
    pse_type: int = 1,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
):
    """Float64 forward of FlashAttentionScore / FlashAttentionVarLenScore.

    Returns ``(attention_out, softmax_max, softmax_sum)``, all float64: attention_out in ``input_layout`` with
    the value head dim, softmax_max/softmax_sum [B, N1, Sq, 8] (TND: [T, N1, 8], laid out per
    ``softmax_layout``).
    Fully masked rows give output 0, softmax_max = -FLT_MAX and softmax_sum = +FLT_MAX. With `sink` ([N1]) every
    row's softmax has one more logit sink[h] whose column is dropped before P V (docs/semantics/sinks.md); the
    statistics then include it (a row without visible keys: max = sink, sum = 1, output 0). Differentiable in float64
    with respect to every input, the sink included (the grad oracle).
    """
    return _forward(
        query,
        key,
        value,
        head_num,
        input_layout,
        pse=pse,
        drop_mask=drop_mask,
        atten_mask=atten_mask,
        prefix=prefix,
        actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen,
        q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx,
        scale_value=scale_value,
        keep_prob=keep_prob,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        sparse_mode=sparse_mode,
        pse_type=pse_type,
        softmax_layout=softmax_layout,
        dtype=torch.float64,
        stats_dtype=torch.float64,
        sink=sink,
    )


def naive_same_dtype_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    drop_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    q_start_idx=None,
    kv_start_idx=None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    sparse_mode: int = 0,
    pse_type: int = 1,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
):
    """The oracle's code path run in the query dtype (plain PyTorch, no upcast).

    This is the "naive same-dtype" reference of the flash-attn precision rule (docs/semantics/precision.md).
    attention_out has the query dtype; the stats are computed in the query dtype and returned as float32.
    """
    return _forward(
        query,
        key,
        value,
        head_num,
        input_layout,
        pse=pse,
        drop_mask=drop_mask,
        atten_mask=atten_mask,
        prefix=prefix,
        actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen,
        q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx,
        scale_value=scale_value,
        keep_prob=keep_prob,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        sparse_mode=sparse_mode,
        pse_type=pse_type,
        softmax_layout=softmax_layout,
        dtype=query.dtype,
        stats_dtype=torch.float32,
        sink=sink,
    )
