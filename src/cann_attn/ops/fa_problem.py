"""Validation of the FA-family parameters (FlashAttentionScore, FlashAttentionVarLenScore, GradV2) and
construction of the canonical `AttentionProblem`. Shared by the forward and the grad operator so both accept
exactly the same inputs (docs/semantics/layouts.md, docs/semantics/masks.md, docs/semantics/invalid-rows.md,
docs/semantics/pse.md, docs/semantics/dropout.md, docs/semantics/softmax-stats.md, docs/semantics/errors.md)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..errors import (
    ParamInvalidError,
    ParamNullptrError,
    caller_stacklevel,
    describe,
    require,
    require_finite,
    require_int,
    require_real,
)
from ..problem import dropout as drop
from ..problem import layout as layouts
from ..problem import mask as masks
from ..problem import pse as pses
from ..problem import sink as sinks
from ..problem import stats
from ..problem.attention import AttentionProblem, Run, mask_runs
from ..problem.lengths import (
    cumulative_lengths,
    padding_tokens,
    require_same_sequence_count,
    starts_of,
    to_int_list,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADS = 256
MAX_HEAD_DIM = 512
# FlashAttentionVarLenScore documents B <= 2K (1K with prefix) for TND (FlashAttentionVarLenScore documentation);
# the dense layouts allow up to 2M (2K with prefix: aclnnFlashAttentionScoreGradV2 documentation).
MAX_BATCH_TND = 2048
MAX_BATCH_DENSE = 2 * 1024 * 1024
MAX_BATCH_WITH_PREFIX_TND = 1024
MAX_BATCH_WITH_PREFIX_DENSE = 2048
# TND token count T, and S of the other layouts, of query and of key/value: 1..1M (seed
# FlashAttentionVarLenScore documentation).
MAX_TOKENS = 1 << 20
# From this key length on, sequences with generated ALiBi get a run each (see _make_runs): shorter ones have no
# key tile far enough from the diagonal to underflow (the reference tiles are 256-512 wide), and batching them
# saves per-tile work.
ALIBI_PER_SEQUENCE_MIN_KV = 1024


@dataclass(frozen=True)
class FaShapes:
    batch: int
    heads_q: int
    heads_kv: int
    dim_qk: int
    dim_v: int
    seq_q: list[int]
    seq_kv: list[int]
    total_q: int  # T (TND) or Sq

    padding_q: int = 0  # TND query tokens past the last sequence (end-of-document padding): no kernel visits them


def _require_tensor(value: torch.Tensor | None, param: str) -> torch.Tensor:
    if value is None:
        raise ParamNullptrError(f"{param}: a required input, got None")
    if not isinstance(value, torch.Tensor):
        raise ParamInvalidError(f"{param}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def validate_shapes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int, input_layout: str,
    actual_seq_qlen, actual_seq_kvlen,
) -> FaShapes:
    """Checks of docs/semantics/layouts.md: dtypes, layout, head counts, D relations, batch and TND lengths."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        _require_tensor(t, name)
        require(t.dtype in FLOAT_DTYPES, name, "dtype float16, bfloat16 or float32", t)
    require(key.dtype == query.dtype, "key", f"the query's dtype {query.dtype}", key)
    require(value.dtype == query.dtype, "value", f"the query's dtype {query.dtype}", value)
    # Missing required attributes are null pointers (161001), like missing required tensors (docs/semantics/errors.md).
    for name, attribute in (("input_layout", input_layout), ("head_num", head_num)):
        if attribute is None:
            raise ParamNullptrError(f"{name}: a required attribute, got None")
    layouts.check_layout(input_layout, layouts.FA_LAYOUTS)
    if require_int(head_num, "head_num") <= 0:
        raise ParamInvalidError(f"head_num: expected a positive int, got {head_num!r}")
    head_num = int(head_num)
    q = layouts.read_dims(query, input_layout, head_num, "query")
    if input_layout in ("BSH", "SBH"):
        hk, hv = key.shape[-1], value.shape[-1]
        if key.dim() != 3 or hk % q.head_dim != 0 or hk == 0:
            raise ParamInvalidError(
                f"key: hidden size must be N2 * D with the query's D={q.head_dim}, got {describe(key)}"
            )
        heads_kv = hk // q.head_dim
        k = layouts.read_dims(key, input_layout, heads_kv, "key")
        v = layouts.read_dims(value, input_layout, heads_kv, "value") if value.dim() == 3 and hv % heads_kv == 0 \
            else None
        if v is None:
            raise ParamInvalidError(f"value: hidden size must be N2 * Dv with N2={heads_kv}, got {describe(value)}")
    else:
        k = layouts.read_dims(key, input_layout, None, "key")
        v = layouts.read_dims(value, input_layout, None, "value")
    layouts.require_head_count(query, input_layout, q.heads, head_num, "query", "head_num")
    require(1 <= q.heads <= MAX_HEADS, "head_num", f"a head count in 1..{MAX_HEADS}", q.heads)
    require(q.head_dim == k.head_dim, "key", f"head dim D equal to the query's {q.head_dim}", key)
    require(1 <= q.head_dim <= MAX_HEAD_DIM, "query", f"head dim D in 1..{MAX_HEAD_DIM}", query)
    require(v.heads == k.heads and v.seq == k.seq and v.batch == k.batch, "value",
            f"the key's shape except the last dim ({list(key.shape)})", value)
    require(1 <= v.head_dim <= q.head_dim, "value", f"head dim Dv in 1..Dqk={q.head_dim}", value)
    if k.heads == 0 or q.heads % k.heads != 0:
        raise ParamInvalidError(
            f"key: the query's head count N1={q.heads} must be a multiple of the key's N2={k.heads}"
        )
    if input_layout == "TND":
        require(q.seq <= MAX_TOKENS, "query", f"T in 1..{MAX_TOKENS}", query)
        require(k.seq <= MAX_TOKENS, "key", f"T in 1..{MAX_TOKENS}", key)  # value's T equals key's (checked above)
        seq_q = cumulative_lengths(actual_seq_qlen, q.seq, "actual_seq_qlen", eod_padding=True)
        seq_kv = cumulative_lengths(actual_seq_kvlen, k.seq, "actual_seq_kvlen", eod_padding=True)
        require_same_sequence_count(seq_q, seq_kv, "actual_seq_qlen", "actual_seq_kvlen")
        for b, (sq, skv) in enumerate(zip(seq_q, seq_kv, strict=True)):
            if sq > 0 and skv == 0:
                raise ParamInvalidError(
                    f"actual_seq_kvlen: sequence {b} has Sq={sq} query tokens but no key tokens (Skv=0)"
                )
        batch = len(seq_q)
        padding_q = padding_tokens(seq_q, q.seq)
    else:
        # S: 1..1M (FlashAttentionVarLenScore documentation, aclnnFlashAttentionScoreGradV2 documentation).
        require(q.seq <= MAX_TOKENS, "query", f"S in 1..{MAX_TOKENS}", query)
        require(k.seq <= MAX_TOKENS, "key", f"S in 1..{MAX_TOKENS}", key)
        require(q.batch == k.batch, "key", f"batch B={q.batch} like the query", key)
        batch = q.batch
        seq_q, seq_kv = [q.seq] * batch, [k.seq] * batch
        padding_q = 0
    max_batch = MAX_BATCH_TND if input_layout == "TND" else MAX_BATCH_DENSE
    require(batch <= max_batch, "query", f"batch B in 1..{max_batch} for layout {input_layout}", batch)
    return FaShapes(batch, q.heads, k.heads, q.head_dim, v.head_dim, seq_q, seq_kv, q.seq, padding_q)


