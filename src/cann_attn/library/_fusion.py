"""Custom ops of FlashAttentionScore, its var-len spelling and its grad, with autograd
(docs/operators/flash_attention_score.md)."""

import torch
from torch import Tensor

from ..errors import require_real
from ..ops.flash_attention_score import (
    INT_MAX,
    FlashAttentionScoreResult,
)
from ..ops.flash_attention_score import (
    flash_attention_score as _eager_flash_attention_score,
)
from ..ops.flash_attention_score import (
    flash_attention_var_len_score as _eager_flash_attention_var_len_score,
)
from ..ops.flash_attention_score_grad import FlashAttentionScoreGradResult
from ..ops.flash_attention_score_grad import flash_attention_score_grad as _eager_flash_attention_score_grad
from ..problem.layout import BATCH_SEQ_DIMS
from ..problem.lengths import to_int_list
from ..problem.stats import accumulation_dtype
from ._outputs import _empty_like_none, _none_if_placeholder

# ================================================================================ FlashAttentionScore (+ VarLen)
_FA_NAMES = (
    "query", "key", "value", "head_num", "input_layout", "pse", "drop_mask", "padding_mask", "atten_mask", "prefix",
    "actual_seq_qlen", "actual_seq_kvlen", "q_start_idx", "kv_start_idx", "scale_value", "keep_prob", "pre_tokens",
    "next_tokens", "inner_precise", "sparse_mode", "pse_type", "softmax_layout", "backend", "sink",
)
# Forward arguments the grad op takes unchanged, in its keyword names.
_FA_SHARED = (
    "head_num", "input_layout", "prefix", "actual_seq_qlen", "actual_seq_kvlen", "q_start_idx", "kv_start_idx",
    "scale_value", "keep_prob", "pre_tokens", "next_tokens", "inner_precise", "sparse_mode", "pse_type",
    "softmax_layout", "backend",
)


def _fa_call(eager, query, key, value, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask, prefix,
             actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx, scale_value, keep_prob, pre_tokens,
             next_tokens, inner_precise, sparse_mode, pse_type, softmax_layout, backend, sink):
    result = eager(
        query, key, value, head_num, input_layout, pse=pse, drop_mask=drop_mask, padding_mask=padding_mask,
        atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=keep_prob,
        pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode,
        pse_type=pse_type, softmax_layout=softmax_layout, backend=backend, sink=sink,
    )
    return tuple(result)


