"""DenseLightningIndexerSoftmaxLse and DenseLightningIndexerGradKLLoss: the warm-up (dense) training of the DSA
indexer (torch_npu npu_dense_lightning_indexer_softmax_lse / npu_dense_lightning_indexer_grad_kl_loss;
docs/operators/dense_lightning_indexer.md)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..backends import select_backend
from ..backends.reference import dense_indexer as kernel
from ..backends.reference.sparse_attention import INVALID_MAX
from ..backends.triton.sparse_plan import indexer_tables, indexer_unsupported
from ..errors import ParamInvalidError, require, require_finite, require_int
from ..problem.lengths import IntList
from ..problem.stats import accumulation_dtype
from ..traceable import traced_as_custom_op
from .lightning_indexer import check_kl_rope
from .sparse_flash_attention import FLOAT_DTYPES, INT64_MAX, SparseProblem, _check_tensor, sequence_spans

DENSE_MODES = (3,)


class DenseLightningIndexerSoftmaxLseResult(NamedTuple):
    softmax_max_index: torch.Tensor
    softmax_sum_index: torch.Tensor


class DenseLightningIndexerGradKLLossResult(NamedTuple):
    d_query_index: torch.Tensor
    d_key_index: torch.Tensor
    d_weights: torch.Tensor
    loss: torch.Tensor


def _check_indexer(query_index, key_index, weights, layout: str, sparse_mode, pre_tokens, next_tokens,
                   actual_seq_qlen, actual_seq_klen) -> SparseProblem:
    """The indexer inputs both operators share (torch_npu pages, 参数说明 and 约束说明)."""
    _check_tensor(query_index, "query_index")
    require(query_index.dtype in FLOAT_DTYPES, "query_index", "dtype float16 or bfloat16", query_index)
    _check_tensor(key_index, "key_index", query_index.dtype)
    _check_tensor(weights, "weights")
    # "参数weights不为float32时，参数query_index、key_index、weights的数据类型应保持一致"
    require(weights.dtype in (torch.float32, query_index.dtype), "weights",
            f"float32 or the query_index dtype {query_index.dtype}", weights)
    if layout not in ("BSND", "TND"):
        raise ParamInvalidError(f"layout: expected 'BSND' or 'TND', got {layout!r}")
    if require_int(sparse_mode, "sparse_mode") not in DENSE_MODES:
        raise ParamInvalidError(f"sparse_mode: expected 3 (the only mode documented), got {sparse_mode!r}")
    rank = 4 if layout == "BSND" else 3
    for name, t in (("query_index", query_index), ("key_index", key_index)):
        require(t.dim() == rank, name, f"a {rank}-D tensor for layout {layout}", t)
    require(query_index.shape[-2] >= 1 or query_index.shape[:-2].numel() == 0, "query_index", "N1index >= 1 heads",
            query_index)
    require(key_index.shape[-2] == 1, "key_index", "N2index = 1", key_index)
    require(key_index.shape[-1] == query_index.shape[-1], "key_index", f"head dim {query_index.shape[-1]}", key_index)
    require(tuple(weights.shape) == tuple(query_index.shape[:-1]), "weights",
            f"query_index's leading dims {list(query_index.shape[:-1])}", weights)
    if layout == "BSND":
        require(key_index.shape[1] >= query_index.shape[1], "key_index", f"S2 >= S1 = {query_index.shape[1]}",
                key_index)
    problem = sequence_spans(layout, query_index, key_index, actual_seq_qlen, actual_seq_klen, "actual_seq_klen",
                             "key_index")
    # "layout为BSND时，S1<=S2；layout为TND时，actual_seq_qlen小于等于actual_seq_klen相同索引位置的值，且相同索引位置
    # S1<=S2" (npu_dense_lightning_indexer_softmax_lse, 约束说明)
    if layout == "TND":
        for b, (sq, skv) in enumerate(zip(problem.q_lengths, problem.kv_lengths, strict=True)):
            if sq > skv:
                raise ParamInvalidError(f"actual_seq_klen: sequence {b} has {sq} query tokens but only {skv} keys "
                                        "(S1 <= S2 per sequence)")
    _check_no_window(problem, pre_tokens, next_tokens)
    return problem


def _check_no_window(problem: SparseProblem, pre_tokens, next_tokens) -> None:
    """pre_tokens / next_tokens are documented without any effect on the formulas; a value that would cut a
    sequence's causal band (smaller than its key count) is refused rather than ignored."""
    longest = max([*problem.kv_lengths, *problem.q_lengths, 0])
    for name, bound in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        value = require_int(bound, name)
        if value < longest:
            raise ParamInvalidError(f"{name}: a sliding window is not supported; expected a value >= the longest "
                                    f"sequence ({longest}) such as the default 2**63-1, got {value}")