def _mask_rows_cols(shapes: FaShapes, tnd: bool) -> tuple[int, int]:
    return (max(shapes.seq_q), max(shapes.seq_kv)) if tnd else (shapes.seq_q[0], shapes.seq_kv[0])


def build_problem(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int, input_layout: str, *,
    pse, drop_mask, atten_mask, prefix, actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx,
    scale_value: float, keep_prob: float, pre_tokens: int, next_tokens: int, inner_precise: int,
    sparse_mode: int, pse_type: int, softmax_layout: str, allowed_modes: tuple[int, ...], sink=None,
) -> tuple[AttentionProblem, FaShapes]:
    """Validate every FA-family parameter and return the canonical problem (nothing is computed)."""
    shapes = validate_shapes(query, key, value, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen)
    sink = sinks.check_sink(sink, shapes.heads_q)
    tnd = input_layout == "TND"
    sparse_mode = require_int(sparse_mode, "sparse_mode")
    pre_tokens = require_int(pre_tokens, "pre_tokens")
    next_tokens = require_int(next_tokens, "next_tokens")
    require_int(inner_precise, "inner_precise")
    require(inner_precise in (0, 1, 2, 3, 4), "inner_precise", "0..4", inner_precise)
    pse_type = require_int(pse_type, "pse_type")
    pses.check_pse_type(pse_type)
    stats.check_softmax_layout(softmax_layout)
    require(tnd or softmax_layout == "", "softmax_layout", "'' for non-TND layouts", softmax_layout)
    if sparse_mode not in allowed_modes:
        raise ParamInvalidError(f"sparse_mode: expected one of {list(allowed_modes)}, got {sparse_mode}")
    if sparse_mode in (7, 8) and not tnd:
        raise ParamInvalidError(f"sparse_mode: mode {sparse_mode} is only supported with input_layout TND")
    if sparse_mode == 5 and tnd:
        raise ParamInvalidError("sparse_mode: mode 5 (prefix, full mask) is not supported with input_layout TND")
    require_finite(scale_value, "scale_value")
    if not 0.0 < require_real(keep_prob, "keep_prob") <= 1.0:
        raise ParamInvalidError(f"keep_prob: expected a value in (0, 1], got {keep_prob!r}")

    has_mask = atten_mask is not None
    prefix_list = _validate_mask(atten_mask, sparse_mode, shapes, tnd, prefix, pre_tokens, next_tokens)
    pse_spec = _validate_pse(pse, pse_type, query, shapes, tnd, sparse_mode, next_tokens, has_mask,
                             q_start_idx, kv_start_idx)
    drop_spec = None
    if float(keep_prob) < 1.0:
        if drop_mask is None:
            raise ParamNullptrError("drop_mask: required when keep_prob < 1, got None")
        numel = shapes.heads_q * sum(a * b for a, b in zip(shapes.seq_q, shapes.seq_kv, strict=True))
        drop.validate_drop_mask(drop_mask, numel)
        drop_spec = drop_mask.reshape(-1)

    runs = _make_runs(shapes, tnd, sparse_mode, atten_mask, prefix_list, pre_tokens, next_tokens,
                      pse_spec, drop_spec, float(keep_prob), float(scale_value))
    problem = AttentionProblem(
        layout=input_layout, batch=shapes.batch, heads_q=shapes.heads_q, heads_kv=shapes.heads_kv,
        dim_qk=shapes.dim_qk, dim_v=shapes.dim_v, scale=float(scale_value), keep_prob=float(keep_prob),
        softmax_layout=softmax_layout, runs=tuple(runs), sink=sink,
    )
    return problem, shapes


