"""Independent float64 oracles for the dense indexer pair and the quantised DSA inference operators, written from
their torch_npu pages (docs/operators/dense_lightning_indexer.md, docs/operators/quant_dsa.md): one query row at a
time, nothing imported from ``cann_attn`` outside this testing package. They validate nothing: feed valid inputs.

- `dense_softmax_lse_oracle`: npu_dense_lightning_indexer_softmax_lse.
- `dense_kl_loss_oracle`: npu_dense_lightning_indexer_grad_kl_loss's loss, differentiable w.r.t. query_index,
  key_index and weights; its autograd gradient is the documented one (dI = q - p) because q is taken from the given
  statistics and the clamp only enters inside the logarithm's value (see its docstring).
"""

from __future__ import annotations

import torch

from .dsa_oracle import INVALID_MAX, KL_CLAMP, sequence_spans

F64 = torch.float64


def _visible_keys(t: int, seq_q: int, seq_kv: int) -> int:
    """Mode 3 (the only documented mode): row t sees keys [0, Skv - Sq + t + 1), clipped to [0, Skv]."""
    return max(0, min(seq_kv, seq_kv - seq_q + t + 1))


def _index_row(q_idx_row: torch.Tensor, k_idx: torch.Tensor, w_row: torch.Tensor) -> torch.Tensor:
    """I[s] = sum_h w[h] ReLU(q[h] . k[s]) for one row: q [H, D], k [S, D], w [H] (float64)."""
    dots = (q_idx_row.to(F64).unsqueeze(1) * k_idx.to(F64).unsqueeze(0)).sum(-1)  # [H, S]
    return (w_row.to(F64).unsqueeze(1) * torch.relu(dots)).sum(0)