def _index_stat_shape(problem: SparseProblem, query_index: torch.Tensor) -> tuple[int, ...]:
    """(B, N2index = 1, S1) or (N2index = 1, T1)."""
    if problem.layout == "TND":
        return (1, query_index.shape[0])
    return (query_index.shape[0], 1, query_index.shape[1])


def _index_stat_rows(problem: SparseProblem, stat: torch.Tensor, b: int, rows: int) -> torch.Tensor:
    if problem.layout == "TND":
        return stat[0, problem.q_spans[b][1] : problem.q_spans[b][1] + rows]
    return stat[b, 0, :rows]


def _head_stat_rows(problem: SparseProblem, stat: torch.Tensor, b: int, rows: int) -> torch.Tensor:
    """[rows, N1] of the attention statistics (B, N2, S1, G) / (N2, T1, G); head h = n2 * G + g."""
    if problem.layout == "TND":
        start = problem.q_spans[b][1]
        part = stat[:, start : start + rows]  # [N2, rows, G]
    else:
        part = stat[b, :, :rows]
    return part.permute(1, 0, 2).reshape(rows, -1)


@traced_as_custom_op
def dense_lightning_indexer_softmax_lse(
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_qlen: IntList | None = None,
    actual_seq_klen: IntList | None = None,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
) -> DenseLightningIndexerSoftmaxLseResult:
    """The indexer softmax statistics over every visible key: with I[t, s] = sum_h weights[t, h] ReLU(q_idx[t, h] .
    k_idx[s]), softmax_max_index = max_s I and softmax_sum_index = sum_s exp(I - max), fp32 of shape (B, 1, S1) or
    (1, T1). Mode 3 only (key s visible to row t iff s <= Skv - Sq + t). Rows with no visible key (and BSND rows
    beyond the actual length) get -2e38 and 0 (docs/operators/dense_lightning_indexer.md)."""
    problem = _check_indexer(query_index, key_index, weights, layout, sparse_mode, pre_tokens, next_tokens,
                             actual_seq_qlen, actual_seq_klen)
    dtype = accumulation_dtype(query_index.dtype)
    shape = _index_stat_shape(problem, query_index)
    softmax_max = torch.full(shape, INVALID_MAX, dtype=dtype, device=query_index.device)
    softmax_sum = torch.zeros(shape, dtype=dtype, device=query_index.device)
    if query_index.numel() and select_backend(
            "auto", query_index.device, op="dense_lightning_indexer_softmax_lse",
            unsupported=lambda: indexer_unsupported(query_index, weights)) == "triton":
        from ..backends.triton import dense_indexer as triton_kernel

        triton_kernel.dense_softmax_lse(query_index, key_index, weights,
                                        indexer_tables(problem, int(sparse_mode), query_index.device),
                                        softmax_max.view(-1), softmax_sum.view(-1))
        return DenseLightningIndexerSoftmaxLseResult(softmax_max, softmax_sum)
    for b in range(len(problem.q_spans)):
        lq, lk = problem.q_lengths[b], problem.kv_lengths[b]
        if lq == 0 or lk == 0:
            continue
        kernel.softmax_lse_sequence(
            problem.rows(query_index, b)[:lq], problem.keys(key_index, b)[:lk, 0], problem.rows(weights, b)[:lq],
            sparse_mode=int(sparse_mode), seq_q=lq, seq_kv=lk, dtype=dtype,
            max_out=_index_stat_rows(problem, softmax_max, b, lq),
            sum_out=_index_stat_rows(problem, softmax_sum, b, lq))
    return DenseLightningIndexerSoftmaxLseResult(softmax_max, softmax_sum)


