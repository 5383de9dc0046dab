"""QuantLightningIndexer and KvQuantSparseFlashAttention: DeepSeek-V3.2 inference with an int8 / fp8 indexer and
latent cache (torch_npu npu_quant_lightning_indexer / npu_kv_quant_sparse_flash_attention;
docs/operators/quant_dsa.md). Dequantisation: problem/dequant.py."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from ..backends import select_backend
from ..backends.reference import indexer as kernel
from ..backends.reference import npu_attention
from ..backends.reference import sparse_attention as sfa_kernel
from ..backends.triton.sparse_plan import MAX_INDEX_DIM, MAX_INDEX_HEADS, indexer_tables, sparse_unsupported
from ..errors import ParamInvalidError, require, require_int
from ..problem import dequant, precision
from ..problem import sink as sink_rule
from ..problem.lengths import IntList
from ..problem.page_table import PAGED_KV_LAYOUT
from ..problem.stats import accumulation_dtype
from ..traceable import traced_as_custom_op
from . import sparse_flash_attention as sfa_ops
from .sparse_flash_attention import (
    INT64_MAX,
    _check_tensor,
    kv_layout,
    paged_sequence_spans,
    require_key_rank,
    sequence_spans,
    validate_sparse,
)

MAX_SPARSE_COUNT = 2048
# Scale dtypes per quantised dtype (npu_quant_lightning_indexer, 约束说明): weights, query scale, key scale.
INDEXER_SCALE_DTYPES = {
    torch.int8: ((torch.float16, torch.float16, torch.float16),),
    torch.float8_e4m3fn: ((torch.bfloat16, torch.float32, torch.float32),
                          (torch.float16, torch.float16, torch.float16)),
}
FP16_MAX = 65504.0
# npu_quant_lightning_indexer: "参数query中的D和参数key中的D值相等为128".
QUANT_INDEXER_HEAD_DIM = 128
# npu_quant_lightning_indexer, query: "N1支持[1, 64]"; Ascend 950, the only NPU that takes float8_e4m3fn inputs
# (Atlas A2/A3: int8 only): "query N1仅支持8、16、24、32、64" (约束说明).
QUANT_INDEXER_MAX_HEADS = 64
FP8_QUANT_INDEXER_HEADS = (8, 16, 24, 32, 64)
# npu_kv_quant_sparse_flash_attention, query: "Q_N值支持1/2/4/8/16/32/48/64/128".
KV_QUANT_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 48, 64, 128)


def _no_hifloat8(value, param: str) -> None:
    """`query_dtype` / `key_dtype` only name hifloat8 (op-plugin refuses any other value), which has no torch dtype
    to compute with here."""
    if value is not None:
        raise ParamInvalidError(f"{param}: only hifloat8 may be named here, and hifloat8 inputs are not supported "
                                f"(no torch dtype); pass None with int8 / float8_e4m3fn tensors, got {value!r}")


def _quant_indexer_unsupported(query: torch.Tensor) -> str | None:
    """Why the Triton indexer kernel cannot score this quantised case (None when it can)."""
    if query.shape[-2] > MAX_INDEX_HEADS:
        return f"{query.shape[-2]} index heads exceed the kernels' {MAX_INDEX_HEADS}"
    if query.shape[-1] > MAX_INDEX_DIM:
        return f"index head dim {query.shape[-1]} exceeds the kernels' {MAX_INDEX_DIM}"
    return None


def _check_query_heads(query: torch.Tensor) -> None:
    """N1 within the documented head counts: 1 .. 64, and for float8_e4m3fn inputs one of 8, 16, 24, 32, 64
    (docs/operators/quant_dsa.md). A query without rows may have no heads either."""
    heads = query.shape[-2]
    if heads == 0 and query.shape[:-2].numel() == 0:
        return
    if query.dtype == torch.float8_e4m3fn:
        allowed, wanted = FP8_QUANT_INDEXER_HEADS, f"one of {list(FP8_QUANT_INDEXER_HEADS)} with float8_e4m3fn"
    else:
        allowed, wanted = range(1, QUANT_INDEXER_MAX_HEADS + 1), f"1 .. {QUANT_INDEXER_MAX_HEADS}"
    require(heads in allowed, "query", f"N1 (heads) {wanted}", query)


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
    actual_seq_lengths_query: IntList | None = None,
    actual_seq_lengths_key: IntList | None = None,
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
    require(query.shape[-1] == QUANT_INDEXER_HEAD_DIM, "query", f"head dim D = {QUANT_INDEXER_HEAD_DIM}", query)
    require(key.shape[-1] == query.shape[-1], "key", f"head dim {query.shape[-1]} like the query", key)
    _check_query_heads(query)
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
    pipeline = precision.quant_indexer_pipeline(query.dtype, weights.dtype) if precision.npu_mode() else None
    npu_scores = None if pipeline is None else functools.partial(npu_attention.quant_index_scores, pipeline)
    indices = torch.full((*query.shape[:-2], 1, sparse_count), -1, dtype=torch.int32, device=query.device)
    if select_backend(backend, query.device, op="quant_lightning_indexer",
                      unsupported=lambda: _quant_indexer_unsupported(query)) == "triton":
        from ..backends.triton import indexer as triton_kernel

        block_table = None if problem.pages is None else problem.pages.table.to(query.device)
        triton_kernel.lightning_top_k(
            query, key, weights, indexer_tables(problem, int(sparse_mode), query.device), sparse_count,
            indices.view(-1, sparse_count), None, block_table, query_scale=query_dequant_scale,
            key_scale=key_dequant_scale)
        return indices
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
            q_scale=problem.rows(query_dequant_scale, b)[:lq], k_scale=key_scales, npu_scores=npu_scores)
    return indices


# Per-tile quantisation (mode 2) with the scales stored beside the data ("combine", repo mode 1) in MLA-absorb
# attention (mode 2): the only values KvQuantSparseFlashAttention documents.
KV_QUANT_MODE, SCALE_REPO_MODE, ABSORB_MODE = 2, 1, 2
# "sparse_block_size支持[1,16]，且要求是2的幂次方" (A2/A3): entry idx names keys [idx * bs, idx * bs + bs), the
# selection rule of SparseFlashAttention (whose own page lists 1, 8, 16, ...; docs/operators/quant_dsa.md).
KV_QUANT_BLOCK_SIZES = (1, 2, 4, 8, 16)


def _require_value(value, param: str, expected, meaning: str) -> None:
    if require_int(value, param) != expected:
        raise ParamInvalidError(f"{param}: expected {expected} ({meaning}, the only value supported), got {value!r}")


@traced_as_custom_op
def kv_quant_sparse_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sparse_indices: torch.Tensor,
    scale_value: float,
    key_quant_mode: int = 2,
    value_quant_mode: int = 2,
    *,
    key_dequant_scale: torch.Tensor | None = None,
    value_dequant_scale: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    actual_seq_lengths_query: IntList | None = None,
    actual_seq_lengths_kv: IntList | None = None,
    sparse_block_size: int = 1,
    layout: str = "BSND",
    layout_kv: str | None = None,
    sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
    attention_mode: int = 2,
    quant_scale_repo_mode: int = 1,
    tile_size: int = 128,
    rope_head_dim: int = 64,
    key_dtype: int | None = None,
    value_dtype: int | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Sparse attention over an 8-bit MLA latent cache: softmax(scale Q . [Dequant(K_nope) ; K_rope]) Dequant(V_nope).

    query [B, S1, N1, 576] / [T1, N1, 576] (nope 512 ++ rope 64, fp16 / bf16); key and value [.., 1, 656] int8 or
    float8_e4m3fn combined rows (512 quantised latent values, the 64 rope values in the query's dtype as bytes, 4
    fp32 tile scales as bytes), BSND, TND or a paged PA_BSND cache with `block_table`; `value` may be the latent
    alone [.., 1, 512], dequantised with the key rows' scales. Each tile of 128 latent values
    is dequantised as x * scale in fp32, rounded once to the query's dtype (problem/dequant.py); the attention, its
    selection rule, lengths, modes and `sinks` are those of `sparse_flash_attention`. Returns the attention output
    [.., N1, 512] in the query's dtype (docs/operators/quant_dsa.md).
    """
    _check_tensor(query, "query")
    require(query.dtype in (torch.float16, torch.bfloat16), "query", "dtype float16 or bfloat16", query)
    _check_tensor(key, "key")
    require(key.dtype in dequant.QUANT_DTYPES, "key", "dtype int8 or float8_e4m3fn", key)
    _check_tensor(value, "value", key.dtype)
    _check_tensor(sparse_indices, "sparse_indices")
    require(sparse_indices.dtype == torch.int32, "sparse_indices", "dtype int32", sparse_indices)
    _require_value(key_quant_mode, "key_quant_mode", KV_QUANT_MODE, "per-tile")
    _require_value(value_quant_mode, "value_quant_mode", KV_QUANT_MODE, "per-tile")
    for name, t in (("key_dequant_scale", key_dequant_scale), ("value_dequant_scale", value_dequant_scale)):
        if t is not None:
            raise ParamInvalidError(f"{name}: reserved, only None is supported (the scales are stored in the "
                                    f"key/value rows), got a tensor")
    _require_value(attention_mode, "attention_mode", ABSORB_MODE, "MLA-absorb")
    _require_value(quant_scale_repo_mode, "quant_scale_repo_mode", SCALE_REPO_MODE, "scales combined with the data")
    _require_value(tile_size, "tile_size", dequant.TILE_SIZE, "per-tile scale granularity")
    _require_value(rope_head_dim, "rope_head_dim", dequant.ROPE_DIM, "MLA rope head dim")
    _no_hifloat8(key_dtype, "key_dtype")
    _no_hifloat8(value_dtype, "value_dtype")
    _default_window(pre_tokens, next_tokens)
    if require_int(sparse_block_size, "sparse_block_size") not in KV_QUANT_BLOCK_SIZES:
        raise ParamInvalidError(f"sparse_block_size: expected one of {list(KV_QUANT_BLOCK_SIZES)}, "
                                f"got {sparse_block_size!r}")
    width = dequant.LATENT_DIM + dequant.ROPE_DIM
    require(query.shape[-1] == width, "query", f"head dim {width} (nope {dequant.LATENT_DIM} ++ rope "
            f"{dequant.ROPE_DIM})", query)
    require(query.dim() >= 2 and query.shape[-2] in KV_QUANT_QUERY_HEADS, "query",
            f"Q_N (heads) among {list(KV_QUANT_QUERY_HEADS)}", query)
    layout_kv = kv_layout(layout, layout_kv, block_table, "layout_kv")
    require_key_rank(key, "key", layout_kv)
    row = dequant.combined_width(query.dtype)
    require(key.shape[-1] == row and key.shape[-2] == 1, "key", f"KV_N = 1 and KV_D = {row} bytes per row (latent "
            f"{dequant.LATENT_DIM} + rope {dequant.ROPE_DIM} x {query.dtype} + 4 fp32 scales)", key)
    latent_only = tuple(value.shape) == (*key.shape[:-1], dequant.LATENT_DIM)
    require(tuple(value.shape) == tuple(key.shape) or latent_only, "value",
            f"the key's shape {list(key.shape)} (combined rows) or the latent alone {[*key.shape[:-1], 512]}", value)
    key_parts = dequant.split_combined(key, query.dtype)
    # The lengths, table and indices checked as SparseFlashAttention checks them (on the rope parts: same rows).
    problem = validate_sparse(query[..., dequant.LATENT_DIM :], key_parts.rope, key_parts.rope, sparse_indices,
                              scale_value, query_rope=None, key_rope=None,
                              actual_seq_lengths_query=actual_seq_lengths_query,
                              actual_seq_lengths_kv=actual_seq_lengths_kv, sparse_block_size=sparse_block_size,
                              layout=layout, sparse_mode=sparse_mode, block_table=block_table, layout_kv=layout_kv,
                              block_sizes=KV_QUANT_BLOCK_SIZES, keyless=True)
    value_is_key = value is key or (value.data_ptr() == key.data_ptr() and value.stride() == key.stride())
    if value_is_key:
        value_parts = key_parts
    elif latent_only:
        # The latent alone carries no scales: each row is dequantised with its key row's tile scales, as
        # op-plugin's own test builds and checks it (value = the int8 latent, key = latent ++ rope ++ scales).
        value_parts = replace(key_parts, latent=value)
    else:
        value_parts = dequant.split_combined(value, query.dtype)
    sinks = sink_rule.check_sink(sinks, problem.heads, "sinks")
    if query.numel() and not precision.npu_mode():
        if select_backend(backend, query.device, op="kv_quant_sparse_flash_attention",
                          unsupported=lambda: sparse_unsupported(query[..., :512], key_parts.rope, key_parts.rope,
                                                                 query[..., 512:])) == "reference":
            return _reference_attention(problem, query, key_parts, value_parts, value_is_key, sparse_indices,
                                        float(scale_value), int(sparse_mode), int(sparse_block_size), sinks)
        return _triton_attention(problem, query, key_parts, value_parts, sparse_indices, float(scale_value),
                                 int(sparse_mode), int(sparse_block_size), sinks)
    # The npu precision mode (its SparseFlashAttention pipeline on the reference backend) and empty queries: the
    # reachable rows dequantised into a temporary of the query's dtype, then SparseFlashAttention.
    rows = _selectable_rows(problem, sparse_indices, int(sparse_block_size), key.shape)
    k_nope = _dequantized_rows(key_parts, rows, query.dtype)
    v_nope = k_nope if value_is_key else _dequantized_rows(value_parts, rows, query.dtype)
    return sfa_ops.forward_problem(
        problem, query[..., : dequant.LATENT_DIM], k_nope, v_nope, sparse_indices,
        query[..., dequant.LATENT_DIM :], key_parts.rope, float(scale_value), int(sparse_mode),
        int(sparse_block_size), sinks, backend).attention_out


