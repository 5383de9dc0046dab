"""torch_npu's DSA spellings: sparse flash attention (+grad), lightning indexer and its KL-loss grad."""

import torch
from torch import Tensor

from ..errors import ParamInvalidError, require_bool, require_real
from ..ops.sparse_flash_attention import INT64_MAX
from ..problem.lengths import to_int_list
from ..problem.page_table import PAGED_KV_LAYOUT
from ..problem.policy import beyond_docs
from ._registry import npu_op

NPU_SPARSE_FLASH_ATTENTION_SCHEMAS = {
    ('7.3', '26.0'): (
        "npu_sparse_flash_attention(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, "
        "float scale_value, *, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, "
        'int sparse_block_size=1, str layout_query="BSND", str layout_kv="BSND", int sparse_mode=3, '
        "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, int attention_mode=0, "
        "bool return_softmax_lse=False) -> (Tensor, Tensor, Tensor)"
    ),
    ('current',): (
        "npu_sparse_flash_attention(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, "
        "float scale_value, *, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, "
        'int sparse_block_size=1, str layout_query="BSND", str layout_kv="BSND", int sparse_mode=3, '
        "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, int attention_mode=0, "
        "bool return_softmax_lse=False, Tensor? sinks=None) -> (Tensor, Tensor, Tensor)"
    ),
}