@traced_as_custom_op
def dense_lightning_indexer_grad_kl_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    weights: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    softmax_max_index: torch.Tensor,
    softmax_sum_index: torch.Tensor,
    scale_value: float,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_qlen: IntList | None = None,
    actual_seq_klen: IntList | None = None,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
) -> DenseLightningIndexerGradKLLossResult:
    """KL loss between the main attention's head-averaged distribution and the indexer's over every visible key,
    with the indexer gradients (docs/operators/dense_lightning_indexer.md).

    p_s = (1/N1) sum_h exp(scale * (q_h . k_{s, h // G} + qr_h . kr_{s, h // G}) - softmax_max[h]) / softmax_sum[h],
    q_s = exp(I[t, s] - softmax_max_index) / softmax_sum_index; loss = sum over tokens and visible keys of
    p_s (log max(p_s, 1e-8) - log max(q_s, 1e-8)) (fp32, shape [1]). dI = q - p; d_weights, d_query_index and
    d_key_index follow by the chain rule through ReLU. No gradient flows to query, key or the rope tensors.
    """
    problem = _check_indexer(query_index, key_index, weights, layout, sparse_mode, pre_tokens, next_tokens,
                             actual_seq_qlen, actual_seq_klen)
    for name, t in (("query", query), ("key", key)):
        _check_tensor(t, name, query_index.dtype)
        require(t.dim() == query_index.dim(), name, f"a {query_index.dim()}-D tensor for layout {layout}", t)
    require(query.shape[:-2] == query_index.shape[:-2], "query", f"query_index's tokens {list(query_index.shape[:-2])}",
            query)
    require(key.shape[:-2] == key_index.shape[:-2], "key", f"key_index's tokens {list(key_index.shape[:-2])}", key)
    heads, heads_kv = query.shape[-2], key.shape[-2]
    require(heads >= 1 or query.numel() == 0, "query", "N1 >= 1 heads", query)
    require(heads_kv >= 1 and heads % heads_kv == 0, "key", f"N2 dividing N1 = {heads}", key)
    require(key.shape[-1] == query.shape[-1], "key", f"head dim {query.shape[-1]} like the query", key)
    check_kl_rope(query, key, query_rope, key_rope)
    group = heads // heads_kv if heads_kv else 1
    if layout == "TND":
        head_shape = (heads_kv, query.shape[0], group)
    else:
        head_shape = (query.shape[0], heads_kv, query.shape[1], group)
    index_shape = _index_stat_shape(problem, query_index)
    for name, t, shape in (("softmax_max", softmax_max, head_shape), ("softmax_sum", softmax_sum, head_shape),
                           ("softmax_max_index", softmax_max_index, index_shape),
                           ("softmax_sum_index", softmax_sum_index, index_shape)):
        _check_tensor(t, name)
        require(t.dtype in (torch.float32, torch.float64) and tuple(t.shape) == shape, name,
                f"float32 of shape {list(shape)}", t)
    scale = require_finite(scale_value, "scale_value")
    # No Triton kernel yet: on CUDA tensors the reference backend's PyTorch loop computes it, with a
    # BackendFallbackWarning (docs/operators/dense_lightning_indexer.md, Backends).
    select_backend("auto", query_index.device, op="dense_lightning_indexer_grad_kl_loss",
                   unsupported=lambda: "DenseLightningIndexerGradKLLoss has no Triton kernel yet")
    dtype = accumulation_dtype(query_index.dtype)
    d_query_index = torch.zeros_like(query_index)
    d_key_index = torch.zeros_like(key_index)
    d_weights = torch.zeros_like(weights)
    loss = torch.zeros((), dtype=torch.float64, device=query_index.device)
    for b in range(len(problem.q_spans)):
        lq, lk = problem.q_lengths[b], problem.kv_lengths[b]
        if lq == 0 or lk == 0:
            continue
        q_main, k_main = problem.rows(query, b)[:lq], problem.keys(key, b)[:lk]
        if query_rope is not None:
            q_main = torch.cat([q_main, problem.rows(query_rope, b)[:lq]], dim=-1)
            k_main = torch.cat([k_main, problem.keys(key_rope, b)[:lk]], dim=-1)
        dq = torch.zeros((lq, *query_index.shape[-2:]), dtype=dtype, device=query_index.device)
        dk = torch.zeros((lk, key_index.shape[-1]), dtype=dtype, device=query_index.device)
        dw = torch.zeros((lq, weights.shape[-1]), dtype=dtype, device=query_index.device)
        loss += kernel.kl_loss_sequence(
            q_main=q_main, k_main=k_main, q_idx=problem.rows(query_index, b)[:lq],
            k_idx=problem.keys(key_index, b)[:lk, 0], weights=problem.rows(weights, b)[:lq],
            row_max=_head_stat_rows(problem, softmax_max, b, lq), row_sum=_head_stat_rows(problem, softmax_sum, b, lq),
            index_max=_index_stat_rows(problem, softmax_max_index, b, lq),
            index_sum=_index_stat_rows(problem, softmax_sum_index, b, lq), scale=scale, sparse_mode=int(sparse_mode),
            seq_q=lq, seq_kv=lk, dq_idx=dq, dk_idx=dk, dw=dw)
        problem.rows(d_query_index, b)[:lq] = dq
        problem.keys(d_key_index, b)[:lk, 0] = dk
        problem.rows(d_weights, b)[:lq] = dw
    return DenseLightningIndexerGradKLLossResult(d_query_index, d_key_index, d_weights, loss.to(dtype).view(1))