def dense_softmax_lse_oracle(query_index, key_index, weights, *, actual_seq_qlen=None, actual_seq_klen=None,
                             layout: str = "BSND") -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax_max_index, softmax_sum_index) in float64: (B, 1, S1) or (1, T1); rows without a visible key hold
    INVALID_MAX and 0."""
    spans = sequence_spans(layout, query_index.shape, key_index.shape, actual_seq_qlen, actual_seq_klen)
    shape = (1, query_index.shape[0]) if layout == "TND" else (query_index.shape[0], 1, query_index.shape[1])
    row_max = torch.full(shape, INVALID_MAX, dtype=F64)
    row_sum = torch.zeros(shape, dtype=F64)
    for span in spans:
        q_rows, k_rows, w_rows = span.q_rows(query_index), span.kv_rows(key_index)[:, 0], span.q_rows(weights)
        for t in range(span.q_len):
            n = _visible_keys(t, span.q_len, span.kv_len)
            if n == 0:
                continue
            scores = _index_row(q_rows[t], k_rows[:n], w_rows[t])
            m = scores.max()
            at = (0, span.q_start + t) if layout == "TND" else (span.batch, 0, t)
            row_max[at] = m
            row_sum[at] = torch.exp(scores - m).sum()
    return row_max, row_sum


def dense_kl_loss_oracle(query, key, query_index, key_index, weights, softmax_max, softmax_sum, softmax_max_index,
                         softmax_sum_index, scale_value: float, *, query_rope=None, key_rope=None,
                         actual_seq_qlen=None, actual_seq_klen=None, layout: str = "BSND") -> torch.Tensor:
    """The summed dense KL loss (float64 scalar), one row at a time.

    For row t and each visible key s (mode 3): p_s = (1/N1) sum_h exp(scale * ([q_h; qr_h] . [k_{s,h//G};
    kr_{s,h//G}]) - softmax_max[h]) / softmax_sum[h], with softmax_max[b, n2, t, g] belonging to head h = n2 * G + g;
    q_s = exp(I[t, s] - softmax_max_index[t]) / softmax_sum_index[t]; loss += sum_s p_s (log max(p_s, 1e-8) -
    log max(q_s, 1e-8)).

    Autograd of this value w.r.t. I gives -p_s d(log q'_s) = -p_s wherever q_s > 1e-8 (q has the given, constant
    statistics), and 0 where the clamp holds. The documented gradient is dI = q - p everywhere; tests compare the
    operator's gradients with `dense_kl_grad_oracle` instead, which states that formula directly.
    """
    spans = sequence_spans(layout, query_index.shape, key_index.shape, actual_seq_qlen, actual_seq_klen)
    heads, heads_kv = query.shape[-2], key.shape[-2]
    group = heads // heads_kv
    total = torch.zeros((), dtype=F64)
    for span in spans:
        for t in range(span.q_len):
            n = _visible_keys(t, span.q_len, span.kv_len)
            if n == 0:
                continue
            p, q = _row_distributions(span, t, n, query, key, query_index, key_index, weights, softmax_max,
                                      softmax_sum, softmax_max_index, softmax_sum_index, scale_value, query_rope,
                                      key_rope, layout, heads, group)
            total = total + (p * (p.clamp_min(KL_CLAMP).log() - q.clamp_min(KL_CLAMP).log())).sum()
    return total


def _row_distributions(span, t, n, query, key, query_index, key_index, weights, softmax_max, softmax_sum,
                       softmax_max_index, softmax_sum_index, scale_value, query_rope, key_rope, layout, heads, group):
    """(p [n], q [n]) of row t of `span` over its n visible keys (q keeps its autograd graph)."""
    q_vec = span.q_rows(query)[t].to(F64)
    k_mat = span.kv_rows(key)[:n].to(F64)
    if query_rope is not None:
        q_vec = torch.cat([q_vec, span.q_rows(query_rope)[t].to(F64)], -1)
        k_mat = torch.cat([k_mat, span.kv_rows(key_rope)[:n].to(F64)], -1)
    p = torch.zeros(n, dtype=F64)
    for h in range(heads):
        n2, g = divmod(h, group)
        if layout == "TND":
            m, s = softmax_max[n2, span.q_start + t, g], softmax_sum[n2, span.q_start + t, g]
        else:
            m, s = softmax_max[span.batch, n2, t, g], softmax_sum[span.batch, n2, t, g]
        z = scale_value * (k_mat[:, n2] * q_vec[h]).sum(-1)
        p = p + torch.exp(z - float(m)) / float(s)
    p = p / heads
    at = (0, span.q_start + t) if layout == "TND" else (span.batch, 0, t)
    scores = _index_row(span.q_rows(query_index)[t], span.kv_rows(key_index)[:n, 0], span.q_rows(weights)[t])
    q = torch.exp(scores - float(softmax_max_index[at])) / float(softmax_sum_index[at])
    return p.detach(), q


def dense_kl_grad_oracle(query, key, query_index, key_index, weights, softmax_max, softmax_sum, softmax_max_index,
                         softmax_sum_index, scale_value: float, *, query_rope=None, key_rope=None,
                         actual_seq_qlen=None, actual_seq_klen=None, layout: str = "BSND"):
    """(d_query_index, d_key_index, d_weights) in float64 from the documented gradient dI = q - p: autograd of
    sum_s (q_s - p_s) * I_s with (q - p) held constant, i.e. dI pushed through I = sum_h w_h ReLU(q_h . k_s)."""
    spans = sequence_spans(layout, query_index.shape, key_index.shape, actual_seq_qlen, actual_seq_klen)
    heads, heads_kv = query.shape[-2], key.shape[-2]
    group = heads // heads_kv
    qi = query_index.detach().to(F64).requires_grad_()
    ki = key_index.detach().to(F64).requires_grad_()
    w = weights.detach().to(F64).requires_grad_()
    surrogate = torch.zeros((), dtype=F64)
    for span in spans:
        for t in range(span.q_len):
            n = _visible_keys(t, span.q_len, span.kv_len)
            if n == 0:
                continue
            p, q = _row_distributions(span, t, n, query, key, qi, ki, w, softmax_max, softmax_sum, softmax_max_index,
                                      softmax_sum_index, scale_value, query_rope, key_rope, layout, heads, group)
            scores = _index_row(span.q_rows(qi)[t], span.kv_rows(ki)[:n, 0], span.q_rows(w)[t])
            surrogate = surrogate + ((q.detach() - p) * scores).sum()
    if not surrogate.requires_grad:
        return torch.zeros_like(qi), torch.zeros_like(ki), torch.zeros_like(w)
    return torch.autograd.grad(surrogate, (qi, ki, w), allow_unused=True, materialize_grads=True)


# ----------------------------------------------------------------------------------------------------------
# QuantLightningIndexer (docs/operators/quant_dsa.md)
# ----------------------------------------------------------------------------------------------------------
def quant_index_scores_oracle(query, key, weights, query_scale, key_scale, *, actual_seq_lengths_query=None,
                              actual_seq_lengths_key=None, layout: str = "BSND", sparse_mode: int = 3
                              ) -> torch.Tensor:
    """float64 scores I[t, s] = sum_h W[t, h] ReLU((Sq[t, h] Sk[s]) (Q[t, h] . K[s])) of the allowed keys, -inf
    elsewhere: [B, S1, S2] (BSND) or [T1, max Skv] (TND). Contiguous key / key_scale only (rebuild a paged cache
    first)."""
    spans = sequence_spans(layout, query.shape, key.shape, actual_seq_lengths_query, actual_seq_lengths_key)
    if layout == "TND":
        scores = torch.full((query.shape[0], max((s.kv_len for s in spans), default=0)), float("-inf"), dtype=F64)
    else:
        scores = torch.full((query.shape[0], query.shape[1], key.shape[1]), float("-inf"), dtype=F64)
    for span in spans:
        q, w, sq = span.q_rows(query).to(F64), span.q_rows(weights).to(F64), span.q_rows(query_scale).to(F64)
        k, sk = span.kv_rows(key)[:, 0].to(F64), span.kv_rows(key_scale)[:, 0].to(F64)
        for t in range(span.q_len):
            thr = span.kv_len - span.q_len + t + 1 if sparse_mode == 3 else span.kv_len
            n = max(0, min(span.kv_len, thr))
            if n == 0:
                continue
            dots = (q[t].unsqueeze(1) * k[:n].unsqueeze(0)).sum(-1)  # [H, n]
            scaled = (sq[t].unsqueeze(1) * sk[:n].unsqueeze(0)) * dots
            scores[span.q_token(t)][:n] = (w[t].unsqueeze(1) * torch.relu(scaled)).sum(0)
    return scores


def top_k_oracle(scores: torch.Tensor, sparse_count: int) -> torch.Tensor:
    """int32 [*lead, 1, K] indices of the finite scores of each row, descending, ties to the smaller index (a
    literal sort on (-score, s)), then -1."""
    lead = scores.shape[:-1]
    rows = scores.reshape(-1, scores.shape[-1]).tolist()
    out = torch.full((len(rows), sparse_count), -1, dtype=torch.int32)
    for r, row in enumerate(rows):
        order = sorted((s for s, v in enumerate(row) if v != float("-inf")), key=lambda s: (-row[s], s))
        for e, s in enumerate(order[:sparse_count]):
            out[r, e] = s
    return out.view(*lead, 1, sparse_count)


# ----------------------------------------------------------------------------------------------------------
# KvQuantSparseFlashAttention (docs/operators/quant_dsa.md)
# ----------------------------------------------------------------------------------------------------------
def dequantize_combined_rows(cache: torch.Tensor, query_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent [.., 512] in query_dtype, rope [.., 64] in query_dtype) of combined rows [.., 656 bytes]: bytes
    512..639 are the rope values, bytes 640..655 four fp32 scales; latent channel c is multiplied by scale c // 128
    in fp32 and rounded once to the query's dtype."""
    raw = cache.contiguous().view(torch.uint8)
    rope = raw[..., 512:640].contiguous().view(query_dtype)
    scales = raw[..., 640:656].contiguous().view(torch.float32)
    latent = cache[..., :512].to(torch.float32)
    channel_scale = torch.stack([scales[..., c // 128] for c in range(512)], dim=-1)
    return (latent * channel_scale).to(query_dtype), rope


def kv_quant_sparse_attention_oracle(query, key, value, sparse_indices, scale_value: float, *,
                                     actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
                                     sparse_block_size: int = 1, layout: str = "BSND", sparse_mode: int = 3,
                                     sinks=None) -> torch.Tensor:
    """float64 output of the quantised sparse attention on contiguous (BSND / TND) combined rows: the documented
    dequantisation, then the SparseFlashAttention oracle with Q = query (nope ++ rope), K = [Dequant(key) ; rope],
    V = Dequant(value)."""
    from .dsa_oracle import sparse_attention_oracle

    k_nope, k_rope = dequantize_combined_rows(key, query.dtype)
    v_nope, _ = dequantize_combined_rows(value, query.dtype)
    return sparse_attention_oracle(
        query[..., :512], k_nope, v_nope, sparse_indices, scale_value, query_rope=query[..., 512:], key_rope=k_rope,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        sparse_block_size=sparse_block_size, layout=layout, sparse_mode=sparse_mode, sinks=sinks)[0]


def quant_lightning_indexer_oracle(query, key, weights, query_dequant_scale, key_dequant_scale, *,
                                   actual_seq_lengths_query=None, actual_seq_lengths_key=None, layout: str = "BSND",
                                   sparse_count: int = 2048, sparse_mode: int = 3) -> torch.Tensor:
    """QuantLightningIndexer's int32 indices [*, 1, K]: `quant_index_scores_oracle` then `top_k_oracle`
    (contiguous key and key scale only)."""
    scores = quant_index_scores_oracle(query, key, weights, query_dequant_scale, key_dequant_scale,
                                       actual_seq_lengths_query=actual_seq_lengths_query,
                                       actual_seq_lengths_key=actual_seq_lengths_key, layout=layout,
                                       sparse_mode=sparse_mode)
    return top_k_oracle(scores, sparse_count)
