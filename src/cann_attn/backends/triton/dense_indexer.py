"""Triton kernel of DenseLightningIndexerSoftmaxLse (docs/operators/dense_lightning_indexer.md): the indexer softmax
statistics over every visible key, max_s I[t, s] and sum_s exp(I[t, s] - max), with
I[t, s] = sum_h w[t, h] ReLU(q_idx[t, h] . k_idx[s]) in fp32.

One program per query row walks its visible keys [0, thr) in chunks of BLOCK_N (index heads as the M dimension of
tl.dot, as the LightningIndexer scoring kernel), keeping the online max and sum; no score leaves registers. Rows
with no visible key (thr = 0) get INVALID_MAX and 0 (docs/semantics/invalid-rows.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .indexer import index_row
from .sparse_attention import INVALID_MAX, _next_pow2, _precision, _rows2, _rows3
from .sparse_plan import RowTables, interpreting


@triton.jit
def _dense_lse_kernel(QI, KI, W, KV_START, THR, MAX, SUM, stride_qt, stride_qh, stride_kt, stride_wt, H, DI,
                      PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    thr = tl.load(THR + r)
    kv0 = tl.load(KV_START + r)
    q, w, offs_d, d_ok = index_row(QI, W, r, stride_qt, stride_qh, stride_wt, H, DI, BLOCK_H, BLOCK_D)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    for start in range(0, thr, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        visible = cols < thr
        k = tl.load(KI + (kv0 + cols)[:, None] * stride_kt + offs_d[None, :], mask=visible[:, None] & d_ok[None, :],
                    other=0.0)
        relu = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0)
        score = tl.where(visible, tl.sum(relu * w[:, None], 0), float("-inf"))
        # Every chunk holds a visible key (start < thr): m_new is finite from the first chunk on.
        m_new = tl.maximum(m_i, tl.max(score, 0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(score[None, :] - m_new[:, None]), 1)
        m_i = m_new
    one = tl.arange(0, 1)
    tl.store(MAX + r + one, tl.where(thr > 0, m_i, INVALID_MAX))
    tl.store(SUM + r + one, tl.where(thr > 0, l_i, 0.0))


def dense_softmax_lse(query_index: torch.Tensor, key_index: torch.Tensor, weights: torch.Tensor, tables: RowTables,
                      max_out: torch.Tensor, sum_out: torch.Tensor) -> None:
    """Fill max_out / sum_out (fp32, R elements in query-row order: (B, 1, S1) or (1, T1)) for every row."""
    rows = tables.rows
    if rows == 0:
        return
    interp = interpreting()
    work = torch.float32 if interp else query_index.dtype  # the interpreter's 16-bit dots are wrong
    qi = _rows3(query_index, rows, work)
    ki = _rows2(key_index, work)
    w = weights.reshape(rows, weights.shape[-1]).float().contiguous()
    heads, di = qi.shape[1], qi.shape[2]
    floor = 1 if interp else 16  # tl.dot's minimum on GPUs
    block_n = min(_next_pow2(tables.max_positions, 1), 256) if interp else 64
    _dense_lse_kernel[(rows,)](qi, ki, w, tables.kv_start, tables.thr, max_out, sum_out, qi.stride(0), qi.stride(1),
                               ki.stride(0), w.stride(0), heads, di, PRECISION=_precision(work),
                               BLOCK_H=_next_pow2(heads, floor), BLOCK_D=_next_pow2(di, floor), BLOCK_N=block_n,
                               **({} if interp else {"num_warps": 4}))
