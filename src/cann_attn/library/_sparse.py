"""Custom ops of the DSA operators: SparseFlashAttention (+ grad, with autograd), LightningIndexer, its KL-loss
grad op and the token count of the indexer loss (docs/operators/sparse_flash_attention.md,
docs/operators/lightning_indexer.md)."""

import torch
from torch import Tensor

from ..errors import ParamInvalidError, require_real
from ..ops.lightning_indexer import (
    LightningIndexerResult,
    SparseLightningIndexerGradKLLossResult,
)
from ..ops.lightning_indexer import (
    count_tokens_with_keys as _eager_count_tokens_with_keys,
)
from ..ops.lightning_indexer import lightning_indexer as _eager_lightning_indexer
from ..ops.lightning_indexer import (
    sparse_lightning_indexer_grad_kl_loss as _eager_sparse_lightning_indexer_grad_kl_loss,
)
from ..ops.sparse_flash_attention import INT64_MAX, SparseFlashAttentionGradResult, SparseFlashAttentionResult
from ..ops.sparse_flash_attention import sparse_flash_attention as _eager_sparse_flash_attention
from ..ops.sparse_flash_attention import sparse_flash_attention_grad as _eager_sparse_flash_attention_grad
from ..problem.lengths import to_int_list
from ..problem.page_table import PAGED_KV_LAYOUT
from ..problem.stats import accumulation_dtype
from ._outputs import _empty_like_none, _kl_loss_grad_fake, _none_if_placeholder

# ================================================================================ SparseFlashAttention (+ Grad)
_SFA_NAMES = (
    "query", "key", "value", "sparse_indices", "scale_value", "query_rope", "key_rope", "actual_seq_lengths_query",
    "actual_seq_lengths_kv", "sparse_block_size", "layout", "sparse_mode", "pre_tokens", "next_tokens", "backend",
    "block_table", "layout_kv", "sinks",
)
_SFA_SHARED = ("actual_seq_lengths_query", "actual_seq_lengths_kv", "layout", "sparse_mode", "pre_tokens",
               "next_tokens", "backend")


