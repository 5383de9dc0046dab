"""torch_npu's inference attention spellings: npu_fused_infer_attention_score (+ _v2) and npu_incre_flash_attention.

Argument names, order and defaults follow op-plugin's ``op_plugin_functions.yaml`` (current releases spell FIA's
scale ``scale``; older torch_npu documentation showed ``scale_value``). The functions run the ``cann_attn::*`` custom
ops, so they are traceable by ``torch.compile(fullgraph=True)``; they are inference operators (not differentiable).
Semantics: docs/operators/fused_infer_attention_score.md and docs/operators/incre_flash_attention.md.
"""

import torch
from torch import Tensor

from .. import library
from ..ops.flash_attention_score import INT_MAX
from ._registry import npu_op

# Registered for the release switch and install() (torch.ops.npu.*); the current schema only.
NPU_FUSED_INFER_ATTENTION_SCORE_SCHEMAS = {
    ("current",): (
        "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
        "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
        "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, "
        "Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, "
        "Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, "
        "Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, "
        "Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, "
        "Tensor? value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, "
        "Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, "
        'int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", '
        "int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, "
        "int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, "
        "bool softmax_lse_flag=False) -> (Tensor, Tensor)"
    ),
}

NPU_FUSED_INFER_ATTENTION_SCORE_V2_SCHEMAS = {
    ("current",): (
        "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, "
        "Tensor? query_rope=None, Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, "
        "SymInt[]? actual_seq_qlen=None, SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, "
        "Tensor? dequant_scale_query=None, Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, "
        "Tensor? dequant_scale_value=None, Tensor? dequant_offset_value=None, "
        "Tensor? dequant_scale_key_rope=None, Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, "
        "Tensor? quant_scale_p=None, Tensor? learnable_sink=None, int num_query_heads=1, "
        "int num_key_value_heads=0, float softmax_scale=1.0, int pre_tokens=2147483647, "
        'int next_tokens=2147483647, str input_layout="BSH", int sparse_mode=0, int block_size=0, '
        "int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, int inner_precise=0, "
        "bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, int? value_dtype=None, "
        "int? query_rope_dtype=None, int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, "
        "int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, "
        "int? dequant_scale_key_dtype=None, int? dequant_scale_value_dtype=None, "
        "int? dequant_scale_key_rope_dtype=None, int? out_dtype=None) -> (Tensor, Tensor)"
    ),
}

NPU_INCRE_FLASH_ATTENTION_SCHEMAS = {
    ("current",): (
        "npu_incre_flash_attention(Tensor query, Tensor key, Tensor value, *, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, Tensor? pse_shift=None, SymInt[]? actual_seq_lengths=None, "
        "Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? block_table=None, "
        "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, "
        "Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? kv_padding_size=None, "
        'int num_heads=1, float scale_value=1.0, str input_layout="BSH", int num_key_value_heads=0, '
        "int block_size=0, int inner_precise=1) -> Tensor"
    ),
}



@npu_op(NPU_FUSED_INFER_ATTENTION_SCORE_SCHEMAS)
def npu_fused_infer_attention_score(
    query: Tensor, key: Tensor, value: Tensor, *, pse_shift: Tensor | None = None, atten_mask: Tensor | None = None,
    actual_seq_lengths=None, actual_seq_lengths_kv=None, dequant_scale1: Tensor | None = None,
    quant_scale1: Tensor | None = None, dequant_scale2: Tensor | None = None, quant_scale2: Tensor | None = None,
    quant_offset2: Tensor | None = None, antiquant_scale: Tensor | None = None,
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
) -> tuple[Tensor, Tensor]:
    """torch_npu.npu_fused_infer_attention_score -> (attention_out, softmax_lse); softmax_lse is a [1] zero tensor
    without ``softmax_lse_flag``."""
    return library.fused_infer_attention_score(
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
        softmax_lse_flag=softmax_lse_flag,
    )


@npu_op(NPU_FUSED_INFER_ATTENTION_SCORE_V2_SCHEMAS)
def npu_fused_infer_attention_score_v2(
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
    out_dtype: int | torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """torch_npu.npu_fused_infer_attention_score_v2 -> (attention_out, softmax_lse); ``out_dtype`` a torch.dtype
    or its ScalarType number, as op-plugin's C++ binding takes it."""
    return library.fused_infer_attention_score_v2(
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
        dequant_scale_key_rope_dtype=dequant_scale_key_rope_dtype, out_dtype=out_dtype,
    )


@npu_op(NPU_INCRE_FLASH_ATTENTION_SCHEMAS)
def npu_incre_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, *, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, pse_shift: Tensor | None = None, actual_seq_lengths=None,
    antiquant_scale: Tensor | None = None, antiquant_offset: Tensor | None = None, block_table: Tensor | None = None,
    dequant_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, kv_padding_size: Tensor | None = None,
    num_heads: int = 1, scale_value: float = 1.0, input_layout: str = "BSH", num_key_value_heads: int = 0,
    block_size: int = 0, inner_precise: int = 1,
) -> Tensor:
    """torch_npu.npu_incre_flash_attention -> attention_out (decode, Q_S = 1; ``actual_seq_lengths`` are the
    key/value lengths)."""
    return library.incre_flash_attention(
        query, key, value, padding_mask=padding_mask, atten_mask=atten_mask, pse_shift=pse_shift,
        actual_seq_lengths=actual_seq_lengths, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        block_table=block_table, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
        kv_padding_size=kv_padding_size, num_heads=num_heads, scale_value=scale_value, input_layout=input_layout,
        num_key_value_heads=num_key_value_heads, block_size=block_size, inner_precise=inner_precise,
    )
