"""Triton FlashAttention backward (FlashAttentionScoreGradV2) over a canonical dense problem (docs/semantics/pse.md,
docs/semantics/dropout.md, docs/semantics/softmax-stats.md).

Three launches, all driven by the `dense_plan` table (varlen TND in one launch each):

1. `_delta_kernel`: Dsum = rowsum(dY * O) in fp32 (docs/semantics/dropout.md), one value per (sequence, head, row).
2. `_dkdv_kernel`, grid (key blocks, N2 kv heads, sequences): each program owns a key block and loops over the
   G query heads of its GQA group and over the query blocks the band lets see that key block, accumulating
   dK / dV in registers. Nothing is shared between programs, so dK / dV are deterministic (no atomics).
3. `_dq_kernel`, grid (query blocks, N1, sequences): the forward's key loop again, accumulating dQ in
   registers (deterministic), and dpse of a type 0/1 pse tensor.

Like `backends/reference/flash_backward.py`, P is recomputed from the GIVEN statistics without renormalisation:
P = exp(S - max) / sum, dP_d = dP * keep / keep_prob, dS = P * (dP_d - Dsum), dV = (P * keep / keep_prob)^T dY,
dQ = scale dS K, dK = scale dS^T Q; dpse = scale * dS (type 1) or dS (type 0), reduced over the pse's
broadcast dimensions. dpse elements that one (sequence, head, i, j) owns alone are stored directly; where
several share an element (batch-broadcast pse with more than one sequence, row-broadcast pse, the 1024-row
compressed pse) the kernel uses fp32 `tl.atomic_add`, so those dpse results are not bitwise deterministic
(dq / dk / dv still are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...problem import sink as sinks
from ...problem.attention import AttentionProblem
from . import dense_tiles as tiles
from .dense_forward import _launcher, common_flags, interpreter_block, mask_pse_args
from .dense_plan import DensePlan, build_plan
from .dense_tiles import (
    C_DELTA,
    C_DK,
    C_DPSE,
    C_DQ,
    C_DROP,
    C_DV,
    C_DY,
    C_K,
    C_MASK,
    C_O,
    C_PSE,
    C_PSE_COMP,
    C_Q,
    C_SEQ_KV,
    C_SEQ_Q,
    C_SLOPE,
    C_STAT,
    C_STAT_HS,
    C_V,
    INTERPRET,
    NCOL,
)


@triton.jit
def _delta_kernel(O, DY, DELTA, TAB, soh, sos, sod, sdyh, sdys, sdyd,
                  DV: tl.constexpr, BLOCK_DV: tl.constexpr, OFF_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr):
    h = tl.program_id(1)
    row = TAB + tl.program_id(2).to(tl.int64) * NCOL
    seq_q = tl.load(row + C_SEQ_Q).to(tl.int32)
    i0 = tl.program_id(0) * BLOCK_M
    if i0 >= seq_q:
        return
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    ok = (offs_m[:, None] < seq_q) & (offs_d[None, :] < DV)
    o_base = O + tiles.tensor_offset(row, C_O, OFF_ALIGN) + h * soh
    dy_base = DY + tiles.tensor_offset(row, C_DY, OFF_ALIGN) + h * sdyh
    o = tl.load(o_base + offs_m[:, None] * sos + offs_d[None, :] * sod, mask=ok, other=0.0)
    dy = tl.load(dy_base + offs_m[:, None] * sdys + offs_d[None, :] * sdyd, mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * dy.to(tl.float32), 1)
    tl.store(DELTA + tl.load(row + C_DELTA) + h * seq_q + offs_m, delta, mask=offs_m < seq_q)


@tiles.device_function
def _row_stats(SMAX, SSUM, DELTA, row, h, offs_m, seq_q, stat_rs):
    """max (log2 units), 1 / sum and Dsum of rows offs_m; rows past Sq get harmless finite values. A fully
    masked row (max -FLT_MAX, docs/semantics/invalid-rows.md) gets max +inf: its P is 0 without overflowing exp2
    (every entry of
    such a row is masked anyway)."""
    ok = offs_m < seq_q
    stat = tl.load(row + C_STAT) + h * tl.load(row + C_STAT_HS) + offs_m * stat_rs
    m = tl.load(SMAX + stat, mask=ok, other=0.0)
    m2 = tl.where(m > -tiles.FLT_MAX, m, float("inf")) * tiles.LOG2E
    inv_l = 1.0 / tl.load(SSUM + stat, mask=ok, other=1.0)
    delta = tl.load(DELTA + tl.load(row + C_DELTA) + h * seq_q + offs_m, mask=ok, other=0.0)
    return m2, inv_l, delta


@triton.jit
def _dkdv_kernel(
    Q, K, V, DY, DK, DV_, SMAX, SSUM, DELTA, TAB, MASK, PSE, SLOPES, DROP,
    sqh, sqs, sqd, skh, sks, skd, svh, svs, svd, sdyh, sdys, sdyd, sdkh, sdks, sdkd, sdvh, sdvs, sdvd,
    stat_rs, mask_hs, mask_rs, mask_cs, pse_hs, pse_rs, pse_cs, slope_hs,
    q_start, kv_start, qk_scale, scale, pse_mul, inv_keep,
    GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_MASK: tl.constexpr, PSE_KIND: tl.constexpr, COMPRESSED: tl.constexpr, HAS_DROP: tl.constexpr,
    BANDED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, OFF_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    kvh = tl.program_id(1)
    row = TAB + tl.program_id(2).to(tl.int64) * NCOL
    seq_kv = tl.load(row + C_SEQ_KV).to(tl.int32)
    j0 = tl.program_id(0) * BLOCK_N
    if j0 >= seq_kv:
        return
    seq_q = tl.load(row + C_SEQ_Q).to(tl.int32)
    lower, upper, prefix = tiles.band_bounds(row)

    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < seq_kv
    j2 = offs_n[:, None]  # key-major tiles: keys on axis 0, queries on axis 1
    k_base = K + tiles.tensor_offset(row, C_K, OFF_ALIGN) + kvh * skh
    v_base = V + tiles.tensor_offset(row, C_V, OFF_ALIGN) + kvh * svh
    k = tl.load(k_base + offs_n[:, None] * sks + offs_dq[None, :] * skd,
                mask=col_ok[:, None] & (offs_dq[None, :] < DQK), other=0.0)
    v = tl.load(v_base + offs_n[:, None] * svs + offs_dv[None, :] * svd,
                mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    # Query rows that may see keys [j0, j_last]: i <= j_last - lower, and i >= j0 - upper unless a key of the
    # block lies inside the prefix (then every row may see it).
    j_last = tl.minimum(j0 + BLOCK_N, seq_kv) - 1
    i_lo = tl.where(j0 < prefix, 0, tl.maximum(j0 - upper, 0))
    i_hi = tl.minimum(seq_q, j_last - lower + 1)
    start = (i_lo // BLOCK_M) * BLOCK_M
    # Query tiles with full_lo <= i0 <= full_hi (and inside Sq) see every key of this block: no elementwise
    # mask. d_min = j0 - (i0 + BLOCK_M - 1) >= lower; d_max = j0 + BLOCK_N - 1 - i0 <= upper, or the whole
    # block inside the prefix.
    cols_full = j0 + BLOCK_N <= seq_kv
    full_hi = j0 - lower - BLOCK_M + 1
    full_lo = tl.where(j0 + BLOCK_N <= prefix, 0, j0 + BLOCK_N - 1 - upper)

    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dq_ok = offs_dq < DQK
    dv_ok = offs_dv < DV
    q_off = tiles.tensor_offset(row, C_Q, OFF_ALIGN)
    dy_off = tiles.tensor_offset(row, C_DY, OFF_ALIGN)
    mask_row = 0
    if HAS_MASK:
        mask_row = tl.load(row + C_MASK)
    pse_row = 0
    comp = 0
    slope_row = 0
    if PSE_KIND == 1:
        pse_row = tl.load(row + C_PSE)
        comp = tl.load(row + C_PSE_COMP)
    if PSE_KIND >= 2:
        slope_row = tl.load(row + C_SLOPE)
    drop_base = 0
    if HAS_DROP:
        drop_base = tl.load(row + C_DROP)
    for g in range(GROUP):
        h = kvh * GROUP + g
        q_head = Q + q_off + h * sqh
        dy_head = DY + dy_off + h * sdyh
        for i0 in tl.range(start, i_hi, BLOCK_M):
            offs_m = i0 + offs_mb
            row_ok = offs_m < seq_q
            i2 = offs_m[None, :]
            q = tl.load(q_head + offs_m[:, None] * sqs + offs_dq[None, :] * sqd,
                        mask=row_ok[:, None] & dq_ok[None, :], other=0.0)
            dy = tl.load(dy_head + offs_m[:, None] * sdys + offs_dv[None, :] * sdyd,
                         mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                dy = dy.to(tl.float32)
            m2, inv_l, delta = _row_stats(SMAX, SSUM, DELTA, row, h, offs_m, seq_q, stat_rs)
            st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
            if PSE_KIND != 0:
                st += tiles.bias_log2(PSE, pse_row + h.to(tl.int64) * pse_hs, SLOPES, slope_row + h * slope_hs, i2,
                                      j2, seq_q, seq_kv, comp, pse_rs, pse_cs, q_start, kv_start, pse_mul, PSE_KIND,
                                      COMPRESSED)
            pt = tl.math.exp2(st - m2[None, :]) * inv_l[None, :]
            if HAS_MASK:
                vis = tiles.visible(i2, j2, seq_q, seq_kv, lower, upper, prefix)
                vis &= tiles.explicit_visible(MASK, mask_row + h.to(tl.int64) * mask_hs, i2, j2, seq_q, seq_kv,
                                              mask_rs, mask_cs)
                pt = tl.where(vis, pt, 0.0)
            elif not (cols_full & (i0 + BLOCK_M <= seq_q) & (i0 <= full_hi) & (i0 >= full_lo)):
                pt = tl.where(tiles.visible(i2, j2, seq_q, seq_kv, lower, upper, prefix), pt, 0.0)
            dpt = tl.dot(v, tl.trans(dy), input_precision=PRECISION)
            if HAS_DROP:
                keep = tiles.keep_bits(DROP, drop_base, h, i2, j2, seq_q, seq_kv)
                pdt = tl.where(keep, pt * inv_keep, 0.0)
                dpt = tl.where(keep, dpt * inv_keep, 0.0)
            else:
                pdt = pt
            dv += tl.dot(pdt.to(dy.dtype), dy, input_precision=PRECISION)
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)

    dk_base = DK + tiles.tensor_offset(row, C_DK, OFF_ALIGN) + kvh * sdkh
    dv_base = DV_ + tiles.tensor_offset(row, C_DV, OFF_ALIGN) + kvh * sdvh
    tl.store(dk_base + offs_n[:, None] * sdks + offs_dq[None, :] * sdkd, (dk * scale).to(DK.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dq[None, :] < DQK))
    tl.store(dv_base + offs_n[:, None] * sdvs + offs_dv[None, :] * sdvd, dv.to(DV_.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _dq_kernel(
    Q, K, V, DY, DQ, SMAX, SSUM, DELTA, TAB, MASK, PSE, SLOPES, DROP, DPSE,
    sqh, sqs, sqd, skh, sks, skd, svh, svs, svd, sdyh, sdys, sdyd, sdqh, sdqs, sdqd,
    stat_rs, mask_hs, mask_rs, mask_cs, pse_hs, pse_rs, pse_cs, slope_hs, dpse_hs, dpse_rs, dpse_cs,
    q_start, kv_start, qk_scale, scale, pse_mul, dpse_mul, inv_keep,
    GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_MASK: tl.constexpr, PSE_KIND: tl.constexpr, COMPRESSED: tl.constexpr, HAS_DROP: tl.constexpr,
    BANDED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, OFF_ALIGN: tl.constexpr,
    WRITE_DPSE: tl.constexpr, DPSE_ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    h = tl.program_id(1)
    row = TAB + tl.program_id(2).to(tl.int64) * NCOL
    seq_q = tl.load(row + C_SEQ_Q).to(tl.int32)
    i0 = tl.program_id(0) * BLOCK_M
    if i0 >= seq_q:
        return
    seq_kv = tl.load(row + C_SEQ_KV).to(tl.int32)
    lower, upper, prefix = tiles.band_bounds(row)
    kvh = h // GROUP

    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seq_q
    i2 = offs_m[:, None]
    q_base = Q + tiles.tensor_offset(row, C_Q, OFF_ALIGN) + h * sqh
    dy_base = DY + tiles.tensor_offset(row, C_DY, OFF_ALIGN) + h * sdyh
    q = tl.load(q_base + offs_m[:, None] * sqs + offs_dq[None, :] * sqd,
                mask=row_ok[:, None] & (offs_dq[None, :] < DQK), other=0.0)
    dy = tl.load(dy_base + offs_m[:, None] * sdys + offs_dv[None, :] * sdyd,
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        dy = dy.to(tl.float32)
    m2, inv_l, delta = _row_stats(SMAX, SSUM, DELTA, row, h, offs_m, seq_q, stat_rs)
    k_base = K + tiles.tensor_offset(row, C_K, OFF_ALIGN) + kvh * skh
    v_base = V + tiles.tensor_offset(row, C_V, OFF_ALIGN) + kvh * svh
    mask_base = 0
    if HAS_MASK:
        mask_base = tl.load(row + C_MASK) + h.to(tl.int64) * mask_hs
    pse_base = 0
    dpse_base = 0
    comp = 0
    slope_addr = 0
    if PSE_KIND == 1:
        pse_base = tl.load(row + C_PSE) + h.to(tl.int64) * pse_hs
        comp = tl.load(row + C_PSE_COMP)
        if WRITE_DPSE:
            dpse_base = tl.load(row + C_DPSE) + h.to(tl.int64) * dpse_hs
    if PSE_KIND >= 2:
        slope_addr = tl.load(row + C_SLOPE) + h * slope_hs
    drop_base = 0
    if HAS_DROP:
        drop_base = tl.load(row + C_DROP)

    start, hi, rows_full, full_lo, full_hi = tiles.key_span(i0, seq_q, seq_kv, lower, upper, prefix, BLOCK_M,
                                                            BLOCK_N)

    dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
    dq_ok = offs_dq < DQK
    dv_ok = offs_dv < DV
    for j0 in tl.range(start, hi, BLOCK_N):
        offs_j = j0 + offs_nb
        col_ok = offs_j < seq_kv
        j2 = offs_j[None, :]
        kt = tl.load(k_base + offs_j[None, :] * sks + offs_dq[:, None] * skd,
                     mask=col_ok[None, :] & dq_ok[:, None], other=0.0)
        vt = tl.load(v_base + offs_j[None, :] * svs + offs_dv[:, None] * svd,
                     mask=col_ok[None, :] & dv_ok[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if PSE_KIND != 0:
            s += tiles.bias_log2(PSE, pse_base, SLOPES, slope_addr, i2, j2, seq_q, seq_kv, comp, pse_rs, pse_cs,
                                 q_start, kv_start, pse_mul, PSE_KIND, COMPRESSED)
        p = tl.math.exp2(s - m2[:, None]) * inv_l[:, None]
        # Masked entries are zeroed after the exp: the max of a fully masked row is -FLT_MAX
        # (docs/semantics/invalid-rows.md).
        if HAS_MASK:
            vis = tiles.visible(i2, j2, seq_q, seq_kv, lower, upper, prefix)
            vis &= tiles.explicit_visible(MASK, mask_base, i2, j2, seq_q, seq_kv, mask_rs, mask_cs)
            p = tl.where(vis, p, 0.0)
        elif not (rows_full & (j0 >= full_lo) & (j0 + BLOCK_N <= full_hi)):
            p = tl.where(tiles.visible(i2, j2, seq_q, seq_kv, lower, upper, prefix), p, 0.0)
        dp = tl.dot(dy, vt, input_precision=PRECISION)
        if HAS_DROP:
            dp = tl.where(tiles.keep_bits(DROP, drop_base, h, i2, j2, seq_q, seq_kv), dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
        if WRITE_DPSE:
            inb = (i2 < seq_q) & col_ok[None, :]
            offs = tiles.pse_element_offsets(i2, j2, seq_q, seq_kv, comp, dpse_rs, dpse_cs, COMPRESSED)
            if DPSE_ATOMIC:
                tl.atomic_add(DPSE + dpse_base + offs, ds * dpse_mul, mask=inb)
            else:
                tl.store(DPSE + dpse_base + offs, ds * dpse_mul, mask=inb)

    dq_base = DQ + tiles.tensor_offset(row, C_DQ, OFF_ALIGN) + h * sdqh
    tl.store(dq_base + offs_m[:, None] * sdqs + offs_dq[None, :] * sdqd, (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dq[None, :] < DQK))


def _configs(outer: str, inner: str, first: tuple[int, int, int] = (64, 32, 4)) -> list[triton.Config]:
    """Hopper-suited backward tiles: the outer (owned) block 64/128, the inner loop block 32..128; `first` (outer,
    inner, warps; two stages) leads the list: the config a launch without autotuning takes.

    sm_90 AOT, bf16 D=128 (aot.py): three stages of 128-wide inner tiles need 229-265 KB of shared memory, over
    Hopper's 227 KB (or within 3 KB of it): left out. dq's (64, 32, 4) compiles to 175 registers without spills;
    dkdv's (128 keys, 32 queries, 8 warps) to 248 without spills, where (64, 32, 4) spills with GQA (16 B) and
    Dqk 192 (456 B against 320 B)."""
    configs = []
    for bo in (64, 128):
        for bi in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    if (bo == 128 and bi == 128 and warps == 4) or (bi == 128 and stages == 3):
                        continue
                    configs.append(triton.Config({outer: bo, inner: bi}, num_warps=warps, num_stages=stages))
    lead = [c for c in configs if (c.kwargs[outer], c.kwargs[inner], c.num_warps, c.num_stages) == (*first, 2)]
    return lead + [c for c in configs if c not in lead]


def backward(
    problem: AttentionProblem, query, key, value, dy, attention_in, softmax_max, softmax_sum,
    dq, dk, dv, dpse_source: torch.Tensor | None, dsink_acc: torch.Tensor | None = None,
) -> None:
    """Fill dq / dk / dv (caller layouts, pre-zeroed) and dpse (fp32, the pse's own shape, pre-zeroed), and add the
    sink's gradient terms to `dsink_acc`, like `reference.flash_backward.backward`."""
    if dsink_acc is not None:  # a few elementwise passes over dY and O (problem/sink.py)
        sinks.sink_grad([(problem.q_view(dy, run), problem.q_view(attention_in, run),
                          problem.stat_view(softmax_max, run), problem.stat_view(softmax_sum, run))
                         for run in problem.runs], problem.sink, dsink_acc.dtype, total=dsink_acc)
    tensors = {"q": query, "k": key, "v": value, "o": attention_in, "dy": dy, "dq": dq, "dk": dk, "dv": dv}
    if softmax_max.stride() != softmax_sum.stride() or softmax_max.stride(-1) not in (0, 1):
        # The kernels address both statistics with softmax_max's offsets and need a unit (or 0) lane stride
        # (dense_plan._plan_stats); other strided statistics (accepted by the op) are copied into that layout.
        softmax_max, softmax_sum = softmax_max.contiguous(), softmax_sum.contiguous()
    plan = build_plan(problem, tensors, stats=softmax_max, dpse=dpse_source)
    if plan.num_seq == 0 or plan.max_seq_q == 0 or plan.max_seq_kv == 0:
        return
    with tiles.interpreter_speed(), tiles.rounded_bf16_outputs(dq, dk, dv) as (dq_k, dk_k, dv_k):
        _launch(problem, plan, query, key, value, dy, attention_in, softmax_max, softmax_sum, dq_k, dk_k, dv_k,
                dpse_source)


def _launch(problem: AttentionProblem, plan: DensePlan, query, key, value, dy, attention_in, softmax_max,
            softmax_sum, dq, dk, dv, dpse_source) -> None:
    flags = common_flags(problem, plan, query.dtype)
    s = plan.strides
    placeholder = plan.table
    interp_block = interpreter_block(plan)
    delta = torch.empty(max(plan.total_q, 1), dtype=torch.float32, device=query.device)
    block_dv = flags["BLOCK_DV"]
    _delta_kernel[(triton.cdiv(plan.max_seq_q, 64), problem.heads_q, plan.num_seq)](
        attention_in, dy, delta, plan.table, *s["o"], *s["dy"], DV=problem.dim_v, BLOCK_DV=block_dv,
        OFF_ALIGN=plan.offset_align, BLOCK_M=64)

    log2e = tiles.LOG2E
    common = (plan.stat_row_stride, *plan.mask_strides, *plan.pse_strides, plan.slope_head_stride)
    scalars = (plan.q_start, plan.kv_start, problem.scale * log2e, problem.scale, plan.pse_multiplier * log2e)
    extra = {"BLOCK_M": interp_block, "BLOCK_N": interp_block} if INTERPRET else {}
    inv_keep = 1.0 / problem.keep_prob
    mask_args = mask_pse_args(plan, placeholder)

    dkdv = _launcher("dkdv", _dkdv_kernel, _configs("BLOCK_N", "BLOCK_M", first=(128, 32, 8)))
    dkdv[lambda meta: (triton.cdiv(plan.max_seq_kv, meta["BLOCK_N"]), problem.heads_kv, plan.num_seq)](
        query, key, value, dy, dk, dv, softmax_max, softmax_sum, delta, plan.table, *mask_args,
        *s["q"], *s["k"], *s["v"], *s["dy"], *s["dk"], *s["dv"], *common, *scalars, inv_keep, **flags, **extra)

    write_dpse = dpse_source is not None and plan.pse_kind == 1
    atomic = write_dpse and plan.dpse_reduces
    dq_kernel = _launcher("dq_atomic" if atomic else "dq", _dq_kernel, _configs("BLOCK_M", "BLOCK_N"),
                          reset_to_zero=["DPSE"] if atomic else None)
    dq_kernel[lambda meta: (triton.cdiv(plan.max_seq_q, meta["BLOCK_M"]), problem.heads_q, plan.num_seq)](
        query, key, value, dy, dq, softmax_max, softmax_sum, delta, plan.table, *mask_args,
        dpse_source if write_dpse else placeholder,
        *s["q"], *s["k"], *s["v"], *s["dy"], *s["dq"], *common, *plan.dpse_strides, *scalars,
        # dpse = scale * dS for pse_type 1 (its bias is scale * pse), dS for type 0: the bias multiplier itself.
        plan.pse_multiplier, inv_keep, **flags, WRITE_DPSE=write_dpse, DPSE_ATOMIC=atomic, **extra)