# sparse_mode values that describe a mask (causal, band, prefix, ...): without atten_mask they mean nothing.
MODES_THAT_NEED_A_MASK = (2, 3, 4, 5, 6, 7, 8)


def _validate_mask(atten_mask, sparse_mode, shapes: FaShapes, tnd, prefix, pre_tokens, next_tokens):
    if atten_mask is None:
        if sparse_mode in MODES_THAT_NEED_A_MASK:
            # Documented (docs/semantics/masks.md) but easy to hit by mistake: a causal mode without its mask.
            mask = f"cann_attn.compressed_mask({sparse_mode})" if sparse_mode != 5 else \
                "the [B, 1, Sq, Skv] mask"
            warnings.warn(f"sparse_mode={sparse_mode} without atten_mask: the FlashAttentionScore family ignores the "
                          f"mode and computes full attention (pass {mask}, or sparse_mode=0)", UserWarning,
                          stacklevel=caller_stacklevel())
        return None
    if not isinstance(atten_mask, torch.Tensor):
        raise ParamInvalidError(f"atten_mask: expected a torch.Tensor, got {type(atten_mask).__name__}")
    masks.check_mask_dtype(atten_mask, (torch.bool, torch.uint8))
    if sparse_mode in masks.COMPRESSED_MODES or sparse_mode == 6:
        masks.validate_compressed_mask(atten_mask, sparse_mode)
    else:
        rows, cols = _mask_rows_cols(shapes, tnd)
        if tnd:
            if tuple(atten_mask.shape) != (rows, cols):
                raise ParamInvalidError(
                    f"atten_mask: TND expects [maxSq, maxSkv]=[{rows}, {cols}], got {describe(atten_mask)}"
                )
        else:
            masks.explicit_mask_views(atten_mask, shapes.batch, shapes.heads_q, rows, cols)
            # docs/semantics/masks.md: mode 5 takes a per-batch full mask (each batch has its own prefix), so its batch
            # dim is B; [1,1,Sq,Skv] is that shape only when B = 1.
            if sparse_mode == 5 and (atten_mask.dim() != 4 or atten_mask.shape[0] != shapes.batch):
                raise ParamInvalidError(
                    f"atten_mask: sparse_mode 5 expects [B,N,Sq,Skv] or [B,1,Sq,Skv], got {describe(atten_mask)}"
                )
    if sparse_mode in (0, 4):
        masks.check_band(pre_tokens, next_tokens)
    if sparse_mode not in (5, 6):
        return None
    prefix_list = to_int_list(prefix, "prefix")
    if prefix_list is None:
        raise ParamNullptrError(f"prefix: required for sparse_mode {sparse_mode}, got None")
    max_batch = MAX_BATCH_WITH_PREFIX_TND if tnd else MAX_BATCH_WITH_PREFIX_DENSE
    require(shapes.batch <= max_batch, "prefix", f"batch B <= {max_batch} with prefix (input_layout "
            f"{'TND' if tnd else 'BSH/SBH/BSND/BNSD'})", shapes.batch)
    if len(prefix_list) < shapes.batch:
        raise ParamInvalidError(f"prefix: expected one value per batch ({shapes.batch}), got {prefix_list}")
    for b in range(shapes.batch):
        sq, skv = shapes.seq_q[b], shapes.seq_kv[b]
        low = 0 if sq > skv else skv - sq
        if not low <= prefix_list[b] <= skv:
            raise ParamInvalidError(
                f"prefix: batch {b} (Sq={sq}, Skv={skv}) expects a value in [{low}, {skv}], got {prefix_list[b]}"
            )
    return prefix_list[: shapes.batch]


