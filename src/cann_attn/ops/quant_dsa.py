"""QuantLightningIndexer and KvQuantSparseFlashAttention: DeepSeek-V3.2 inference with an int8 / fp8 indexer and
latent cache (torch_npu npu_quant_lightning_indexer / npu_kv_quant_sparse_flash_attention;
docs/operators/quant_dsa.md). Dequantisation: problem/dequant.py."""

from __future__ import annotations

import torch

from ..backends import select_backend
from ..backends.reference import indexer as kernel
from ..errors import ParamInvalidError, require, require_int
from ..problem import dequant
from ..problem.page_table import PAGED_KV_LAYOUT
from ..traceable import traced_as_custom_op
from .sparse_flash_attention import (
    INT64_MAX,
    _check_tensor,
    kv_layout,
    paged_sequence_spans,
    require_key_rank,
    sequence_spans,
)

MAX_SPARSE_COUNT = 2048
# Scale dtypes per quantised dtype (npu_quant_lightning_indexer, 约束说明): weights, query scale, key scale.
INDEXER_SCALE_DTYPES = {
    torch.int8: ((torch.float16, torch.float16, torch.float16),),
    torch.float8_e4m3fn: ((torch.bfloat16, torch.float32, torch.float32),
                          (torch.float16, torch.float16, torch.float16)),
}
FP16_MAX = 65504.0


def _no_hifloat8(value, param: str) -> None:
    """`query_dtype` / `key_dtype` only name hifloat8 (op-plugin refuses any other value), which has no torch dtype
    to compute with here."""
    if value is not None:
        raise ParamInvalidError(f"{param}: only hifloat8 may be named here, and hifloat8 inputs are not supported "
                                f"(no torch dtype); pass None with int8 / float8_e4m3fn tensors, got {value!r}")


def _default_window(pre_tokens, next_tokens) -> None:
    """"仅支持默认值2^63-1" (both quantised operators' pages)."""
    for name, bound in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        if require_int(bound, name) != INT64_MAX:
            raise ParamInvalidError(f"{name}: only the default 2**63-1 is supported, got {bound!r}")