def _triton_attention(problem, query, key_parts: dequant.CombinedCache, value_parts: dequant.CombinedCache,
                      sparse_indices, scale: float, sparse_mode: int, block_size: int, sinks) -> torch.Tensor:
    """The Triton SparseFlashAttention kernel reading the combined cache rows in place (contiguous or paged through
    the block table): each gathered tile's latent is dequantised in registers by the rule of problem/dequant.py, no
    temporary of the cache is written."""
    from ..backends.triton.sparse_attention import QuantizedLatent

    quantized = QuantizedLatent(key_parts.scales, value_parts.scales, query.dtype, dequant.TILE_SIZE)
    out, _, _ = sfa_ops.triton_forward(
        problem, query[..., : dequant.LATENT_DIM], key_parts.latent, value_parts.latent, sparse_indices,
        query[..., dequant.LATENT_DIM :], key_parts.rope, scale, sparse_mode, block_size, sinks, quantized)
    return out


def _sequence_tokens(problem, sparse_indices: torch.Tensor, block_size: int, b: int) -> torch.Tensor:
    """Sorted key positions of sequence b that an entry of its `sparse_indices` rows can reach: tokens
    [idx * bs, idx * bs + bs) below the key length of the entries >= 0. A superset of the keys the attention reads
    (docs/operators/sparse_flash_attention.md); nothing else of the cache is dequantised."""
    lq, lk = problem.q_lengths[b], problem.kv_lengths[b]
    device = sparse_indices.device
    idx = problem.rows(sparse_indices, b)[:lq].reshape(-1).to(torch.int64)
    idx = idx[(idx >= 0) & (idx < -(-lk // block_size))]
    reached = torch.zeros(-(-lk // block_size) * block_size, dtype=torch.bool, device=device)
    # A mark per token (index_fill_: a bool index_put_ takes ~100x longer on the CPU); no sort.
    reached.index_fill_(0, (idx.unsqueeze(-1) * block_size + torch.arange(block_size, device=device)).reshape(-1),
                        True)
    return reached[:lk].nonzero().squeeze(-1)


def _cache_rows(problem, b: int, tokens: torch.Tensor, cache_shape) -> tuple[torch.Tensor, ...]:
    """Index tuple over the cache's leading axes of sequence b's key positions `tokens`: through the block table for
    a paged cache ([block, slot]), [start + token] for TND, [b, token] for BSND."""
    if problem.pages is not None:
        flat = problem.pages.physical_rows(b).to(tokens.device)[tokens]
        return flat // cache_shape[1], flat % cache_shape[1]
    if problem.layout == "TND":
        return (tokens + problem.kv_spans[b][1],)
    return torch.full_like(tokens, b), tokens


def _selectable_rows(problem, sparse_indices: torch.Tensor, block_size: int, cache_shape) -> tuple[torch.Tensor, ...]:
    """`_cache_rows` of every sequence's reachable tokens, concatenated."""
    parts = [_cache_rows(problem, b, _sequence_tokens(problem, sparse_indices, block_size, b), cache_shape)
             for b in range(len(problem.q_spans)) if problem.q_lengths[b] and problem.kv_lengths[b]]
    if not parts:
        width = 1 if problem.layout == "TND" and problem.pages is None else 2
        return tuple(torch.zeros(0, dtype=torch.int64, device=sparse_indices.device) for _ in range(width))
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


def _reference_attention(problem, query, key_parts: dequant.CombinedCache, value_parts: dequant.CombinedCache,
                         value_is_key: bool, sparse_indices, scale: float, sparse_mode: int, block_size: int, sinks):
    """The reference backend's SparseFlashAttention loop with each sequence's reachable rows dequantised straight
    into the kernel's fp32 key buffer (the latent rounded to the query's dtype first, as the rule says), instead of a
    dequantised copy of the cache converted again. Same kernel, same values: bit for bit `sparse_flash_attention`
    on the dequantised cache (tests/test_kv_quant_sfa.py)."""
    q_nope, q_rope = query[..., : dequant.LATENT_DIM], query[..., dequant.LATENT_DIM :]
    out, softmax_max, softmax_sum = sfa_ops._initial_outputs(problem, q_nope, key_parts.latent)
    dtype = accumulation_dtype(query.dtype)
    width = dequant.LATENT_DIM + dequant.ROPE_DIM
    for b in range(len(problem.q_spans)):
        lq, lk = problem.q_lengths[b], problem.kv_lengths[b]
        if lq == 0 or lk == 0:
            continue
        tokens = _sequence_tokens(problem, sparse_indices, block_size, b)
        rows = _cache_rows(problem, b, tokens, key_parts.latent.shape)
        # Rows no entry reaches stay 0 and are never read.
        k = torch.zeros((lk, width), dtype=dtype, device=query.device)
        k[:, : dequant.LATENT_DIM].index_copy_(0, tokens, _dequantized(key_parts, rows, query.dtype).to(dtype))
        k[:, dequant.LATENT_DIM :].index_copy_(0, tokens, _take(key_parts.rope, rows).to(dtype))
        if value_is_key:
            v = k[:, : dequant.LATENT_DIM]
        else:
            v = torch.zeros((lk, dequant.LATENT_DIM), dtype=dtype, device=query.device)
            v.index_copy_(0, tokens, _dequantized(value_parts, rows, query.dtype).to(dtype))
        seq = sfa_kernel.SparseSequence(q=problem.rows(q_nope, b)[:lq], q_rope=problem.rows(q_rope, b)[:lq], k=k, v=v,
                                        indices=problem.rows(sparse_indices, b)[:lq, 0], seq_q=lq, seq_kv=lk,
                                        value_is_key=value_is_key)
        target_rows = problem.rows(out, b)[:lq]
        # With sinks the output stays in the compute dtype until the sink is merged (one rounding), as in SFA.
        target = target_rows if sinks is None else torch.zeros(target_rows.shape, dtype=dtype, device=out.device)
        sfa_kernel.forward_sequence(seq, scale, sparse_mode, block_size, dtype, target,
                                    sfa_ops._stat_rows(problem, softmax_max, b)[:lq],
                                    sfa_ops._stat_rows(problem, softmax_sum, b)[:lq])
        if sinks is not None:
            sfa_ops._merge_sinks(problem, b, target, softmax_max, softmax_sum, sinks, out_rows=target)
            target_rows.copy_(target)
    if sinks is not None:  # computed rows of sequences without keys: the sink alone
        for b in range(len(problem.q_spans)):
            if problem.q_lengths[b] > 0 and problem.kv_lengths[b] == 0:
                sfa_ops._merge_sinks(problem, b, out, softmax_max, softmax_sum, sinks)
    return out


def _linear(rows: tuple[torch.Tensor, ...], shape) -> torch.Tensor:
    """Row-major positions over the indexed leading axes of `shape` of the index tuple `rows`."""
    linear = rows[0]
    for axis in range(1, len(rows)):
        linear = linear * shape[axis] + rows[axis]
    return linear


def _take(t: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """t[rows][:, 0] (the KV head axis of size 1 dropped) as one row gather of a flat view (a paged cache whose
    blocks are not adjacent in memory, "0轴非连续", flattens to a copy first)."""
    return t.flatten(0, len(rows) - 1).index_select(0, _linear(rows, t.shape))[:, 0]


def _dequantized(parts: dequant.CombinedCache, rows: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """[n, 512] latent of the cache rows `rows` (an index tuple over its leading axes), dequantised to `dtype`."""
    return dequant.dequantize_tiles(_take(parts.latent, rows), _take(parts.scales, rows), dequant.TILE_SIZE, dtype)


def _dequantized_rows(parts: dequant.CombinedCache, rows: tuple[torch.Tensor, ...], dtype: torch.dtype
                      ) -> torch.Tensor:
    """The latent of the cache's shape in `dtype`, dequantised at `rows` only (problem/dequant.py); the other rows
    are 0. The npu-mode SparseFlashAttention pipeline reads whole blocks, rows no entry reaches included, and masks
    their scores: uninitialised memory there (NaN bit patterns) turned outputs into NaN for block sizes > 1."""
    out = torch.zeros((*parts.latent.shape[:-1], dequant.LATENT_DIM), dtype=dtype, device=parts.latent.device)
    out.view(-1, *out.shape[len(rows):]).index_copy_(0, _linear(rows, parts.latent.shape),
                                                     _dequantized(parts, rows, dtype).unsqueeze(1))
    return out


