"""Custom ops of PromptFlashAttentionV2 and TransQuantParam (docs/operators/prompt_flash_attention.md)."""

import torch
from torch import Tensor

from ..errors import require_real
from ..ops.flash_attention_score import (
    INT_MAX,
)
from ..ops.prompt_flash_attention import prompt_flash_attention as _eager_prompt_flash_attention
from ..problem.lengths import to_int_list
from ..problem.quant import trans_quant_param as _eager_trans_quant_param


# ================================================================================ PromptFlashAttentionV2 + quant
@torch.library.custom_op("cann_attn::prompt_flash_attention", mutates_args=())
def _pfa_op(
    query: Tensor, key: Tensor, value: Tensor, pse_shift: Tensor | None = None, atten_mask: Tensor | None = None,
    actual_seq_lengths: list[int] | None = None, actual_seq_lengths_kv: list[int] | None = None,
    deq_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, deq_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, num_heads: int = 1,
    scale_value: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = 0, input_layout: str = "BSH",
    num_key_value_heads: int = 0, sparse_mode: int = 0, backend: str = "auto",
) -> Tensor:
    """PromptFlashAttentionV2 -> attention_out."""
    return _eager_prompt_flash_attention(
        query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=actual_seq_lengths_kv, deq_scale1=deq_scale1, quant_scale1=quant_scale1,
        deq_scale2=deq_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2, num_heads=num_heads,
        scale_value=scale_value, pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
        num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode, backend=backend,
    )


def _pfa_output_dtype(query_dtype: torch.dtype, quant_scale2) -> torch.dtype:
    """int8 with quant_scale2, else float16 for int8 inputs, else the query dtype
    (docs/operators/prompt_flash_attention.md)."""
    if quant_scale2 is not None:
        return torch.int8
    return torch.float16 if query_dtype == torch.int8 else query_dtype


@_pfa_op.register_fake
def _(query, key, value, pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
      deq_scale1=None, quant_scale1=None, deq_scale2=None, quant_scale2=None, quant_offset2=None, num_heads=1,
      scale_value=1.0, pre_tokens=INT_MAX, next_tokens=0, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
      backend="auto"):
    shape = tuple(query.shape)
    if input_layout == "BNSD_BSND":  # input BNSD, output BSND
        shape = (query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    return query.new_empty(shape, dtype=_pfa_output_dtype(query.dtype, quant_scale2))


def prompt_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, *, pse_shift: Tensor | None = None, atten_mask: Tensor | None = None,
    actual_seq_lengths=None, actual_seq_lengths_kv=None, deq_scale1: Tensor | None = None,
    quant_scale1: Tensor | None = None, deq_scale2: Tensor | None = None, quant_scale2: Tensor | None = None,
    quant_offset2: Tensor | None = None, num_heads: int = 1, scale_value: float = 1.0, pre_tokens: int = INT_MAX,
    next_tokens: int = 0, input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0,
    backend: str = "auto",
) -> Tensor:
    """``cann_attn.prompt_flash_attention`` through the ``cann_attn::prompt_flash_attention`` custom op."""
    return torch.ops.cann_attn.prompt_flash_attention(
        query, key, value, pse_shift, atten_mask, to_int_list(actual_seq_lengths, "actual_seq_lengths"),
        to_int_list(actual_seq_lengths_kv, "actual_seq_lengths_kv"), deq_scale1, quant_scale1, deq_scale2, quant_scale2,
        quant_offset2, num_heads, require_real(scale_value, "scale_value"), pre_tokens, next_tokens, input_layout,
        num_key_value_heads,
        sparse_mode, backend,
    )


@torch.library.custom_op("cann_attn::trans_quant_param", mutates_args=())
def _tqp_op(scale: Tensor, offset: Tensor | None = None, round_mode: int = 0) -> Tensor:
    """UINT64 deq-scale words of float32 `scale` (and `offset`) as an int64 tensor of scale's shape."""
    return _eager_trans_quant_param(scale, offset, round_mode)


@_tqp_op.register_fake
def _(scale, offset=None, round_mode=0):
    shape = scale.shape if offset is None else torch.broadcast_shapes(scale.shape, offset.shape)
    return scale.new_empty(shape, dtype=torch.int64)


def trans_quant_param(scale, offset=None, round_mode: int = 0) -> Tensor:
    """``cann_attn.trans_quant_param`` through the ``cann_attn::trans_quant_param`` custom op (Python numbers are
    turned into float32 tensors first)."""
    if not isinstance(scale, Tensor):
        scale = torch.tensor(scale, dtype=torch.float32)
    if offset is not None and not isinstance(offset, Tensor):
        offset = torch.tensor(offset, dtype=torch.float32)
    return torch.ops.cann_attn.trans_quant_param(scale, offset, round_mode)