@traced_as_custom_op
def quant_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    query_dequant_scale: torch.Tensor,
    key_dequant_scale: torch.Tensor,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    block_table: torch.Tensor | None = None,
    layout: str = "BSND",
    layout_key: str | None = None,
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
    query_dtype: int | None = None,
    key_dtype: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Top-`sparse_count` keys per query row by I[t, s] = sum_h W[t, h] ReLU(Sq[t, h] Sk[s] (Q[t, h] . K[s])).

    Q, K int8 or float8_e4m3fn (per-token-head quantisation, modes 0); Sq [B, S1, N1] / [T1, N1], Sk the key's
    leading dims ([B, S2, 1], [T2, 1] or the paged [block_num, block_size, 1]). Selection, ties, -1 padding, layouts,
    lengths and paged caches as `lightning_indexer` (docs/operators/lightning_indexer.md); scores in fp32.
    Returns int32 [B, S1, 1, K] / [T1, 1, K] (docs/operators/quant_dsa.md).
    """
    _check_tensor(query, "query")
    require(query.dtype in dequant.QUANT_DTYPES, "query", "dtype int8 or float8_e4m3fn", query)
    _check_tensor(key, "key", query.dtype)
    for name, t in (("weights", weights), ("query_dequant_scale", query_dequant_scale),
                    ("key_dequant_scale", key_dequant_scale)):
        _check_tensor(t, name)
    combos = INDEXER_SCALE_DTYPES[query.dtype]
    given = (weights.dtype, query_dequant_scale.dtype, key_dequant_scale.dtype)
    if given not in combos:
        names = " or ".join("(" + ", ".join(str(d).replace("torch.", "") for d in c) + ")" for c in combos)
        raise ParamInvalidError(f"weights/query_dequant_scale/key_dequant_scale: expected dtypes {names} with "
                                f"{str(query.dtype).replace('torch.', '')} inputs, got {given}")
    for name, mode in (("query_quant_mode", query_quant_mode), ("key_quant_mode", key_quant_mode)):
        if require_int(mode, name) != 0:
            raise ParamInvalidError(f"{name}: expected 0 (per-token-head, the only mode), got {mode!r}")
    _no_hifloat8(query_dtype, "query_dtype")
    _no_hifloat8(key_dtype, "key_dtype")
    _default_window(pre_tokens, next_tokens)
    layout_key = kv_layout(layout, layout_key, block_table, "layout_key")
    rank = 4 if layout == "BSND" else 3
    require(query.dim() == rank, "query", f"a {rank}-D tensor for layout {layout}", query)
    require_key_rank(key, "key", layout_key)
    require(key.shape[-2] == 1, "key", "N2 = 1", key)
    require(key.shape[-1] == query.shape[-1], "key", f"head dim {query.shape[-1]} like the query", key)
    require(query.shape[:-2].numel() == 0 or query.shape[-2] >= 1, "query", "N1 >= 1 heads", query)
    for name, t, shape in (("weights", weights, query.shape[:-1]),
                           ("query_dequant_scale", query_dequant_scale, query.shape[:-1]),
                           ("key_dequant_scale", key_dequant_scale, key.shape[:-1])):
        require(tuple(t.shape) == tuple(shape), name, f"shape {list(shape)}", t)
    if require_int(sparse_mode, "sparse_mode") not in (0, 3):
        raise ParamInvalidError(f"sparse_mode: expected 0 or 3, got {sparse_mode!r}")
    sparse_count = require_int(sparse_count, "sparse_count")
    if not 1 <= sparse_count <= MAX_SPARSE_COUNT:
        raise ParamInvalidError(f"sparse_count: expected an int in [1, {MAX_SPARSE_COUNT}], got {sparse_count}")
    # "该接口要求W⊙Scale_Q的结果在float16的表示范围内"
    folded = weights.to(torch.float32) * query_dequant_scale.to(torch.float32)
    if folded.numel() and not bool((folded.abs() <= FP16_MAX).all()):
        raise ParamInvalidError(f"weights/query_dequant_scale: W * Scale_Q must lie within the float16 range "
                                f"(|x| <= {FP16_MAX}), got max {float(folded.abs().max())}")
    if layout_key == PAGED_KV_LAYOUT:
        problem = paged_sequence_spans(layout, query, key, actual_seq_lengths_query, actual_seq_lengths_key,
                                       block_table, "actual_seq_lengths_key", "key")
    else:
        problem = sequence_spans(layout, query, key, actual_seq_lengths_query, actual_seq_lengths_key,
                                 "actual_seq_lengths_key", "key")
    select_backend(backend, query.device, op="quant_lightning_indexer")  # reference kernels only (any device)
    indices = torch.full((*query.shape[:-2], 1, sparse_count), -1, dtype=torch.int32, device=query.device)
    for b in range(len(problem.q_spans)):
        lq, lk = problem.q_lengths[b], problem.kv_lengths[b]
        if lq == 0 or lk == 0:
            continue
        if problem.pages is None:
            keys, key_scales = problem.keys(key, b)[:lk, 0], problem.keys(key_dequant_scale, b)[:lk, 0]
        else:
            keys = problem.pages.sequence_columns([key], b, key.dtype)
            key_scales = problem.pages.sequence_columns([key_dequant_scale.unsqueeze(-1)], b, torch.float32)[:, 0]
        kernel.top_k_sequence(
            problem.rows(query, b)[:lq], keys, problem.rows(weights, b)[:lq], sparse_mode=int(sparse_mode),
            seq_q=lq, seq_kv=lk, k=sparse_count, indices_out=problem.rows(indices, b)[:lq, 0], values_out=None,
            q_scale=problem.rows(query_dequant_scale, b)[:lq], k_scale=key_scales)
    return indices
