"""Dense lightning indexer: the indexer's softmax statistics and the dense KL loss with its gradients
(docs/operators/dense_lightning_indexer.md).

Rows go in tiles of ROW_TILE; a tile forms [rows, Skv] index scores and [rows, N1, Skv] main-attention
probabilities, never an Sq x Skv matrix. Every visible key of a row takes part (no selection).
"""

from __future__ import annotations

import torch

from ...problem.sparse import allowed_keys
from .indexer import KL_CLAMP
from .sparse_attention import INVALID_MAX

# 16 rows x 64 heads x 4096 keys of fp32 probabilities is 16 MB: the tile's working set stays cache-sized.
ROW_TILE = 16


def _visible(sparse_mode: int, seq_q: int, seq_kv: int, t0: int, t1: int, device) -> torch.Tensor:
    """[rows, Skv] bool: key s is visible to row t (mode 3: s <= Skv - Sq + t; docs/operators/lightning_indexer.md)."""
    rows = torch.arange(t0, t1, device=device)
    allowed = allowed_keys(sparse_mode, seq_q, seq_kv, rows)
    return torch.arange(seq_kv, device=device).view(1, -1) < allowed.view(-1, 1)


def _relu_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor):
    """(ReLU(q_idx . k_idx) [rows, H, Skv], I = sum_h w_h ReLU(...) [rows, Skv]) in the inputs' dtype."""
    relu = torch.relu(torch.matmul(q_idx, k_idx.transpose(0, 1)))
    return relu, torch.bmm(weights.unsqueeze(1), relu).squeeze(1)


@torch.no_grad()
def softmax_lse_sequence(q_idx, k_idx, weights, *, sparse_mode: int, seq_q: int, seq_kv: int, dtype: torch.dtype,
                         max_out: torch.Tensor, sum_out: torch.Tensor) -> None:
    """Fill max_out / sum_out [Sq] with max_s I[t, s] and sum_s exp(I[t, s] - max) over the visible keys; a row with
    no visible key gets INVALID_MAX and 0."""
    k = k_idx.to(dtype)
    for t0 in range(0, seq_q, ROW_TILE):
        t1 = min(t0 + ROW_TILE, seq_q)
        _, scores = _relu_scores(q_idx[t0:t1].to(dtype), k, weights[t0:t1].to(dtype))
        visible = _visible(sparse_mode, seq_q, seq_kv, t0, t1, scores.device)
        scores.masked_fill_(~visible, float("-inf"))
        has_keys = visible.any(-1)
        row_max = torch.where(has_keys, scores.amax(-1), 0.0)
        row_sum = torch.exp(scores - row_max.unsqueeze(-1)).sum(-1)
        max_out[t0:t1] = torch.where(has_keys, row_max, INVALID_MAX)
        sum_out[t0:t1] = torch.where(has_keys, row_sum, 0.0)


@torch.no_grad()
def kl_loss_sequence(*, q_main, k_main, q_idx, k_idx, weights, row_max, row_sum, index_max, index_sum,
                     scale: float, sparse_mode: int, seq_q: int, seq_kv: int, dq_idx, dk_idx, dw) -> torch.Tensor:
    """Loss (summed over the sequence's rows) and indexer gradients of one sequence.

    q_main [Sq, N1, Dk] and k_main [Skv, N2, Dk] carry the rope dims appended; query head h reads key head
    h // (N1 / N2). row_max / row_sum [Sq, N1] are the attention statistics, index_max / index_sum [Sq] the
    indexer's. dq_idx [Sq, H, D] and dw [Sq, H] are written, dk_idx [Skv, D] accumulated, all in fp32 (float64 for
    float64 inputs)."""
    dtype = dq_idx.dtype
    heads, heads_kv = q_main.shape[1], k_main.shape[1]
    group = heads // heads_kv
    k_heads = k_main.to(dtype).permute(1, 2, 0)  # [N2, Dk, Skv]
    k_index = k_idx.to(dtype)
    loss = torch.zeros((), dtype=torch.float64, device=q_idx.device)
    for t0 in range(0, seq_q, ROW_TILE):
        t1 = min(t0 + ROW_TILE, seq_q)
        rows = t1 - t0
        visible = _visible(sparse_mode, seq_q, seq_kv, t0, t1, q_idx.device)
        # Target: the main attention's probabilities from the given statistics, averaged over the N1 heads.
        q_heads = q_main[t0:t1].to(dtype).view(rows, heads_kv, group, -1).transpose(0, 1)  # [N2, rows, G, Dk]
        z = torch.matmul(q_heads.reshape(heads_kv, rows * group, -1), k_heads)  # [N2, rows * G, Skv]
        z = z.view(heads_kv, rows, group, seq_kv).permute(1, 0, 2, 3).reshape(rows, heads, seq_kv)
        z.mul_(scale).sub_(row_max[t0:t1].to(dtype).unsqueeze(-1))
        z.masked_fill_(~visible.unsqueeze(1), float("-inf"))
        probs = torch.exp(z).div_(row_sum[t0:t1].to(dtype).unsqueeze(-1))
        # Hidden keys are exactly 0 in both distributions, whatever a keyless row's statistics (0 / 0 there).
        p = probs.sum(1).mul_(1.0 / heads).masked_fill_(~visible, 0.0)
        # The indexer's distribution from its given statistics.
        q_t = q_idx[t0:t1].to(dtype)
        w_t = weights[t0:t1].to(dtype)
        relu, scores = _relu_scores(q_t, k_index, w_t)
        scores = scores.sub_(index_max[t0:t1].to(dtype).unsqueeze(-1)).masked_fill_(~visible, float("-inf"))
        q_dist = torch.exp(scores).div_(index_sum[t0:t1].to(dtype).unsqueeze(-1)).masked_fill_(~visible, 0.0)
        terms = p * (p.clamp_min(KL_CLAMP).log() - q_dist.clamp_min(KL_CLAMP).log())
        loss += terms.masked_fill_(~visible, 0.0).sum().to(torch.float64)
        d_scores = q_dist.sub_(p)  # dI = q - p; 0 where the key is not visible (both are 0 there)
        dw[t0:t1] = torch.bmm(relu, d_scores.unsqueeze(-1)).squeeze(-1)
        ds = relu.sign_().mul_(w_t.unsqueeze(-1)).mul_(d_scores.unsqueeze(1))  # dI * w * [q.k > 0]
        dq_idx[t0:t1] = torch.matmul(ds, k_index)
        dk_idx += torch.einsum("rhs,rhd->sd", ds, q_t)
    return loss