NPU_SPARSE_FLASH_ATTENTION_GRAD_SCHEMAS = {
    ('7.3', '26.0', 'current'): (
        "npu_sparse_flash_attention_grad(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, "
        "Tensor d_out, Tensor out, Tensor softmax_max, Tensor softmax_sum, float scale_value, "
        "int sparse_block_size, Tensor? query_rope=None, Tensor? key_rope=None, "
        'Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, str? layout="BSND", '
        "int? sparse_mode=3, int? pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807, "
        "int? attention_mode=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
}

NPU_LIGHTNING_INDEXER_SCHEMAS = {
    ('7.3', '26.0', 'current'): (
        "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, "
        "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, "
        'Tensor? block_table=None, str layout_query="BSND", str layout_key="BSND", int sparse_count=2048, '
        "int sparse_mode=3, int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, "
        "bool return_value=False) -> (Tensor, Tensor)"
    ),
}

NPU_SPARSE_LIGHTNING_INDEXER_GRAD_KL_LOSS_SCHEMAS = {
    ('7.3', '26.0'): (
        "npu_sparse_lightning_indexer_grad_kl_loss(Tensor query, Tensor key, Tensor query_index, "
        "Tensor key_index, Tensor weights, Tensor sparse_indices, Tensor softmax_max, Tensor softmax_sum, "
        "float scale_value, *, Tensor? query_rope=None, Tensor? key_rope=None, "
        "SymInt[]? actual_seq_qlen=None, SymInt[]? actual_seq_klen=None, str? layout='BSND', "
        "int? sparse_mode=3, int? pre_tokens=9223372036854775807, "
        "int? next_tokens=9223372036854775807) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    ('current',): (
        "npu_sparse_lightning_indexer_grad_kl_loss(Tensor query, Tensor key, Tensor query_index, "
        "Tensor key_index, Tensor weights, Tensor sparse_indices, Tensor softmax_max, Tensor softmax_sum, "
        "float scale_value, *, Tensor? query_rope=None, Tensor? key_rope=None, "
        "SymInt[]? actual_seq_qlen=None, SymInt[]? actual_seq_klen=None, str? layout='BSND', "
        "int? sparse_mode=3, int? pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807, "
        "Tensor? sinks=None) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
}


def _check_paged_outputs(layout_kv: str, flag: str, value: bool) -> None:
    """``return_softmax_lse`` / ``return_value`` are "仅在训练且layout_kv不为PA_BSND场景支持" (torch_npu docs):
    a paged cache (docs/semantics/paged-kv.md) returns the attention output / indices only. vLLM's DCP merges
    need SFA's statistics over a paged cache, so `return_softmax_lse` is computed there too (the same statistics
    as over the contiguous keys; docs/semantics/beyond-docs.md); `CANN_ATTN_STRICT_DOCS=1` refuses it."""
    if not require_bool(value, flag) or layout_kv != PAGED_KV_LAYOUT:
        return
    if flag == "return_softmax_lse":
        beyond_docs(flag, "return_softmax_lse with a paged cache (layout_kv='PA_BSND')",
                    "vllm-ascend's DSA decode context parallel (vllm_ascend/device/device_op.py, "
                    "npu_sparse_flash_attention(layout_kv='PA_BSND', return_softmax_lse=return_lse) for the DCP LSE "
                    "merge)")
        return
    raise ParamInvalidError(f"{flag}: expected False with a paged cache (layout_kv='PA_BSND'), got True")


def _check_sinks(sinks) -> None:
    """The KL loss's ``sinks``: its documentation says only that the target is L1-normalised "after the sinks'
    correction", not how (docs/semantics/sinks.md); refused rather than guessed."""
    if sinks is not None:
        raise ParamInvalidError("sinks: not supported by npu_sparse_lightning_indexer_grad_kl_loss here (the public "
                                "documentation does not define how sinks enter the loss's target; pass the "
                                "sink-inclusive softmax_max/softmax_sum of the attention instead), got a tensor")


def _check_attention_mode(attention_mode: int) -> None:
    if attention_mode not in (0, 2):
        raise ParamInvalidError(f"attention_mode: expected 0 or 2 (MLA-absorb), got {attention_mode!r}")


@npu_op(NPU_SPARSE_FLASH_ATTENTION_SCHEMAS, renamed={"layout": "layout_query"})
def npu_sparse_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float, *,
    block_table: Tensor | None = None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, sparse_block_size: int = 1,
    layout_query: str = "BSND", layout_kv: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX, attention_mode: int = 0, return_softmax_lse: bool = False,
    sinks: Tensor | None = None,
):
    """torch_npu.npu_sparse_flash_attention -> ``(attention_out, softmax_max, softmax_sum)``.

    The statistics ([B, N2, S1, G] / [N2, T1, G], fp32) are returned with ``return_softmax_lse=True``, else empty
    (0,) tensors. Differentiable w.r.t. query, key, value, query_rope and key_rope (SparseFlashAttentionGrad).
    ``layout_kv='PA_BSND'`` with ``block_table``: key/value/key_rope are paged caches (docs/semantics/paged-kv.md).
    ``sinks`` (float32 [N1]): one softmax logit per query head (docs/semantics/sinks.md); as in torch_npu's
    derivatives it receives no gradient here (``cann_attn.sparse_attention`` gives it one).
    """
    _check_paged_outputs(layout_kv, "return_softmax_lse", return_softmax_lse)
    _check_attention_mode(attention_mode)
    out, softmax_max, softmax_sum = torch.ops.cann_attn.sparse_flash_attention(
        query, key, value, sparse_indices, require_real(scale_value, "scale_value"), query_rope, key_rope,
        to_int_list(actual_seq_lengths_query, "actual_seq_lengths_query"),
        to_int_list(actual_seq_lengths_kv, "actual_seq_lengths_kv"), sparse_block_size, layout_query, sparse_mode,
        pre_tokens, next_tokens, block_table=block_table, layout_kv=layout_kv,
        sinks=None if sinks is None else sinks.detach(),
    )
    if not return_softmax_lse:
        softmax_max = softmax_max.new_empty((0,))
        softmax_sum = softmax_sum.new_empty((0,))
    return out, softmax_max, softmax_sum


@npu_op(NPU_SPARSE_FLASH_ATTENTION_GRAD_SCHEMAS)
def npu_sparse_flash_attention_grad(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, d_out: Tensor, out: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, sparse_block_size: int,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_qlen=None, actual_seq_kvlen=None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
    attention_mode: int = 0,
):
    """torch_npu.npu_sparse_flash_attention_grad -> ``(d_query, d_key, d_value, d_query_rope, d_key_rope)``;
    like torch_npu the rope gradients are empty (0,) tensors without rope inputs, and the result is deterministic.
    """
    _check_attention_mode(attention_mode)
    return torch.ops.cann_attn.sparse_flash_attention_grad(
        query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum, require_real(scale_value,
        "scale_value"),
        sparse_block_size, query_rope, key_rope, to_int_list(actual_seq_qlen, "actual_seq_qlen"),
        to_int_list(actual_seq_kvlen, "actual_seq_kvlen"), layout, sparse_mode, pre_tokens, next_tokens, True,
    )[:5]


@npu_op(NPU_LIGHTNING_INDEXER_SCHEMAS, renamed={"layout": "layout_query"})
def npu_lightning_indexer(
    query: Tensor, key: Tensor, weights: Tensor, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
    block_table: Tensor | None = None, layout_query: str = "BSND", layout_key: str = "BSND",
    sparse_count: int = 2048, sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
    return_value: bool = False,
):
    """torch_npu.npu_lightning_indexer -> ``(sparse_indices, sparse_values)``; int32 indices [B, S1, 1, K] /
    [T1, 1, K]; sparse_values is an empty (0,) tensor unless ``return_value``."""
    _check_paged_outputs(layout_key, "return_value", return_value)
    return torch.ops.cann_attn.lightning_indexer(
        query, key, weights, to_int_list(actual_seq_lengths_query, "actual_seq_lengths_query"),
        to_int_list(actual_seq_lengths_key, "actual_seq_lengths_key"), layout_query, sparse_count, sparse_mode,
        return_value, block_table=block_table, layout_key=layout_key,
    )


@npu_op(NPU_SPARSE_LIGHTNING_INDEXER_GRAD_KL_LOSS_SCHEMAS)
def npu_sparse_lightning_indexer_grad_kl_loss(
    query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor, sparse_indices: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, *, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, actual_seq_qlen=None, actual_seq_klen=None, layout: str = "BSND",
    sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX, sinks: Tensor | None = None,
):
    """torch_npu.npu_sparse_lightning_indexer_grad_kl_loss -> ``(d_query_index, d_key_index, d_weights, loss)``
    (loss: fp32 [1], summed over all tokens; docs/operators/lightning_indexer.md)."""
    _check_sinks(sinks)
    return torch.ops.cann_attn.sparse_lightning_indexer_grad_kl_loss(
        query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum,
        require_real(scale_value, "scale_value"),
        query_rope, key_rope, to_int_list(actual_seq_qlen, "actual_seq_qlen"),
        to_int_list(actual_seq_klen, "actual_seq_klen"),
        layout, sparse_mode, pre_tokens, next_tokens, True,
    )