@torch.library.custom_op("cann_attn::flash_attention_score", mutates_args=())
def _fa_op(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, pse: Tensor | None = None,
    drop_mask: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    prefix: list[int] | None = None, actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None, q_start_idx: list[int] | None = None,
    kv_start_idx: list[int] | None = None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, inner_precise: int = 0, sparse_mode: int = 0,
    pse_type: int = 1, softmax_layout: str = "", backend: str = "auto", sink: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FlashAttentionScore -> (attention_out, softmax_max, softmax_sum, softmax_out)."""
    return _fa_call(_eager_flash_attention_score, query, key, value, head_num, input_layout, pse, drop_mask,
                    padding_mask, atten_mask, prefix, actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx,
                    scale_value, keep_prob, pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type,
                    softmax_layout, backend, sink)


@torch.library.custom_op("cann_attn::flash_attention_var_len_score", mutates_args=())
def _fa_varlen_op(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str = "TND", pse: Tensor | None = None,
    drop_mask: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    prefix: list[int] | None = None, actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None, q_start_idx: list[int] | None = None,
    kv_start_idx: list[int] | None = None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, inner_precise: int = 0, sparse_mode: int = 0,
    pse_type: int = 1, softmax_layout: str = "", backend: str = "auto", sink: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FlashAttentionVarLenScore (TND) -> (attention_out, softmax_max, softmax_sum, softmax_out)."""
    return _fa_call(_eager_flash_attention_var_len_score, query, key, value, head_num, input_layout, pse, drop_mask,
                    padding_mask, atten_mask, prefix, actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx,
                    scale_value, keep_prob, pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type,
                    softmax_layout, backend, sink)


def _fa_out_shape(query: Tensor, key: Tensor, value: Tensor, head_num: int, layout: str) -> tuple:
    """attention_out: the query's layout with value's head dim (docs/semantics/layouts.md)."""
    if layout in ("BSH", "SBH"):
        head_dim = query.shape[2] // head_num
        heads_kv = key.shape[2] // head_dim
        return (query.shape[0], query.shape[1], head_num * (value.shape[2] // heads_kv))
    if layout in ("BSND", "BNSD"):
        return (*query.shape[:3], value.shape[3])
    return (query.shape[0], query.shape[1], value.shape[2])  # TND keeps the token count


def _fa_stat_shape(query: Tensor, head_num: int, layout: str) -> tuple:
    """softmax_max / softmax_sum: [B, N1, Sq, 8], TND [T, N1, 8] (docs/semantics/softmax-stats.md)."""
    if layout == "TND":
        return (query.shape[0], head_num, 8)
    batch, seq = BATCH_SEQ_DIMS[layout]
    return (query.shape[batch], head_num, query.shape[seq], 8)


def _fa_fake(query, key, value, head_num, input_layout, *args, **kwargs):
    stat_dtype = accumulation_dtype(query.dtype)
    stat_shape = _fa_stat_shape(query, head_num, input_layout)
    return (
        query.new_empty(_fa_out_shape(query, key, value, head_num, input_layout)),
        query.new_empty(stat_shape, dtype=stat_dtype),
        query.new_empty(stat_shape, dtype=stat_dtype),
        query.new_empty((0,)),
    )


_fa_op.register_fake(_fa_fake)
_fa_varlen_op.register_fake(_fa_fake)


def _fa_setup_context(ctx, inputs, output):
    args = dict(zip(_FA_NAMES, inputs, strict=False))
    attention_out, softmax_max, softmax_sum, softmax_out = output
    ctx.save_for_backward(args["query"], args["key"], args["value"], args["pse"], args["drop_mask"],
                          args["atten_mask"], attention_out, softmax_max, softmax_sum, args.get("sink"))
    ctx.options = {name: args[name] for name in _FA_SHARED if name in args}
    ctx.mark_non_differentiable(softmax_max, softmax_sum, softmax_out)


def _fa_backward(ctx, d_out, d_max, d_sum, d_softmax_out):
    query, key, value, pse, drop_mask, atten_mask, attention_out, softmax_max, softmax_sum, sink = ctx.saved_tensors
    options = ctx.options
    dq, dk, dv, dpse, dsink = torch.ops.cann_attn.flash_attention_score_grad(
        query, key, value, d_out.contiguous(), options["head_num"], options["input_layout"], pse=pse,
        drop_mask=drop_mask, atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
        attention_in=attention_out, sink=sink,
        **{k: v for k, v in options.items() if k not in ("head_num", "input_layout")},
    )
    pse_grad = None
    if pse is not None and options["pse_type"] in (0, 1) and ctx.needs_input_grad[_FA_NAMES.index("pse")]:
        pse_grad = dpse
    sink_grad = dsink if sink is not None and ctx.needs_input_grad[_FA_NAMES.index("sink")] else None
    grads = {"query": dq, "key": dk, "value": dv, "pse": pse_grad, "sink": sink_grad}
    return tuple(grads.get(name) for name in _FA_NAMES)


_fa_op.register_autograd(_fa_backward, setup_context=_fa_setup_context)
_fa_varlen_op.register_autograd(_fa_backward, setup_context=_fa_setup_context)


@torch.library.custom_op("cann_attn::flash_attention_score_grad", mutates_args=())
def _fa_grad_op(
    query: Tensor, key: Tensor, value: Tensor, dy: Tensor, head_num: int, input_layout: str,
    pse: Tensor | None = None, drop_mask: Tensor | None = None, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, softmax_max: Tensor | None = None, softmax_sum: Tensor | None = None,
    softmax_in: Tensor | None = None, attention_in: Tensor | None = None, prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None, actual_seq_kvlen: list[int] | None = None,
    q_start_idx: list[int] | None = None, kv_start_idx: list[int] | None = None, scale_value: float = 1.0,
    keep_prob: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, inner_precise: int = 0,
    sparse_mode: int = 0, pse_type: int = 1, softmax_layout: str = "", backend: str = "auto",
    sink: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FlashAttentionScoreGradV2 -> (dq, dk, dv, dpse, dsink); dpse is an empty (0,) tensor without a type 0/1
    pse, dsink one without a sink."""
    result = _eager_flash_attention_score_grad(
        query, key, value, dy, head_num, input_layout, pse=pse, drop_mask=drop_mask, padding_mask=padding_mask,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in,
        attention_in=attention_in, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx,
        scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens,
        inner_precise=inner_precise, sparse_mode=sparse_mode, pse_type=pse_type, softmax_layout=softmax_layout,
        backend=backend, sink=sink,
    )
    dpse = result.dpse if result.dpse is not None else _empty_like_none(query)
    dsink = result.dsink if result.dsink is not None else _empty_like_none(query, torch.float32)
    return result.dq, result.dk, result.dv, dpse, dsink


@_fa_grad_op.register_fake
def _(query, key, value, dy, head_num, input_layout, pse=None, drop_mask=None, padding_mask=None, atten_mask=None,
      softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, prefix=None, actual_seq_qlen=None,
      actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None, scale_value=1.0, keep_prob=1.0, pre_tokens=INT_MAX,
      next_tokens=INT_MAX, inner_precise=0, sparse_mode=0, pse_type=1, softmax_layout="", backend="auto", sink=None):
    dpse = pse.new_empty(pse.shape) if pse is not None and pse_type in (0, 1) else _empty_like_none(query)
    dsink = sink.new_empty(sink.shape) if sink is not None else _empty_like_none(query, torch.float32)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dpse, dsink


def flash_attention_score(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, *, pse: Tensor | None = None,
    drop_mask: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None,
    scale_value: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX,
    inner_precise: int = 0, sparse_mode: int = 0, pse_type: int = 1, softmax_layout: str = "",
    sink: Tensor | None = None, backend: str = "auto",
) -> FlashAttentionScoreResult:
    """``cann_attn.flash_attention_score`` through the ``cann_attn::flash_attention_score`` custom op:
    traceable by torch.compile and differentiable (gradients to query, key, value and a type 0/1 pse)."""
    return FlashAttentionScoreResult(*torch.ops.cann_attn.flash_attention_score(
        query, key, value, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask,
        to_int_list(prefix, "prefix"), to_int_list(actual_seq_qlen, "actual_seq_qlen"),
        to_int_list(actual_seq_kvlen, "actual_seq_kvlen"), to_int_list(q_start_idx, "q_start_idx"),
        to_int_list(kv_start_idx, "kv_start_idx"), require_real(scale_value, "scale_value"),
        require_real(keep_prob, "keep_prob"), pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type,
        softmax_layout, backend, sink,
    ))


def flash_attention_var_len_score(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str = "TND", *,
    pse: Tensor | None = None, drop_mask: Tensor | None = None, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, q_start_idx=None,
    kv_start_idx=None, scale_value: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX, inner_precise: int = 0, sparse_mode: int = 0, pse_type: int = 1,
    softmax_layout: str = "", sink: Tensor | None = None, backend: str = "auto",
) -> FlashAttentionScoreResult:
    """``cann_attn.flash_attention_var_len_score`` through the ``cann_attn::flash_attention_var_len_score`` op."""
    return FlashAttentionScoreResult(*torch.ops.cann_attn.flash_attention_var_len_score(
        query, key, value, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask,
        to_int_list(prefix, "prefix"), to_int_list(actual_seq_qlen, "actual_seq_qlen"),
        to_int_list(actual_seq_kvlen, "actual_seq_kvlen"), to_int_list(q_start_idx, "q_start_idx"),
        to_int_list(kv_start_idx, "kv_start_idx"), require_real(scale_value, "scale_value"),
        require_real(keep_prob, "keep_prob"), pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type,
        softmax_layout, backend, sink,
    ))


def flash_attention_score_grad(
    query: Tensor, key: Tensor, value: Tensor, dy: Tensor, head_num: int, input_layout: str, *,
    pse: Tensor | None = None, drop_mask: Tensor | None = None, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, softmax_max: Tensor | None = None, softmax_sum: Tensor | None = None,
    softmax_in: Tensor | None = None, attention_in: Tensor | None = None, prefix=None, actual_seq_qlen=None,
    actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, inner_precise: int = 0, sparse_mode: int = 0,
    pse_type: int = 1, softmax_layout: str = "", sink: Tensor | None = None, backend: str = "auto",
) -> FlashAttentionScoreGradResult:
    """``cann_attn.flash_attention_score_grad`` through the ``cann_attn::flash_attention_score_grad`` op; dpse is
    None without a type 0/1 pse tensor, dsink None without a sink."""
    dq, dk, dv, dpse, dsink = torch.ops.cann_attn.flash_attention_score_grad(
        query, key, value, dy, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask, softmax_max,
        softmax_sum, softmax_in, attention_in, to_int_list(prefix, "prefix"),
        to_int_list(actual_seq_qlen, "actual_seq_qlen"), to_int_list(actual_seq_kvlen, "actual_seq_kvlen"),
        to_int_list(q_start_idx, "q_start_idx"), to_int_list(kv_start_idx, "kv_start_idx"),
        require_real(scale_value, "scale_value"), require_real(keep_prob, "keep_prob"), pre_tokens, next_tokens,
        inner_precise, sparse_mode, pse_type, softmax_layout, backend, sink,
    )
    return FlashAttentionScoreGradResult(dq, dk, dv, _none_if_placeholder(dpse, pse is not None and pse_type in (0, 1)),
                                         _none_if_placeholder(dsink, sink is not None))
