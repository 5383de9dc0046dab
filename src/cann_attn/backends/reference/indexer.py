"""Lightning indexer scores / top-k and the indexer KL loss with its gradients (docs/operators/lightning_indexer.md).

Index score: I[t, s] = sum_h w[t, h] * ReLU(q_idx[t, h] . k_idx[s]) in fp32. Rows are processed in tiles; the
indexer forward forms a [rows, Skv] score tile (never S1 x S2), the KL op gathers only the selected keys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...problem.dequant import score_scales
from ...problem.sparse import allowed_keys, indexer_selection
from ...problem.stats import accumulation_dtype
from . import native
from .softmax_exp import EXP2_FLOOR, LOG2E, exp2_flushed_
from .sparse_attention import query_with_rope
from .workspace import Workspace

ROW_TILE = 64
# Rows per KL tile (selection, indexer scores, softmax, KL terms, gradients, dK scatter): 32 measured best of
# 8..64 at DeepSeek-V3.2 shapes on a 2-core EPYC; processing the indexer part per 8 rows (more, smaller ops)
# measured slower.
KL_ROW_TILE = 32
# With the native loops (no gathered [rows, W, D] copies) the per-tile PyTorch work is small and larger tiles
# amortise it: 128 rows measured 252 ms against 324 (32 rows), 287 (64) and 262 (256) at the same shapes.
NATIVE_KL_ROW_TILE = 128
# Rows per main-attention target sub-tile: 8 rows' gathered keys (8 x 512 x 576 fp32, 9.4 MB) stay in a 32 MB
# last-level cache between the gather and the GEMM. Against gathering all 32 rows at once: ~20% faster in most
# alternating A/B runs, none better in a spell of low memory bandwidth; 4 and 8 rows measured alike.
TARGET_ROW_TILE = 8
KL_CLAMP = 1e-8
# The indexer forward pads the key count to a multiple of KEY_ALIGN (zero keys, scores sliced off) so every row
# of the [rows * H, Skv] ReLU tile starts 64-byte aligned. Measured (MKL, AVX2, 1 or 2 threads): the q.k GEMM is
# column-invariant, but the weight reduction (the bmm in index_scores) gives a column-position-dependent last bit
# when the row stride is no multiple of 8 floats (Skv = 257: 94 of 257 columns differ from an identical key's),
# so identical keys broke the tie rule of docs/operators/lightning_indexer.md ("ties to the smaller index"). 16 fp32 =
# 64 bytes also covers AVX-512; the aligned bmm is no slower (at most 15 extra zero keys).
KEY_ALIGN = 16


def _sortable(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering like the fp32 scores, ties broken toward the smaller column (exact top-k order)."""
    bits = (scores + 0.0).contiguous().view(torch.int32).to(torch.int64)  # + 0.0 folds -0 into +0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    cols = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return (ordered << 32) | (0xFFFFFFFF - cols)


