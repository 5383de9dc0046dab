"""FlashAttentionScoreGradV2 (training backward; aclnnFlashAttentionScoreGradV2 documentation), all five layouts
including TND, which is the backward of FlashAttentionVarLenScore."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..backends import kernels, select_backend
from ..backends.reference import npu_attention
from ..backends.triton.dense_plan import dense_unsupported
from ..errors import ParamInvalidError, ParamNullptrError, require
from ..problem import layout as layouts
from ..problem import precision, stats
from ..traceable import traced_as_custom_op
from .fa_problem import build_problem
from .flash_attention_score import dense_forward

INT_MAX = 2147483647
GRAD_MODES = (0, 1, 2, 3, 4, 5, 6, 7, 8)


class FlashAttentionScoreGradResult(NamedTuple):
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dpse: torch.Tensor | None
    dsink: torch.Tensor | None = None


@traced_as_custom_op
def flash_attention_score_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dy: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    drop_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    q_start_idx=None,
    kv_start_idx=None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    inner_precise: int = 0,
    sparse_mode: int = 0,
    pse_type: int = 1,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    backend: str = "auto",
) -> FlashAttentionScoreGradResult:
    """Gradients of the FlashAttentionScore forward w.r.t. query, key, value and a pse tensor.

    Takes every forward parameter (docs/semantics/layouts.md, docs/semantics/masks.md, docs/semantics/invalid-rows.md,
    docs/semantics/pse.md, docs/semantics/dropout.md) plus `dy` (gradient of attention_out) and the forward's
    softmax_max / softmax_sum (same layout as produced, docs/semantics/softmax-stats.md) and attention_in (its
    output). P is
    recomputed from the given statistics without renormalisation; when they (or attention_in) are absent they
    are recomputed by the forward. dk / dv of GQA/MQA are summed over each query-head group. `dpse` is the real
    gradient w.r.t. a type 0/1 pse tensor in the pse's own shape (reduced over its broadcast dimensions, the
    compressed form included) and None for ALiBi types 2/3 or without pse. `softmax_in` and `padding_mask`
    are reserved and ignored. With `sink` (float32 [N1]) the given statistics are the sink-inclusive ones the forward
    wrote, and `dsink` ([N1], float32) is the gradient w.r.t. the sink, summed over batches and rows
    (docs/semantics/sinks.md); without a sink it is None.
    """
    problem, shapes = build_problem(
        query, key, value, head_num, input_layout,
        pse=pse, drop_mask=drop_mask, atten_mask=atten_mask, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, scale_value=scale_value,
        keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens,
        inner_precise=inner_precise, sparse_mode=sparse_mode, pse_type=pse_type,
        softmax_layout=softmax_layout, allowed_modes=GRAD_MODES, sink=sink,
    )
    out_shape = layouts.output_shape(input_layout, shapes.batch, shapes.total_q, shapes.heads_q, shapes.dim_v)
    _check_like(dy, "dy", out_shape, query.dtype)
    if attention_in is not None:
        _check_like(attention_in, "attention_in", out_shape, query.dtype)
    # dy and attention_in too: the kernels' int32 in-sequence offsets must fit for every tensor they index.
    kernel_tensors = {"q": query, "k": key, "v": value, "dy": dy,
                      **({} if attention_in is None else {"o": attention_in})}
    backend = select_backend(backend, query.device, op="flash_attention_score_grad",
                             unsupported=lambda: dense_unsupported(problem, query.dtype, tensors=kernel_tensors))
    stat_shape = stats.stats_shape(problem.tnd, shapes.batch, shapes.heads_q, shapes.total_q)
    if (softmax_max is None) != (softmax_sum is None):
        raise ParamInvalidError("softmax_max/softmax_sum: give both forward statistics or neither")
    stat_dtype = stats.accumulation_dtype(query.dtype)
    if softmax_max is not None:
        # Non-contiguous statistics are supported (GradV2 table, softmaxMax/SumOptional: 非连续Tensor √): the
        # kernels read them through strided views by logical index. Only TND with softmax_layout "" is
        # refused: there the [T, N1, 8] tensor's memory holds per-sequence [N1, Sq_b, 8] blocks
        # (docs/semantics/softmax-stats.md), so its meaning lies in the memory order, which a strided view
        # does not have.
        memory_layout = problem.tnd and problem.softmax_layout == ""
        for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
            require(isinstance(t, torch.Tensor) and t.dtype in (torch.float32, stat_dtype)
                    and tuple(t.shape) == stat_shape, name, f"float32 of shape {list(stat_shape)}", t)
            if memory_layout:
                require(t.is_contiguous(), name, "a contiguous tensor with TND and softmax_layout '' (its memory "
                        "holds per-sequence [N1, Sq, 8] blocks)", t)
    if softmax_max is None or attention_in is None:
        recomputed_out, new_max, new_sum = dense_forward(problem, shapes, backend, query, key, value)
        if softmax_max is None:
            softmax_max, softmax_sum = new_max, new_sum
        if attention_in is None:
            attention_in = recomputed_out

    dq = torch.zeros_like(query)
    dk = torch.zeros_like(key)
    dv = torch.zeros_like(value)
    has_pse_tensor = pse is not None and pse_type in (0, 1)
    dpse_acc = torch.zeros(pse.shape, dtype=stat_dtype, device=pse.device) if has_pse_tensor else None
    # The backends add the sink's gradient terms (docs/semantics/sinks.md) where they form rowsum(dY * O) anyway.
    dsink_acc = None if problem.sink is None else torch.zeros(problem.heads_q, dtype=stat_dtype, device=dy.device)
    if query.numel() > 0 and key.numel() > 0 and precision.npu_mode():
        npu_attention.backward(problem, precision.fa_grad_pipeline(query.dtype), query, key, value, dy, attention_in,
                               softmax_max, softmax_sum, dq, dk, dv, dpse_acc, dsink_acc=dsink_acc)
    elif query.numel() > 0 and key.numel() > 0:
        kernels("dense_backward", backend).backward(problem, query, key, value, dy, attention_in, softmax_max,
                                                    softmax_sum, dq, dk, dv, dpse_acc, dsink_acc=dsink_acc)
    dpse = dpse_acc.to(pse.dtype) if dpse_acc is not None else None
    dsink = None if dsink_acc is None else dsink_acc.to(device=problem.sink.device, dtype=problem.sink.dtype)
    return FlashAttentionScoreGradResult(dq, dk, dv, dpse, dsink)


def _check_like(t, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if t is None:
        raise ParamNullptrError(f"{name}: a required input, got None")
    require(isinstance(t, torch.Tensor), name, "a torch.Tensor", t)
    require(tuple(t.shape) == tuple(shape) and t.dtype == dtype, name,
            f"dtype {dtype} and the attention output's shape {list(shape)}", t)

