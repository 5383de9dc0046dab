"""Fused Triton FlashAttention forward over a canonical dense problem (docs/semantics/masks.md,
docs/semantics/invalid-rows.md, docs/semantics/pse.md, docs/semantics/dropout.md, docs/semantics/softmax-stats.md).

One launch covers every sequence of the problem (varlen TND included): the grid is (query blocks of the
longest sequence, N1 query heads, sequences) and each program reads its sequence's integers from the
`dense_plan` table. Per program: the band/prefix give the visible key range (tiles outside it are never
visited), an online softmax in fp32 runs over the key tiles in log2 units (exp2 with log2(e) folded into the
scale), the band mask is evaluated only on tiles the band cuts, the explicit mask / pse / dropout bits are
read per tile, and ALiBi is generated in-kernel. GQA/MQA reads kv head h // G directly (K/V are never
expanded); Dv < Dqk uses separately padded head dims.

Matches `backends/reference/flash_forward.py`: softmax_max / softmax_sum are taken before dropout,
out = sum(P * keep * V) / (row_sum * keep_prob), and rows with nothing visible give out 0, max -FLT_MAX,
sum +FLT_MAX (docs/semantics/invalid-rows.md).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...problem import layout as layouts
from ...problem import sink as sinks
from ...problem import stats
from ...problem.attention import AttentionProblem
from . import dense_tiles as tiles
from .dense_plan import DensePlan, build_plan
from .dense_tiles import (
    C_DROP,
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
from .jit import device_function, tuning_configs

# log2 of problem/stats.ACCUMULATION_LIMIT, the bound kept on |P V| (a constexpr global: kernels may only read those)
ACCUMULATION_LIMIT_LOG2 = tl.constexpr(int(math.log2(stats.ACCUMULATION_LIMIT)))


@device_function
def _load_q(q_base, i0, seq_q, sqs, sqd, DQK: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_DQK: tl.constexpr):
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_dq = tl.arange(0, BLOCK_DQK)
    q = tl.load(q_base + offs_m[:, None] * sqs + offs_dq[None, :] * sqd,
                mask=(offs_m[:, None] < seq_q) & (offs_dq[None, :] < DQK), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@device_function
def _attend(q, q_base, sqs, sqd, MASK, PSE, SLOPES, DROP, bt_row, k_base, v_base, mask_base, pse_base, slope_addr,
            drop_base, comp, h, i0, seq_q, seq_kv, lower, upper, prefix, start, hi, rows_full, full_lo, full_hi,
            sks, skd, svs, svd, mask_rs, mask_cs, pse_rs, pse_cs, q_start, kv_start, qk_scale, pse_mul, skb, svb,
            value_scale, DQK: tl.constexpr, DV: tl.constexpr, PSE_KIND: tl.constexpr, COMPRESSED: tl.constexpr,
            HAS_MASK: tl.constexpr, HAS_DROP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
            BLOCK_DV: tl.constexpr, SCALE_V: tl.constexpr, STAGES: tl.constexpr):
    """The online softmax over the visible key tiles: (acc, m_i, l_i) of the query block, in log2 units. SCALE_V:
    each V column multiplied by `value_scale` (powers of two) before P V. STAGES: the loop's pipeline depth (None:
    the launch's num_stages)."""
    i2 = (i0 + tl.arange(0, BLOCK_M))[:, None]
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    dq_ok = offs_dq < DQK
    dv_ok = offs_dv < DV
    offs_n = tl.arange(0, BLOCK_N)
    for j0 in tl.range(start, hi, BLOCK_N, num_stages=STAGES):
        if SCALE_V:  # noqa: SIM108 (constexpr). Read per tile: q kept through this rare pass costs registers
            q_tile = _load_q(q_base, i0, seq_q, sqs, sqd, DQK, UPCAST, BLOCK_M, BLOCK_DQK)
        else:
            q_tile = q
        offs_j = j0 + offs_n
        col_ok = offs_j < seq_kv
        j2 = offs_j[None, :]
        if PAGE > 0:
            block = tl.load(bt_row + offs_j // PAGE, mask=col_ok, other=0).to(tl.int64)
            k_rows = block * skb + (offs_j % PAGE) * sks
            v_rows = block * svb + (offs_j % PAGE) * svs
        else:
            k_rows = offs_j * sks
            v_rows = offs_j * svs
        kt = tl.load(k_base + k_rows[None, :] + offs_dq[:, None] * skd,
                     mask=col_ok[None, :] & dq_ok[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q_tile, kt, input_precision=PRECISION) * qk_scale
        if PSE_KIND != 0:
            s += tiles.bias_log2(PSE, pse_base, SLOPES, slope_addr, i2, j2, seq_q, seq_kv, comp, pse_rs, pse_cs,
                                 q_start, kv_start, pse_mul, PSE_KIND, COMPRESSED)
        if HAS_MASK:
            vis = tiles.visible(i2, j2, seq_q, seq_kv, lower, upper, prefix)
            vis &= tiles.explicit_visible(MASK, mask_base, i2, j2, seq_q, seq_kv, mask_rs, mask_cs)
            s = tl.where(vis, s, float("-inf"))
        elif not (rows_full & (j0 >= full_lo) & (j0 + BLOCK_N <= full_hi)):
            s = tl.where(tiles.visible(i2, j2, seq_q, seq_kv, lower, upper, prefix), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen nothing visible keep max -inf: shift them by 0 so no inf - inf appears.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - shift[:, None])
        alpha = tl.math.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if HAS_DROP:
            p = tl.where(tiles.keep_bits(DROP, drop_base, h, i2, j2, seq_q, seq_kv), p, 0.0)
        v = tl.load(v_base + v_rows[:, None] + offs_dv[None, :] * svd,
                    mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if SCALE_V:  # exact powers of two: each product keeps its bits unless it would overflow
            v = (v.to(tl.float32) * value_scale[None, :]).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)

    return acc, m_i, l_i


@device_function
def _value_column_scales(v_base, bt_row, i0, seq_kv, svs, svd, svb, DV: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr):
    """problem/stats.value_column_scales on the device: per V column of this kv head and sequence, 2^-k with
    k = ceil(log2(seq_kv x max|v| / 2^126)) + 1 where that bound reaches 2^126 (and is finite), else 1."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = i0 * 0 + tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    column_max = tl.zeros([BLOCK_DV], tl.float32)
    for j0 in tl.range(0, seq_kv, BLOCK_N, num_stages=1):
        offs_j = j0 + offs_n
        col_ok = offs_j < seq_kv
        if PAGE > 0:
            block = tl.load(bt_row + offs_j // PAGE, mask=col_ok, other=0).to(tl.int64)
            v_rows = block * svb + (offs_j % PAGE) * svs
        else:
            v_rows = offs_j * svs
        v = tl.load(v_base + v_rows[:, None] + offs_dv[None, :] * svd, mask=col_ok[:, None] & dv_ok[None, :],
                    other=0.0)
        column_max = tl.maximum(column_max, tl.max(tl.abs(v.to(tl.float32)), 0))
    excess = tl.log2(column_max) + tl.log2(seq_kv.to(tl.float32)) - ACCUMULATION_LIMIT_LOG2
    k = tl.where((column_max <= tiles.FLT_MAX) & (excess >= 0.0), tl.ceil(excess) + 1.0, 0.0).to(tl.int32)
    return ((127 - k) << 23).to(tl.float32, bitcast=True)  # 2^-k exactly (k <= 40: a normal number)


@triton.jit
def _forward_kernel(
    Q, K, V, O, SMAX, SSUM, TAB, MASK, PSE, SLOPES, DROP, BT,
    sqh, sqs, sqd, skh, sks, skd, svh, svs, svd, soh, sos, sod,
    stat_rs, mask_hs, mask_rs, mask_cs, pse_hs, pse_rs, pse_cs, slope_hs,
    q_start, kv_start, qk_scale, pse_mul, keep_prob, skb, svb,
    GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_MASK: tl.constexpr, PSE_KIND: tl.constexpr, COMPRESSED: tl.constexpr, HAS_DROP: tl.constexpr,
    WRITE_STATS: tl.constexpr, BANDED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    OFF_ALIGN: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """PAGE > 0: K and V are paged caches (docs/semantics/paged-kv.md) read in place: key j of a sequence is slot
    j % PAGE of block BT[bt_row + j // PAGE] (bt_row: the table column of k; skb / svb: block strides)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    row = TAB + tl.program_id(2).to(tl.int64) * NCOL
    seq_q = tl.load(row + C_SEQ_Q).to(tl.int32)
    i0 = pid_m * BLOCK_M
    if i0 >= seq_q:
        return
    seq_kv = tl.load(row + C_SEQ_KV).to(tl.int32)
    lower, upper, prefix = tiles.band_bounds(row)
    kvh = h // GROUP

    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seq_q

    q_base = Q + tiles.tensor_offset(row, C_Q, OFF_ALIGN) + h * sqh
    q = _load_q(q_base, i0, seq_q, sqs, sqd, DQK, UPCAST, BLOCK_M, BLOCK_DQK)
    bt_row = BT
    if PAGE > 0:
        bt_row = BT + tl.load(row + C_K)
        k_base = K + kvh * skh
        v_base = V + kvh * svh
    else:
        k_base = K + tiles.tensor_offset(row, C_K, OFF_ALIGN) + kvh * skh
        v_base = V + tiles.tensor_offset(row, C_V, OFF_ALIGN) + kvh * svh
    mask_base = 0
    if HAS_MASK:
        mask_base = tl.load(row + C_MASK) + h.to(tl.int64) * mask_hs
    pse_base = 0
    comp = 0
    slope_addr = 0
    if PSE_KIND == 1:
        pse_base = tl.load(row + C_PSE) + h.to(tl.int64) * pse_hs
        comp = tl.load(row + C_PSE_COMP)
    if PSE_KIND >= 2:
        slope_addr = tl.load(row + C_SLOPE) + h * slope_hs
    drop_base = 0
    if HAS_DROP:
        drop_base = tl.load(row + C_DROP)

    RESCUE_BLOCK_N: tl.constexpr = max(BLOCK_N // 2, 16)
    start, hi, rows_full, full_lo, full_hi = tiles.key_span(i0, seq_q, seq_kv, lower, upper, prefix, BLOCK_M,
                                                            BLOCK_N)

    acc, m_i, l_i = _attend(q, q_base, sqs, sqd, MASK, PSE, SLOPES, DROP, bt_row, k_base, v_base, mask_base,
                            pse_base, slope_addr, drop_base, comp, h, i0, seq_q, seq_kv, lower, upper, prefix, start,
                            hi, rows_full, full_lo, full_hi, sks, skd, svs, svd, mask_rs, mask_cs, pse_rs, pse_cs,
                            q_start, kv_start, qk_scale, pse_mul, skb, svb, tl.full([BLOCK_DV], 1.0, tl.float32),
                            DQK, DV, PSE_KIND, COMPRESSED, HAS_MASK, HAS_DROP, UPCAST, PRECISION, PAGE, BLOCK_M,
                            BLOCK_N, BLOCK_DQK, BLOCK_DV, False, None)
    # Values near FLT_MAX (docs/semantics/precision.md, "Values near the float maximum"): where this program's
    # P V overflowed, the keys are visited again with V scaled per column by an exact power of two
    # (problem/stats.value_column_scales' rule), and the output divided by row_sum x 2^-k. Ordinary inputs only
    # pay the finiteness test of the finished accumulator.
    value_scale = tl.full([BLOCK_DV], 1.0, tl.float32)
    overflowed = tl.sum(tl.where(tl.abs(acc) <= tiles.FLT_MAX, 0, 1))
    if overflowed > 0:
        # i0 + 0, but computed here: offsets are derived anew in this branch rather than kept live from the
        # ordinary path (registers).
        i0 += tl.minimum(overflowed, 0)
        value_scale = _value_column_scales(v_base, bt_row, i0, seq_kv, svs, svd, svb, DV, PAGE, BLOCK_N,
                                           BLOCK_DV)
        if tl.min(value_scale) < 1.0:
            # Neither q nor any tile of the first pass is kept for this rare pass, which is not software-pipelined
            # (no shared memory of its own) and takes half-width key tiles: its registers stay below the
            # ordinary path's, whose count the whole kernel gets.
            acc, m_i, l_i = _attend(0, q_base, sqs, sqd, MASK, PSE, SLOPES, DROP, bt_row, k_base, v_base, mask_base,
                                    pse_base, slope_addr, drop_base, comp, h, i0, seq_q, seq_kv, lower, upper,
                                    prefix, start, hi, rows_full, full_lo, full_hi, sks, skd, svs, svd, mask_rs,
                                    mask_cs, pse_rs, pse_cs, q_start, kv_start, qk_scale, pse_mul, skb, svb,
                                    value_scale, DQK, DV, PSE_KIND, COMPRESSED, HAS_MASK, HAS_DROP, UPCAST, PRECISION,
                                    PAGE, BLOCK_M, RESCUE_BLOCK_N, BLOCK_DQK, BLOCK_DV, True, 1)

    # "!= 0", not "> 0": a row with a NaN logit keeps its NaN sum and gives a NaN output, as in the reference
    # backend and the formulas; only rows without a visible key (sum exactly 0) are invalid rows
    # (docs/semantics/invalid-rows.md).
    valid = l_i != 0.0
    denom = tl.where(valid, l_i * keep_prob, 1.0)
    out = tl.where(valid[:, None], acc / (denom[:, None] * value_scale[None, :]), 0.0)
    o_base = O + tiles.tensor_offset(row, C_O, OFF_ALIGN) + h * soh
    tl.store(o_base + offs_m[:, None] * sos + offs_dv[None, :] * sod, out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    if WRITE_STATS:
        offs_w = tl.arange(0, 8)
        stat_off = (tl.load(row + C_STAT) + h * tl.load(row + C_STAT_HS)
                    + offs_m[:, None] * stat_rs + offs_w[None, :])
        # tl.max may drop a NaN logit on the GPU (max.f32 returns the other operand): a NaN sum marks the row. A
        # +inf maximum stays +inf (its sum is NaN from inf - inf), as the reference backend writes it.
        nan_row = (l_i != l_i) & (m_i != float("inf"))
        row_max = tl.where(valid, tl.where(nan_row, float("nan"), m_i * tiles.LN2), -tiles.FLT_MAX)
        row_sum = tl.where(valid, l_i, tiles.FLT_MAX)
        wmask = row_ok[:, None] & (offs_w[None, :] < 8)
        tl.store(SMAX + stat_off, tl.broadcast_to(row_max[:, None], [BLOCK_M, 8]), mask=wmask)
        tl.store(SSUM + stat_off, tl.broadcast_to(row_sum[:, None], [BLOCK_M, 8]), mask=wmask)


def _gpu_configs() -> list[triton.Config]:
    """Hopper-suited forward tiles (H100/H200): 64/128 query rows per program, 32..128 keys per step.

    sm_90 AOT, bf16 D=128 (aot.py): every 8-warp config and the 4-warp ones up to 64 x 64 compile without spills;
    the first (the default without autotuning) takes 177 registers, 48 KB of shared memory. Four stages of
    128-key tiles need 272-288 KB of shared memory, over Hopper's 227 KB: left out."""
    configs = []
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    if (bm == 64 and warps == 8) or (bn == 128 and stages == 4):
                        continue
                    configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages))
    return configs


TUNE_KEY = ["DQK", "DV", "HAS_MASK", "PSE_KIND", "HAS_DROP", "BANDED", "GROUP", "OFF_ALIGN"]
_tuned: dict[str, object] = {}


def _launcher(name: str, kernel, configs, reset_to_zero: list[str] | None = None):
    """The autotuned kernel on a GPU (built once: threads launching together may each build one, and `setdefault`
    keeps the first, so all share one autotuner and its timings), the plain kernel in the interpreter."""
    if INTERPRET:
        return kernel
    tuned = _tuned.get(name)
    if tuned is None:
        tuned = _tuned.setdefault(name, triton.autotune(tuning_configs(configs), key=TUNE_KEY,
                                                        reset_to_zero=reset_to_zero)(kernel))
    return tuned


def interpreter_block(plan: DensePlan) -> int:
    """One square tile size under the interpreter, where run time grows with programs x loop iterations (each
    tile operation costs ~0.1 ms whatever its size): 16 exercises the multi-tile paths at test shapes, longer
    sequences take 64 or 128."""
    longest = max(plan.max_seq_q, plan.max_seq_kv)
    return 16 if longest <= 128 else 64 if longest <= 512 else 128


def head_block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def common_flags(problem: AttentionProblem, plan: DensePlan, dtype: torch.dtype) -> dict:
    """Constexpr switches shared by every dense kernel."""
    return {
        "GROUP": problem.group, "DQK": problem.dim_qk, "DV": problem.dim_v,
        "BLOCK_DQK": head_block(problem.dim_qk), "BLOCK_DV": head_block(problem.dim_v),
        "HAS_MASK": plan.mask is not None, "PSE_KIND": plan.pse_kind, "COMPRESSED": plan.pse_compressed,
        "HAS_DROP": plan.drop is not None, "BANDED": plan.banded,
        # The interpreter computes bf16/fp16 dots wrongly: give it fp32 tiles. On a GPU fp16/bf16 operands feed
        # the tensor cores with fp32 accumulation, and fp32 inputs keep full fp32 products (no TF32).
        "UPCAST": INTERPRET, "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "OFF_ALIGN": plan.offset_align,
    }


def mask_pse_args(plan: DensePlan, placeholder: torch.Tensor) -> tuple:
    """(MASK, PSE, SLOPES, DROP) tensors, placeholders where absent."""
    return tuple(t if t is not None else placeholder for t in (plan.mask, plan.pse, plan.slopes, plan.drop))


def forward(problem: AttentionProblem, query, key, value, out, softmax_max=None, softmax_sum=None,
            block_table: torch.Tensor | None = None) -> None:
    """Fill `out` and (when given) `softmax_max` / `softmax_sum`, like `reference.flash_forward.forward`. With
    `block_table`, key / value are paged caches as [block_num, N2, block_size, D] views, read in place."""
    plan = build_plan(problem, {"q": query, "k": key, "v": value, "o": out}, stats=softmax_max,
                      block_table=block_table)
    if plan.num_seq == 0 or plan.max_seq_q == 0:
        return
    if problem.sink is not None:
        _forward_with_sink(problem, plan, query, key, value, out, softmax_max, softmax_sum)
        return
    with tiles.rounded_bf16_outputs(out) as (out_k,):
        launch_forward(problem, plan, query, key, value, out_k, softmax_max, softmax_sum, block_table)


def _forward_with_sink(problem: AttentionProblem, plan: DensePlan, query, key, value, out, softmax_max,
                       softmax_sum) -> None:
    """The kernel's output and statistics over the keys, then the sink merged into them (problem/sink.py) while the
    output is still fp32: one rounding to the output dtype, as without a sink."""
    wide = out if out.dtype == torch.float32 else \
        torch.empty_strided(out.shape, out.stride(), dtype=torch.float32, device=out.device)
    if softmax_max is None:  # the merge needs each row's statistics even where the caller wants none
        seq = layouts.read_dims(query, problem.layout, problem.heads_q, "query").seq
        shape = stats.stats_shape(problem.tnd, problem.batch, problem.heads_q, seq)
        softmax_max, softmax_sum = stats.allocate(shape, torch.float32, out.device, keyless_rows=False)
    launch_forward(problem, plan, query, key, value, wide, softmax_max, softmax_sum)
    for run in problem.runs:
        if run.seq_q > 0 and run.seq_kv > 0:
            smax, ssum = problem.stat_view(softmax_max, run), problem.stat_view(softmax_sum, run)
            sinks.merge_into_finished(problem.q_view(wide, run), smax, ssum,
                                      sinks.head_values(problem.sink, torch.float32, out.device))
    if wide is not out:
        out.copy_(wide)


def launch_forward(problem: AttentionProblem, plan: DensePlan, query, key, value, out, softmax_max,
                   softmax_sum, block_table: torch.Tensor | None = None) -> None:
    flags = common_flags(problem, plan, query.dtype)
    flags["PAGE"] = 0 if block_table is None else key.shape[2]
    write_stats = softmax_max is not None
    s = plan.strides
    log2e = tiles.LOG2E
    args = (
        query, key, value, out,
        softmax_max if write_stats else plan.table, softmax_sum if write_stats else plan.table,
        plan.table, *mask_pse_args(plan, plan.table), plan.table if block_table is None else block_table,
        *s["q"], *s["k"], *s["v"], *s["o"],
        plan.stat_row_stride, *plan.mask_strides, *plan.pse_strides, plan.slope_head_stride,
        plan.q_start, plan.kv_start, problem.scale * log2e, plan.pse_multiplier * log2e, problem.keep_prob,
        plan.block_strides.get("k", 0), plan.block_strides.get("v", 0),
    )
    kernel = _launcher("forward", _forward_kernel, _gpu_configs())

    def grid(meta):
        return (triton.cdiv(plan.max_seq_q, meta["BLOCK_M"]), problem.heads_q, plan.num_seq)

    if INTERPRET:
        block = interpreter_block(plan)
        with tiles.interpreter_speed():
            kernel[grid](*args, **flags, WRITE_STATS=write_stats, BLOCK_M=block, BLOCK_N=block)
    else:
        kernel[grid](*args, **flags, WRITE_STATS=write_stats)
