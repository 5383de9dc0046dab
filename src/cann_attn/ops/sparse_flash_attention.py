"""SparseFlashAttention forward and SparseFlashAttentionGrad (DSA; aclnnSparseFlashAttentionGrad documentation)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..backends import select_backend
from ..backends.reference import npu_attention
from ..backends.reference import sparse_attention as kernel
from ..backends.triton.sparse_plan import index_rows, sfa_tables, sparse_unsupported
from ..errors import (
    ParamInvalidError,
    ParamNullptrError,
    require,
    require_bool,
    require_finite,
    require_int,
)
from ..problem import precision
from ..problem import sink as sink_rule
from ..problem.lengths import cumulative_lengths, per_batch_lengths, starts_of
from ..problem.page_table import DSA_BLOCK_SIZES, PAGED_KV_LAYOUT, PageTable, page_table
from ..problem.sparse import SPARSE_BLOCK_SIZES
from ..problem.stats import accumulation_dtype, value_column_scales
from ..traceable import traced_as_custom_op

INT64_MAX = 2**63 - 1
# The only sliding-window bounds SparseFlashAttention(Grad) supports: the documented 2147483647 (参数说明 of
# preTokens / nextTokens in aclnnSparseFlashAttentionGrad) and this API's default 2**63-1 (docs/design.md), which
# mean the same thing here: no window.
SFA_WINDOW_VALUES = (2147483647, INT64_MAX)
SFA_MODES = (0, 3)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADS = 128


class SparseFlashAttentionResult(NamedTuple):
    attention_out: torch.Tensor
    softmax_max: torch.Tensor
    softmax_sum: torch.Tensor


class SparseFlashAttentionGradResult(NamedTuple):
    d_query: torch.Tensor
    d_key: torch.Tensor
    d_value: torch.Tensor
    d_query_rope: torch.Tensor | None
    d_key_rope: torch.Tensor | None
    d_sinks: torch.Tensor | None = None


@dataclass(frozen=True)
class SparseProblem:
    """Validated DSA inputs: per-sequence (start, length) of queries and keys in their tensors."""

    layout: str
    heads: int
    q_spans: list[tuple[int, int, int]]  # (batch or -1, token start, length)
    kv_spans: list[tuple[int, int, int]]
    seq_q: list[int]  # the sequences' query lengths (BSND: the tensor's S1)
    seq_kv: list[int]
    q_lengths: list[int]  # actual query rows computed per sequence
    kv_lengths: list[int]
    pages: PageTable | None = None  # the block table of a paged (PA_BSND) key/value cache

    def rows(self, t: torch.Tensor, b: int) -> torch.Tensor:
        """[S_b, ...] view of sequence b of a query-side tensor (all its rows, actual or not)."""
        if self.layout == "TND":
            _, start, length = self.q_spans[b]
            return t[start : start + length]
        return t[b]

    def keys(self, t: torch.Tensor, b: int) -> torch.Tensor:
        """[S_b, ...] keys of sequence b of a key-side tensor; from a paged cache a copy of its L_b tokens only
        (docs/semantics/paged-kv.md: no other block is read)."""
        if self.pages is not None:
            return self.pages.gather_tokens(t, [b])
        if self.layout == "TND":
            _, start, length = self.kv_spans[b]
            return t[start : start + length]
        return t[b]


def _check_tensor(t, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    if t is None:
        raise ParamNullptrError(f"{name}: a required input, got None")
    require(isinstance(t, torch.Tensor), name, "a torch.Tensor", t)
    if dtype is not None:
        require(t.dtype == dtype, name, f"the query's dtype {dtype}", t)
    return t


def validate_sparse(query, key, value, sparse_indices, scale_value, *, query_rope, key_rope, actual_seq_lengths_query,
                    actual_seq_lengths_kv, sparse_block_size, layout, sparse_mode, pre_tokens=INT64_MAX,
                    next_tokens=INT64_MAX, block_table=None, layout_kv=None,
                    block_sizes: tuple[int, ...] = SPARSE_BLOCK_SIZES, keyless: bool = False) -> SparseProblem:
    """Documented constraints of the SFA family (docs/semantics/layouts.md, docs/operators/sparse_flash_attention.md,
    docs/semantics/errors.md; a paged key/value cache: docs/semantics/paged-kv.md). `block_sizes`: the operator's
    documented `sparse_block_size` values (KvQuantSparseFlashAttention documents its own); `keyless`: TND sequences
    with queries but no keys are computed (their rows select nothing: output 0) instead of refused, as
    KvQuantSparseFlashAttention documents lengths >= 0."""
    _check_tensor(query, "query")
    require(query.dtype in FLOAT_DTYPES, "query", "dtype float16 or bfloat16", query)
    for name, t in (("key", key), ("value", value)):
        _check_tensor(t, name, query.dtype)
    _check_tensor(sparse_indices, "sparse_indices")
    require(sparse_indices.dtype in (torch.int32, torch.int64), "sparse_indices", "dtype int32 or int64",
            sparse_indices)
    if layout not in ("BSND", "TND"):
        raise ParamInvalidError(f"layout: expected 'BSND' or 'TND', got {layout!r}")
    if require_int(sparse_mode, "sparse_mode") not in SFA_MODES:
        raise ParamInvalidError(f"sparse_mode: expected 0 or 3, got {sparse_mode!r}")
    # An integer first (8.0 would pass `in SPARSE_BLOCK_SIZES` and break the index arithmetic later;
    # docs/operators/sparse_flash_attention.md).
    if require_int(sparse_block_size, "sparse_block_size") not in block_sizes:
        raise ParamInvalidError(
            f"sparse_block_size: expected an int, one of {list(block_sizes)}, got {sparse_block_size!r}"
        )
    for name, bound in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        if require_int(bound, name) not in SFA_WINDOW_VALUES:
            raise ParamInvalidError(f"{name}: expected an int equal to 2147483647 or 2**63-1 (the only supported "
                                    f"value: no sliding window), got {bound!r}")
    require_finite(scale_value, "scale_value")
    layout_kv = kv_layout(layout, layout_kv, block_table, "layout_kv")
    rank = 4 if layout == "BSND" else 3
    for name, t in (("query", query), ("sparse_indices", sparse_indices)):
        require(t.dim() == rank, name, f"a {rank}-D tensor for layout {layout}", t)
    for name, t in (("key", key), ("value", value)):
        require_key_rank(t, name, layout_kv)
    if (query_rope is None) != (key_rope is None):
        raise ParamInvalidError("query_rope/key_rope: give both rope tensors or neither")
    if query_rope is not None:
        _check_tensor(query_rope, "query_rope", query.dtype)
        _check_tensor(key_rope, "key_rope", query.dtype)
        require(query_rope.shape[:-1] == query.shape[:-1], "query_rope",
                f"query's leading dims {list(query.shape[:-1])}", query_rope)
        require(key_rope.shape[:-1] == key.shape[:-1], "key_rope", f"key's leading dims {list(key.shape[:-1])}",
                key_rope)
        require(key_rope.shape[-1] == query_rope.shape[-1], "key_rope", f"rope dim {query_rope.shape[-1]}", key_rope)
    heads, heads_kv = query.shape[-2], key.shape[-2]
    require(heads_kv == 1, "key", "N2 = 1 (MLA-absorbed MQA)", key)
    require(value.shape[-2] == 1, "value", "N2 = 1", value)
    # N1 = 0 is an empty query, which returns empty outputs without error (docs/semantics/errors.md).
    require(heads <= MAX_HEADS and (heads >= 1 or query.numel() == 0), "query", f"N1 in 1..{MAX_HEADS}", query)
    require(key.shape[-1] == query.shape[-1], "key", f"head dim {query.shape[-1]} like the query", key)
    require(value.shape[:-1] == key.shape[:-1], "value", f"key's leading dims {list(key.shape[:-1])}", value)
    # kD >= vD (docs/semantics/layouts.md): value's head dim may be smaller than key's, never larger. An empty query
    # (D = 0 included) returns directly (docs/semantics/errors.md).
    require(query.numel() == 0 or value.shape[-1] <= key.shape[-1], "value",
            f"head dim <= the key's {key.shape[-1]} (kD >= vD)", value)
    require(sparse_indices.shape[:-2] == query.shape[:-2] and sparse_indices.shape[-2] == 1, "sparse_indices",
            f"shape {[*query.shape[:-2], 1, 'K']}", sparse_indices)
    require(sparse_indices.shape[-1] >= 1, "sparse_indices", "K >= 1 entries per row", sparse_indices)
    if sparse_indices.numel() and int(sparse_indices.min()) < -1:
        raise ParamInvalidError(f"sparse_indices: entries must be >= 0 or the padding value -1, got "
                                f"min {int(sparse_indices.min())}")
    if layout_kv == PAGED_KV_LAYOUT:
        # "支持sparse_block_size整除block_size" (npu_sparse_flash_attention, 约束说明): a sparse block never
        # straddles two pages.
        if key.shape[1] % int(sparse_block_size):
            raise ParamInvalidError(f"sparse_block_size: expected a divisor of the cache's block_size "
                                    f"{key.shape[1]} (key.shape[1]), got {sparse_block_size}")
        return paged_sequence_spans(layout, query, key, actual_seq_lengths_query, actual_seq_lengths_kv,
                                    block_table, "actual_seq_lengths_kv")
    return sequence_spans(layout, query, key, actual_seq_lengths_query, actual_seq_lengths_kv, "actual_seq_lengths_kv",
                          keyless=keyless)


def kv_layout(layout: str, layout_kv: str | None, block_table, param: str) -> str:
    """The key-side layout: `layout_kv` (None or "" -> "PA_BSND" with a block_table, else the query's layout).
    A non-paged key layout must equal the query's and takes no block_table; with "PA_BSND" the query may be
    BSND or TND (torch_npu npu_sparse_flash_attention / npu_lightning_indexer, docs/semantics/paged-kv.md)."""
    if layout not in ("BSND", "TND"):
        raise ParamInvalidError(f"layout: expected 'BSND' or 'TND', got {layout!r}")
    if layout_kv is None or layout_kv == "":
        layout_kv = PAGED_KV_LAYOUT if block_table is not None else layout
    if layout_kv not in ("BSND", "TND", PAGED_KV_LAYOUT):
        raise ParamInvalidError(f"{param}: expected 'BSND', 'TND' or '{PAGED_KV_LAYOUT}', got {layout_kv!r}")
    if layout_kv != PAGED_KV_LAYOUT:
        if block_table is not None:
            raise ParamInvalidError(f"block_table: only with {param}='{PAGED_KV_LAYOUT}' (a paged cache), got a "
                                    f"block_table with {param}={layout_kv!r}")
        if layout_kv != layout:
            raise ParamInvalidError(f"{param}: expected the query's layout {layout!r} (or '{PAGED_KV_LAYOUT}'), "
                                    f"got {layout_kv!r}")
    return layout_kv


def require_key_rank(t: torch.Tensor, name: str, layout_kv: str) -> None:
    """A key-side tensor has the rank of its layout: TND 3-D; BSND and a paged cache [block_num, block_size, 1, D]
    4-D (docs/semantics/paged-kv.md)."""
    rank = 3 if layout_kv == "TND" else 4
    shape = "[block_num, block_size, 1, D]" if layout_kv == PAGED_KV_LAYOUT else f"layout {layout_kv}"
    require(t.dim() == rank, name, f"a {rank}-D tensor for {shape}", t)


def paged_sequence_spans(layout: str, query: torch.Tensor, cache: torch.Tensor, actual_q, actual_kv, block_table,
                         kv_param: str, key_param: str = "key") -> SparseProblem:
    """Per-sequence spans of a DSA problem whose keys live in a paged cache [block_num, block_size, 1, D]: the
    query's sequences (BSND batch rows or TND cumulative ends) and the page table of their keys
    (docs/semantics/paged-kv.md). A sequence with no keys is allowed (its rows select nothing)."""
    heads = query.shape[-2]
    if layout == "BSND":
        batch, s1 = query.shape[0], query.shape[1]
        q_len = per_batch_lengths(actual_q, "actual_seq_lengths_query", batch, s1)
        q_spans = [(b, 0, s1) for b in range(batch)]
        seq_q = [s1] * batch
    else:
        q_len = cumulative_lengths(actual_q, query.shape[0], "actual_seq_lengths_query")
        q_spans = [(-1, s, n) for s, n in zip(starts_of(q_len), q_len, strict=True)]
        seq_q = q_len
    pages = page_table(block_table, block_size=cache.shape[1], block_count=cache.shape[0], kv_lengths=actual_kv,
                       batch=len(q_len), rule=DSA_BLOCK_SIZES, lengths_param=kv_param,
                       block_size_param=f"{key_param} (block_size = {key_param}.shape[1])", cache_param=key_param)
    kv_len = list(pages.kv_lengths)
    kv_spans = [(b, 0, n) for b, n in enumerate(kv_len)]
    return SparseProblem(layout, heads, q_spans, kv_spans, seq_q, kv_len, q_len, kv_len, pages)


def sequence_spans(layout: str, query: torch.Tensor, key: torch.Tensor, actual_q, actual_kv,
                   kv_param: str, key_param: str = "key", keyless: bool = False) -> SparseProblem:
    """Per-sequence spans of a BSND (plain per-batch actual lengths) or TND (cumulative ends) DSA problem; a TND
    sequence with queries but no keys is refused unless `keyless`."""
    heads = query.shape[-2]
    if layout == "BSND":
        batch = query.shape[0]
        require(key.shape[0] == batch, key_param, f"batch B={batch} like the query", key)
        s1, s2 = query.shape[1], key.shape[1]
        q_len = per_batch_lengths(actual_q, "actual_seq_lengths_query", batch, s1)
        kv_len = per_batch_lengths(actual_kv, kv_param, batch, s2)
        q_spans = [(b, 0, s1) for b in range(batch)]
        kv_spans = [(b, 0, s2) for b in range(batch)]
        return SparseProblem(layout, heads, q_spans, kv_spans, [s1] * batch, [s2] * batch, q_len, kv_len)
    q_len = cumulative_lengths(actual_q, query.shape[0], "actual_seq_lengths_query")
    kv_len = cumulative_lengths(actual_kv, key.shape[0], kv_param)
    if len(q_len) != len(kv_len):
        raise ParamInvalidError(
            f"{kv_param}: expected {len(q_len)} sequences like actual_seq_lengths_query, got {len(kv_len)}"
        )
    for b, (sq, skv) in enumerate(zip(q_len, kv_len, strict=True)):
        if sq > 0 and skv == 0 and not keyless:
            raise ParamInvalidError(f"{kv_param}: sequence {b} has {sq} query tokens but no key tokens")
    q_spans = [(-1, s, n) for s, n in zip(starts_of(q_len), q_len, strict=True)]
    kv_spans = [(-1, s, n) for s, n in zip(starts_of(kv_len), kv_len, strict=True)]
    return SparseProblem(layout, heads, q_spans, kv_spans, q_len, kv_len, q_len, kv_len)


def _sequences(problem: SparseProblem, query, key, value, sparse_indices, query_rope, key_rope):
    """(b, SparseSequence) for each sequence with rows to compute; K carries the rope dims appended (the kernel
    appends Q's per tile), K and V are converted once to the compute dtype. Sequences without keys are skipped:
    their rows select nothing and keep the zero output / invalid statistics they were initialised with."""
    dtype = accumulation_dtype(query.dtype)
    value_is_key = value is key or (
        value.shape == key.shape and value.stride() == key.stride() and value.data_ptr() == key.data_ptr()
    )
    for b in range(len(problem.q_spans)):
        lq, lk = problem.q_lengths[b], problem.kv_lengths[b]
        if lq == 0 or lk == 0:
            continue
        q_rope = None if query_rope is None else problem.rows(query_rope, b)[:lq]
        if problem.pages is not None:
            # A paged cache: the sequence's keys (++ rope keys) assembled in one pass, the shared latent once.
            k = problem.pages.sequence_columns([key] + ([] if key_rope is None else [key_rope]), b, dtype)
            v = k[:, : value.shape[-1]] if value_is_key else problem.pages.sequence_columns([value], b, dtype)
        else:
            k = problem.keys(key, b)[:lk, 0].to(dtype)
            v = problem.keys(value, b)[:lk, 0].to(dtype)
            if query_rope is not None:
                k = torch.cat([k, problem.keys(key_rope, b)[:lk, 0].to(dtype)], dim=-1)
        yield b, kernel.SparseSequence(
            q=problem.rows(query, b)[:lq], q_rope=q_rope, k=k, v=v,
            indices=problem.rows(sparse_indices, b)[:lq, 0],
            seq_q=lq, seq_kv=lk, value_is_key=value_is_key,
        )


def _stat_rows(problem: SparseProblem, stat: torch.Tensor, b: int) -> torch.Tensor:
    """[S_b, N1] view of softmax_max/sum ([B, 1, S1, N1] or [1, T1, N1])."""
    if problem.layout == "TND":
        _, start, length = problem.q_spans[b]
        return stat[0, start : start + length]
    return stat[b, 0]


def _stats_shape(problem: SparseProblem, query: torch.Tensor) -> tuple[int, ...]:
    if problem.layout == "TND":
        return (1, query.shape[0], problem.heads)
    return (query.shape[0], 1, query.shape[1], problem.heads)


@traced_as_custom_op
def sparse_flash_attention(
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
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
    backend: str = "auto",
    block_table: torch.Tensor | None = None,
    layout_kv: str | None = None,
    sinks: torch.Tensor | None = None,
) -> SparseFlashAttentionResult:
    """DSA sparse attention forward: each query row attends to the keys its `sparse_indices` select.

    MLA-absorbed MQA (N2 = 1): Q = [query ; query_rope], K = [key ; key_rope], V = value; z = scale * Q.K over the
    selected blocks of `sparse_block_size` tokens, P = softmax(z), out = P V (docs/operators/sparse_flash_attention.md).
    Layouts BSND (optional per-batch actual lengths) and TND (cumulative ends). sparse_mode 3 (causal, bottom-right) or
    0. Returns attention_out (query's shape with value's D), softmax_max / softmax_sum ([B, 1, S1, N1] or [1, T1, N1]);
    rows with nothing selected give 0 with max = -2e38, sum = 0. pre_tokens/next_tokens must be 2147483647 or 2**63-1
    (no sliding window, the only supported value). An empty query returns these initial outputs directly.

    Paged key/value cache (`layout_kv="PA_BSND"`, implied by a `block_table`): key, value and key_rope are
    [block_num, block_size, 1, D] caches, `block_table` [B, >= max blocks per sequence] int32 maps each sequence's
    logical blocks to physical ones, `actual_seq_lengths_kv` (required) holds plain per-sequence key counts, and
    `layout` (BSND or TND) describes the query alone (docs/semantics/paged-kv.md). The result equals that of the
    same keys laid out contiguously.

    `sinks` (float32 [N1], optional; torch_npu npu_sparse_flash_attention): one more softmax logit per query head in
    every computed row, dropped before P V; the statistics include it, and a computed row with nothing selected gets
    max = sinks[h], sum = 1, output 0 (docs/semantics/sinks.md).
    """
    problem = validate_sparse(query, key, value, sparse_indices, scale_value, query_rope=query_rope,
                              key_rope=key_rope, actual_seq_lengths_query=actual_seq_lengths_query,
                              actual_seq_lengths_kv=actual_seq_lengths_kv, sparse_block_size=sparse_block_size,
                              layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
                              block_table=block_table, layout_kv=layout_kv)
    sinks = sink_rule.check_sink(sinks, problem.heads, "sinks")
    # A NumPy integer is accepted; the kernels take a Python int.
    return forward_problem(problem, query, key, value, sparse_indices, query_rope, key_rope, float(scale_value),
                           int(sparse_mode), int(sparse_block_size), sinks, backend)


def forward_problem(problem: SparseProblem, query, key, value, sparse_indices, query_rope, key_rope, scale_value: float,
                    sparse_mode: int, block_size: int, sinks, backend: str) -> SparseFlashAttentionResult:
    """`sparse_flash_attention` of a validated problem (also KvQuantSparseFlashAttention's path over a dequantised
    temporary, whose block sizes are its own).

    Values near the float maximum (docs/semantics/precision.md, "Values near the float maximum"): where the output
    is not finite, the value columns whose P V accumulation can overflow are scaled by exact powers of two
    (`stats.value_column_scales`), the call is run again on the same backend and those columns are scaled back, so
    a finite answer near 3e38 stays finite; ordinary calls pay one isfinite pass over the output."""
    if query.numel() == 0:
        # Empty query (B, S1/T1, N1 or D zero): "query为空Tensor：直接返回" (docs/semantics/errors.md).
        return SparseFlashAttentionResult(*_initial_outputs(problem, query, value))
    use_triton = select_backend(backend, query.device, op="sparse_flash_attention",
                                unsupported=lambda: sparse_unsupported(query, key, value, query_rope)) == "triton"

    def run(values: torch.Tensor) -> SparseFlashAttentionResult:
        if use_triton:
            return SparseFlashAttentionResult(*triton_forward(problem, query, key, values, sparse_indices, query_rope,
                                                              key_rope, float(scale_value), int(sparse_mode),
                                                              block_size, sinks))
        return _reference_forward(problem, query, key, values, sparse_indices, query_rope, key_rope, scale_value,
                                  sparse_mode, block_size, sinks)

    result = run(value)
    if kernel.all_finite(result.attention_out):
        return result
    column_max = value.detach().abs().reshape(-1, value.shape[-1]).amax(0)
    scales = value_column_scales(column_max, max(problem.kv_lengths, default=0))
    if scales is None:
        return result
    scaled = run(value * scales.to(device=value.device, dtype=value.dtype))
    out = (scaled.attention_out.float() / scales.to(scaled.attention_out.device)).to(result.attention_out.dtype)
    return SparseFlashAttentionResult(out, scaled.softmax_max, scaled.softmax_sum)


def _reference_forward(problem: SparseProblem, query, key, value, sparse_indices, query_rope, key_rope,
                       scale_value: float, sparse_mode: int, block_size: int, sinks) -> SparseFlashAttentionResult:
    out, softmax_max, softmax_sum = _initial_outputs(problem, query, value)
    dtype = accumulation_dtype(query.dtype)
    pipeline = precision.sfa_pipeline(key.dtype, query.dtype) if precision.npu_mode() else None
    for b, seq in _sequences(problem, query, key, value, sparse_indices, query_rope, key_rope):
        rows = problem.rows(out, b)[: seq.seq_q]
        # With sinks the output stays in the compute dtype until the sink is merged (one rounding).
        target = rows if sinks is None else torch.zeros(rows.shape, dtype=dtype, device=rows.device)
        stats = (_stat_rows(problem, softmax_max, b)[: seq.seq_q], _stat_rows(problem, softmax_sum, b)[: seq.seq_q])
        if pipeline is not None:
            npu_attention.sparse_forward_sequence(seq, pipeline, float(scale_value), sparse_mode, block_size, target,
                                                  *stats)
        else:
            kernel.forward_sequence(seq, float(scale_value), sparse_mode, block_size, dtype, target, *stats)
        if sinks is not None:
            _merge_sinks(problem, b, target, softmax_max, softmax_sum, sinks, out_rows=target)
            rows.copy_(target if pipeline is None else pipeline.output(target))
    if sinks is not None:  # computed rows of sequences without keys: nothing selected, the sink alone
        for b in range(len(problem.q_spans)):
            if problem.q_lengths[b] > 0 and problem.kv_lengths[b] == 0:
                _merge_sinks(problem, b, out, softmax_max, softmax_sum, sinks)
    return SparseFlashAttentionResult(out, softmax_max, softmax_sum)


def triton_forward(problem: SparseProblem, query, key, value, sparse_indices, query_rope, key_rope, scale: float,
                   sparse_mode: int, block_size: int, sinks, quantized=None):
    """(out, softmax_max, softmax_sum) of the forward on the Triton kernel, the sinks merged before the output's one
    rounding; `quantized` (backends/triton/sparse_attention.py QuantizedLatent): key / value are quantised latents
    dequantised in the kernel (KvQuantSparseFlashAttention)."""
    from ..backends.triton import sparse_attention as triton_kernel

    indices = index_rows(sparse_indices)
    tables = sfa_tables(problem, indices, sparse_mode, block_size)
    block_table = None if problem.pages is None else problem.pages.table.to(query.device)
    out, softmax_max, softmax_sum = triton_kernel.sparse_forward(
        query, key, value, indices, query_rope, key_rope, tables, scale, block_size, _stats_shape(problem, query),
        block_table, wide_output=sinks is not None, quantized=quantized)
    if sinks is not None:
        for b in range(len(problem.q_spans)):
            _merge_sinks(problem, b, out, softmax_max, softmax_sum, sinks)
        out = out.to(query.dtype)
    return out, softmax_max, softmax_sum


def _merge_sinks(problem: SparseProblem, b: int, out: torch.Tensor, softmax_max: torch.Tensor,
                 softmax_sum: torch.Tensor, sinks: torch.Tensor, out_rows: torch.Tensor | None = None) -> None:
    """Merge the sinks into the computed rows of sequence b (problem/sink.py): `out` the whole output (or `out_rows`
    the sequence's computed rows already), in a dtype at least fp32 unless those rows are all 0."""
    lq = problem.q_lengths[b]
    if lq == 0:
        return
    rows = problem.rows(out, b)[:lq] if out_rows is None else out_rows
    row_max, row_sum = _stat_rows(problem, softmax_max, b)[:lq], _stat_rows(problem, softmax_sum, b)[:lq]
    sink_rule.merge_into_output_(rows, row_max, row_sum, sinks.to(device=row_max.device, dtype=row_max.dtype))


def _initial_outputs(problem: SparseProblem, query: torch.Tensor, value: torch.Tensor):
    """(out, softmax_max, softmax_sum) of rows with nothing selected: 0, -2e38, 0 (docs/semantics/invalid-rows.md,
    docs/operators/sparse_flash_attention.md)."""
    dtype = accumulation_dtype(query.dtype)
    out = torch.zeros((*query.shape[:-1], value.shape[-1]), dtype=query.dtype, device=query.device)
    softmax_max = torch.full(_stats_shape(problem, query), kernel.INVALID_MAX, dtype=dtype, device=query.device)
    softmax_sum = torch.zeros(_stats_shape(problem, query), dtype=dtype, device=query.device)
    return out, softmax_max, softmax_sum


@traced_as_custom_op
def sparse_flash_attention_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sparse_indices: torch.Tensor,
    d_out: torch.Tensor,
    out: torch.Tensor,
    softmax_max: torch.Tensor,
    softmax_sum: torch.Tensor,
    scale_value: float,
    *,
    sparse_block_size: int = 1,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    layout: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
    deterministic: bool = False,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
) -> SparseFlashAttentionGradResult:
    """Gradients of `sparse_flash_attention` (SparseFlashAttentionGrad, docs/operators/sparse_flash_attention.md).

    P = exp(z - softmax_max) / softmax_sum from the given statistics; dQ = scale dS K (split into d_query and
    d_query_rope), dK = scale dS^T Q and dV = P^T dO scattered (added) into the selected keys, fp32 accumulation.
    Rows with nothing selected and rows beyond the actual query length get zero gradients. The CPU reference is
    deterministic in any case; `deterministic=True` (or torch.use_deterministic_algorithms(True)) also forces
    deterministic scatter-adds on GPUs. An empty query returns zero gradients directly.

    With `sinks` (the forward's, float32 [N1]) the given statistics are the sink-inclusive ones and `d_sinks` ([N1],
    float32) is the gradient w.r.t. the sinks, -sum over computed rows of P_sink * rowsum(dO * O)
    (docs/semantics/sinks.md); without sinks it is None. torch_npu's grad takes no sinks: its gradients w.r.t. the
    other inputs need none beyond the statistics.
    """
    problem = validate_sparse(query, key, value, sparse_indices, scale_value, query_rope=query_rope,
                              key_rope=key_rope, actual_seq_lengths_query=actual_seq_lengths_query,
                              actual_seq_lengths_kv=actual_seq_lengths_kv, sparse_block_size=sparse_block_size,
                              layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens)
    block_size = int(sparse_block_size)
    out_shape = (*query.shape[:-1], value.shape[-1])
    for name, t in (("d_out", d_out), ("out", out)):
        _check_tensor(t, name, query.dtype)
        require(tuple(t.shape) == out_shape, name, f"the attention output's shape {list(out_shape)}", t)
    stat_shape = _stats_shape(problem, query)
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        _check_tensor(t, name)
        require(t.dtype in (torch.float32, torch.float64) and tuple(t.shape) == stat_shape, name,
                f"float32 of shape {list(stat_shape)}", t)
    sinks = sink_rule.check_sink(sinks, problem.heads, "sinks")
    deterministic = resolve_deterministic(deterministic)
    d_sinks = None if sinks is None else _sink_grads(problem, d_out, out, softmax_max, softmax_sum, sinks)
    if query.numel() == 0:
        # Empty query: "直接返回" (docs/semantics/errors.md); no row selects anything, so all gradients
        # are 0.
        return SparseFlashAttentionGradResult(*_zero_grads(query, key, value, query_rope, key_rope), d_sinks)
    if select_backend(backend, query.device, op="sparse_flash_attention_grad",
                      unsupported=lambda: sparse_unsupported(query, key, value, query_rope)) == "triton":
        from ..backends.triton import sparse_attention as triton_kernel

        indices = index_rows(sparse_indices)
        tables = sfa_tables(problem, indices, sparse_mode, block_size)
        return SparseFlashAttentionGradResult(*triton_kernel.sparse_backward(
            query, key, value, indices, d_out, out, softmax_max, softmax_sum, query_rope, key_rope, tables,
            float(scale_value), block_size, bool(deterministic)), d_sinks)
    dq, dk, dv, dq_rope, dk_rope = _zero_grads(query, key, value, query_rope, key_rope)
    dtype = accumulation_dtype(query.dtype)
    pipeline = precision.sfa_grad_pipeline(query.dtype) if precision.npu_mode() else None
    d_qk = query.shape[-1]
    guard = _deterministic_guard(deterministic and query.device.type != "cpu")
    with guard:
        for b, seq in _sequences(problem, query, key, value, sparse_indices, query_rope, key_rope):
            dq_seq = torch.empty((seq.seq_q, problem.heads, seq.dim_qk), dtype=dtype, device=query.device)
            dk_seq = torch.zeros((seq.seq_kv, seq.k.shape[-1]), dtype=dtype, device=query.device)
            dv_seq = torch.zeros((seq.seq_kv, seq.v.shape[-1]), dtype=dtype, device=query.device)
            args = (seq, problem.rows(d_out, b)[: seq.seq_q], problem.rows(out, b)[: seq.seq_q],
                    _stat_rows(problem, softmax_max, b)[: seq.seq_q], _stat_rows(problem, softmax_sum, b)[: seq.seq_q])
            if pipeline is not None:
                npu_attention.sparse_backward_sequence(args[0], pipeline, *args[1:], float(scale_value), sparse_mode,
                                                       block_size, dq_seq, dk_seq, dv_seq)
                dq_seq, dk_seq, dv_seq = (pipeline.outputs(t) for t in (dq_seq, dk_seq, dv_seq))
            else:
                kernel.backward_sequence(*args, float(scale_value), sparse_mode, block_size, dtype, dq_seq, dk_seq,
                                         dv_seq)
            problem.rows(dq, b)[: seq.seq_q] = dq_seq[..., :d_qk]
            problem.keys(dk, b)[: seq.seq_kv, 0] = dk_seq[:, :d_qk]
            problem.keys(dv, b)[: seq.seq_kv, 0] = dv_seq
            if query_rope is not None:
                problem.rows(dq_rope, b)[: seq.seq_q] = dq_seq[..., d_qk:]
                problem.keys(dk_rope, b)[: seq.seq_kv, 0] = dk_seq[:, d_qk:]
    return SparseFlashAttentionGradResult(dq, dk, dv, dq_rope, dk_rope, d_sinks)


def _sink_grads(problem: SparseProblem, d_out, out, softmax_max, softmax_sum, sinks: torch.Tensor) -> torch.Tensor:
    """d_sinks [N1]: the sink rule's -P_sink * rowsum(dO * O) summed over every computed row of every sequence."""
    dtype = accumulation_dtype(out.dtype)
    total = torch.zeros(problem.heads, dtype=dtype, device=out.device)
    heads = sinks.to(device=out.device, dtype=dtype)
    for b in range(len(problem.q_spans)):
        lq = problem.q_lengths[b]
        if lq == 0:
            continue
        total += sink_rule.sink_grad_terms(
            problem.rows(d_out, b)[:lq], problem.rows(out, b)[:lq], _stat_rows(problem, softmax_max, b)[:lq],
            _stat_rows(problem, softmax_sum, b)[:lq], heads, dtype).sum(0)
    return total.to(device=sinks.device, dtype=sinks.dtype)


def _zero_grads(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if t is None else torch.zeros_like(t) for t in tensors)


def resolve_deterministic(deterministic: bool) -> bool:
    """The `deterministic` the grad ops run with: the flag, or PyTorch's global setting. The seeds document it as
    "与整网确定性参数use_deterministic_algorithms保持一致" (consistent with the network-wide
    use_deterministic_algorithms), so `torch.use_deterministic_algorithms(True)` also makes the backwards reached
    through autograd (which pass the default False) deterministic. The flag itself must be a bool."""
    return require_bool(deterministic, "deterministic") or torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def _deterministic_guard(enabled: bool):
    """GPU scatter-adds use atomics unless deterministic algorithms are forced for the call. The caller's global
    setting is restored whole: its warn_only flag too (`use_deterministic_algorithms(x)` alone resets it)."""
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if enabled:
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn_only)
