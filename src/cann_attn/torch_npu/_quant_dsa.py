"""torch_npu's dense indexer pair and quantised DSA inference spellings (docs/operators/dense_lightning_indexer.md,
docs/operators/quant_dsa.md)."""

import torch
from torch import Tensor

from ..ops.sparse_flash_attention import INT64_MAX
from ..problem.lengths import to_int_list
from ._registry import npu_op

NPU_DENSE_LIGHTNING_INDEXER_SOFTMAX_LSE_SCHEMAS = {
    ('26.0', 'current'): (
        "npu_dense_lightning_indexer_softmax_lse(Tensor query_index, Tensor key_index, Tensor weights, *, "
        "SymInt[]? actual_seq_qlen=None, SymInt[]? actual_seq_klen=None, str? layout='BSND', int? sparse_mode=3, "
        "int? pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807) -> (Tensor, Tensor)"
    ),
}

NPU_DENSE_LIGHTNING_INDEXER_GRAD_KL_LOSS_SCHEMAS = {
    ('26.0', 'current'): (
        "npu_dense_lightning_indexer_grad_kl_loss(Tensor query, Tensor key, Tensor query_index, Tensor key_index, "
        "Tensor weights, Tensor softmax_max, Tensor softmax_sum, Tensor softmax_max_index, "
        "Tensor softmax_sum_index, float scale_value, *, Tensor? query_rope=None, Tensor? key_rope=None, "
        "SymInt[]? actual_seq_qlen=None, SymInt[]? actual_seq_klen=None, str? layout='BSND', int? sparse_mode=3, "
        "int? pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807) "
        "-> (Tensor, Tensor, Tensor, Tensor)"
    ),
}


@npu_op(NPU_DENSE_LIGHTNING_INDEXER_SOFTMAX_LSE_SCHEMAS)
def npu_dense_lightning_indexer_softmax_lse(
    query_index: Tensor, key_index: Tensor, weights: Tensor, *, actual_seq_qlen=None, actual_seq_klen=None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
):
    """torch_npu.npu_dense_lightning_indexer_softmax_lse -> ``(softmax_max_index, softmax_sum_index)``, fp32
    (B, 1, S1) / (1, T1)."""
    return torch.ops.cann_attn.dense_lightning_indexer_softmax_lse(
        query_index, key_index, weights, to_int_list(actual_seq_qlen, "actual_seq_qlen"),
        to_int_list(actual_seq_klen, "actual_seq_klen"), layout, sparse_mode, pre_tokens, next_tokens)


@npu_op(NPU_DENSE_LIGHTNING_INDEXER_GRAD_KL_LOSS_SCHEMAS)
def npu_dense_lightning_indexer_grad_kl_loss(
    query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor, softmax_max: Tensor,
    softmax_sum: Tensor, softmax_max_index: Tensor, softmax_sum_index: Tensor, scale_value: float, *,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_qlen=None, actual_seq_klen=None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
):
    """torch_npu.npu_dense_lightning_indexer_grad_kl_loss -> ``(d_query_index, d_key_index, d_weights, loss)``
    (loss: fp32 [1], summed over all tokens)."""
    return torch.ops.cann_attn.dense_lightning_indexer_grad_kl_loss(
        query, key, query_index, key_index, weights, softmax_max, softmax_sum, softmax_max_index, softmax_sum_index,
        float(scale_value), query_rope, key_rope, to_int_list(actual_seq_qlen, "actual_seq_qlen"),
        to_int_list(actual_seq_klen, "actual_seq_klen"), layout, sparse_mode, pre_tokens, next_tokens)


_QLI_HEAD = (
    "npu_quant_lightning_indexer(Tensor query, Tensor key, Tensor weights, Tensor query_dequant_scale, "
    "Tensor key_dequant_scale, int query_quant_mode, int key_quant_mode, *, Tensor? actual_seq_lengths_query=None, "
    "Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, str layout_query=\"BSND\", "
    "str layout_key=\"BSND\", int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, "
    "int next_tokens=9223372036854775807"
)
NPU_QUANT_LIGHTNING_INDEXER_SCHEMAS = {
    ('7.3',): _QLI_HEAD + ") -> Tensor",
    ('26.0', 'current'): _QLI_HEAD + ", int? query_dtype=None, int? key_dtype=None) -> Tensor",
}


@npu_op(NPU_QUANT_LIGHTNING_INDEXER_SCHEMAS)
def npu_quant_lightning_indexer(
    query: Tensor, key: Tensor, weights: Tensor, query_dequant_scale: Tensor, key_dequant_scale: Tensor,
    query_quant_mode: int, key_quant_mode: int, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
    block_table: Tensor | None = None, layout_query: str = "BSND", layout_key: str = "BSND",
    sparse_count: int = 2048, sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
    query_dtype: int | None = None, key_dtype: int | None = None,
):
    """torch_npu.npu_quant_lightning_indexer -> int32 sparse indices [B, S1, 1, K] / [T1, 1, K]."""
    return torch.ops.cann_attn.quant_lightning_indexer(
        query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode, key_quant_mode,
        to_int_list(actual_seq_lengths_query, "actual_seq_lengths_query"),
        to_int_list(actual_seq_lengths_key, "actual_seq_lengths_key"), block_table, layout_query, layout_key,
        sparse_count, sparse_mode, pre_tokens, next_tokens, query_dtype, key_dtype)
