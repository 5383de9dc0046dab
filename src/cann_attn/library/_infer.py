"""Custom ops of FusedInferAttentionScore (v1, v2) and IncreFlashAttention
(docs/operators/fused_infer_attention_score.md, docs/operators/incre_flash_attention.md)."""

import torch
from torch import Tensor

from ..errors import require_bool, require_real
from ..ops.fia_problem import scalar_type_number
from ..ops.flash_attention_score import (
    INT_MAX,
)
from ..ops.fused_infer_attention_score import FIA_LAYOUTS
from ..ops.fused_infer_attention_score import PACKED as FIA_PACKED
from ..ops.fused_infer_attention_score import _output_shape as _fia_output_shape
from ..ops.fused_infer_attention_score import (
    fused_infer_attention_score as _eager_fused_infer_attention_score,
)
from ..ops.fused_infer_attention_score import (
    fused_infer_attention_score_v2 as _eager_fused_infer_attention_score_v2,
)
from ..ops.incre_flash_attention import incre_flash_attention as _eager_incre_flash_attention
from ..problem.layout import BATCH_SEQ_DIMS
from ..problem.lengths import to_int_list
from ..problem.nz import NZ_DIMS, nz_width
from ._prompt import _pfa_output_dtype


# ============================================================ FusedInferAttentionScore (v1, v2), IncreFlashAttention
def _dtype_code(code, name: str):
    """A v2 `*_dtype` given as a torch.dtype as its c10::ScalarType number (op-plugin's binding does so for
    `int?`), so the custom op's schema takes it; the operator decides what the number may be."""
    return scalar_type_number(code, name) if isinstance(code, torch.dtype) else code


def _fia_fake_outputs(query, value, num_heads, num_key_value_heads, input_layout, quant_scale2, softmax_lse_flag,
                      paged: bool = False, query_rope=None):
    """(attention_out, softmax_lse) shapes and dtypes of FusedInferAttentionScore
    (docs/operators/fused_infer_attention_score.md); `paged`: value is a block cache (docs/semantics/paged-kv.md),
    whose 3-D form [block_num, block_size, H] packs the heads like BSH."""
    q_layout, out_layout = FIA_LAYOUTS.get(input_layout, ("BSH", "BSH"))
    heads_kv = num_key_value_heads or num_heads
    packs_heads = q_layout == "BSH" or (paged and value.dim() == 3)
    if paged and value.dim() == NZ_DIMS:
        dim_v = nz_width(value)
    else:
        dim_v = value.shape[-1] // heads_kv if packs_heads else value.shape[-1]
    if q_layout in FIA_PACKED:
        batch, seq = None, query.shape[0 if q_layout == "TND" else 1]  # seq: the token count T
    else:
        batch_dim, seq_dim = BATCH_SEQ_DIMS[q_layout]
        batch, seq = query.shape[batch_dim], query.shape[seq_dim]
    # An int8 MLA query (v2's full quantisation) outputs the rope dtype.
    dtype = query_rope.dtype if query.dtype == torch.int8 and query_rope is not None else _pfa_output_dtype(
        query.dtype, quant_scale2)
    out = query.new_empty(_fia_output_shape(out_layout, batch, seq, num_heads, dim_v), dtype=dtype)
    if not softmax_lse_flag:
        return out, query.new_empty((1,), dtype=torch.float32)
    lse_shape = (seq, num_heads, 1) if batch is None else (batch, num_heads, seq, 1)
    return out, query.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("cann_attn::fused_infer_attention_score", mutates_args=())
