"""PromptFlashAttentionV2 (prefill inference with GQA, actual lengths and int8; PromptFlashAttentionV2
documentation)."""

from __future__ import annotations

import torch

from ..errors import ParamInvalidError, ParamNullptrError, require, require_finite, require_int
from ..problem import layout as layouts
from ..problem.lengths import per_batch_lengths
from ..traceable import traced_as_custom_op
from .flash_attention_score import INT_MAX
from .infer_attention import (
    MAX_BATCH,
    MAX_BATCH_UNALIGNED,
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    attend,
    quant_plan,
    reject_offset_with_invalid_rows,
    validate_mask,
    validate_pse_shift,
)

PFA_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND")
PFA_MODES = (0, 1, 2, 3, 4)


@traced_as_custom_op
def prompt_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    deq_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    deq_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    num_heads: int = 1,
    scale_value: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = 0,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """Prefill attention softmax(scale * Q K^T + pse_shift, masked) V, per batch over its actual lengths.

    Layouts BSH, BSND, BNSD, BNSD_BSND (input BNSD, output BSND); GQA via `num_key_value_heads` (0 = num_heads;
    ratio <= 64). `actual_seq_lengths(_kv)`: None (full S), one value for every batch, or >= B values (the first
    B). sparse_mode 0..4 with each batch's actual lengths; next_tokens defaults to 0; modes 1..4 need the mask
    (docs/semantics/masks.md). Rows beyond the actual query length and rows with no visible key are 0
    (docs/semantics/invalid-rows.md). pse_shift: S = scale * x + pse_shift, its top-left block used
    (docs/semantics/pse.md). int8 (docs/operators/prompt_flash_attention.md): int8 inputs need deq_scale1, quant_scale1,
    deq_scale2 (float32 or trans_quant_param words); quant_scale2 (+ quant_offset2) quantize the output to int8.
    Output dtype: int8 with quant_scale2, else float16 for int8 inputs, else the query's dtype.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t is None:
            raise ParamNullptrError(f"{name}: a required input, got None")
        require(isinstance(t, torch.Tensor), name, "a torch.Tensor", t)
        require(t.dtype in (torch.float16, torch.bfloat16, torch.int8, torch.float32, torch.float64), name,
                "dtype float16, bfloat16 or int8", t)
    require(key.dtype == query.dtype, "key", f"the query's dtype {query.dtype}", key)
    require(value.dtype == query.dtype, "value", f"the query's dtype {query.dtype}", value)
    layouts.check_layout(input_layout, PFA_LAYOUTS)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ParamInvalidError(f"num_heads: expected a positive int, got {num_heads!r}")
    if isinstance(num_key_value_heads, bool) or not isinstance(num_key_value_heads, int) or num_key_value_heads < 0:
        raise ParamInvalidError(f"num_key_value_heads: expected an int >= 0, got {num_key_value_heads!r}")
    heads_kv = num_key_value_heads or num_heads
    q = layouts.read_dims(query, input_layout, num_heads, "query", "num_heads")
    kv_layout = "BNSD" if input_layout == "BNSD_BSND" else input_layout
    k = layouts.read_dims(key, kv_layout, heads_kv, "key", "num_key_value_heads")
    v = layouts.read_dims(value, kv_layout, heads_kv, "value", "num_key_value_heads")
    layouts.require_head_count(query, input_layout, q.heads, num_heads, "query", "num_heads")
    if input_layout != "BSH" and k.heads != heads_kv:
        raise ParamInvalidError(
            f"num_key_value_heads: expected the key's head count N={k.heads} (0 means num_heads), "
            f"got {num_key_value_heads}"
        )
    if num_heads % heads_kv != 0 or num_heads // heads_kv > MAX_GROUP:
        raise ParamInvalidError(
            f"num_key_value_heads: num_heads={num_heads} must be a multiple of it with a ratio <= {MAX_GROUP}, "
            f"got {heads_kv}"
        )
    require(k.head_dim == q.head_dim, "key", f"head dim D={q.head_dim} like the query", key)
    require(v.head_dim == q.head_dim and v.seq == k.seq and v.batch == k.batch and v.heads == k.heads, "value",
            f"the key's shape {list(key.shape)}", value)
    require(k.batch == q.batch, "key", f"batch B={q.batch} like the query", key)
    # D = 0 makes an empty query, which returns an empty output (docs/semantics/errors.md; seed: "如果是空则直接返回").
    require(q.head_dim <= MAX_HEAD_DIM and (q.head_dim >= 1 or query.numel() == 0), "query",
            f"head dim D in 1..{MAX_HEAD_DIM}", query)
    require(num_heads <= MAX_HEADS, "num_heads", f"at most {MAX_HEADS}", num_heads)
    alignment = 32 if query.dtype == torch.int8 else 16
    if q.head_dim % alignment != 0:
        require(q.batch <= MAX_BATCH_UNALIGNED, "query",
                f"batch B <= {MAX_BATCH_UNALIGNED} when D={q.head_dim} is not a multiple of {alignment}", query)
    if input_layout in ("BSH", "BSND"):
        require(num_heads * q.head_dim < MAX_HIDDEN, "query", f"N * D < {MAX_HIDDEN} for layout {input_layout}",
                query)
    require(q.batch <= MAX_BATCH, "query", f"batch B <= {MAX_BATCH}", query)
    for name, value_ in (("sparse_mode", sparse_mode), ("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        require_int(value_, name)
    if sparse_mode not in PFA_MODES:
        raise ParamInvalidError(f"sparse_mode: PromptFlashAttentionV2 supports 0..4, got {sparse_mode}")

    batch, seq_q, seq_kv = q.batch, q.seq, k.seq
    act_q = per_batch_lengths(actual_seq_lengths, "actual_seq_lengths", batch, seq_q)
    act_kv = per_batch_lengths(actual_seq_lengths_kv, "actual_seq_lengths_kv", batch, seq_kv)
    mask_views = validate_mask(atten_mask, sparse_mode, batch, num_heads, seq_q, seq_kv, pre_tokens, next_tokens)
    validate_pse_shift(pse_shift, query, batch, num_heads, seq_q, seq_kv)
    plan = quant_plan(query, deq_scale1, quant_scale1, deq_scale2, quant_scale2, quant_offset2,
                      "BSND" if input_layout == "BNSD_BSND" else input_layout, num_heads, q.head_dim)
    if plan.offset_nonzero:
        reject_offset_with_invalid_rows(atten_mask is not None, sparse_mode, act_q, act_kv, pre_tokens, next_tokens)
    scale = require_finite(scale_value, "scale_value")
    out_layout = "BSND" if input_layout == "BNSD_BSND" else input_layout
    out = torch.zeros(layouts.output_shape(out_layout, batch, seq_q, num_heads, q.head_dim),
                      dtype=plan.output_dtype, device=query.device)
    # Every tensor goes to the computation as a [B, N, S, D] view, so input and output layouts may differ.
    attend(
        layouts.as_bnsd(query, input_layout, num_heads), layouts.as_bnsd(key, kv_layout, heads_kv),
        layouts.as_bnsd(value, kv_layout, heads_kv), layouts.as_bnsd(out, out_layout, num_heads),
        heads_kv=heads_kv, scale=scale, atten_mask=atten_mask, mask_views=mask_views,
        sparse_mode=sparse_mode, act_q=act_q, act_kv=act_kv, pre_tokens=pre_tokens, next_tokens=next_tokens,
        pse_shift=pse_shift, plan=plan, backend=backend, op="prompt_flash_attention",
    )
    return out
