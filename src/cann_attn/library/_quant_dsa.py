"""Custom ops (``torch.ops.cann_attn.*``) of the dense indexer pair and the quantised DSA inference operators, in
the style of :mod:`cann_attn.library` (which re-exports the Python wrappers below, so ``traced_as_custom_op`` finds
them there): each op runs the eager operator, a fake twin gives shapes and dtypes, and the wrapper converts length
tensors to int lists."""

import torch
from torch import Tensor

from ..errors import require_real
from ..ops.dense_indexer import (
    DenseLightningIndexerGradKLLossResult,
    DenseLightningIndexerSoftmaxLseResult,
)
from ..ops.dense_indexer import dense_lightning_indexer_grad_kl_loss as _eager_dense_grad_kl_loss
from ..ops.dense_indexer import dense_lightning_indexer_softmax_lse as _eager_dense_softmax_lse
from ..ops.quant_dsa import kv_quant_sparse_flash_attention as _eager_kv_quant_sfa
from ..ops.quant_dsa import quant_lightning_indexer as _eager_quant_lightning_indexer
from ..ops.sparse_flash_attention import INT64_MAX
from ..problem.dequant import LATENT_DIM
from ..problem.lengths import to_int_list
from ..problem.stats import accumulation_dtype
from ._outputs import _kl_loss_grad_fake


def _index_stat_shape(query_index: Tensor, layout: str) -> tuple[int, ...]:
    return (1, query_index.shape[0]) if layout == "TND" else (query_index.shape[0], 1, query_index.shape[1])


# ====================================================================== the dense indexer pair
@torch.library.custom_op("cann_attn::dense_lightning_indexer_softmax_lse", mutates_args=())
def _dense_lse_op(
    query_index: Tensor, key_index: Tensor, weights: Tensor, actual_seq_qlen: list[int] | None = None,
    actual_seq_klen: list[int] | None = None, layout: str = "BSND", sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
) -> tuple[Tensor, Tensor]:
    """DenseLightningIndexerSoftmaxLse -> (softmax_max_index, softmax_sum_index)."""
    return tuple(_eager_dense_softmax_lse(
        query_index, key_index, weights, actual_seq_qlen=actual_seq_qlen, actual_seq_klen=actual_seq_klen,
        layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens))


@_dense_lse_op.register_fake
def _(query_index, key_index, weights, actual_seq_qlen=None, actual_seq_klen=None, layout="BSND", *args, **kwargs):
    shape = _index_stat_shape(query_index, layout)
    dtype = accumulation_dtype(query_index.dtype)
    return query_index.new_empty(shape, dtype=dtype), query_index.new_empty(shape, dtype=dtype)


def dense_lightning_indexer_softmax_lse(
    query_index: Tensor, key_index: Tensor, weights: Tensor, *, actual_seq_qlen=None, actual_seq_klen=None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
) -> DenseLightningIndexerSoftmaxLseResult:
    """``cann_attn.dense_lightning_indexer_softmax_lse`` through its custom op."""
    return DenseLightningIndexerSoftmaxLseResult(*torch.ops.cann_attn.dense_lightning_indexer_softmax_lse(
        query_index, key_index, weights, to_int_list(actual_seq_qlen, "actual_seq_qlen"),
        to_int_list(actual_seq_klen, "actual_seq_klen"), layout, sparse_mode, pre_tokens, next_tokens))


