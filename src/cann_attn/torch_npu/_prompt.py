"""torch_npu's PromptFlashAttention and quant-parameter spellings."""

from torch import Tensor

from .. import library
from ._registry import npu_op

# The current default; torch_npu 7.1/7.2 had 2147473647 (sic), which use_release("7.2") restores.
PFA_PRE_TOKENS = 2147483647

NPU_PROMPT_FLASH_ATTENTION_SCHEMAS = {
    ('7.1', '7.2'): (
        "npu_prompt_flash_attention(Tensor query, Tensor key, Tensor value, *, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, Tensor? pse_shift=None, int[]? actual_seq_lengths=None, "
        "Tensor? deq_scale1=None, Tensor? quant_scale1=None, Tensor? deq_scale2=None, "
        "Tensor? quant_scale2=None, Tensor? quant_offset2=None, int num_heads=1, float scale_value=1.0, "
        'int pre_tokens=2147473647, int next_tokens=0, str input_layout="BSH", int num_key_value_heads=0, '
        "int[]? actual_seq_lengths_kv=None, int sparse_mode=0) -> Tensor"
    ),
    ('7.3', '26.0', 'current'): (
        "npu_prompt_flash_attention(Tensor query, Tensor key, Tensor value, *, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, Tensor? pse_shift=None, int[]? actual_seq_lengths=None, "
        "Tensor? deq_scale1=None, Tensor? quant_scale1=None, Tensor? deq_scale2=None, "
        "Tensor? quant_scale2=None, Tensor? quant_offset2=None, int num_heads=1, float scale_value=1.0, "
        'int pre_tokens=2147483647, int next_tokens=0, str input_layout="BSH", int num_key_value_heads=0, '
        "int[]? actual_seq_lengths_kv=None, int sparse_mode=0) -> Tensor"
    ),
}

NPU_TRANS_QUANT_PARAM_SCHEMAS = {
    ('7.1', '7.2', '7.3', '26.0', 'current'): (
        "npu_trans_quant_param(Tensor scale, Tensor? offset=None, int? round_mode=0) -> Tensor"
    ),
}


@npu_op(NPU_PROMPT_FLASH_ATTENTION_SCHEMAS)
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
    return library.prompt_flash_attention(
        query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=actual_seq_lengths_kv, deq_scale1=deq_scale1, quant_scale1=quant_scale1,
        deq_scale2=deq_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2, num_heads=num_heads,
        scale_value=scale_value, pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
        num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode,
    )


@npu_op(NPU_TRANS_QUANT_PARAM_SCHEMAS)
def npu_trans_quant_param(scale: Tensor, offset: Tensor | None = None, round_mode: int | None = 0) -> Tensor:
    """torch_npu.npu_trans_quant_param: float32 scales (and offsets) -> UINT64 deq-scale words, returned as int64
    (docs/operators/prompt_flash_attention.md). ``round_mode`` 0 truncates the scale to its high 19 bits, 1 (R_INT)
    rounds it to nearest, ties to even; None (torch_npu's ``int?``) means 0."""
    return library.trans_quant_param(scale, offset, 0 if round_mode is None else round_mode)

