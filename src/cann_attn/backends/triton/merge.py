"""Triton kernels of the merge operators (RingAttentionUpdate, AttentionUpdate), the rule of
cann_attn.problem.merge on canonical rows: outputs [R, D], statistics [R] (docs/operators/ring_attention_update.md,
docs/operators/attention_update.md).

One program handles BLOCK_R rows: it forms the per-row weights once in fp32, then streams the head dim in BLOCK_D
columns. Empty rows (max or lse <= -FLT_MAX, or a zero sum) contribute nothing; a row empty everywhere becomes an
invalid row (output 0, max -FLT_MAX, sum FLT_MAX; lse the largest given). NaN statistics propagate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ...problem.stats import FLT_MAX as _FLT_MAX

FLT_MAX = tl.constexpr(_FLT_MAX)
BLOCK_R = 16


def _block_d(head_dim: int) -> int:
    return min(128, triton.next_power_of_2(max(head_dim, 1)))


@triton.jit
def _ring_update_kernel(A, B, MA, SA, MB, SB, OUT, MO, SO, R, D, stride_a, stride_b, stride_o,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    ma = tl.load(MA + rows, mask=live, other=0.0)
    sa = tl.load(SA + rows, mask=live, other=1.0)
    mb = tl.load(MB + rows, mask=live, other=0.0)
    sb = tl.load(SB + rows, mask=live, other=1.0)
    empty_a = (ma <= -FLT_MAX) | (sa == 0.0)
    empty_b = (mb <= -FLT_MAX) | (sb == 0.0)
    both = empty_a & empty_b
    m = tl.maximum(ma, mb, propagate_nan=tl.PropagateNan.ALL)
    wa = sa * tl.exp(ma - m)
    wb = sb * tl.exp(mb - m)
    s = wa + wb
    # Two finite weights whose sum overflows: the ratios from the halves, exactly (cann_attn.problem.merge).
    half = tl.where((s == float("inf")) & (wa < float("inf")) & (wb < float("inf")), 0.5, 1.0)
    fa = (wa * half) / (wa * half + wb * half)
    fb = (wb * half) / (wa * half + wb * half)
    new_m = tl.where(both, -FLT_MAX, tl.where(empty_b, ma, tl.where(empty_a, mb, m)))
    new_s = tl.where(both, FLT_MAX, tl.where(empty_b, sa, tl.where(empty_a, sb, s)))
    tl.store(MO + rows, new_m, mask=live)
    tl.store(SO + rows, new_s, mask=live)
    r64 = rows.to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = live[:, None] & (cols < D)[None, :]
        a = tl.load(A + r64[:, None] * stride_a + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        b = tl.load(B + r64[:, None] * stride_b + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        blend = a * fa[:, None] + b * fb[:, None]
        out = tl.where(empty_b[:, None], a, tl.where(empty_a[:, None], b, blend))
        out = tl.where(both[:, None], 0.0, out)
        tl.store(OUT + r64[:, None] * stride_o + cols[None, :], out.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _lse_update_kernel(LSE, PARTS, OUT, LSE_OUT, K, R, D, stride_lk, stride_pk, stride_pr, stride_o,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    r64 = rows.to(tl.int64)
    top = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for k in range(K):
        lse = tl.load(LSE + k * stride_lk + rows, mask=live, other=float("-inf"))
        top = tl.maximum(top, lse, propagate_nan=tl.PropagateNan.ALL)
    all_empty = top <= -FLT_MAX
    shift = tl.where(all_empty, 0.0, top)
    total = tl.zeros((BLOCK_R,), tl.float32)
    for k in range(K):
        lse = tl.load(LSE + k * stride_lk + rows, mask=live, other=float("-inf"))
        total += tl.where(lse <= -FLT_MAX, 0.0, tl.exp(lse - shift))
    merged = tl.where(all_empty, top, shift + tl.log(total))
    tl.store(LSE_OUT + rows, merged, mask=live)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = live[:, None] & (cols < D)[None, :]
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        for k in range(K):
            lse = tl.load(LSE + k * stride_lk + rows, mask=live, other=float("-inf"))
            w = tl.where((lse <= -FLT_MAX) | all_empty, 0.0, tl.exp(lse - merged))
            part = tl.load(PARTS + k * stride_pk + r64[:, None] * stride_pr + cols[None, :], mask=ok,
                           other=0.0).to(tl.float32)
            # an empty part's output is not read: 0 * inf/NaN must not reach the sum
            part = tl.where(w[:, None] == 0.0, 0.0, part)
            acc += part * w[:, None]
        tl.store(OUT + r64[:, None] * stride_o + cols[None, :], acc.to(OUT.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Unit column stride (the kernels index columns directly)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def ring_update(out_a: torch.Tensor, max_a: torch.Tensor, sum_a: torch.Tensor, out_b: torch.Tensor,
                max_b: torch.Tensor, sum_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [R, D] in out_a's dtype, max [R], sum [R]) of the union of two blocks (float32 statistics)."""
    rows, head_dim = out_a.shape
    a, b = _rows(out_a), _rows(out_b)
    ma, sa, mb, sb = (t.to(torch.float32).contiguous() for t in (max_a, sum_a, max_b, sum_b))
    out = torch.empty((rows, head_dim), dtype=out_a.dtype, device=out_a.device)
    new_max = torch.empty(rows, dtype=torch.float32, device=out_a.device)
    new_sum = torch.empty_like(new_max)
    if rows:
        _ring_update_kernel[(triton.cdiv(rows, BLOCK_R),)](
            a, b, ma, sa, mb, sb, out, new_max, new_sum, rows, head_dim, a.stride(0), b.stride(0), out.stride(0),
            BLOCK_R=BLOCK_R, BLOCK_D=_block_d(head_dim))
    return out, new_max, new_sum


def lse_update(lse: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [R, D] in the parts' dtype, lse [R] float32) of K parts."""
    rows, head_dim = outs[0].shape
    lse_stack = torch.stack([t.to(torch.float32) for t in lse])
    parts = torch.stack(list(outs))
    out = torch.empty((rows, head_dim), dtype=outs[0].dtype, device=outs[0].device)
    merged = torch.empty(rows, dtype=torch.float32, device=outs[0].device)
    if rows:
        _lse_update_kernel[(triton.cdiv(rows, BLOCK_R),)](
            lse_stack, parts, out, merged, len(lse), rows, head_dim, lse_stack.stride(0), parts.stride(0),
            parts.stride(1), out.stride(0), BLOCK_R=BLOCK_R, BLOCK_D=_block_d(head_dim))
    return out, merged