@dataclass(frozen=True)
class _PseSpec:
    pse: torch.Tensor
    pse_type: int
    form: str  # "alibi", "full", "row_broadcast", "compressed"
    q_start: int = 0
    kv_start: int = 0


def start_index(value, param: str) -> int:
    """The ALiBi start index of q_start_idx / kv_start_idx: its first value, 0 when absent or empty
    (docs/semantics/pse.md)."""
    values = to_int_list(value, param)
    return 0 if not values else values[0]


def _validate_pse(pse, pse_type, query, shapes: FaShapes, tnd, sparse_mode, next_tokens, has_mask,
                  q_start_idx, kv_start_idx) -> _PseSpec | None:
    if pse is None:
        return None
    if not isinstance(pse, torch.Tensor):
        raise ParamInvalidError(f"pse: expected a torch.Tensor, got {type(pse).__name__}")
    if tnd:  # these TND rules hold for every pse type, ALiBi slopes included
        _check_tnd_pse_allowed(shapes, sparse_mode, has_mask, pse_type)
    if pse_type in pses.ALIBI_TYPES:
        pses.validate_slopes(pse, shapes.batch, shapes.heads_q)
        return _PseSpec(pse, pse_type, "alibi", start_index(q_start_idx, "q_start_idx"),
                        start_index(kv_start_idx, "kv_start_idx"))
    require(pse.dtype == query.dtype, "pse", f"the query's dtype {query.dtype} for pse_type {pse_type}", pse)
    if tnd:
        max_q, max_kv = max(shapes.seq_q), max(shapes.seq_kv)
        ok_rows = pse.dim() == 4 and (pse.shape[2] == max_q or pse.shape[2] == pses.COMPRESSED_PSE_ROWS)
        if not (ok_rows and pse.shape[0] in (1, shapes.batch) and pse.shape[1] == shapes.heads_q
                and pse.shape[3] == max_kv):
            raise ParamInvalidError(
                f"pse: TND expects [B or 1, N1, maxSq, maxSkv] (or 1024 rows, compressed) with B={shapes.batch}, "
                f"N1={shapes.heads_q}, maxSq={max_q}, maxSkv={max_kv}, got {describe(pse)}"
            )
        rows = pse.shape[2]
        compressed_seqs = [b for b, s in enumerate(shapes.seq_q) if s > rows]
        form = "compressed" if compressed_seqs else "full"
        check = compressed_seqs
    else:
        form = pses.classify_dense_pse(pse, shapes.batch, shapes.heads_q, shapes.seq_q[0], shapes.seq_kv[0])
        check = list(range(shapes.batch)) if form == "compressed" else []
    for b in check:
        if not pses.compressed_pse_allowed(sparse_mode, next_tokens, has_mask, shapes.seq_q[b], shapes.seq_kv[b]):
            raise ParamInvalidError(
                "pse: the compressed 1024-row pse needs Sq == Skv > 1024 and lower-triangular attention "
                f"(sparse_mode 2/3, or 0 with next_tokens <= 0, with atten_mask); got sparse_mode={sparse_mode}, "
                f"Sq={shapes.seq_q[b]}, Skv={shapes.seq_kv[b]}, atten_mask given={has_mask}"
            )
    return _PseSpec(pse, pse_type, form)