@torch.library.custom_op("cann_attn::dense_lightning_indexer_grad_kl_loss", mutates_args=())
def _dense_kl_op(
    query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor, softmax_max: Tensor,
    softmax_sum: Tensor, softmax_max_index: Tensor, softmax_sum_index: Tensor, scale_value: float,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_qlen: list[int] | None = None,
    actual_seq_klen: list[int] | None = None, layout: str = "BSND", sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DenseLightningIndexerGradKLLoss -> (d_query_index, d_key_index, d_weights, loss)."""
    return tuple(_eager_dense_grad_kl_loss(
        query, key, query_index, key_index, weights, softmax_max, softmax_sum, softmax_max_index, softmax_sum_index,
        scale_value, query_rope=query_rope, key_rope=key_rope, actual_seq_qlen=actual_seq_qlen,
        actual_seq_klen=actual_seq_klen, layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
        next_tokens=next_tokens))


@_dense_kl_op.register_fake
def _(query, key, query_index, key_index, weights, *args, **kwargs):
    return _kl_loss_grad_fake(query, query_index, key_index, weights)


def dense_lightning_indexer_grad_kl_loss(
    query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor, softmax_max: Tensor,
    softmax_sum: Tensor, softmax_max_index: Tensor, softmax_sum_index: Tensor, scale_value: float, *,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_qlen=None, actual_seq_klen=None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
) -> DenseLightningIndexerGradKLLossResult:
    """``cann_attn.dense_lightning_indexer_grad_kl_loss`` through its custom op."""
    return DenseLightningIndexerGradKLLossResult(*torch.ops.cann_attn.dense_lightning_indexer_grad_kl_loss(
        query, key, query_index, key_index, weights, softmax_max, softmax_sum, softmax_max_index, softmax_sum_index,
        require_real(scale_value, "scale_value"), query_rope, key_rope, to_int_list(actual_seq_qlen, "actual_seq_qlen"),
        to_int_list(actual_seq_klen, "actual_seq_klen"), layout, sparse_mode, pre_tokens, next_tokens))


# ====================================================================== QuantLightningIndexer
@torch.library.custom_op("cann_attn::quant_lightning_indexer", mutates_args=())
def _quant_li_op(
    query: Tensor, key: Tensor, weights: Tensor, query_dequant_scale: Tensor, key_dequant_scale: Tensor,
    query_quant_mode: int = 0, key_quant_mode: int = 0, actual_seq_lengths_query: list[int] | None = None,
    actual_seq_lengths_key: list[int] | None = None, block_table: Tensor | None = None, layout: str = "BSND",
    layout_key: str = "", sparse_count: int = 2048, sparse_mode: int = 3, pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX, query_dtype: int | None = None, key_dtype: int | None = None,
    backend: str = "auto",
) -> Tensor:
    """QuantLightningIndexer -> sparse_indices (int32)."""
    return _eager_quant_lightning_indexer(
        query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode, key_quant_mode,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_key=actual_seq_lengths_key,
        block_table=block_table, layout=layout, layout_key=layout_key or None, sparse_count=sparse_count,
        sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens, query_dtype=query_dtype,
        key_dtype=key_dtype, backend=backend).clone()


@_quant_li_op.register_fake
def _(query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode=0, key_quant_mode=0,
      actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None, layout="BSND", layout_key="",
      sparse_count=2048, *args, **kwargs):
    return query.new_empty((*query.shape[:-2], 1, sparse_count), dtype=torch.int32)


def quant_lightning_indexer(
    query: Tensor, key: Tensor, weights: Tensor, query_dequant_scale: Tensor, key_dequant_scale: Tensor,
    query_quant_mode: int = 0, key_quant_mode: int = 0, *, actual_seq_lengths_query=None,
    actual_seq_lengths_key=None, block_table: Tensor | None = None, layout: str = "BSND",
    layout_key: str | None = None, sparse_count: int = 2048, sparse_mode: int = 3, pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX, query_dtype: int | None = None, key_dtype: int | None = None,
    backend: str = "auto",
) -> Tensor:
    """``cann_attn.quant_lightning_indexer`` through its custom op."""
    return torch.ops.cann_attn.quant_lightning_indexer(
        query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode, key_quant_mode,
        to_int_list(actual_seq_lengths_query, "actual_seq_lengths_query"),
        to_int_list(actual_seq_lengths_key, "actual_seq_lengths_key"), block_table, layout, layout_key or "",
        sparse_count, sparse_mode, pre_tokens, next_tokens, query_dtype, key_dtype, backend)


# ====================================================================== KvQuantSparseFlashAttention
@torch.library.custom_op("cann_attn::kv_quant_sparse_flash_attention", mutates_args=())
def _kv_quant_sfa_op(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float, key_quant_mode: int = 2,
    value_quant_mode: int = 2, block_table: Tensor | None = None, actual_seq_lengths_query: list[int] | None = None,
    actual_seq_lengths_kv: list[int] | None = None, sparse_block_size: int = 1, layout: str = "BSND",
    layout_kv: str = "", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
    attention_mode: int = 2, quant_scale_repo_mode: int = 1, tile_size: int = 128, rope_head_dim: int = 64,
    key_dtype: int | None = None, value_dtype: int | None = None, sinks: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """KvQuantSparseFlashAttention -> attention_out (key_dequant_scale / value_dequant_scale are reserved: None)."""
    return _eager_kv_quant_sfa(
        query, key, value, sparse_indices, scale_value, key_quant_mode, value_quant_mode, block_table=block_table,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        sparse_block_size=sparse_block_size, layout=layout, layout_kv=layout_kv or None, sparse_mode=sparse_mode,
        pre_tokens=pre_tokens, next_tokens=next_tokens, attention_mode=attention_mode,
        quant_scale_repo_mode=quant_scale_repo_mode, tile_size=tile_size, rope_head_dim=rope_head_dim,
        key_dtype=key_dtype, value_dtype=value_dtype, sinks=sinks, backend=backend)


@_kv_quant_sfa_op.register_fake
def _(query, key, value, sparse_indices, *args, **kwargs):
    return query.new_empty((*query.shape[:-1], LATENT_DIM))


def kv_quant_sparse_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float, key_quant_mode: int = 2,
    value_quant_mode: int = 2, *, key_dequant_scale: Tensor | None = None, value_dequant_scale: Tensor | None = None,
    block_table: Tensor | None = None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
    sparse_block_size: int = 1, layout: str = "BSND", layout_kv: str | None = None, sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX, attention_mode: int = 2,
    quant_scale_repo_mode: int = 1, tile_size: int = 128, rope_head_dim: int = 64, key_dtype: int | None = None,
    value_dtype: int | None = None, sinks: Tensor | None = None, backend: str = "auto",
) -> Tensor:
    """``cann_attn.kv_quant_sparse_flash_attention`` through its custom op."""
    if key_dequant_scale is not None or value_dequant_scale is not None:
        # reserved parameters: the eager operator raises its own error
        return _eager_kv_quant_sfa(query, key, value, sparse_indices, scale_value, key_quant_mode, value_quant_mode,
                                   key_dequant_scale=key_dequant_scale, value_dequant_scale=value_dequant_scale)
    return torch.ops.cann_attn.kv_quant_sparse_flash_attention(
        query, key, value, sparse_indices, require_real(scale_value, "scale_value"), key_quant_mode, value_quant_mode,
        block_table,
        to_int_list(actual_seq_lengths_query, "actual_seq_lengths_query"),
        to_int_list(actual_seq_lengths_kv, "actual_seq_lengths_kv"), sparse_block_size, layout, layout_kv or "",
        sparse_mode, pre_tokens, next_tokens, attention_mode, quant_scale_repo_mode, tile_size, rope_head_dim,
        key_dtype, value_dtype, sinks, backend)
