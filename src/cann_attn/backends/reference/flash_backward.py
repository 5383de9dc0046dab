"""Tiled FlashAttention backward (FlashAttentionScoreGradV2; docs/semantics/pse.md, docs/semantics/dropout.md,
docs/semantics/softmax-stats.md).

Per query tile and visible key tile, P is recomputed from the given softmax statistics (no renormalisation):
P = exp(S - max) / sum, P_drop = P * keep / keep_prob, dV += P_drop^T dY, dP = dY V^T,
dS = P * (dP * keep / keep_prob - rowsum(dY * O)), dQ += scale dS K, dK += dS^T (scale Q), dpse from dS
(the query tile carries the scale; dQ's is applied once, to its finished rows).
dQ/dK/dV accumulate in fp32: straight in the outputs when they are fp32 and their layout gives the GEMMs'
[count * N2, rows, D] view, else in buffers. No [Sq, Skv] matrix is ever formed.

Where the fused forward applies (fp32 on the CPU with a BLAS sgemm) and no dpse is asked for, each query
tile goes to `native.fa_backward_blocks` (one call, or one per key tile as in the forward): a thread takes one kv
head's run of key pieces through all five products for every row of the tile, so it alone writes those dK / dV rows
(B=1 N=8 S=2048 D=128, backward alone: 421 -> 345 ms).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...problem import sink as sinks
from ...problem.attention import AttentionProblem, Run
from . import native
from .flash_forward import TILE_ELEMENTS, RunKernel, fused_block_rows, group_rows, key_tiles
from .softmax_exp import EXP2_FLOOR, LOG2E, exp_shifted_

# The fused native backward (`native.fa_backward_blocks`, same conditions as the fused forward): query rows per block,
# key columns per piece, and the work items per query tile below which an entry's key pieces are split over several
# items (whose dQ terms then go through private buffers). Two score-sized blocks (P and dP) per thread, 128 x 512 fp32
# (256 KB each): measured faster than 64 x 512, 128 x 256 and 256 x 512 at B=1 N=8 S=2048 and N=1 S=8192.
FUSED_BLOCK_ROWS = 128
FUSED_SUB_COLS = 512
FUSED_MIN_ITEMS = 8
# Query rows per tile of an unmasked run whose tiles each go to one fused call (no pse tensor, no dropout): no score
# tile is formed in Python there, so tiles grow past the PyTorch loop's score-buffer budget (256 rows at 8 heads), up
# to 2048 rows and TILE_ELEMENTS for the per-tile [c, N1, rows, D] tensors (scaled Q, dY, dQ). A call then packs each
# key piece for more row blocks while it is in L2, and reads and writes the dK / dV rows once per tile: B=1 N=8 S=2048
# D=128 backward alone 308-322 -> 288-304 ms (1024 or 2048 rows). Only where that keeps every bit: one query head per
# kv head and tile heights in whole FUSED_BLOCK_ROWS blocks, so that the row blocks, and so the GEMMs and the order of
# every sum, stay the same (a GQA group's rows are stacked per tile: taller tiles would reorder dK / dV's sums).
# Masked runs keep their tile height: taller causal tiles measured slower (256: 178 ms, 1024: 188 ms).
FUSED_TILE_ROWS = 2048
# Elements of the product dY * O that `row_sums` forms at a time on the CPU (512 KB fp32, within L2): a tile-sized
# temporary (8 MB at B=1 N=8 S=2048 D=128) cost its page faults and a trip through memory, ~4 ms per backward.
ROW_SUM_ELEMENTS = 1 << 17


@torch.no_grad()  # kernels fill preallocated outputs; autograd pairs the ops one level up
def backward(
    problem: AttentionProblem, query, key, value, dy, attention_in, softmax_max, softmax_sum,
    dq, dk, dv, dpse_source: torch.Tensor | None, dsink_acc: torch.Tensor | None = None,
) -> None:
    """Fill dq / dk / dv (caller layouts) and accumulate dpse (fp32, the pse's own shape) for every run, and with a
    sink its gradient terms into `dsink_acc` [N1] (problem/sink.py; rows of runs without keys have O = 0 and add
    nothing)."""
    for run, dk_view, dv_view in runs_to_fill(problem, dk, dv):
        kernel = RunKernel(problem, run, query, key, value)
        _backward_run(kernel, problem, run, dy, attention_in, softmax_max, softmax_sum, dq, dk_view, dv_view,
                      dpse_source, dsink_acc)


def runs_to_fill(problem: AttentionProblem, dk: torch.Tensor,
                 dv: torch.Tensor) -> Iterator[tuple[Run, torch.Tensor, torch.Tensor]]:
    """(run, dk view, dv view) of every run with both queries and keys; the dk / dv rows of a run with keys but no
    queries are zeroed here (runs without keys own no dk / dv rows)."""
    for run in problem.runs:
        if run.seq_kv == 0:
            continue
        dk_view, dv_view = problem.kv_view(dk, run), problem.kv_view(dv, run)
        if run.seq_q == 0:
            dk_view.zero_()
            dv_view.zero_()
            continue
        yield run, dk_view, dv_view


def pse_grad_target(run: Run, dpse_source: torch.Tensor | None) -> torch.Tensor | None:
    """The slice of the fp32 dpse buffer that this run's pse view reads from."""
    if dpse_source is None or run.pse is None or run.pse.source is None:
        return None
    return dpse_source if dpse_source.shape[0] == 1 else dpse_source[run.b0 : run.b0 + run.count]


def _backward_run(kernel: RunKernel, problem: AttentionProblem, run: Run, dy, attention_in, softmax_max,
                  softmax_sum, dq, dk_view, dv_view, dpse_source, dsink_acc) -> None:
    c, n2 = run.count, problem.heads_kv
    dtype, device = kernel.dtype, kernel.device
    d_qk = problem.dim_qk
    dy_all, o_all = problem.q_view(dy, run), problem.q_view(attention_in, run)
    max_all = problem.stat_view(softmax_max, run)[..., 0]
    sum_all = problem.stat_view(softmax_sum, run)[..., 0]
    dq_view = problem.q_view(dq, run)
    dk_acc = _accumulator(dk_view, (c * n2, run.seq_kv, d_qk), dtype)
    dv_acc = _accumulator(dv_view, (c * n2, run.seq_kv, kernel.v.shape[-1]), dtype)
    pse_grad = pse_grad_target(run, dpse_source)
    inv_keep = 1.0 / problem.keep_prob
    # With a sink, the run's rowsum(dY * O), for dsink's terms once the tiles are done (a few ops per run, not per tile)
    run_d_sum = None if dsink_acc is None else torch.empty((c, problem.heads_q, run.seq_q), dtype=dtype, device=device)
    block_q = _tile_rows(kernel, problem, run)
    for i0 in range(0, run.seq_q, block_q):
        i1 = min(i0 + block_q, run.seq_q)
        q_tile = kernel.query_tile(i0, i1)
        dy_t = dy_all[:, :, i0:i1].to(dtype)
        # rowsum(dY * O) with O the forward output (after dropout), per docs/semantics/dropout.md.
        d_sum = row_sums(dy_t, o_all[:, :, i0:i1], dtype)
        if run_d_sum is not None:
            run_d_sum[:, :, i0:i1] = d_sum
        dy_g = group_rows(dy_t, n2)
        row_max = max_all[:, :, i0:i1].to(dtype).unsqueeze(-1)
        inv_sum = 1.0 / sum_all[:, :, i0:i1].to(dtype).unsqueeze(-1)
        dq_acc = _accumulator(dq_view[:, :, i0:i1], (c * n2, q_tile.shape[1], d_qk), dtype)
        fused_done = kernel.fused and pse_grad is None and all(t.stride(-1) == 1 for t in (dq_acc, dk_acc, dv_acc)) \
            and _fused_backward(kernel, q_tile, i0, i1, dy_g.contiguous(), d_sum.contiguous(), row_max, inv_sum,
                                dq_acc, dk_acc, dv_acc, kernel.bf16_scores(i0, i1, dy_all))
        for j0, j1, state in () if fused_done else key_tiles(run, i0, i1, kernel.block_k, kernel.max_width):
            entries = kernel.entries(i0, i1, j0, j1, row_max)
            if entries is None:
                continue
            heads = kernel.heads(entries)
            n_entries, cols = entries.stop - entries.start, j1 - j0
            p = kernel.scores(q_tile, i0, i1, j0, j1, state, entries)
            _probabilities(p, row_max[:, heads], inv_sum[:, heads])
            p_g = p.view(n_entries, -1, cols)
            dy_e = dy_g[entries]
            dp = torch.bmm(dy_e, kernel.v[entries, j0:j1].transpose(1, 2), out=kernel.scratch(p_g.shape))
            dp = dp.view(p.shape)
            if run.dropout is not None:
                keep = run.dropout.keep_tile(i0, i1, j0, j1, device)[:, heads].to(dtype) * inv_keep
                dv_acc[entries, j0:j1].baddbmm_((p * keep).view(n_entries, -1, cols).transpose(1, 2), dy_e)
                dp.mul_(keep)
            else:
                dv_acc[entries, j0:j1].baddbmm_(p_g.transpose(1, 2), dy_e)
            if native.usable(dp, p) and dp.is_contiguous() and p.is_contiguous():
                ds = native.fa_ds_rows(dp, p, d_sum[:, heads].contiguous())
            else:
                ds = dp.sub_(d_sum[:, heads].unsqueeze(-1)).mul_(p)
            ds_g = ds.view(n_entries, -1, cols)
            dq_acc[entries].baddbmm_(ds_g, kernel.k[entries, j0:j1, :d_qk])
            dk_acc[entries, j0:j1].baddbmm_(ds_g.transpose(1, 2), q_tile[entries, :, :d_qk])
            if pse_grad is not None:
                run.pse.accumulate_grad(pse_grad, i0, i1, j0, j1, ds)
        dq_acc.mul_(problem.scale)
        _store(dq_view[:, :, i0:i1], dq_acc)
    _store(dk_view, dk_acc)
    _store(dv_view, dv_acc)
    if run_d_sum is not None:
        terms = sinks.sink_grad_terms_from_rowsum(run_d_sum, max_all, sum_all,
                                                  sinks.head_values(problem.sink, dtype, device))
        dsink_acc += terms.sum(dim=(0, 2)).to(dsink_acc.dtype)


def row_sums(dy_t: torch.Tensor, o_t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rowsum(dY * O) [c, N1, rows] of dy_t (`dtype`) and o_t [c, N1, rows, Dv]: the products and sums of
    `(dy_t * o_t.to(dtype)).sum(-1)`, on the CPU a block of rows at a time (ROW_SUM_ELEMENTS)."""
    c, n1, rows, dv = dy_t.shape
    step = max(1, ROW_SUM_ELEMENTS // max(1, c * n1 * dv))
    if dy_t.device.type != "cpu" or step >= rows:
        return (dy_t * o_t.to(dtype)).sum(-1)
    out = torch.empty((c, n1, rows), dtype=dtype, device=dy_t.device)
    buf = torch.empty((c, n1, step, dv), dtype=dtype, device=dy_t.device)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        prod = torch.mul(dy_t[:, :, r0:r1], o_t[:, :, r0:r1].to(dtype), out=buf[:, :, : r1 - r0])
        torch.sum(prod, -1, out=out[:, :, r0:r1])
    return out


def _tile_rows(kernel: RunKernel, problem: AttentionProblem, run: Run) -> int:
    """Query rows per backward tile: up to FUSED_TILE_ROWS where the comment above allows, else the run's tile
    height."""
    if not (kernel.fused and kernel.dense and run.pse is None and run.dropout is None
            and problem.heads_q == problem.heads_kv and kernel.block_q % FUSED_BLOCK_ROWS == 0):
        return kernel.block_q
    budget = TILE_ELEMENTS // (run.count * problem.heads_q * max(problem.dim_qk, kernel.v.shape[-1]))
    rows = min(FUSED_TILE_ROWS, budget) // FUSED_BLOCK_ROWS * FUSED_BLOCK_ROWS
    return max(kernel.block_q, min(rows, run.seq_q))


def _fused_backward(kernel: RunKernel, q_tile, i0: int, i1: int, dy_g, d_sum, row_max, inv_sum, dq_acc, dk_acc,
                    dv_acc, bf16: native.Bf16Scores | None) -> bool:
    """The query tile through the fused native backward: one call for all key tiles where `fused_tiles` allows, else
    one call per tile for the GEMM batch entries `entries` keeps (as the PyTorch loop). Returns False, having done
    nothing, where per-tile calls would run on one thread (a run with one kv head: a work item owns a whole entry's
    key piece, and a per-tile call has one piece); that depends on the run alone, never on which entries a tile
    skips, so skipping changes no bit."""
    entries_all = dq_acc.shape[0]
    whole = kernel.fused_tiles(i0, i1)
    if whole is None and entries_all < 2:
        return False
    alibi = kernel.alibi_rows(q_tile, i0, i1)
    shift = row_max.reshape(entries_all, -1).contiguous()
    factor = inv_sum.reshape(entries_all, -1).contiguous()
    d_sum = d_sum.view(entries_all, -1)
    if whole is not None:
        native.fa_backward_blocks(q_tile, dy_g, d_sum, shift, factor, kernel.k, kernel.v, *whole, FUSED_BLOCK_ROWS,
                                  FUSED_SUB_COLS, FUSED_MIN_ITEMS, LOG2E, EXP2_FLOOR, dq_acc, dk_acc, dv_acc,
                                  bf16=bf16, alibi=alibi)
        return True
    for j0, j1, state in kernel.key_tiles(i0, i1):
        entries = kernel.entries(i0, i1, j0, j1, row_max)
        if entries is None:
            continue
        bias = kernel.fused_bias(q_tile, i0, i1, j0, j1, state, entries)
        n_entries = entries.stop - entries.start
        # min_items scaled by the call's entries: an entry's pieces split into the same runs whichever entries come.
        native.fa_backward_blocks(q_tile[entries], dy_g[entries], d_sum[entries], shift[entries], factor[entries],
                                  kernel.k[entries], kernel.v[entries], [(j0, j1)], bias,
                                  fused_block_rows(q_tile.shape[1]), FUSED_SUB_COLS, FUSED_MIN_ITEMS * n_entries,
                                  LOG2E, EXP2_FLOOR, dq_acc[entries], dk_acc[entries], dv_acc[entries],
                                  keep=kernel.fused_keep(i0, i1, j0, entries), keep_prob=kernel.problem.keep_prob,
                                  bf16=None if bf16 is None else bf16.take(entries),
                                  alibi=None if alibi is None else alibi.take(entries))
    return True


def _probabilities(s: torch.Tensor, row_max: torch.Tensor, inv_sum: torch.Tensor) -> None:
    """s [c, heads, rows, cols] logits -> P = exp(s - softmax_max) / softmax_sum in place (row_max / inv_sum
    [c, heads, rows, 1]): the native loop in one pass per row (fp32 on the CPU), else the same rule in PyTorch."""
    if native.usable(s) and s.is_contiguous():
        native.fa_exp_rows(s, row_max.contiguous(), inv_sum.contiguous(), LOG2E, EXP2_FLOOR)
    else:
        exp_shifted_(s, row_max).mul_(inv_sum)


def _accumulator(target: torch.Tensor, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """Where to accumulate a gradient whose output view is `target` (zero-initialised by the op): `target`
    itself viewed as `shape` when it has the accumulation dtype and its strides allow the view (no buffer, no
    copy back), else a zeroed fp32 buffer."""
    if target.dtype == dtype:
        try:
            return target.view(shape)
        except RuntimeError:  # strides that no view can merge (e.g. a GQA group's heads with a row slice)
            pass
    return torch.zeros(shape, dtype=dtype, device=target.device)


def _store(target: torch.Tensor, acc: torch.Tensor) -> None:
    """Copy a finished accumulator into its output view, unless it is that view (`_accumulator`)."""
    if acc.data_ptr() != target.data_ptr():
        target.copy_(acc.view(target.shape))
