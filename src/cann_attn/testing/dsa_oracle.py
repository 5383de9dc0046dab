"""Independent float64 oracles for the DSA operators (docs/semantics/layouts.md, docs/semantics/invalid-rows.md,
docs/operators/sparse_flash_attention.md, docs/operators/lightning_indexer.md).

Written from docs/semantics/index.mdonly: pure PyTorch, nothing imported from ``cann_attn``. Every rule is stated as a
literal per-row Python loop over the row's index entries, so that it can serve as the independent truth in tests.
It validates almost nothing: feed it valid inputs.

- `sparse_attention_oracle`: SparseFlashAttention forward, returning (out, softmax_max, softmax_sum). It is
  differentiable w.r.t. query, key, value, query_rope and key_rope through torch.autograd: the gradients of ``(out *
  d_out).sum()`` are the goldens of SparseFlashAttentionGrad (docs/operators/sparse_flash_attention.md states the grad
  formulas, which are exactly the derivative of this forward).
- `lightning_indexer_oracle` / `indexer_score_matrix`: index scores, top-k with ties to the smaller index.
- `indexer_kl_loss_oracle`: the SparseLightningIndexerGradKLLoss loss, differentiable w.r.t. query_index,
  key_index and weights, with the DOCUMENTED gradient dI_j = q_j - p_j (see its docstring).

Conventions: B batch, N1 query heads (N2 = 1: MLA-absorbed MQA), t query row and s key position, both 0-based
inside their sequence. Layouts BSND ([B, S, N, D], optional per-batch actual lengths) and TND ([T, N, D],
cumulative ends without a leading 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "INVALID_MAX",
    "KL_CLAMP",
    "SPARSE_BLOCK_SIZES",
    "SequenceSpan",
    "index_scores_oracle",
    "indexer_kl_loss_oracle",
    "indexer_score_matrix",
    "kl_selected_entries",
    "lightning_indexer_oracle",
    "sequence_spans",
    "sfa_selected_tokens",
    "sparse_attention_oracle",
    "stats_shape",
]

INVALID_MAX = -2e38  # softmax_max of a row with nothing selected (docs/semantics/invalid-rows.md); its softmax_sum is 0
KL_CLAMP = 1e-8  # p' = max(p, 1e-8), q' = max(q, 1e-8) in the KL loss value (docs/operators/lightning_indexer.md)
SPARSE_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)


# ----------------------------------------------------------------------------------------------------------
# Sequences and lengths (docs/semantics/layouts.md)
# ----------------------------------------------------------------------------------------------------------
def _int_list(value) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(x) for x in value.reshape(-1).tolist()]
    if isinstance(value, int):
        return [value]
    return [int(x) for x in value]


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence: where its query rows and keys live in the tensors, and its actual lengths.

    BSND: batch b, rows [0, q_len) of query[b] and keys [0, kv_len) of key[b] (q_len/kv_len are the actual
    lengths, the rows beyond are not part of the sequence). TND: rows [q_start, q_start + q_len) of the packed
    tensors (batch is None)."""

    batch: int | None
    q_start: int
    q_len: int
    kv_start: int
    kv_len: int

    def q_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[q_len, ...] rows of a query-side tensor ([B, S1, ...] or [T1, ...])."""
        if self.batch is None:
            return t[self.q_start : self.q_start + self.q_len]
        return t[self.batch, : self.q_len]

    def kv_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[kv_len, ...] rows of a key-side tensor ([B, S2, ...] or [T2, ...])."""
        if self.batch is None:
            return t[self.kv_start : self.kv_start + self.kv_len]
        return t[self.batch, : self.kv_len]

    def q_token(self, t: int) -> tuple[int, ...]:
        """Index of row t of this sequence in a query-side tensor."""
        return (t + self.q_start,) if self.batch is None else (self.batch, t)


def sequence_spans(layout: str, q_shape: Sequence[int], kv_shape: Sequence[int], actual_q=None,
                   actual_kv=None) -> list[SequenceSpan]:
    """The sequences of a DSA problem.

    BSND: one per batch; actual lengths are plain per-batch lengths (None -> the tensor's S; one value -> every
    batch; otherwise the first B values are used). TND: cumulative ends without a leading 0 ([2, 4, 6] = three
    sequences of 2); both lists are required and have one entry per sequence.
    """
    if layout == "BSND":
        batch, s1, s2 = q_shape[0], q_shape[1], kv_shape[1]

        def per_batch(value, full):
            lengths = _int_list(value)
            if lengths is None:
                return [full] * batch
            if len(lengths) == 1:
                return lengths * batch
            return lengths[:batch]

        q_len, kv_len = per_batch(actual_q, s1), per_batch(actual_kv, s2)
        return [SequenceSpan(b, 0, q_len[b], 0, kv_len[b]) for b in range(batch)]
    q_ends, kv_ends = _int_list(actual_q), _int_list(actual_kv)
    spans, q_prev, kv_prev = [], 0, 0
    for q_end, kv_end in zip(q_ends, kv_ends, strict=True):
        spans.append(SequenceSpan(None, q_prev, q_end - q_prev, kv_prev, kv_end - kv_prev))
        q_prev, kv_prev = q_end, kv_end
    return spans


