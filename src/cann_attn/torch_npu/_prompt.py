"""torch_npu's PromptFlashAttention and quant-parameter spellings."""

import torch
from torch import Tensor

from .. import library
from ._common import _ints

PFA_PRE_TOKENS = 2147473647  # torch_npu's documented default for npu_prompt_flash_attention (sic)

def npu_prompt_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, *, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, pse_shift: Tensor | None = None, actual_seq_lengths=None,
    deq_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, deq_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, num_heads: int = 1,
    scale_value: float = 1.0, pre_tokens: int = PFA_PRE_TOKENS, next_tokens: int = 0, input_layout: str = "BSH",
    num_key_value_heads: int = 0, actual_seq_lengths_kv=None, sparse_mode: int = 0,
) -> Tensor:
    """torch_npu.npu_prompt_flash_attention (PromptFlashAttentionV2, inference: not differentiable). The output
    dtype is int8 with quant_scale2, float16 for int8 inputs, else the query's. padding_mask is reserved."""
    return torch.ops.cann_attn.prompt_flash_attention(
        query, key, value, pse_shift, atten_mask, _ints(actual_seq_lengths, "actual_seq_lengths"),
        _ints(actual_seq_lengths_kv, "actual_seq_lengths_kv"), deq_scale1, quant_scale1, deq_scale2, quant_scale2,
        quant_offset2, num_heads, float(scale_value), pre_tokens, next_tokens, input_layout, num_key_value_heads,
        sparse_mode,
    )


def npu_trans_quant_param(scale: Tensor, offset: Tensor | None = None, round_mode: int | None = 0) -> Tensor:
    """torch_npu.npu_trans_quant_param: float32 scales (and offsets) -> UINT64 deq-scale words, returned as int64
    (docs/operators/prompt_flash_attention.md). ``round_mode`` 0 truncates the scale to its high 19 bits, 1 (R_INT)
    rounds it to nearest, ties
    to even; None (torch_npu's ``int?``) means 0."""
    return library.trans_quant_param(scale, offset, 0 if round_mode is None else round_mode)

