"""Triton kernels of LightningIndexer (scores + top-k) and SparseLightningIndexerGradKLLoss
(docs/operators/lightning_indexer.md).

Scores: I[t, s] = sum_h w[t, h] * ReLU(q_idx[t, h] . k_idx[s]). One program scores one query row against a block of
BLOCK_N keys, index heads as the M dimension of tl.dot, and writes int64 sort keys (the fp32 score's bits made
order-preserving in the high word, 0xFFFFFFFF - column in the low word; disallowed keys get INT64_MIN), so that
every key is distinct and the largest keys are exactly "descending score, ties to the smaller index". The selection
step is then torch.topk over those keys (any top-k algorithm gives the same answer on distinct keys, on the GPU
too); scores are decoded from the chosen keys, rows are processed in slabs to bound the key buffer.

KL loss backward, one program per query row, two kernels:
1. over the row's examined entries (first k_t = min(K, allowed), -1 / out-of-range skipped, `indexer_selection`
   rule): the target p_j = mean_h exp(scale * q_h.k_j - softmax_max[h]) / softmax_sum[h] (main heads in groups
   against one gathered latent chunk) and the index score I_j, both stored per entry, plus the online max/sum of I;
2. q_j = softmax(I), the clamped KL terms, dI = q - p, dW, d_query_index in registers and d_key_index scattered
   with fp32 atomics, or for deterministic=True written per (row, entry) and reduced per key in sorted order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .jit import device_function
from .sparse_attention import (
    DETERMINISTIC_WORKSPACE_BYTES,
    _next_pow2,
    _pages3,
    _precision,
    _rows2,
    _rows3,
    deterministic_scatter_add,
    laid_out_like,
    paged_key_slots,
)
from .sparse_plan import RowTables, interpreting

# Constants used inside kernels must be constexpr globals.
KL_CLAMP = tl.constexpr(1e-8)
INT64_MIN = tl.constexpr(-(2**63))
LOW_WORD = tl.constexpr(0xFFFFFFFF)
TOPK_KEY_BYTES = 1 << 30  # sort-key buffer per slab of query rows
MAX_GRID_Y = 65535  # CUDA's limit on grid axes y and z


@device_function
def examined_keys(row_idx, start, n_exam, thr, kv0, BLOCK_N: tl.constexpr):
    """Entries [start, start + BLOCK_N) of a query row's selection (row_idx: its sparse_indices) under the
    `indexer_selection` rule: (e, in_exam, valid, key_row) with in_exam = e < n_exam (the first min(K, allowed)
    entries), valid = in_exam, idx >= 0 and idx < thr, key_row = kv0 + idx (kv0 where not valid)."""
    e = start + tl.arange(0, BLOCK_N)
    in_exam = e < n_exam
    idx = tl.load(row_idx + e, mask=in_exam, other=-1)
    valid = in_exam & (idx >= 0) & (idx < thr)
    return e, in_exam, valid, kv0 + tl.where(valid, idx, 0).to(tl.int64)


# ----------------------------------------------------------------------------------------------------------
# LightningIndexer
# ----------------------------------------------------------------------------------------------------------
@device_function
def index_row(QI, W, r, stride_qt, stride_qh, stride_wt, H, DI, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query row r of an indexer: (q [BLOCK_H, BLOCK_D] its index heads, w [BLOCK_H] its fp32 weights, zero past
    H heads / DI channels; offs_d and d_ok, the channel offsets and their mask for the key loads)."""
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < DI
    q = tl.load(QI + r * stride_qt + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(W + r * stride_wt + heads, mask=h_ok, other=0.0).to(tl.float32)
    return q, w, offs_d, d_ok


@triton.jit
def _index_keys_kernel(QI, KI, W, KV_START, THR, KEYS, BT, QS, KS, row0, width,
                       stride_qt, stride_qh, stride_kt, stride_wt, stride_keys, stride_kb, stride_sb,
                       H, DI, PRECISION: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                       QUANT: tl.constexpr):
    """KEYS[r - row0, s] for keys s of block program_id(0) (INT64_MIN where s >= thr(r)). PAGE > 0: KI is a paged
    cache [block_num, PAGE, D] read in place through the block table BT (KV_START: each row's offset into BT;
    docs/semantics/paged-kv.md). QUANT (QuantLightningIndexer): QI / KI hold the int8 / fp8 values (exactly, as
    fp16 or fp32) and each dot product is scaled by QS[r, h] * KS[s] before the ReLU (problem/dequant.py); KS is
    [rows] or, paged, [block_num, PAGE] read through the same table."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = row0 + tl.program_id(1).to(tl.int64)
    thr = tl.load(THR + r)
    allowed = cols < thr
    out = KEYS + (r - row0) * stride_keys + cols
    if tl.program_id(0) * BLOCK_N < thr:
        q, w, offs_d, d_ok = index_row(QI, W, r, stride_qt, stride_qh, stride_wt, H, DI, BLOCK_H, BLOCK_D)
        kv0 = tl.load(KV_START + r)
        if PAGE > 0:
            block, slot = paged_key_slots(kv0 + cols, kv0, allowed, BT, PAGE)
            k_off = block * stride_kb + slot * stride_kt
            s_off = block * stride_sb + slot
        else:
            k_off = (kv0 + cols) * stride_kt
            s_off = kv0 + cols
        k = tl.load(KI + k_off[:, None] + offs_d[None, :], mask=allowed[:, None] & d_ok[None, :], other=0.0)
        dots = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if QUANT:
            heads = tl.arange(0, BLOCK_H)
            qs = tl.load(QS + r * H + heads, mask=heads < H, other=0.0)
            ks = tl.load(KS + s_off, mask=allowed, other=0.0)
            dots = dots * (qs[:, None] * ks[None, :])
        relu = tl.maximum(dots, 0.0)
        score = tl.sum(relu * w[:, None], 0)
        score = tl.where(score == 0.0, 0.0, score)  # -0 sorts like +0 (ties to the smaller index)
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        key = (ordered << 32) | (tl.full([BLOCK_N], LOW_WORD, tl.int64) - cols.to(tl.int64))
        tl.store(out, tl.where(allowed, key, INT64_MIN), mask=cols < width)
    else:
        tl.store(out, tl.full([BLOCK_N], INT64_MIN, tl.int64), mask=cols < width)


def _decode_scores(keys: torch.Tensor) -> torch.Tensor:
    """fp32 scores from sort keys (inverse of the kernel's encoding)."""
    ordered = (keys >> 32).to(torch.int32)
    bits = torch.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.view(torch.float32)


def lightning_top_k(query_index: torch.Tensor, key_index: torch.Tensor, weights: torch.Tensor, tables: RowTables,
                    sparse_count: int, indices_out: torch.Tensor, values_out: torch.Tensor | None,
                    block_table: torch.Tensor | None = None, query_scale: torch.Tensor | None = None,
                    key_scale: torch.Tensor | None = None) -> None:
    """Fill indices_out [R, K] (int32, pre-filled with -1) and values_out [R, K] (pre-filled with -inf). With
    `block_table`, key_index is a paged cache [block_num, block_size, 1, D] read in place. With `query_scale`
    ([.., H], per row and head) and `key_scale` (the key's leading dims, paged like it), int8 / float8_e4m3fn inputs
    are scored as QuantLightningIndexer (their values are exact in fp16, so the GPU's fp16 dot products with fp32
    accumulation are those of the quantised values)."""
    rows = tables.rows
    width = tables.max_positions  # the largest allowed-key count of any row
    if rows == 0 or width == 0:
        return
    interp = interpreting()
    quant = query_scale is not None
    work = torch.float32 if interp else (torch.float16 if quant else query_index.dtype)
    qi = _rows3(query_index, rows, work)
    ki = _pages3(key_index, work) if block_table is not None else _rows2(key_index, work)
    stride_kb, stride_kt = (ki.stride(0), ki.stride(1)) if block_table is not None else (0, ki.stride(0))
    # Tiny; fp32 in-kernel anyway. Contiguous: the kernels read a row's heads at unit stride.
    w = weights.reshape(rows, weights.shape[-1]).float().contiguous()
    heads, di = qi.shape[1], qi.shape[2]
    block_h = _next_pow2(heads, 1 if interp else 16)
    block_d = _next_pow2(di, 1 if interp else 16)
    block_n = min(_next_pow2(width, 1), 256) if interp else 64
    k = min(sparse_count, width)
    # Rows go on grid axis y, which allows at most 65535 programs.
    slab = max(1, min(rows, TOPK_KEY_BYTES // (width * 8), MAX_GRID_Y))
    qs = w if not quant else query_scale.reshape(rows, heads).float().contiguous()
    ks = w if not quant else (key_scale.reshape(key_scale.shape[0], -1) if block_table is not None
                              else key_scale.reshape(-1)).float().contiguous()
    stride_sb = ks.stride(0) if quant and block_table is not None else 0
    for row0 in range(0, rows, slab):
        n = min(slab, rows - row0)
        keys = torch.empty((n, width), dtype=torch.int64, device=qi.device)
        grid = (triton.cdiv(width, block_n), n)
        _index_keys_kernel[grid](qi, ki, w, tables.kv_start, tables.thr, keys,
                                 tables.kv_start if block_table is None else block_table, qs, ks, row0, width,
                                 qi.stride(0), qi.stride(1), stride_kt, w.stride(0), keys.stride(0), stride_kb,
                                 stride_sb, heads, di, PRECISION=_precision(work), BLOCK_H=block_h, BLOCK_D=block_d,
                                 BLOCK_N=block_n, PAGE=0 if block_table is None else key_index.shape[1], QUANT=quant,
                                 **({} if interp else {"num_warps": 4}))
        top, order = torch.topk(keys, k, dim=-1, sorted=True)
        taken = torch.arange(k, device=keys.device).view(1, -1) < tables.thr[row0 : row0 + n].view(-1, 1)
        indices_out[row0 : row0 + n, :k] = torch.where(taken, order, -1).to(torch.int32)
        if values_out is not None:
            values = torch.where(taken, _decode_scores(top), float("-inf"))
            values_out[row0 : row0 + n, :k] = values.to(values_out.dtype)


# ----------------------------------------------------------------------------------------------------------
# SparseLightningIndexerGradKLLoss
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _kl_prepare_kernel(Q, QR, K, KR, MAX, SUM, QI, KI, W, IDX, KV_START, THR, P, S, STATS,
                       scale, width,
                       stride_qt, stride_qh, stride_qrt, stride_qrh, stride_kt, stride_krt, stride_qit, stride_qih,
                       stride_kit, stride_wt, stride_it, K_ENTRIES,
                       N1, D, DR, H, DI,
                       HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_HM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr):
    """P[r, e] = head-averaged main-attention probability, S[r, e] = index score (-inf: entry not counted),
    STATS[r] = (max, sum of exp(S - max)) of the row."""
    r = tl.program_id(0).to(tl.int64)
    thr = tl.load(THR + r)
    kv0 = tl.load(KV_START + r)
    n_exam = tl.minimum(thr, K_ENTRIES)  # k_t = min(K, allowed)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_r = tl.arange(0, BLOCK_DR)
    r_ok = offs_r < DR
    qi, w, offs_di, di_ok = index_row(QI, W, r, stride_qit, stride_qih, stride_wt, H, DI, BLOCK_H, BLOCK_DI)
    # Online max / sum of exp of the index scores, per lane (merged after the loop).
    m_vec = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_vec = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_exam, BLOCK_N):
        e, in_exam, valid, key_row = examined_keys(IDX + r * stride_it, start, n_exam, thr, kv0, BLOCK_N)
        # Target distribution: main heads in groups of BLOCK_HM against the gathered latent chunk.
        k = tl.load(K + key_row[:, None] * stride_kt + offs_d[None, :], mask=valid[:, None] & d_ok[None, :],
                    other=0.0)
        if HAS_ROPE:
            kr = tl.load(KR + key_row[:, None] * stride_krt + offs_r[None, :], mask=valid[:, None] & r_ok[None, :],
                         other=0.0)
        p_sum = tl.zeros([BLOCK_N], tl.float32)
        for h0 in range(0, N1, BLOCK_HM):
            heads = h0 + tl.arange(0, BLOCK_HM)
            h_ok = heads < N1
            q = tl.load(Q + r * stride_qt + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :],
                        mask=h_ok[:, None] & d_ok[None, :], other=0.0)
            z = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if HAS_ROPE:
                qr = tl.load(QR + r * stride_qrt + heads[:, None].to(tl.int64) * stride_qrh + offs_r[None, :],
                             mask=h_ok[:, None] & r_ok[None, :], other=0.0)
                z += tl.dot(qr, tl.trans(kr), input_precision=PRECISION)
            m = tl.load(MAX + r * N1 + heads, mask=h_ok, other=0.0)
            inv_l = 1.0 / tl.load(SUM + r * N1 + heads, mask=h_ok, other=1.0)
            prob = tl.exp(z * scale - m[:, None]) * inv_l[:, None]
            p_sum += tl.sum(tl.where(h_ok[:, None], prob, 0.0), 0)
        p = tl.where(valid, p_sum / N1, 0.0)
        # Index scores of the same entries.
        ki = tl.load(KI + key_row[:, None] * stride_kit + offs_di[None, :], mask=valid[:, None] & di_ok[None, :],
                     other=0.0)
        relu = tl.maximum(tl.dot(qi, tl.trans(ki), input_precision=PRECISION), 0.0)
        s = tl.where(valid, tl.sum(relu * w[:, None], 0), float("-inf"))
        m_new = tl.maximum(m_vec, s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_vec = l_vec * tl.exp(m_vec - m_use) + tl.exp(s - m_use)
        m_vec = m_new
        tl.store(P + r * width + e, p, mask=in_exam)
        tl.store(S + r * width + e, s, mask=in_exam)
    m_row = tl.max(m_vec, 0)
    m_row_use = tl.where(m_row == float("-inf"), 0.0, m_row)
    tl.store(STATS + r * 2, m_row)
    tl.store(STATS + r * 2 + 1, tl.sum(l_vec * tl.exp(m_vec - m_row_use), 0))


@triton.jit
def _kl_grad_kernel(QI, KI, W, IDX, KV_START, THR, P, S, STATS, DQI, DW, DKI, KEYS, LOSS,
                    width, row0, det_width,
                    stride_qit, stride_qih, stride_kit, stride_wt, stride_it, stride_dqt, stride_dqh, stride_dwt,
                    stride_dki, K_ENTRIES, H, DI,
                    DETERMINISTIC: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr):
    """Loss of row r and its gradients. DKI: fp32 [R2, DI] accumulator, or (DETERMINISTIC) the [items, DI]
    workspace of the slab starting at row0 with item = (r - row0) * det_width + e and KEYS[item] its key row."""
    r = row0 + tl.program_id(0).to(tl.int64)
    thr = tl.load(THR + r)
    kv0 = tl.load(KV_START + r)
    n_exam = tl.minimum(thr, K_ENTRIES)
    m_i = tl.load(STATS + r * 2)
    inv_l = 1.0 / tl.load(STATS + r * 2 + 1)
    qi, w, offs_d, d_ok = index_row(QI, W, r, stride_qit, stride_qih, stride_wt, H, DI, BLOCK_H, BLOCK_DI)
    heads = tl.arange(0, BLOCK_H)  # for the dQ / dW stores
    h_ok = heads < H
    dq = tl.zeros([BLOCK_H, BLOCK_DI], tl.float32)
    dw = tl.zeros([BLOCK_H], tl.float32)
    loss = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_exam, BLOCK_N):
        e, in_exam, valid, key_row = examined_keys(IDX + r * stride_it, start, n_exam, thr, kv0, BLOCK_N)
        ki = tl.load(KI + key_row[:, None] * stride_kit + offs_d[None, :], mask=valid[:, None] & d_ok[None, :],
                     other=0.0)
        relu = tl.maximum(tl.dot(qi, tl.trans(ki), input_precision=PRECISION), 0.0)  # [BLOCK_H, BLOCK_N]
        s = tl.load(S + r * width + e, mask=valid, other=float("-inf"))
        p = tl.load(P + r * width + e, mask=valid, other=0.0)
        q = tl.where(valid, tl.exp(s - m_i) * inv_l, 0.0)
        p_c = tl.maximum(p, KL_CLAMP)
        q_c = tl.maximum(q, KL_CLAMP)
        loss += tl.where(valid, p_c * (tl.log(p_c) - tl.log(q_c)), 0.0)
        d_s = tl.where(valid, q - p, 0.0)  # dI = q - p (docs/operators/lightning_indexer.md)
        dw += tl.sum(relu * d_s[None, :], 1)
        ds = tl.where(relu > 0, d_s[None, :] * w[:, None], 0.0)
        ds_in = ds.to(ki.dtype)
        dq += tl.dot(ds_in, ki, input_precision=PRECISION)
        dk_part = tl.dot(tl.trans(ds_in), qi, input_precision=PRECISION)  # [BLOCK_N, BLOCK_DI]
        if DETERMINISTIC:
            item = (r - row0) * det_width + e
            tl.store(KEYS + item, tl.where(valid, key_row, -1), mask=in_exam)
            tl.store(DKI + item[:, None] * stride_dki + offs_d[None, :], dk_part, mask=in_exam[:, None] & d_ok[None, :])
        else:
            tl.atomic_add(DKI + key_row[:, None] * stride_dki + offs_d[None, :], dk_part,
                          mask=valid[:, None] & d_ok[None, :], sem="relaxed")
    tl.store(DQI + r * stride_dqt + heads[:, None].to(tl.int64) * stride_dqh + offs_d[None, :],
             dq.to(DQI.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
    tl.store(DW + r * stride_dwt + heads, dw.to(DW.dtype.element_ty), mask=h_ok)
    tl.store(LOSS + r, tl.sum(loss, 0))


def kl_loss_backward(query: torch.Tensor, key: torch.Tensor, query_index: torch.Tensor, key_index: torch.Tensor,
                     weights: torch.Tensor, indices: torch.Tensor, softmax_max: torch.Tensor,
                     softmax_sum: torch.Tensor, query_rope: torch.Tensor | None, key_rope: torch.Tensor | None,
                     tables: RowTables, scale: float, deterministic: bool):
    """(d_query_index, d_key_index, d_weights, loss [1] fp32) of SparseLightningIndexerGradKLLoss; `indices` is
    sparse_indices as [R, K]."""
    rows = tables.rows
    dev = query_index.device
    interp = interpreting()
    work = torch.float32 if interp else query_index.dtype
    heads, di = query_index.shape[-2], query_index.shape[-1]
    n1, d = query.shape[-2], query.shape[-1]
    has_rope = query_rope is not None
    dr = query_rope.shape[-1] if has_rope else 0
    ki = _rows2(key_index, work)
    d_key_index = torch.zeros((ki.shape[0], di), dtype=torch.float32, device=dev)
    d_query_index = torch.zeros((rows, heads, di), dtype=work, device=dev)
    w = weights.reshape(rows, heads).float().contiguous()  # the kernel reads a row's heads at unit stride
    d_weights = torch.zeros((rows, heads), dtype=torch.float32, device=dev)
    loss_rows = torch.zeros(rows, dtype=torch.float32, device=dev)
    width = min(indices.shape[-1], tables.max_positions)  # entries any row examines
    if rows and width:
        q3, k2 = _rows3(query, rows, work), _rows2(key, work)
        qr3 = _rows3(query_rope, rows, work) if has_rope else q3
        kr2 = _rows2(key_rope, work) if has_rope else k2
        qi = _rows3(query_index, rows, work)
        stat_max = softmax_max.float().contiguous()
        stat_sum = softmax_sum.float().contiguous()
        p_buf = torch.empty((rows, width), dtype=torch.float32, device=dev)
        s_buf = torch.empty((rows, width), dtype=torch.float32, device=dev)
        stats = torch.empty((rows, 2), dtype=torch.float32, device=dev)
        floor = 1 if interp else 16
        block_n = min(_next_pow2(width, 1), 512) if interp else 32
        # 32 main heads per step with 2 stages: 84-88 KB of shared memory and no spills at D = 512 + 64, where
        # 64 heads with 3 stages needed 240-384 KB, over Hopper's 227 KB per block (sm_90 AOT compile); fp32
        # operands take 16 heads.
        block_hm = _next_pow2(n1, floor) if interp else min(16 if work == torch.float32 else 32, _next_pow2(n1, 16))
        common = dict(PRECISION=_precision(work), BLOCK_N=block_n)
        block_h, block_di = _next_pow2(heads, floor), _next_pow2(di, floor)
        _kl_prepare_kernel[(rows,)](
            q3, qr3, k2, kr2, stat_max, stat_sum, qi, ki, w, indices, tables.kv_start, tables.thr, p_buf, s_buf,
            stats, float(scale), width, q3.stride(0), q3.stride(1), qr3.stride(0), qr3.stride(1), k2.stride(0),
            kr2.stride(0), qi.stride(0), qi.stride(1), ki.stride(0), w.stride(0), indices.stride(0),
            indices.shape[-1], n1, d, dr, heads, di, HAS_ROPE=has_rope, BLOCK_HM=block_hm,
            BLOCK_D=_next_pow2(d, floor), BLOCK_DR=_next_pow2(dr, floor) if dr else floor, BLOCK_H=block_h,
            BLOCK_DI=block_di, **common, **({} if interp else {"num_warps": 8, "num_stages": 2}))

        def launch(grid_rows, row0, det_width, dki, keys, det):
            _kl_grad_kernel[(grid_rows,)](
                qi, ki, w, indices, tables.kv_start, tables.thr, p_buf, s_buf, stats, d_query_index, d_weights,
                dki, keys, loss_rows, width, row0, det_width, qi.stride(0), qi.stride(1), ki.stride(0),
                w.stride(0), indices.stride(0), d_query_index.stride(0), d_query_index.stride(1),
                d_weights.stride(0), dki.stride(0), indices.shape[-1], heads, di, DETERMINISTIC=det, BLOCK_H=block_h,
                BLOCK_DI=block_di, **common, **({} if interp else {"num_warps": 4}))

        if not deterministic:
            launch(rows, 0, 0, d_key_index, d_key_index, False)
        else:
            det_width = triton.cdiv(width, block_n) * block_n  # every chunk position has an item
            slab = max(1, min(rows, DETERMINISTIC_WORKSPACE_BYTES // (det_width * di * 4)))
            for row0 in range(0, rows, slab):
                n = min(slab, rows - row0)
                keys = torch.full((n * det_width,), -1, dtype=torch.int64, device=dev)
                work_buf = torch.empty((n * det_width, di), dtype=torch.float32, device=dev)
                launch(n, row0, det_width, work_buf, keys, True)
                deterministic_scatter_add(keys, work_buf, d_key_index)
    loss = loss_rows.double().sum().float().view(1)  # summed over all tokens (fixed order)
    return (laid_out_like(d_query_index, query_index), laid_out_like(d_key_index, key_index),
            laid_out_like(d_weights, weights), loss)