def stats_shape(layout: str, q_shape: Sequence[int], heads: int) -> tuple[int, ...]:
    """softmax_max / softmax_sum shape: [B, N2=1, S1, G=N1] (BSND) or [N2=1, T1, G=N1] (TND)."""
    if layout == "TND":
        return (1, q_shape[0], heads)
    return (q_shape[0], 1, q_shape[1], heads)


def _stat_row(stat: torch.Tensor, layout: str, span: SequenceSpan, t: int) -> torch.Tensor:
    """[N1] statistics of row t of `span`."""
    if layout == "TND":
        return stat[0, span.q_start + t]
    return stat[span.batch, 0, t]


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[H, D] x [T, D] -> [H, T] dot products as an elementwise product and sum (no GEMM: float64 GEMMs of a
    new shape cost ~25 ms each on some CPU builds, and these shapes change every row)."""
    return (a.unsqueeze(1) * b.unsqueeze(0)).sum(dim=-1)


def _causal_threshold(sparse_mode: int, seq_q: int, seq_kv: int, t: int) -> int:
    """thr(t): row t may see keys [0, thr). Mode 3 (bottom-right causal): Skv - Sq + t + 1; mode 0: Skv."""
    return seq_kv - seq_q + t + 1 if sparse_mode == 3 else seq_kv


# ----------------------------------------------------------------------------------------------------------
# SparseFlashAttention (docs/operators/sparse_flash_attention.md)
# ----------------------------------------------------------------------------------------------------------
def sfa_selected_tokens(row_indices: Sequence[int], t: int, seq_q: int, seq_kv: int, sparse_mode: int,
                        block_size: int) -> list[int]:
    """Key positions row t attends to, in entry order, duplicates kept (the kernel's rule,
    docs/operators/sparse_flash_attention.md).

    thr = Skv - Sq + t + 1 (mode 3) or Skv (mode 0); only the first n = min(K, ceil(thr / bs)) entries are
    examined; scanning stops at the first -1; an entry whose block starts at >= thr is skipped; the block
    [i*bs, i*bs + bs) is clipped to [i*bs, thr).
    """
    thr = _causal_threshold(sparse_mode, seq_q, seq_kv, t)
    if thr <= 0:
        return []
    n = min(len(row_indices), math.ceil(thr / block_size))
    tokens: list[int] = []
    for e in range(n):
        idx = int(row_indices[e])
        if idx == -1:
            break
        if idx < -1:
            raise ValueError(f"sparse index {idx} < -1 is not valid input")
        start = idx * block_size
        if start >= thr:
            continue
        tokens.extend(range(start, min(start + block_size, thr)))
    return tokens


def sparse_attention_oracle(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sparse_indices: torch.Tensor,
    scale_value: float,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    sparse_block_size: int = 1,
    layout: str = "BSND",
    sparse_mode: int = 3,
    compute_dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """SparseFlashAttention forward, one query row at a time (docs/operators/sparse_flash_attention.md,
    docs/semantics/invalid-rows.md).

    Q = [query ; query_rope], K = [key ; key_rope] (without rope: query, key), V = value, N2 = 1. For row t of a
    sequence, the selected key positions T_t come from `sfa_selected_tokens` (duplicates kept), and per head h:
    z = scale * Q[t, h] . K[T_t]; softmax_max = max z; softmax_sum = sum exp(z - max); out = softmax(z) @ V[T_t].
    Rows with nothing selected, and BSND rows beyond the actual query length, give out = 0, softmax_max = -2e38,
    softmax_sum = 0. Keys beyond a sequence's actual length are never read.

    Returns (out [..., N1, Dv] in `compute_dtype`, softmax_max, softmax_sum of shape [B, 1, S1, N1] / [1, T1, N1]
    in float64, or float32 when `compute_dtype` is not float64). `out` is differentiable (torch.autograd) w.r.t.
    the five input tensors; the statistics are detached. A `compute_dtype` other than float64 gives the "naive
    same-dtype" reference of the flash-attn rule. With `return_lse`, a fourth output is the differentiable
    log-sum-exp max + log(sum) of every row and head ([..., N1], 0 for rows with nothing selected): its gradient
    w.r.t. the logits is P, which lets a golden reproduce the grad's Dl = rowsum(dO * O) taken from a given O.

    `sinks` ([N1], docs/semantics/sinks.md): every computed row (t below the actual query length) gets one more logit
    sinks[h] in its softmax, dropped before P V, as op-plugin's SFA golden does (the max over [z, sinks], the sum
    plus exp(sinks - max)); a row with nothing selected then has max = sinks, sum = 1, output 0. `out` is then
    differentiable w.r.t. `sinks` too.
    """
    cd = compute_dtype
    q_all, k_all, v_all = query.to(cd), key.to(cd), value.to(cd)
    if query_rope is not None:
        q_all = torch.cat([q_all, query_rope.to(cd)], dim=-1)
        k_all = torch.cat([k_all, key_rope.to(cd)], dim=-1)
    heads, d_v = query.shape[-2], value.shape[-1]
    spans = sequence_spans(layout, query.shape, key.shape, actual_seq_lengths_query, actual_seq_lengths_kv)
    s_shape = stats_shape(layout, query.shape, heads)
    stat_dtype = torch.float64 if cd == torch.float64 else torch.float32  # -2e38 does not fit in fp16/bf16 ranges
    softmax_max = torch.full(s_shape, INVALID_MAX, dtype=stat_dtype)
    softmax_sum = torch.zeros(s_shape, dtype=stat_dtype)
    zero_row = torch.zeros(heads, d_v, dtype=cd)
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    lse_rows: dict[tuple[int, ...], torch.Tensor] = {}
    for span in spans:
        k_seq = span.kv_rows(k_all)[:, 0]  # [Lk, Dqk]: keys beyond the actual length are never touched
        v_seq = span.kv_rows(v_all)[:, 0]
        idx_seq = span.q_rows(sparse_indices)[:, 0].tolist()
        q_seq = span.q_rows(q_all)
        for t in range(span.q_len):
            tokens = sfa_selected_tokens(idx_seq[t], t, span.q_len, span.kv_len, sparse_mode, sparse_block_size)
            if not tokens and (sinks is None or bool((sinks == float("-inf")).all())):
                continue
            pos = torch.tensor(tokens, dtype=torch.int64)
            z = scale_value * _dot(q_seq[t], k_seq[pos]) if tokens else q_seq.new_zeros(heads, 0)  # [N1, T]
            if sinks is not None:  # the sink column, dropped from P below
                z = torch.cat([z, sinks.to(cd).view(heads, 1)], dim=-1)
            m = z.amax(dim=-1).detach()
            if sinks is not None:  # a head whose only column is a -inf sink: shift by 0, every term is 0
                m = torch.where(m == float("-inf"), 0.0, m)
            e = torch.exp(z - m.unsqueeze(-1))
            total = e.sum(dim=-1)
            p = e / torch.where(total == 0, 1.0, total).unsqueeze(-1)
            if sinks is not None:
                p = p[:, : len(tokens)]
                m = torch.where(total == 0, INVALID_MAX, m)
            rows[span.q_token(t)] = (p.unsqueeze(-1) * v_seq[pos].unsqueeze(0)).sum(dim=1)  # [N1, Dv]
            # 0 for a head with nothing in its softmax (every selected entry invalid and a -inf sink)
            lse_rows[span.q_token(t)] = torch.where(total == 0, 0.0, m + torch.log(torch.where(total == 0, 1.0, total)))
            stat_index = (0, span.q_start + t) if layout == "TND" else (span.batch, 0, t)
            softmax_max[stat_index] = m
            softmax_sum[stat_index] = total.detach()
    lead = tuple(query.shape[:-2])
    flat = [rows.get(tok, zero_row) for tok in _all_tokens(lead)]
    out = torch.stack(flat).reshape(*lead, heads, d_v) if flat else torch.zeros(*lead, heads, d_v, dtype=cd)
    if not return_lse:
        return out, softmax_max, softmax_sum
    zero_lse = torch.zeros(heads, dtype=cd)
    flat_lse = [lse_rows.get(tok, zero_lse) for tok in _all_tokens(lead)]
    lse = torch.stack(flat_lse).reshape(*lead, heads) if flat_lse else torch.zeros(*lead, heads, dtype=cd)
    return out, softmax_max, softmax_sum, lse


def _all_tokens(lead: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Row-major list of the query-token indices of a [B, S1] or [T1] leading shape."""
    if len(lead) == 1:
        return [(t,) for t in range(lead[0])]
    return [(b, s) for b in range(lead[0]) for s in range(lead[1])]