def index_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor,
                 q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, Skv] scores of query rows q_idx [rows, H, D] against keys k_idx [Skv, D], weights [rows, H]. With
    q_scale [rows, H] and k_scale [Skv] (QuantLightningIndexer) each dot product is first scaled by
    q_scale[t, h] * k_scale[s] (problem/dequant.py)."""
    rows, heads, dim = q_idx.shape
    dots = (q_idx.reshape(rows * heads, dim) @ k_idx.transpose(0, 1)).view(rows, heads, -1)
    if q_scale is None:
        return torch.bmm(weights.unsqueeze(1), dots.relu_()).squeeze(1)
    if bool((q_scale >= 0).all()) and bool((k_scale >= 0).all()):
        # Non-negative scales leave the ReLU's sign test to the dot product: ReLU(sq sk x) = sk (sq ReLU(x)), so the
        # scales fold into the weights and a per-key factor instead of two passes over [rows, H, Skv].
        folded = weights * q_scale.to(weights.dtype)
        return torch.bmm(folded.unsqueeze(1), dots.relu_()).squeeze(1).mul_(k_scale.to(weights.dtype))
    dots.mul_(score_scales(q_scale, k_scale).to(dots.dtype))
    return torch.bmm(weights.unsqueeze(1), dots.relu_()).squeeze(1)


@torch.no_grad()  # kernels fill preallocated outputs; autograd pairs the ops one level up
def top_k_sequence(q_idx, k_idx, weights, *, sparse_mode: int, seq_q: int, seq_kv: int, k: int,
                   indices_out: torch.Tensor, values_out: torch.Tensor | None,
                   q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                   npu_scores: Callable[..., torch.Tensor] | None = None,
                   npu_values: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Fill indices_out [Sq, K] (int32, -1 padded) and values_out [Sq, K] for one sequence; q_scale [Sq, H] and
    k_scale [Skv] dequantise int8 / fp8 inputs (QuantLightningIndexer, computed in fp32). `npu_scores` (the "npu"
    precision mode, docs/semantics/precision.md) forms the scores instead of `index_scores`, and `npu_values` rounds
    the returned values (fp32 in, fp32 values of the output dtype out)."""
    dtype = accumulation_dtype(q_idx.dtype)
    k_all = torch.zeros((-(-seq_kv // KEY_ALIGN) * KEY_ALIGN, k_idx.shape[-1]), dtype=dtype, device=k_idx.device)
    k_all[:seq_kv] = k_idx
    k_scale_all = None
    if k_scale is not None:
        k_scale_all = torch.zeros(k_all.shape[0], dtype=torch.float32, device=k_idx.device)
        k_scale_all[:seq_kv] = k_scale
    for t0 in range(0, seq_q, ROW_TILE):
        t1 = min(t0 + ROW_TILE, seq_q)
        rows = torch.arange(t0, t1, device=q_idx.device)
        score = index_scores if npu_scores is None else npu_scores
        scores = score(q_idx[t0:t1].to(dtype), k_all, weights[t0:t1].to(dtype),
                       None if q_scale is None else q_scale[t0:t1], k_scale_all)[:, :seq_kv]
        allowed = allowed_keys(sparse_mode, seq_q, seq_kv, rows)
        cols = torch.arange(seq_kv, device=q_idx.device).view(1, -1)
        disallowed = cols >= allowed.view(-1, 1)
        width = min(k, seq_kv)
        if width > 0:
            if dtype == torch.float64:
                masked = scores.masked_fill(disallowed, float("-inf"))
                order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :width]
            else:
                keys = _sortable(scores).masked_fill(disallowed, torch.iinfo(torch.int64).min)
                order = torch.topk(keys, width, dim=-1, sorted=True).indices
            taken = torch.arange(width, device=q_idx.device).view(1, -1) < allowed.view(-1, 1)
            indices_out[t0:t1, :width] = torch.where(taken, order, -1).to(torch.int32)
            if values_out is not None:
                picked = torch.gather(scores, 1, order)
                picked = torch.where(taken, picked, float("-inf"))
                values_out[t0:t1, :width] = (picked if npu_values is None else npu_values(picked)).to(values_out.dtype)


def _target_distribution(q_main: torch.Tensor, q_rope: torch.Tensor | None, k_main: torch.Tensor,
                         tokens: torch.Tensor, valid: torch.Tensor, all_valid: bool, row_max: torch.Tensor,
                         row_sum: torch.Tensor, scale: float, ws: Workspace) -> torch.Tensor:
    """p [rows, W]: the main-attention probabilities of each row's selected keys `tokens` [rows, W], averaged over
    the N1 heads (docs/operators/lightning_indexer.md), from q_main [rows, N1, D] (+ q_rope [rows, N1, Dr]) and k_main
    [Skv, D + Dr]; exactly 0 on invalid entries (`valid` False).

    exp(z - m) / l is taken as 2^(z' - (m + ln l) log2 e) with z' = (scale log2 e q) . k: the shift rides in the
    GEMM (baddbmm), leaving one threshold and one exp2 pass. Rows go in TARGET_ROW_TILE sub-tiles so the gathered
    keys stay in the last-level cache for the GEMM that reads them."""
    rows, heads, _ = q_main.shape
    dtype = k_main.dtype
    width = tokens.shape[1]
    query = query_with_rope(ws, "q_main", q_main, q_rope, k_main.shape[-1], dtype, scale * LOG2E)
    # (m + ln l) log2 e per row and head; l = 0 gives -inf and an infinite target, as the formula does.
    shift = row_sum.to(dtype).log().add_(row_max.to(dtype)).mul_(LOG2E).unsqueeze(-1)
    p = ws.take("p", (rows, width), dtype)
    if native.usable(query, k_main):
        # The native loop reads each valid entry's key row in place (no gather) and skips invalid entries.
        native.kl_target(query, k_main, tokens, None if all_valid else valid, shift.squeeze(-1).contiguous(),
                         EXP2_FLOOR, p)
        return p
    for r0 in range(0, rows, TARGET_ROW_TILE):
        r1 = min(r0 + TARGET_ROW_TILE, rows)
        keys = ws.gather_rows("k_main", k_main, tokens[r0:r1])
        z = torch.baddbmm(shift[r0:r1], query[r0:r1], keys.transpose(1, 2), beta=-1.0,
                          out=ws.take("z", (r1 - r0, heads, width), dtype))
        exp2_flushed_(z)
        torch.sum(z, 1, out=p[r0:r1])
    p.mul_(1.0 / heads)
    return p if all_valid else p.masked_fill_(~valid, 0.0)


@torch.no_grad()  # kernels fill preallocated outputs; autograd pairs the ops one level up
def kl_loss_sequence(seq_q: int, seq_kv: int, *, q_main, q_rope, k_main, q_idx, k_idx, weights, indices, row_max,
                     row_sum, scale: float, sparse_mode: int, dq_idx, dk_idx, dw,
                     score_grad: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Loss (summed over the sequence's rows) and gradients of one sequence.

    q_main [Sq, N1, D] with q_rope [Sq, N1, Dr] (or None), k_main [Skv, D + Dr] (key ++ key_rope); row_max/row_sum
    [Sq, N1] are the SFA stats. dq_idx [Sq, H, D] and dw [Sq, H] are written, dk_idx [Skv, D] accumulated (fp32,
    fixed order). `score_grad` (the "npu" precision mode, docs/semantics/precision.md) rounds the ReLU gradient
    before the dq / dk GEMMs; it takes the PyTorch path."""
    dtype = dq_idx.dtype
    loss = torch.zeros((), dtype=torch.float64, device=q_idx.device)
    k_idx_all = k_idx.to(dtype)
    k_main_all = k_main.to(dtype)
    ws = Workspace(q_idx.device)
    row_tile = NATIVE_KL_ROW_TILE if native.usable(k_idx_all, k_main_all) else KL_ROW_TILE
    for t0 in range(0, seq_q, row_tile):
        t1 = min(t0 + row_tile, seq_q)
        rows = torch.arange(t0, t1, device=q_idx.device)
        tokens, valid = indexer_selection(indices[t0:t1], rows, sparse_mode=sparse_mode, seq_q=seq_q, seq_kv=seq_kv)
        all_valid = bool(valid.all())
        p = _target_distribution(q_main[t0:t1], None if q_rope is None else q_rope[t0:t1], k_main_all, tokens,
                                 valid, all_valid, row_max[t0:t1], row_sum[t0:t1], scale, ws)
        # Indexer distribution over the same entries. The native loops read the selected key rows in place; the
        # PyTorch path gathers them ([rows, W, D]) for batched GEMMs.
        q_t = q_idx[t0:t1].to(dtype).contiguous()
        w_t = weights[t0:t1].to(dtype)
        use_native = native.usable(q_t, k_idx_all) and score_grad is None
        if use_native:
            relu = native.rows_dot(q_t, k_idx_all, tokens, ws.take("relu", (*q_t.shape[:2], tokens.shape[1]), dtype))
        else:
            k_sel = ws.gather_rows("k_idx", k_idx_all, tokens)
            relu = torch.bmm(q_t, k_sel.transpose(1, 2))
        relu.relu_()  # [rows, H, W]
        scores = torch.bmm(w_t.unsqueeze(1), relu).squeeze(1)
        if all_valid:
            q_dist = torch.softmax(scores, dim=-1)
        else:
            scores.masked_fill_(~valid, float("-inf"))
            has_keys = valid.any(-1, keepdim=True)
            q_dist = torch.softmax(torch.where(has_keys, scores, 0.0), dim=-1).masked_fill_(~valid, 0.0)
        p_c, q_c = p.clamp_min(KL_CLAMP), q_dist.clamp_min(KL_CLAMP)
        terms = p_c * (p_c.log() - q_c.log())
        if not all_valid:
            terms.masked_fill_(~valid, 0.0)
        loss += terms.sum().to(torch.float64)
        d_scores = q_dist.sub_(p)  # dI_j = q_j - p_j (0 on invalid entries, where both are 0)
        dw[t0:t1] = torch.bmm(relu, d_scores.unsqueeze(-1)).squeeze(-1)
        # dI/d(q.k) = w * [q.k > 0]: relu > 0 exactly where q.k > 0.
        ds = relu.sign_().mul_(w_t.unsqueeze(-1)).mul_(d_scores.unsqueeze(1))
        if score_grad is not None:
            ds = score_grad(ds)
        # Invalid entries have ds = 0 (both distributions are 0 there): they add exact zeros to token 0.
        if use_native:
            dq_rows = dq_idx[t0:t1]
            if dq_rows.is_contiguous():
                native.rows_combine(ds, k_idx_all, tokens, dq_rows)
            else:
                dq_rows.copy_(native.rows_combine(ds, k_idx_all, tokens, torch.empty_like(q_t)))
            native.rows_scatter(ds, q_t, tokens, dk_idx)
        else:
            torch.bmm(ds, k_sel, out=dq_idx[t0:t1])
            dk_sel = torch.bmm(ds.transpose(1, 2), q_t, out=ws.take("dk_sel", (*tokens.shape, q_t.shape[-1]), dtype))
            dk_idx.index_add_(0, tokens.reshape(-1), dk_sel.flatten(0, 1))
    return loss