def _fia_op(
    query: Tensor, key: Tensor, value: Tensor, pse_shift: Tensor | None = None, atten_mask: Tensor | None = None,
    actual_seq_lengths: list[int] | None = None, actual_seq_lengths_kv: list[int] | None = None,
    dequant_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, antiquant_scale: Tensor | None = None,
    antiquant_offset: Tensor | None = None, key_antiquant_scale: Tensor | None = None,
    key_antiquant_offset: Tensor | None = None, value_antiquant_scale: Tensor | None = None,
    value_antiquant_offset: Tensor | None = None, block_table: Tensor | None = None,
    query_padding_size: Tensor | None = None, kv_padding_size: Tensor | None = None,
    key_shared_prefix: Tensor | None = None, value_shared_prefix: Tensor | None = None,
    actual_shared_prefix_len: list[int] | None = None, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, key_rope_antiquant_scale: Tensor | None = None, num_heads: int = 1,
    scale: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, input_layout: str = "BSH",
    num_key_value_heads: int = 0, sparse_mode: int = 0, inner_precise: int = 0, block_size: int = 0,
    antiquant_mode: int = 0, key_antiquant_mode: int = 0, value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False, backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """FusedInferAttentionScore -> (attention_out, softmax_lse)."""
    return _eager_fused_infer_attention_score(
        query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=actual_seq_lengths_kv, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
        antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset, key_antiquant_scale=key_antiquant_scale,
        key_antiquant_offset=key_antiquant_offset, value_antiquant_scale=value_antiquant_scale,
        value_antiquant_offset=value_antiquant_offset, block_table=block_table,
        query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
        key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
        actual_shared_prefix_len=actual_shared_prefix_len, query_rope=query_rope, key_rope=key_rope,
        key_rope_antiquant_scale=key_rope_antiquant_scale, num_heads=num_heads, scale=scale, pre_tokens=pre_tokens,
        next_tokens=next_tokens, input_layout=input_layout, num_key_value_heads=num_key_value_heads,
        sparse_mode=sparse_mode, inner_precise=inner_precise, block_size=block_size, antiquant_mode=antiquant_mode,
        key_antiquant_mode=key_antiquant_mode, value_antiquant_mode=value_antiquant_mode,
        softmax_lse_flag=softmax_lse_flag, backend=backend,
    )


@_fia_op.register_fake
def _(query, key, value, pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
      dequant_scale1=None, quant_scale1=None, dequant_scale2=None, quant_scale2=None, quant_offset2=None,
      antiquant_scale=None, antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
      value_antiquant_scale=None, value_antiquant_offset=None, block_table=None, query_padding_size=None,
      kv_padding_size=None, key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None,
      query_rope=None, key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=INT_MAX,
      next_tokens=INT_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
      antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0, softmax_lse_flag=False, backend="auto"):
    return _fia_fake_outputs(query, value, num_heads, num_key_value_heads, input_layout, quant_scale2,
                             softmax_lse_flag, block_table is not None)


def fused_infer_attention_score(
    query: Tensor, key: Tensor, value: Tensor, *, pse_shift: Tensor | None = None,
    atten_mask: Tensor | None = None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
    dequant_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, antiquant_scale: Tensor | None = None,
    antiquant_offset: Tensor | None = None, key_antiquant_scale: Tensor | None = None,
    key_antiquant_offset: Tensor | None = None, value_antiquant_scale: Tensor | None = None,
    value_antiquant_offset: Tensor | None = None, block_table: Tensor | None = None,
    query_padding_size: Tensor | None = None, kv_padding_size: Tensor | None = None,
    key_shared_prefix: Tensor | None = None, value_shared_prefix: Tensor | None = None,
    actual_shared_prefix_len=None, query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    key_rope_antiquant_scale: Tensor | None = None, num_heads: int = 1, scale: float = 1.0,
    pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, input_layout: str = "BSH", num_key_value_heads: int = 0,
    sparse_mode: int = 0, inner_precise: int = 0, block_size: int = 0, antiquant_mode: int = 0,
    key_antiquant_mode: int = 0, value_antiquant_mode: int = 0, softmax_lse_flag: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``cann_attn.fused_infer_attention_score`` through the ``cann_attn::fused_infer_attention_score`` custom op."""
    return torch.ops.cann_attn.fused_infer_attention_score(
        query, key, value, pse_shift, atten_mask, to_int_list(actual_seq_lengths, "actual_seq_lengths"),
        to_int_list(actual_seq_lengths_kv, "actual_seq_lengths_kv"), dequant_scale1, quant_scale1, dequant_scale2,
        quant_scale2, quant_offset2, antiquant_scale, antiquant_offset, key_antiquant_scale, key_antiquant_offset,
        value_antiquant_scale, value_antiquant_offset, block_table, query_padding_size, kv_padding_size,
        key_shared_prefix, value_shared_prefix, to_int_list(actual_shared_prefix_len, "actual_shared_prefix_len"),
        query_rope, key_rope, key_rope_antiquant_scale, num_heads, require_real(scale, "scale"), pre_tokens,
        next_tokens,
        input_layout, num_key_value_heads, sparse_mode, inner_precise, block_size, antiquant_mode,
        key_antiquant_mode, value_antiquant_mode, require_bool(softmax_lse_flag, "softmax_lse_flag"), backend,
    )


@torch.library.custom_op("cann_attn::fused_infer_attention_score_v2", mutates_args=())
def _fia_v2_op(
    query: Tensor, key: Tensor, value: Tensor, query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    pse_shift: Tensor | None = None, atten_mask: Tensor | None = None, actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None, block_table: Tensor | None = None,
    dequant_scale_query: Tensor | None = None, dequant_scale_key: Tensor | None = None,
    dequant_offset_key: Tensor | None = None, dequant_scale_value: Tensor | None = None,
    dequant_offset_value: Tensor | None = None, dequant_scale_key_rope: Tensor | None = None,
    quant_scale_out: Tensor | None = None, quant_offset_out: Tensor | None = None,
    quant_scale_p: Tensor | None = None, learnable_sink: Tensor | None = None, num_query_heads: int = 1,
    num_key_value_heads: int = 0, softmax_scale: float = 1.0, pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX, input_layout: str = "BSH", sparse_mode: int = 0, block_size: int = 0,
    query_quant_mode: int = 0, key_quant_mode: int = 0, value_quant_mode: int = 0, inner_precise: int = 0,
    return_softmax_lse: bool = False, query_dtype: int | None = None, key_dtype: int | None = None,
    value_dtype: int | None = None, query_rope_dtype: int | None = None, key_rope_dtype: int | None = None,
    key_shared_prefix_dtype: int | None = None, value_shared_prefix_dtype: int | None = None,
    dequant_scale_query_dtype: int | None = None, dequant_scale_key_dtype: int | None = None,
    dequant_scale_value_dtype: int | None = None, dequant_scale_key_rope_dtype: int | None = None,
    out_dtype: int | None = None, backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """FusedInferAttentionScore with v2's argument set -> (attention_out, softmax_lse)."""
    return _eager_fused_infer_attention_score_v2(
        query, key, value, query_rope=query_rope, key_rope=key_rope, pse_shift=pse_shift, atten_mask=atten_mask,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, block_table=block_table,
        dequant_scale_query=dequant_scale_query, dequant_scale_key=dequant_scale_key,
        dequant_offset_key=dequant_offset_key, dequant_scale_value=dequant_scale_value,
        dequant_offset_value=dequant_offset_value, dequant_scale_key_rope=dequant_scale_key_rope,
        quant_scale_out=quant_scale_out, quant_offset_out=quant_offset_out, quant_scale_p=quant_scale_p,
        learnable_sink=learnable_sink, num_query_heads=num_query_heads, num_key_value_heads=num_key_value_heads,
        softmax_scale=softmax_scale, pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
        sparse_mode=sparse_mode, block_size=block_size, query_quant_mode=query_quant_mode,
        key_quant_mode=key_quant_mode, value_quant_mode=value_quant_mode, inner_precise=inner_precise,
        return_softmax_lse=return_softmax_lse, query_dtype=query_dtype, key_dtype=key_dtype, value_dtype=value_dtype,
        query_rope_dtype=query_rope_dtype, key_rope_dtype=key_rope_dtype,
        key_shared_prefix_dtype=key_shared_prefix_dtype, value_shared_prefix_dtype=value_shared_prefix_dtype,
        dequant_scale_query_dtype=dequant_scale_query_dtype, dequant_scale_key_dtype=dequant_scale_key_dtype,
        dequant_scale_value_dtype=dequant_scale_value_dtype,
        dequant_scale_key_rope_dtype=dequant_scale_key_rope_dtype, out_dtype=out_dtype, backend=backend,
    )


@_fia_v2_op.register_fake
def _(query, key, value, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None, actual_seq_qlen=None,
      actual_seq_kvlen=None, block_table=None, dequant_scale_query=None, dequant_scale_key=None,
      dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None, dequant_scale_key_rope=None,
      quant_scale_out=None, quant_offset_out=None, quant_scale_p=None, learnable_sink=None, num_query_heads=1,
      num_key_value_heads=0, softmax_scale=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
      sparse_mode=0, block_size=0, query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0,
      return_softmax_lse=False, query_dtype=None, key_dtype=None, value_dtype=None, query_rope_dtype=None,
      key_rope_dtype=None, key_shared_prefix_dtype=None, value_shared_prefix_dtype=None,
      dequant_scale_query_dtype=None, dequant_scale_key_dtype=None, dequant_scale_value_dtype=None,
      dequant_scale_key_rope_dtype=None, out_dtype=None, backend="auto"):
    return _fia_fake_outputs(query, value, num_query_heads, num_key_value_heads, input_layout, quant_scale_out,
                             return_softmax_lse, block_table is not None, query_rope)


def fused_infer_attention_score_v2(
    query: Tensor, key: Tensor, value: Tensor, *, query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    pse_shift: Tensor | None = None, atten_mask: Tensor | None = None, actual_seq_qlen=None, actual_seq_kvlen=None,
    block_table: Tensor | None = None, dequant_scale_query: Tensor | None = None,
    dequant_scale_key: Tensor | None = None, dequant_offset_key: Tensor | None = None,
    dequant_scale_value: Tensor | None = None, dequant_offset_value: Tensor | None = None,
    dequant_scale_key_rope: Tensor | None = None, quant_scale_out: Tensor | None = None,
    quant_offset_out: Tensor | None = None, quant_scale_p: Tensor | None = None,
    learnable_sink: Tensor | None = None, num_query_heads: int = 1, num_key_value_heads: int = 0,
    softmax_scale: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, input_layout: str = "BSH",
    sparse_mode: int = 0, block_size: int = 0, query_quant_mode: int = 0, key_quant_mode: int = 0,
    value_quant_mode: int = 0, inner_precise: int = 0, return_softmax_lse: bool = False,
    query_dtype: int | None = None, key_dtype: int | None = None, value_dtype: int | None = None,
    query_rope_dtype: int | None = None, key_rope_dtype: int | None = None,
    key_shared_prefix_dtype: int | None = None, value_shared_prefix_dtype: int | None = None,
    dequant_scale_query_dtype: int | None = None, dequant_scale_key_dtype: int | None = None,
    dequant_scale_value_dtype: int | None = None, dequant_scale_key_rope_dtype: int | None = None,
    out_dtype: int | torch.dtype | None = None, backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``cann_attn.fused_infer_attention_score_v2`` through its custom op; `out_dtype` may be a torch.dtype, passed
    on as its ScalarType number as op-plugin's binding does."""
    return torch.ops.cann_attn.fused_infer_attention_score_v2(
        query, key, value, query_rope, key_rope, pse_shift, atten_mask, to_int_list(actual_seq_qlen, "actual_seq_qlen"),
        to_int_list(actual_seq_kvlen, "actual_seq_kvlen"), block_table, dequant_scale_query, dequant_scale_key,
        dequant_offset_key, dequant_scale_value, dequant_offset_value, dequant_scale_key_rope, quant_scale_out,
        quant_offset_out, quant_scale_p, learnable_sink, num_query_heads, num_key_value_heads,
        require_real(softmax_scale, "softmax_scale"),
        pre_tokens, next_tokens, input_layout, sparse_mode, block_size, query_quant_mode, key_quant_mode,
        value_quant_mode, inner_precise, require_bool(return_softmax_lse, "return_softmax_lse"),
        *(_dtype_code(code, name) for name, code in (
            ("query_dtype", query_dtype), ("key_dtype", key_dtype), ("value_dtype", value_dtype),
            ("query_rope_dtype", query_rope_dtype), ("key_rope_dtype", key_rope_dtype),
            ("key_shared_prefix_dtype", key_shared_prefix_dtype),
            ("value_shared_prefix_dtype", value_shared_prefix_dtype),
            ("dequant_scale_query_dtype", dequant_scale_query_dtype),
            ("dequant_scale_key_dtype", dequant_scale_key_dtype),
            ("dequant_scale_value_dtype", dequant_scale_value_dtype),
            ("dequant_scale_key_rope_dtype", dequant_scale_key_rope_dtype))),
        scalar_type_number(out_dtype), backend,
    )


@torch.library.custom_op("cann_attn::incre_flash_attention", mutates_args=())
def _ifa_op(
    query: Tensor, key: Tensor, value: Tensor, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    pse_shift: Tensor | None = None, actual_seq_lengths: list[int] | None = None,
    antiquant_scale: Tensor | None = None, antiquant_offset: Tensor | None = None, block_table: Tensor | None = None,
    dequant_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, kv_padding_size: Tensor | None = None,
    num_heads: int = 1, scale_value: float = 1.0, input_layout: str = "BSH", num_key_value_heads: int = 0,
    block_size: int = 0, inner_precise: int = 1, backend: str = "auto",
) -> Tensor:
    """IncreFlashAttention -> attention_out."""
    return _eager_incre_flash_attention(
        query, key, value, padding_mask=padding_mask, atten_mask=atten_mask, pse_shift=pse_shift,
        actual_seq_lengths=actual_seq_lengths, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        block_table=block_table, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
        kv_padding_size=kv_padding_size, num_heads=num_heads, scale_value=scale_value, input_layout=input_layout,
        num_key_value_heads=num_key_value_heads, block_size=block_size, inner_precise=inner_precise,
        backend=backend,
    )


@_ifa_op.register_fake
def _(query, key, value, padding_mask=None, atten_mask=None, pse_shift=None, actual_seq_lengths=None,
      antiquant_scale=None, antiquant_offset=None, block_table=None, dequant_scale1=None, quant_scale1=None,
      dequant_scale2=None, quant_scale2=None, quant_offset2=None, kv_padding_size=None, num_heads=1,
      scale_value=1.0, input_layout="BSH", num_key_value_heads=0, block_size=0, inner_precise=1, backend="auto"):
    return _fia_fake_outputs(query, value, num_heads, num_key_value_heads, input_layout, quant_scale2, False,
                             block_table is not None)[0]


def incre_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, *, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, pse_shift: Tensor | None = None, actual_seq_lengths=None,
    antiquant_scale: Tensor | None = None, antiquant_offset: Tensor | None = None, block_table: Tensor | None = None,
    dequant_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, kv_padding_size: Tensor | None = None,
    num_heads: int = 1, scale_value: float = 1.0, input_layout: str = "BSH", num_key_value_heads: int = 0,
    block_size: int = 0, inner_precise: int = 1, backend: str = "auto",
) -> Tensor:
    """``cann_attn.incre_flash_attention`` through the ``cann_attn::incre_flash_attention`` custom op."""
    return torch.ops.cann_attn.incre_flash_attention(
        query, key, value, padding_mask, atten_mask, pse_shift, to_int_list(actual_seq_lengths, "actual_seq_lengths"),
        antiquant_scale, antiquant_offset, block_table, dequant_scale1, quant_scale1, dequant_scale2, quant_scale2,
        quant_offset2, kv_padding_size, num_heads, require_real(scale_value, "scale_value"), input_layout,
        num_key_value_heads,
        block_size, inner_precise, backend,
    )