# ----------------------------------------------------------------------------------------------------------
# LightningIndexer (docs/operators/lightning_indexer.md)
# ----------------------------------------------------------------------------------------------------------
def index_scores_oracle(query_index: torch.Tensor, key_index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """I[t, s] = sum_h w[t, h] * ReLU(q_idx[t, h] . k_idx[s]) in float64 (no scale inside).

    query_index [rows, H, D], key_index [S, D], weights [rows, H] -> [rows, S]."""
    q, k, w = query_index.double(), key_index.double(), weights.double()
    return torch.stack([(w[t].unsqueeze(-1) * torch.relu(_dot(q[t], k))).sum(dim=0) for t in range(q.shape[0])]) \
        if q.shape[0] else torch.zeros(0, k.shape[0], dtype=torch.float64)


def _allowed(sparse_mode: int, seq_q: int, seq_kv: int, t: int) -> int:
    """Number of keys row t may use: thr(t) clipped to [0, Skv] (mode 3: s <= Skv - Sq + t)."""
    return max(0, min(seq_kv, _causal_threshold(sparse_mode, seq_q, seq_kv, t)))


def indexer_score_matrix(query_index, key_index, weights, *, actual_seq_lengths_query=None,
                         actual_seq_lengths_key=None, layout: str = "BSND", sparse_mode: int = 3) -> torch.Tensor:
    """float64 index scores of every (row, key) pair, -inf where the key is not allowed.

    Shape [B, S1, S2] (BSND; rows beyond the actual query length and keys beyond the actual key length -inf) or
    [T1, max Skv_b] (TND; column s is the sequence's own key s)."""
    spans = sequence_spans(layout, query_index.shape, key_index.shape, actual_seq_lengths_query,
                           actual_seq_lengths_key)
    if layout == "TND":
        width = max((s.kv_len for s in spans), default=0)
        scores = torch.full((query_index.shape[0], width), float("-inf"), dtype=torch.float64)
    else:
        scores = torch.full((query_index.shape[0], query_index.shape[1], key_index.shape[1]), float("-inf"),
                            dtype=torch.float64)
    for span in spans:
        if span.q_len == 0 or span.kv_len == 0:
            continue
        seq_scores = index_scores_oracle(span.q_rows(query_index), span.kv_rows(key_index)[:, 0],
                                         span.q_rows(weights))
        for t in range(span.q_len):
            allowed = _allowed(sparse_mode, span.q_len, span.kv_len, t)
            scores[span.q_token(t)][:allowed] = seq_scores[t, :allowed]
    return scores


def lightning_indexer_oracle(query_index, key_index, weights, *, actual_seq_lengths_query=None,
                             actual_seq_lengths_key=None, layout: str = "BSND", sparse_count: int = 2048,
                             sparse_mode: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """LightningIndexer forward: (indices int32 [B, S1, 1, K] / [T1, 1, K], values float64 of the same shape).

    Row t keeps min(K, #allowed) allowed keys sorted by descending score, ties to the smaller index (a literal
    Python sort on (-score, s)), then -1; values are the scores there and -inf in the -1 slots. BSND rows beyond
    the actual query length are all -1."""
    scores = indexer_score_matrix(query_index, key_index, weights, actual_seq_lengths_query=actual_seq_lengths_query,
                                  actual_seq_lengths_key=actual_seq_lengths_key, layout=layout,
                                  sparse_mode=sparse_mode)
    lead = tuple(query_index.shape[:-2])
    indices = torch.full((*lead, 1, sparse_count), -1, dtype=torch.int32)
    values = torch.full((*lead, 1, sparse_count), float("-inf"), dtype=torch.float64)
    for tok in _all_tokens(lead):
        row = scores[tok].tolist()
        candidates = [s for s, v in enumerate(row) if v != float("-inf")]
        order = sorted(candidates, key=lambda s: (-row[s], s))[:sparse_count]
        for e, s in enumerate(order):
            indices[(*tok, 0, e)] = s
            values[(*tok, 0, e)] = row[s]
    return indices, values


# ----------------------------------------------------------------------------------------------------------
# SparseLightningIndexerGradKLLoss (docs/operators/lightning_indexer.md)
# ----------------------------------------------------------------------------------------------------------
def kl_selected_entries(row_indices: Sequence[int], t: int, seq_q: int, seq_kv: int, sparse_mode: int = 3
                        ) -> list[int]:
    """Key positions entering row t's KL term: of the first k_t = min(K, #allowed) entries, those equal to -1 or
    out of range (outside [0, #allowed)) are skipped; no early stop; duplicates kept."""
    allowed = _allowed(sparse_mode, seq_q, seq_kv, t)
    k_t = min(len(row_indices), allowed)
    return [int(i) for i in row_indices[:k_t] if 0 <= int(i) < allowed]


class KLOracleResult(NamedTuple):
    loss: torch.Tensor  # float64 scalar, summed over all tokens, differentiable (documented gradient)
    tokens_with_keys: int  # query tokens with at least one selected entry (divisor of reduction="mean")


def indexer_kl_loss_oracle(
    query: torch.Tensor,
    key: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    sparse_indices: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    scale_value: float,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    layout: str = "BSND",
    sparse_mode: int = 3,
) -> KLOracleResult:
    """The indexer KL loss of docs/operators/lightning_indexer.md, in float64, summed over every token of every
    sequence.

    For row t with selected entries j (`kl_selected_entries`):
      p_j = (1/N1) sum_h exp(scale * (q_h.k_j + qr_h.kr_j) - softmax_max[h]) / softmax_sum[h]   (target, no grad)
      I_j = sum_h' w[h'] ReLU(q_idx[h'] . k_idx[j]);   q_j = softmax_j(I)   (over the selected entries)
      value_t = sum_j p'_j (log p'_j - log q'_j),   p' = max(p, 1e-8), q' = max(q, 1e-8).

    Gradient convention. The operator documents dI_j = Softmax(I)_j - p_j (docs/operators/lightning_indexer.md), which
    is NOT the autograd of the clamped value (that differs wherever q_j < 1e-8, which is common). So the returned loss
    is
      value.detach() + (g - g.detach())   with the gradient path   g = logsumexp_j(I_j) - sum_j p_j I_j,
    whose value is the clamped KL and whose autograd w.r.t. I is exactly q_j - p_j. When sum_j p_j = 1 (the
    statistics come from the SFA forward over the same selection, as in DSA training), g equals
    sum_j p_j * (-log_softmax(I)_j), the cross-entropy form of the same gradient. From I the gradient flows to
    query_index, key_index (duplicates add up) and weights through ReLU (derivative [r > 0]); query, key, rope and
    the statistics get none.
    """
    spans = sequence_spans(layout, query_index.shape, key_index.shape, actual_seq_lengths_query,
                           actual_seq_lengths_key)
    q_main, k_main = query.detach().double(), key.detach().double()
    if query_rope is not None:
        q_main = torch.cat([q_main, query_rope.detach().double()], dim=-1)
        k_main = torch.cat([k_main, key_rope.detach().double()], dim=-1)
    q_idx_all, k_idx_all, w_all = query_index.double(), key_index.double(), weights.double()
    terms: list[torch.Tensor] = []
    with_keys = 0
    for span in spans:
        if span.q_len == 0 or span.kv_len == 0:
            continue
        idx_seq = span.q_rows(sparse_indices)[:, 0].tolist()
        qm, km = span.q_rows(q_main), span.kv_rows(k_main)[:, 0]
        qi, ki, w = span.q_rows(q_idx_all), span.kv_rows(k_idx_all)[:, 0], span.q_rows(w_all)
        for t in range(span.q_len):
            entries = kl_selected_entries(idx_seq[t], t, span.q_len, span.kv_len, sparse_mode)
            if not entries:
                continue
            with_keys += 1
            pos = torch.tensor(entries, dtype=torch.int64)
            row_max = _stat_row(softmax_max, layout, span, t).double().unsqueeze(-1)
            row_sum = _stat_row(softmax_sum, layout, span, t).double().unsqueeze(-1)
            z = scale_value * _dot(qm[t], km[pos])  # [N1, E]
            p = (torch.exp(z - row_max) / row_sum).mean(dim=0).detach()  # [E]
            scores = (w[t].unsqueeze(-1) * torch.relu(_dot(qi[t], ki[pos]))).sum(dim=0)  # [E]
            lse = torch.logsumexp(scores, dim=-1)
            p_c = p.clamp_min(KL_CLAMP)
            q_c = torch.exp(scores.detach() - lse.detach()).clamp_min(KL_CLAMP)
            value = (p_c * (p_c.log() - q_c.log())).sum()
            grad_path = lse - (p * scores).sum()
            terms.append(value.detach() + (grad_path - grad_path.detach()))
    if not terms:
        zero = (query_index.double().sum() + key_index.double().sum() + weights.double().sum()) * 0.0
        return KLOracleResult(zero, 0)
    return KLOracleResult(torch.stack(terms).sum(), with_keys)
