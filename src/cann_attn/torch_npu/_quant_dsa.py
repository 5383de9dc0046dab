"""torch_npu's dense indexer pair and quantised DSA inference spellings (docs/operators/dense_lightning_indexer.md,
docs/operators/quant_dsa.md)."""

import torch
from torch import Tensor

from ..errors import require_real
from ..ops.sparse_flash_attention import INT64_MAX
from ..problem.lengths import IntList, to_int_list
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
    query_index: Tensor, key_index: Tensor, weights: Tensor, *, actual_seq_qlen: IntList | None = None,
    actual_seq_klen: IntList | None = None,
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
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_qlen: IntList | None = None,
    actual_seq_klen: IntList | None = None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
):
    """torch_npu.npu_dense_lightning_indexer_grad_kl_loss -> ``(d_query_index, d_key_index, d_weights, loss)``
    (loss: fp32 [1], summed over all tokens)."""
    return torch.ops.cann_attn.dense_lightning_indexer_grad_kl_loss(
        query, key, query_index, key_index, weights, softmax_max, softmax_sum, softmax_max_index, softmax_sum_index,
        require_real(scale_value, "scale_value"), query_rope, key_rope, to_int_list(actual_seq_qlen, "actual_seq_qlen"),
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


@npu_op(NPU_QUANT_LIGHTNING_INDEXER_SCHEMAS, renamed={"layout": "layout_query"})
def npu_quant_lightning_indexer(
    query: Tensor, key: Tensor, weights: Tensor, query_dequant_scale: Tensor, key_dequant_scale: Tensor,
    query_quant_mode: int, key_quant_mode: int, *, actual_seq_lengths_query: IntList | None = None,
    actual_seq_lengths_key: IntList | None = None,
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


_KVQ_SFA_HEAD = (
    "npu_kv_quant_sparse_flash_attention(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, "
    "float scale_value, int key_quant_mode, int value_quant_mode, *, Tensor? key_dequant_scale=None, "
    "Tensor? value_dequant_scale=None, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, "
    "Tensor? actual_seq_lengths_kv=None, int sparse_block_size=1, str layout_query=\"BSND\", "
    "str layout_kv=\"BSND\", int sparse_mode=3, int pre_tokens=9223372036854775807, "
    "int next_tokens=9223372036854775807, int attention_mode=0, int quant_scale_repo_mode=1, int tile_size=128, "
    "int rope_head_dim=64"
)
NPU_KV_QUANT_SPARSE_FLASH_ATTENTION_SCHEMAS = {
    ('7.3',): _KVQ_SFA_HEAD + ") -> Tensor",
    ('26.0',): _KVQ_SFA_HEAD + ", int? key_dtype=None, int? value_dtype=None) -> Tensor",
    ('current',): _KVQ_SFA_HEAD + ", int? key_dtype=None, int? value_dtype=None, Tensor? sinks=None) -> Tensor",
}


@npu_op(NPU_KV_QUANT_SPARSE_FLASH_ATTENTION_SCHEMAS, renamed={"layout": "layout_query"})
def npu_kv_quant_sparse_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float, key_quant_mode: int,
    value_quant_mode: int, *, key_dequant_scale: Tensor | None = None, value_dequant_scale: Tensor | None = None,
    block_table: Tensor | None = None, actual_seq_lengths_query: IntList | None = None,
    actual_seq_lengths_kv: IntList | None = None,
    sparse_block_size: int = 1, layout_query: str = "BSND", layout_kv: str = "BSND", sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX, attention_mode: int = 0,
    quant_scale_repo_mode: int = 1, tile_size: int = 128, rope_head_dim: int = 64, key_dtype: int | None = None,
    value_dtype: int | None = None, sinks: Tensor | None = None,
):
    """torch_npu.npu_kv_quant_sparse_flash_attention -> attention_out [.., N1, 512]. As documented, only
    ``attention_mode=2`` is accepted (the schema's default 0 raises ParamInvalidError)."""
    from ..library import kv_quant_sparse_flash_attention

    return kv_quant_sparse_flash_attention(
        query, key, value, sparse_indices, scale_value, key_quant_mode, value_quant_mode,
        key_dequant_scale=key_dequant_scale, value_dequant_scale=value_dequant_scale, block_table=block_table,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        sparse_block_size=sparse_block_size, layout=layout_query, layout_kv=layout_kv, sparse_mode=sparse_mode,
        pre_tokens=pre_tokens, next_tokens=next_tokens, attention_mode=attention_mode,
        quant_scale_repo_mode=quant_scale_repo_mode, tile_size=tile_size, rope_head_dim=rope_head_dim,
        key_dtype=key_dtype, value_dtype=value_dtype, sinks=None if sinks is None else sinks.detach())
