"""Tiled FlashAttention forward over a canonical `AttentionProblem` (SEMANTICS.md sections 2-6).

Online softmax over key tiles of each query tile: never more than one [count, N1, BLOCK_Q, BLOCK_K] score
tile exists. Tiles the mask structure hides are skipped; fully visible tiles skip the mask. GQA shares K/V
across a group by stacking the group's query rows into one GEMM ([count * N2, G * rows, D]).
"""

from __future__ import annotations

import torch

from ...problem.attention import AttentionProblem, Run
from ...problem.mask import TileState
from ...problem.stats import FLT_MAX

BLOCK_Q = 256
BLOCK_K = 512


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation everywhere; float64 inputs (gradcheck) stay float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward(problem: AttentionProblem, query, key, value, out, softmax_max, softmax_sum) -> None:
    """Fill `out` (query layout, Dv), `softmax_max` and `softmax_sum` for every run of `problem`."""
    for run in problem.runs:
        if run.seq_q == 0:
            continue
        _forward_run(problem, run, query, key, value, out, softmax_max, softmax_sum)


def group_rows(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """[c, N1, r, D] -> [c * N2, G * r, D] (contiguous): a GQA group's rows share one K/V matrix."""
    c, n1, r, d = t.shape
    return t.reshape(c * heads_kv, (n1 // heads_kv) * r, d)


def scores_tile(problem: AttentionProblem, run: Run, q_tile, k_tile, i0, i1, j0, j1) -> torch.Tensor:
    """Scaled logits with pse, [c, N1, rows, cols], in the compute dtype (mask not applied)."""
    c, rows, cols = run.count, i1 - i0, j1 - j0
    kt = k_tile.transpose(1, 2)
    if run.pse is None:
        s = torch.bmm(q_tile, kt)
        s.mul_(problem.scale)
    else:
        bias = run.pse.tile(i0, i1, j0, j1, q_tile.device).to(q_tile.dtype)
        bias = bias.expand(c, problem.heads_q, rows, cols).reshape(q_tile.shape[0], -1, cols)
        s = torch.baddbmm(bias, q_tile, kt, beta=1.0, alpha=problem.scale)
    return s.view(c, problem.heads_q, rows, cols)


def apply_mask(run: Run, s: torch.Tensor, state: TileState, i0, i1, j0, j1) -> None:
    if state is TileState.PARTIAL:
        s.masked_fill_(run.mask.masked_tile(i0, i1, j0, j1, s.device), float("-inf"))


def key_tiles(run: Run, i0: int, i1: int, block_k: int):
    """(j0, j1, state) of the key tiles rows [i0, i1) may see, in order."""
    lo, hi = run.mask.key_range(i0, i1)
    for j0 in range(lo - lo % block_k, hi, block_k):
        j1 = min(j0 + block_k, run.seq_kv)
        state = run.mask.tile_state(i0, i1, j0, j1)
        if state is TileState.EMPTY or run.mask.explicit_tile_all_masked(i0, i1, j0, j1):
            continue
        yield j0, j1, state


def _forward_run(problem: AttentionProblem, run: Run, query, key, value, out, softmax_max, softmax_sum):
    dtype = compute_dtype(query.dtype)
    n2, c = problem.heads_kv, run.count
    q_all = problem.q_view(query, run)
    k_all = problem.kv_view(key, run).to(dtype).reshape(c * n2, run.seq_kv, -1)
    v_all = problem.kv_view(value, run).to(dtype).reshape(c * n2, run.seq_kv, -1)
    out_view = problem.q_view(out, run)
    max_view, sum_view = problem.stat_view(softmax_max, run), problem.stat_view(softmax_sum, run)
    dv = v_all.shape[-1]
    for i0 in range(0, run.seq_q, BLOCK_Q):
        i1 = min(i0 + BLOCK_Q, run.seq_q)
        rows = i1 - i0
        q_tile = group_rows(q_all[:, :, i0:i1].to(dtype), n2)
        row_max = torch.full((c, problem.heads_q, rows), float("-inf"), dtype=dtype, device=query.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros((c * n2, q_tile.shape[1], dv), dtype=dtype, device=query.device)
        for j0, j1, state in key_tiles(run, i0, i1, BLOCK_K):
            s = scores_tile(problem, run, q_tile, k_all[:, j0:j1], i0, i1, j0, j1)
            apply_mask(run, s, state, i0, i1, j0, j1)
            new_max = torch.maximum(row_max, s.amax(-1))
            # A row that has seen nothing visible yet keeps max -inf; shift it by 0 to avoid inf - inf.
            shift = torch.where(new_max == float("-inf"), 0.0, new_max)
            s.sub_(shift.unsqueeze(-1)).exp_()
            correction = torch.exp(row_max - shift)
            row_sum.mul_(correction).add_(s.sum(-1))
            row_max = new_max
            if run.dropout is not None:
                s.mul_(run.dropout.keep_tile(i0, i1, j0, j1, s.device))
            acc.mul_(correction.view(c * n2, -1, 1))
            acc.baddbmm_(s.view(c * n2, -1, j1 - j0), v_all[:, j0:j1])
        valid = row_sum > 0
        denom = torch.where(valid, row_sum * problem.keep_prob, 1.0).view(c * n2, -1, 1)
        result = (acc / denom).view(c, problem.heads_q, rows, dv)
        result.masked_fill_(~valid.unsqueeze(-1), 0.0)
        out_view[:, :, i0:i1].copy_(result)
        max_view[:, :, i0:i1].copy_(torch.where(valid, row_max, -FLT_MAX).unsqueeze(-1).expand(-1, -1, -1, 8))
        sum_view[:, :, i0:i1].copy_(torch.where(valid, row_sum, FLT_MAX).unsqueeze(-1).expand(-1, -1, -1, 8))