def _check_tnd_pse_allowed(shapes: FaShapes, sparse_mode: int, has_mask: bool, pse_type: int) -> None:
    """TND combinations that take no pse. Modes 7/8 only count with a mask: without one the mode is ignored
    (full attention, docs/semantics/masks.md). The experimental mode-8 start-index rule of :146 is not enforced."""
    empty = [b for b, s in enumerate(shapes.seq_q) if s == 0]
    if empty:  # FlashAttentionVarLenScore documentation
        raise ParamInvalidError(
            f"pse: not supported (pse_type {pse_type}) when a TND sequence has Sq=0 (actual_seq_qlen), "
            f"got Sq=0 for sequence(s) {empty}"
        )
    if has_mask and sparse_mode == 7:  # FlashAttentionVarLenScore documentation
        raise ParamInvalidError(f"pse: not supported with sparse_mode 7, got pse_type {pse_type}")
    if has_mask and sparse_mode == 8:  # FlashAttentionVarLenScore documentation
        unequal = [b for b, (sq, skv) in enumerate(zip(shapes.seq_q, shapes.seq_kv, strict=True)) if sq != skv]
        if unequal:
            b = unequal[0]
            raise ParamInvalidError(
                f"pse: sparse_mode 8 takes a pse (pse_type {pse_type}) only when every sequence has Sq == Skv, "
                f"got Sq={shapes.seq_q[b]}, Skv={shapes.seq_kv[b]} for sequence {b}"
            )