@torch.library.custom_op("cann_attn::sparse_flash_attention", mutates_args=())
def _sfa_op(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    actual_seq_lengths_query: list[int] | None = None, actual_seq_lengths_kv: list[int] | None = None,
    sparse_block_size: int = 1, layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX, backend: str = "auto", block_table: Tensor | None = None, layout_kv: str = "",
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """SparseFlashAttention -> (attention_out, softmax_max, softmax_sum); `block_table` / `layout_kv="PA_BSND"`:
    a paged key/value cache (docs/semantics/paged-kv.md); `sinks`: docs/semantics/sinks.md."""
    return tuple(_eager_sparse_flash_attention(
        query, key, value, sparse_indices, scale_value, query_rope=query_rope, key_rope=key_rope,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        sparse_block_size=sparse_block_size, layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
        next_tokens=next_tokens, backend=backend, block_table=block_table, layout_kv=layout_kv or None, sinks=sinks,
    ))


def _dsa_stat_shape(query: Tensor, layout: str) -> tuple:
    """[B, N2=1, S1, G=N1] or [N2=1, T1, G] (docs/operators/sparse_flash_attention.md)."""
    if layout == "TND":
        return (1, query.shape[0], query.shape[1])
    return (query.shape[0], 1, query.shape[1], query.shape[2])


@_sfa_op.register_fake
def _(query, key, value, sparse_indices, scale_value, query_rope=None, key_rope=None, actual_seq_lengths_query=None,
      actual_seq_lengths_kv=None, sparse_block_size=1, layout="BSND", sparse_mode=3, pre_tokens=INT64_MAX,
      next_tokens=INT64_MAX, backend="auto", block_table=None, layout_kv="", sinks=None):
    stat_dtype = accumulation_dtype(query.dtype)
    stat_shape = _dsa_stat_shape(query, layout)
    return (query.new_empty((*query.shape[:-1], value.shape[-1])), query.new_empty(stat_shape, dtype=stat_dtype),
            query.new_empty(stat_shape, dtype=stat_dtype))


def _sfa_setup_context(ctx, inputs, output):
    args = dict(zip(_SFA_NAMES, inputs, strict=False))
    attention_out, softmax_max, softmax_sum = output
    ctx.save_for_backward(args["query"], args["key"], args["value"], args["sparse_indices"], args["query_rope"],
                          args["key_rope"], attention_out, softmax_max, softmax_sum, args.get("sinks"))
    ctx.scale_value, ctx.sparse_block_size = args["scale_value"], args.get("sparse_block_size", 1)
    ctx.options = {name: args[name] for name in _SFA_SHARED if name in args}
    ctx.paged = args.get("block_table") is not None or args.get("layout_kv") == PAGED_KV_LAYOUT
    ctx.mark_non_differentiable(softmax_max, softmax_sum)


def _sfa_backward(ctx, d_out, d_max, d_sum):
    if ctx.paged:
        # SparseFlashAttentionGrad takes contiguous BSND/TND keys only (docs/semantics/paged-kv.md): a paged cache
        # is an inference input.
        raise ParamInvalidError("block_table: gradients through a paged (PA_BSND) key/value cache are not "
                                "supported; SparseFlashAttentionGrad takes BSND or TND keys")
    query, key, value, sparse_indices, query_rope, key_rope, out, softmax_max, softmax_sum, sinks = ctx.saved_tensors
    dq, dk, dv, dq_rope, dk_rope, d_sinks = torch.ops.cann_attn.sparse_flash_attention_grad(
        query, key, value, sparse_indices, d_out.contiguous(), out, softmax_max, softmax_sum, ctx.scale_value,
        ctx.sparse_block_size, query_rope=query_rope, key_rope=key_rope, sinks=sinks, **ctx.options,
    )
    grads = {"query": dq, "key": dk, "value": dv,
             "query_rope": dq_rope if query_rope is not None else None,
             "key_rope": dk_rope if key_rope is not None else None,
             "sinks": d_sinks if sinks is not None and ctx.needs_input_grad[_SFA_NAMES.index("sinks")] else None}
    return tuple(grads.get(name) for name in _SFA_NAMES)


_sfa_op.register_autograd(_sfa_backward, setup_context=_sfa_setup_context)


@torch.library.custom_op("cann_attn::sparse_flash_attention_grad", mutates_args=())
def _sfa_grad_op(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, d_out: Tensor, out: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, sparse_block_size: int = 1,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    actual_seq_lengths_query: list[int] | None = None, actual_seq_lengths_kv: list[int] | None = None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
    deterministic: bool = False, backend: str = "auto", sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """SparseFlashAttentionGrad -> (d_query, d_key, d_value, d_query_rope, d_key_rope, d_sinks); the rope gradients
    are empty (0,) tensors without rope inputs, d_sinks one without sinks."""
    result = _eager_sparse_flash_attention_grad(
        query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum, scale_value,
        sparse_block_size=sparse_block_size, query_rope=query_rope, key_rope=key_rope,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        deterministic=deterministic, backend=backend, sinks=sinks,
    )
    dq_rope = result.d_query_rope if result.d_query_rope is not None else _empty_like_none(query)
    dk_rope = result.d_key_rope if result.d_key_rope is not None else _empty_like_none(key)
    d_sinks = result.d_sinks if result.d_sinks is not None else _empty_like_none(query, torch.float32)
    return result.d_query, result.d_key, result.d_value, dq_rope, dk_rope, d_sinks


@_sfa_grad_op.register_fake
def _(query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum, scale_value, sparse_block_size=1,
      query_rope=None, key_rope=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None, layout="BSND",
      sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, deterministic=False, backend="auto", sinks=None):
    dq_rope = torch.empty_like(query_rope) if query_rope is not None else _empty_like_none(query)
    dk_rope = torch.empty_like(key_rope) if key_rope is not None else _empty_like_none(key)
    d_sinks = torch.empty_like(sinks) if sinks is not None else _empty_like_none(query, torch.float32)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dq_rope, dk_rope, d_sinks


def sparse_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float, *,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None, sparse_block_size: int = 1, layout: str = "BSND", sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX, backend: str = "auto",
    block_table: Tensor | None = None, layout_kv: str | None = None, sinks: Tensor | None = None,
) -> SparseFlashAttentionResult:
    """``cann_attn.sparse_flash_attention`` through the ``cann_attn::sparse_flash_attention`` custom op:
    traceable and differentiable (gradients to query, key, value, query_rope, key_rope; not through a paged
    cache)."""
    return SparseFlashAttentionResult(*torch.ops.cann_attn.sparse_flash_attention(
        query, key, value, sparse_indices, require_real(scale_value, "scale_value"), query_rope, key_rope,
        to_int_list(actual_seq_lengths_query, "actual_seq_lengths_query"),
        to_int_list(actual_seq_lengths_kv, "actual_seq_lengths_kv"), sparse_block_size, layout, sparse_mode, pre_tokens,
        next_tokens, backend, block_table=block_table, layout_kv=layout_kv or "", sinks=sinks,
    ))


def sparse_flash_attention_grad(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, d_out: Tensor, out: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, *, sparse_block_size: int = 1,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None, layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX, deterministic: bool = False, backend: str = "auto", sinks: Tensor | None = None,
) -> SparseFlashAttentionGradResult:
    """``cann_attn.sparse_flash_attention_grad`` through its custom op; rope gradients are None without rope,
    d_sinks None without sinks."""
    dq, dk, dv, dq_rope, dk_rope, d_sinks = torch.ops.cann_attn.sparse_flash_attention_grad(
        query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum, require_real(scale_value,
        "scale_value"),
        sparse_block_size, query_rope, key_rope, to_int_list(actual_seq_lengths_query, "actual_seq_lengths_query"),
        to_int_list(actual_seq_lengths_kv, "actual_seq_lengths_kv"), layout, sparse_mode, pre_tokens, next_tokens,
        deterministic, backend, sinks,
    )
    return SparseFlashAttentionGradResult(dq, dk, dv, _none_if_placeholder(dq_rope, query_rope is not None),
                                          _none_if_placeholder(dk_rope, key_rope is not None),
                                          _none_if_placeholder(d_sinks, sinks is not None))


# ===================================================================== LightningIndexer and its KL-loss grad op
@torch.library.custom_op("cann_attn::lightning_indexer", mutates_args=())
def _li_op(
    query_index: Tensor, key_index: Tensor, weights: Tensor, actual_seq_lengths_query: list[int] | None = None,
    actual_seq_lengths_key: list[int] | None = None, layout: str = "BSND", sparse_count: int = 2048,
    sparse_mode: int = 3, return_value: bool = False, backend: str = "auto", block_table: Tensor | None = None,
    layout_key: str = "",
) -> tuple[Tensor, Tensor]:
    """LightningIndexer -> (sparse_indices, sparse_values); sparse_values is an empty (0,) tensor unless
    return_value; `block_table` / `layout_key="PA_BSND"`: a paged key cache (docs/semantics/paged-kv.md)."""
    result = _eager_lightning_indexer(
        query_index, key_index, weights, actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_key=actual_seq_lengths_key, layout=layout, sparse_count=sparse_count,
        sparse_mode=sparse_mode, return_value=return_value, backend=backend, block_table=block_table,
        layout_key=layout_key or None,
    )
    values = result.sparse_values if result.sparse_values is not None else _empty_like_none(query_index)
    return result.sparse_indices, values


@_li_op.register_fake
def _(query_index, key_index, weights, actual_seq_lengths_query=None, actual_seq_lengths_key=None, layout="BSND",
      sparse_count=2048, sparse_mode=3, return_value=False, backend="auto", block_table=None, layout_key=""):
    shape = (*query_index.shape[:-2], 1, sparse_count)
    indices = query_index.new_empty(shape, dtype=torch.int32)
    values = query_index.new_empty(shape) if return_value else _empty_like_none(query_index)
    return indices, values


def lightning_indexer(
    query_index: Tensor, key_index: Tensor, weights: Tensor, *, actual_seq_lengths_query=None,
    actual_seq_lengths_key=None, layout: str = "BSND", sparse_count: int = 2048, sparse_mode: int = 3,
    return_value: bool = False, backend: str = "auto", block_table: Tensor | None = None,
    layout_key: str | None = None,
) -> LightningIndexerResult:
    """``cann_attn.lightning_indexer`` through the ``cann_attn::lightning_indexer`` custom op."""
    indices, values = torch.ops.cann_attn.lightning_indexer(
        query_index, key_index, weights, to_int_list(actual_seq_lengths_query, "actual_seq_lengths_query"),
        to_int_list(actual_seq_lengths_key, "actual_seq_lengths_key"), layout, sparse_count, sparse_mode, return_value,
        backend, block_table=block_table, layout_key=layout_key or "",
    )
    return LightningIndexerResult(indices, _none_if_placeholder(values, return_value))


@torch.library.custom_op("cann_attn::sparse_lightning_indexer_grad_kl_loss", mutates_args=())
def _sli_kl_op(
    query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor, sparse_indices: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, actual_seq_lengths_query: list[int] | None = None,
    actual_seq_lengths_key: list[int] | None = None, layout: str = "BSND", sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX, deterministic: bool = False, backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """SparseLightningIndexerGradKLLoss -> (d_query_index, d_key_index, d_weights, loss)."""
    return tuple(_eager_sparse_lightning_indexer_grad_kl_loss(
        query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum, scale_value,
        query_rope=query_rope, key_rope=key_rope, actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_key=actual_seq_lengths_key, layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
        next_tokens=next_tokens, deterministic=deterministic, backend=backend,
    ))


@_sli_kl_op.register_fake
def _(query, key, query_index, key_index, weights, *args, **kwargs):
    return _kl_loss_grad_fake(query, query_index, key_index, weights)


def sparse_lightning_indexer_grad_kl_loss(
    query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor, sparse_indices: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, *, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
    deterministic: bool = False, backend: str = "auto",
) -> SparseLightningIndexerGradKLLossResult:
    """``cann_attn.sparse_lightning_indexer_grad_kl_loss`` through its custom op."""
    return SparseLightningIndexerGradKLLossResult(*torch.ops.cann_attn.sparse_lightning_indexer_grad_kl_loss(
        query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum,
        require_real(scale_value, "scale_value"),
        query_rope, key_rope, to_int_list(actual_seq_lengths_query, "actual_seq_lengths_query"),
        to_int_list(actual_seq_lengths_key, "actual_seq_lengths_key"), layout, sparse_mode, pre_tokens, next_tokens,
        deterministic, backend,
    ))


@torch.library.custom_op("cann_attn::count_tokens_with_keys", mutates_args=())
def _count_op(
    query_index: Tensor, key_index: Tensor, sparse_indices: Tensor, layout: str, sparse_mode: int,
    actual_seq_lengths_query: list[int] | None = None, actual_seq_lengths_key: list[int] | None = None,
) -> Tensor:
    """max(1, query tokens with a valid selected key) as a 0-d fp32 CPU tensor: the divisor of
    ``cann_attn.indexer_kl_loss(reduction="mean")``, a tensor so that compiled code needs no data-dependent int."""
    # float32 whatever torch's default dtype (the fake's promise).
    return torch.tensor(float(max(1, _eager_count_tokens_with_keys(
        query_index, key_index, sparse_indices, layout, sparse_mode, actual_seq_lengths_query,
        actual_seq_lengths_key))), dtype=torch.float32)


@_count_op.register_fake
def _(query_index, key_index, sparse_indices, layout, sparse_mode, actual_seq_lengths_query=None,
      actual_seq_lengths_key=None):
    return torch.empty((), dtype=torch.float32)


def count_tokens_with_keys(query_index: Tensor, key_index: Tensor, sparse_indices: Tensor, layout: str,
                           sparse_mode: int, actual_seq_lengths_query=None, actual_seq_lengths_key=None) -> Tensor:
    """The ``cann_attn::count_tokens_with_keys`` custom op (see there)."""
    return torch.ops.cann_attn.count_tokens_with_keys(
        query_index, key_index, sparse_indices, layout, sparse_mode,
        to_int_list(actual_seq_lengths_query, "actual_seq_lengths_query"),
        to_int_list(actual_seq_lengths_key, "actual_seq_lengths_key"))
