"""LightningIndexer forward and SparseLightningIndexerGradKLLoss (DSA indexer; seed
aclnnSparseLightningIndexerGradKLLoss documentation, docs/operators/lightning_indexer.md)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..backends import select_backend
from ..backends.reference import indexer as kernel
from ..backends.reference import npu_attention
from ..backends.triton.sparse_plan import index_rows, indexer_tables, indexer_unsupported
from ..errors import ParamInvalidError, require, require_finite, require_int
from ..problem import precision
from ..problem.page_table import PAGED_KV_LAYOUT
from ..problem.sparse import indexer_selection
from ..problem.stats import accumulation_dtype
from ..traceable import traced_as_custom_op
from .sparse_flash_attention import (
    FLOAT_DTYPES,
    INT64_MAX,
    _check_tensor,
    _deterministic_guard,
    kv_layout,
    paged_sequence_spans,
    require_key_rank,
    resolve_deterministic,
    sequence_spans,
)


class LightningIndexerResult(NamedTuple):
    sparse_indices: torch.Tensor
    sparse_values: torch.Tensor | None


class SparseLightningIndexerGradKLLossResult(NamedTuple):
    d_query_index: torch.Tensor
    d_key_index: torch.Tensor
    d_weights: torch.Tensor
    loss: torch.Tensor


def _check_common(query_index, key_index, weights, layout, sparse_mode, allowed_modes, layout_key=None):
    _check_tensor(query_index, "query_index")
    require(query_index.dtype in FLOAT_DTYPES, "query_index", "dtype float16 or bfloat16", query_index)
    _check_tensor(key_index, "key_index", query_index.dtype)
    _check_tensor(weights, "weights")
    require(weights.dtype in FLOAT_DTYPES, "weights", "dtype float16, bfloat16 or float32", weights)
    if layout not in ("BSND", "TND"):
        raise ParamInvalidError(f"layout: expected 'BSND' or 'TND', got {layout!r}")
    if require_int(sparse_mode, "sparse_mode") not in allowed_modes:
        raise ParamInvalidError(f"sparse_mode: expected one of {list(allowed_modes)}, got {sparse_mode!r}")
    rank = 4 if layout == "BSND" else 3
    require(query_index.dim() == rank, "query_index", f"a {rank}-D tensor for layout {layout}", query_index)
    require_key_rank(key_index, "key_index", layout if layout_key is None else layout_key)
    _require_heads(query_index, "query_index", "Nidx1")
    require(key_index.shape[-2] == 1, "key_index", "Nidx2 = 1", key_index)
    require(key_index.shape[-1] == query_index.shape[-1], "key_index", f"head dim {query_index.shape[-1]}", key_index)
    require(tuple(weights.shape) == tuple(query_index.shape[:-1]), "weights",
            f"query_index's leading dims {list(query_index.shape[:-1])}", weights)


def _require_heads(t: torch.Tensor, name: str, label: str) -> None:
    """At least one head when the tensor has query tokens. The documented (约束说明) head counts (N1 in 8..128, Nidx1 in
    8..64, powers of two) are the NPU kernel's tilings, not semantics, so any positive count is accepted. Zero heads
    describe no indexer / attention: every index score would be the empty sum 0 and the 1/N1 head mean of the KL
    target (docs/operators/lightning_indexer.md) is undefined. A query without tokens is an empty problem and returns
    empty results whatever its head count (docs/semantics/errors.md)."""
    if t.shape[:-2].numel() > 0:
        require(t.shape[-2] >= 1, name, f"{label} >= 1 heads", t)


@traced_as_custom_op
def lightning_indexer(
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    layout: str = "BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    return_value: bool = False,
    backend: str = "auto",
    block_table: torch.Tensor | None = None,
    layout_key: str | None = None,
) -> LightningIndexerResult:
    """Top-`sparse_count` keys per query row by index score I[t,s] = sum_h w[t,h] ReLU(q_idx[t,h] . k_idx[s]).

    Mode 3 allows key s for row t iff s <= Skv - Sq + t (mode 0: every key). Ties go to the smaller index; row t
    holds min(K, #allowed) indices in descending score order, then -1 (docs/operators/lightning_indexer.md). Output
    int32 [B, S1, 1, K] or [T1, 1, K]; with `return_value` also the scores at those positions in the query's dtype
    (-inf in -1 slots). BSND rows beyond the actual query length are all -1.

    Paged key cache (`layout_key="PA_BSND"`, implied by a `block_table`): key_index is [block_num, block_size, 1, D],
    `block_table` int32 [B, >= max blocks per sequence], `actual_seq_lengths_key` (required) plain per-sequence key
    counts; `layout` describes the query (docs/semantics/paged-kv.md). Indices are logical key positions.
    """
    layout_key = kv_layout(layout, layout_key, block_table, "layout_key")
    _check_common(query_index, key_index, weights, layout, sparse_mode, (0, 3), layout_key)
    sparse_count = require_int(sparse_count, "sparse_count")  # a NumPy integer too, like the other int parameters
    if sparse_count < 1:
        raise ParamInvalidError(f"sparse_count: expected a positive int, got {sparse_count!r}")
    if layout_key == PAGED_KV_LAYOUT:
        problem = paged_sequence_spans(layout, query_index, key_index, actual_seq_lengths_query,
                                       actual_seq_lengths_key, block_table, "actual_seq_lengths_key", "key_index")
    else:
        problem = sequence_spans(layout, query_index, key_index, actual_seq_lengths_query, actual_seq_lengths_key,
                                 "actual_seq_lengths_key", "key_index")
    lead = query_index.shape[:-2]
    indices = torch.full((*lead, 1, sparse_count), -1, dtype=torch.int32, device=query_index.device)
    values = None
    if return_value:
        values = torch.full((*lead, 1, sparse_count), float("-inf"), dtype=query_index.dtype,
                            device=query_index.device)
    if select_backend(backend, query_index.device, op="lightning_indexer",
                      unsupported=lambda: indexer_unsupported(query_index, weights)) == "triton":
        from ..backends.triton import indexer as triton_kernel

        block_table = None if problem.pages is None else problem.pages.table.to(query_index.device)
        triton_kernel.lightning_top_k(
            query_index, key_index, weights, indexer_tables(problem, sparse_mode, query_index.device), sparse_count,
            indices.view(-1, sparse_count), None if values is None else values.view(-1, sparse_count), block_table)
        return LightningIndexerResult(indices, values)
    pipeline = precision.indexer_pipeline(query_index.dtype) if precision.npu_mode() else None
    npu_scores = None if pipeline is None else functools.partial(npu_attention.index_scores, pipeline)
    for b in range(len(problem.q_spans)):
        lq, lk = problem.q_lengths[b], problem.kv_lengths[b]
        if lq == 0 or lk == 0:
            continue
        keys = (problem.keys(key_index, b)[:lk, 0] if problem.pages is None
                else problem.pages.sequence_columns([key_index], b, key_index.dtype))
        kernel.top_k_sequence(
            problem.rows(query_index, b)[:lq], keys, problem.rows(weights, b)[:lq],
            sparse_mode=sparse_mode, seq_q=lq, seq_kv=lk, k=sparse_count,
            indices_out=problem.rows(indices, b)[:lq, 0],
            values_out=None if values is None else problem.rows(values, b)[:lq, 0],
            npu_scores=npu_scores, npu_values=None if pipeline is None else pipeline.values,
        )
    return LightningIndexerResult(indices, values)


def check_kl_rope(query: torch.Tensor, key: torch.Tensor, query_rope: torch.Tensor | None,
                  key_rope: torch.Tensor | None) -> None:
    """The KL-loss operators' optional rope pair (sparse and dense): Q = [query ; query_rope] and
    K = [key ; key_rope] (docs/operators/lightning_indexer.md), so both or neither are given, each rope tensor
    shares its main tensor's leading dims, and both carry the same Dr (参数说明, queryRope (B,S1,N1,Dr) /
    keyRope (B,S2,N2,Dr)); a mismatch would broadcast or crash."""
    if (query_rope is None) != (key_rope is None):
        raise ParamInvalidError("query_rope/key_rope: give both rope tensors or neither")
    if query_rope is None:
        return
    _check_tensor(query_rope, "query_rope", query.dtype)
    _check_tensor(key_rope, "key_rope", query.dtype)
    require(query_rope.shape[:-1] == query.shape[:-1], "query_rope", f"leading dims {list(query.shape[:-1])}",
            query_rope)
    require(key_rope.shape[:-1] == key.shape[:-1], "key_rope", f"leading dims {list(key.shape[:-1])}", key_rope)
    require(key_rope.shape[-1] == query_rope.shape[-1], "key_rope", f"rope dim Dr = {query_rope.shape[-1]} like "
            "query_rope", key_rope)


@traced_as_custom_op
def sparse_lightning_indexer_grad_kl_loss(
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
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
    deterministic: bool = False,
    backend: str = "auto",
) -> SparseLightningIndexerGradKLLossResult:
    """KL loss between the main attention's head-averaged distribution and the indexer's, with its gradients.

    Target p_j = mean_h exp(scale * (q_h.k_j + qr_h.kr_j) - softmax_max[h]) / softmax_sum[h] over the selected keys (SFA
    statistics), indexer distribution q = softmax(I[t, idx]); loss = sum over all tokens of sum_j p'_j (log p'_j - log
    q'_j) with p', q' clamped at 1e-8 (fp32, shape [1]). Gradients: dI = q - p, dW, d_query_index, and d_key_index
    scatter-added (docs/operators/lightning_indexer.md). No gradient flows to query/key/rope. `deterministic=True` or
    torch.use_deterministic_algorithms(True) makes GPU scatter-adds deterministic (the CPU reference always is).
    """
    _check_common(query_index, key_index, weights, layout, sparse_mode, (3,))
    for name, t in (("query", query), ("key", key)):
        _check_tensor(t, name, query_index.dtype)
    _check_tensor(sparse_indices, "sparse_indices")
    require(sparse_indices.dtype in (torch.int32, torch.int64), "sparse_indices", "dtype int32 or int64",
            sparse_indices)
    _require_heads(query, "query", "N1")
    require(key.shape[-2] == 1, "key", "N2 = 1", key)
    require(key.shape[-1] == query.shape[-1], "key", f"head dim {query.shape[-1]} like the query", key)
    require(query.shape[:-2] == query_index.shape[:-2], "query", f"query_index's tokens {list(query_index.shape[:-2])}",
            query)
    require(key.shape[:-2] == key_index.shape[:-2], "key", f"key_index's tokens {list(key_index.shape[:-2])}", key)
    check_kl_rope(query, key, query_rope, key_rope)
    require(sparse_indices.shape[:-2] == query_index.shape[:-2] and sparse_indices.shape[-2] == 1, "sparse_indices",
            f"shape {[*query_index.shape[:-2], 1, 'K']}", sparse_indices)
    heads = query.shape[-2]
    stat_shape = (1, query.shape[0], heads) if layout == "TND" else (query.shape[0], 1, query.shape[1], heads)
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        _check_tensor(t, name)
        require(t.dtype in (torch.float32, torch.float64) and tuple(t.shape) == stat_shape, name,
                f"float32 of shape {list(stat_shape)}", t)
    require_finite(scale_value, "scale_value")
    problem = sequence_spans(layout, query_index, key_index, actual_seq_lengths_query, actual_seq_lengths_key,
                             "actual_seq_lengths_key", "key_index")
    deterministic = resolve_deterministic(deterministic)
    if select_backend(backend, query.device, op="sparse_lightning_indexer_grad_kl_loss",
                      unsupported=lambda: indexer_unsupported(query_index, weights, query, query_rope)) == "triton":
        from ..backends.triton import indexer as triton_kernel

        return SparseLightningIndexerGradKLLossResult(*triton_kernel.kl_loss_backward(
            query, key, query_index, key_index, weights, index_rows(sparse_indices),
            softmax_max, softmax_sum, query_rope, key_rope, indexer_tables(problem, sparse_mode, query.device),
            float(scale_value), bool(deterministic)))
    dtype = accumulation_dtype(query_index.dtype)
    pipeline = precision.kl_loss_pipeline(query_index.dtype) if precision.npu_mode() else None
    d_query_index = torch.zeros_like(query_index)
    d_key_index = torch.zeros_like(key_index)
    d_weights = torch.zeros_like(weights)
    loss = torch.zeros((), dtype=torch.float64, device=query.device)
    with _deterministic_guard(deterministic and query.device.type != "cpu"):
        for b in range(len(problem.q_spans)):
            lq, lk = problem.q_lengths[b], problem.kv_lengths[b]
            if lq == 0 or lk == 0:
                continue
            # Keys carry the rope dims appended here (once); the kernel appends the query's per tile.
            k_main = problem.keys(key, b)[:lk, 0]
            q_rope = None
            if query_rope is not None:
                q_rope = problem.rows(query_rope, b)[:lq]
                k_main = torch.cat([k_main, problem.keys(key_rope, b)[:lk, 0]], dim=-1)
            dq = torch.zeros((lq, *query_index.shape[-2:]), dtype=dtype, device=query.device)
            dk = torch.zeros((lk, key_index.shape[-1]), dtype=dtype, device=query.device)
            dw = torch.zeros((lq, weights.shape[-1]), dtype=dtype, device=query.device)
            loss += kernel.kl_loss_sequence(
                lq, lk, q_main=problem.rows(query, b)[:lq], q_rope=q_rope, k_main=k_main,
                q_idx=problem.rows(query_index, b)[:lq], k_idx=problem.keys(key_index, b)[:lk, 0],
                weights=problem.rows(weights, b)[:lq],
                indices=problem.rows(sparse_indices, b)[:lq, 0], row_max=_stat_rows(problem, softmax_max, b, lq),
                row_sum=_stat_rows(problem, softmax_sum, b, lq), scale=float(scale_value), sparse_mode=sparse_mode,
                dq_idx=dq, dk_idx=dk, dw=dw, score_grad=None if pipeline is None else pipeline.score_grad,
            )
            if pipeline is not None:
                dq, dk, dw = pipeline.query_outputs(dq), pipeline.outputs(dk), precision.half_away(weights.dtype)(dw)
            problem.rows(d_query_index, b)[:lq] = dq
            problem.keys(d_key_index, b)[:lk, 0] = dk
            problem.rows(d_weights, b)[:lq] = dw
    return SparseLightningIndexerGradKLLossResult(d_query_index, d_key_index, d_weights, loss.to(dtype).view(1))


def _stat_rows(problem, stat: torch.Tensor, b: int, rows: int) -> torch.Tensor:
    """[rows, N1] of the SFA statistics ([B, 1, S1, N1] or [1, T1, N1]) for sequence b."""
    if problem.layout == "TND":
        start = problem.q_spans[b][1]
        return stat[0, start : start + rows]
    return stat[b, 0, :rows]


def count_tokens_with_keys(query_index, key_index, sparse_indices, layout: str, sparse_mode: int,
                           actual_seq_lengths_query=None, actual_seq_lengths_key=None) -> int:
    """Query tokens with at least one valid selected key under the KL rule (the divisor of reduction="mean")."""
    problem = sequence_spans(layout, query_index, key_index, actual_seq_lengths_query, actual_seq_lengths_key,
                             "actual_seq_lengths_key", "key_index")
    total = 0
    for b in range(len(problem.q_spans)):
        lq, lk = problem.q_lengths[b], problem.kv_lengths[b]
        if lq == 0 or lk == 0:
            continue
        rows = torch.arange(lq, device=sparse_indices.device)
        _, valid = indexer_selection(problem.rows(sparse_indices, b)[:lq, 0], rows, sparse_mode=sparse_mode,
                                     seq_q=lq, seq_kv=lk)
        total += int(valid.any(-1).sum())
    return total