def _make_runs(shapes: FaShapes, tnd, sparse_mode, atten_mask, prefix_list, pre_tokens, next_tokens,
               pse_spec: _PseSpec | None, drop_flat, keep_prob, scale) -> list[Run]:
    band_batch = masks.band_batch_index(sparse_mode, shapes.seq_q) if sparse_mode in (7, 8) else None
    seq_masks = []
    for b in range(shapes.batch):
        sq, skv = shapes.seq_q[b], shapes.seq_kv[b]
        if atten_mask is None:
            seq_masks.append(masks.full_attention(sq, skv))
        else:
            seq_masks.append(masks.sequence_mask(
                sparse_mode, sq, skv, pre_tokens=pre_tokens, next_tokens=next_tokens, explicit=None,
                prefix=None if prefix_list is None else prefix_list[b], is_band_batch=(b == band_batch),
            ))
    uses_explicit = atten_mask is not None and sparse_mode in (0, 1, 5)
    q_starts = starts_of(shapes.seq_q) if tnd else [0] * shapes.batch
    kv_starts = starts_of(shapes.seq_kv) if tnd else [0] * shapes.batch
    element_base = starts_of([shapes.heads_q * a * c for a, c in zip(shapes.seq_q, shapes.seq_kv, strict=True)])
    # Long sequences with generated ALiBi run one at a time: the reference kernels skip a head's tiles whose
    # terms all underflow, which they decide per sequence (a batched tile spans every sequence's heads).
    alibi_per_sequence = (pse_spec is not None and pse_spec.form == "alibi"
                          and max(shapes.seq_kv, default=0) >= ALIBI_PER_SEQUENCE_MIN_KV)
    runs = []
    for b0, count in mask_runs(seq_masks, one_per_sequence=(uses_explicit and tnd) or alibi_per_sequence):
        base = seq_masks[b0]
        sq, skv = base.seq_q, base.seq_kv
        explicit = None
        if uses_explicit:
            explicit = _explicit_run_view(atten_mask, tnd, b0, count, sq, skv)
        mask = masks.SequenceMask(sq, skv, base.lower, base.upper, base.prefix, explicit)
        dropout = None
        if drop_flat is not None:
            dropout = drop.SequenceDropout(drop_flat, keep_prob, element_base[b0], count, shapes.heads_q, sq, skv)
        pse = _pse_run(pse_spec, tnd, b0, count, sq, skv, scale) if pse_spec is not None and sq > 0 else None
        runs.append(Run(b0, count, sq, skv, q_starts[b0], kv_starts[b0], mask, pse, dropout))
    return runs


def _explicit_run_view(atten_mask: torch.Tensor, tnd: bool, b0: int, count: int, sq: int, skv: int):
    if tnd:
        return atten_mask[:sq, :skv].view(1, 1, sq, skv) if sq and skv else atten_mask[:sq, :skv][None, None]
    if atten_mask.dim() == 2:
        return atten_mask[None, None]
    if atten_mask.dim() == 3:
        return atten_mask[None]
    return atten_mask if atten_mask.shape[0] == 1 else atten_mask[b0 : b0 + count]


def _pse_run(spec: _PseSpec, tnd: bool, b0: int, count: int, sq: int, skv: int, scale: float):
    pse = spec.pse
    if spec.form == "alibi":
        return pses.SequencePse(spec.pse_type, scale, sq, skv, slopes=pses.slopes_for(pse, b0, count),
                                q_start=spec.q_start, kv_start=spec.kv_start)
    source = pses.batch_rows(pse, b0, count)
    rows = source.shape[2]
    if tnd:
        used_rows = min(rows, sq)
        return pses.SequencePse(spec.pse_type, scale, sq, skv, source=source, row0=rows - used_rows,
                                col0=source.shape[3] - skv, compressed=sq > rows)
    return pses.SequencePse(spec.pse_type, scale, sq, skv, source=source, compressed=spec.form == "compressed")
