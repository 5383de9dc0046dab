"""Differentiable entry points pairing each forward operator with its grad operator (DESIGN.md)."""

from __future__ import annotations

import torch

from .ops.flash_attention_score import INT_MAX, flash_attention_score
from .ops.flash_attention_score_grad import flash_attention_score_grad
from .problem.dropout import drop_mask_numel, gen_drop_mask
from .problem.lengths import to_int_list


class _FlashAttentionFunction(torch.autograd.Function):
    """Saves exactly what FlashAttentionScoreGradV2 consumes: inputs, output, softmax statistics, drop mask."""

    @staticmethod
    def forward(ctx, query, key, value, pse, drop_mask, options: dict):
        result = flash_attention_score(query, key, value, pse=pse, drop_mask=drop_mask, **options)
        ctx.save_for_backward(query, key, value, pse, drop_mask, result.attention_out, result.softmax_max,
                              result.softmax_sum)
        ctx.options = options
        ctx.mark_non_differentiable(result.softmax_max, result.softmax_sum)
        return result.attention_out

    @staticmethod
    def backward(ctx, dy):
        query, key, value, pse, drop_mask, out, softmax_max, softmax_sum = ctx.saved_tensors
        grads = flash_attention_score_grad(
            query, key, value, dy.contiguous(), pse=pse, drop_mask=drop_mask, softmax_max=softmax_max,
            softmax_sum=softmax_sum, attention_in=out, **ctx.options,
        )
        dpse = grads.dpse if pse is not None and ctx.needs_input_grad[3] else None
        return grads.dq, grads.dk, grads.dv, dpse, None, None


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    q_start_idx=None,
    kv_start_idx=None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    dropout_p: float | None = None,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    inner_precise: int = 0,
    sparse_mode: int = 0,
    pse_type: int = 1,
    softmax_layout: str = "",
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Differentiable FlashAttentionScore: returns attention_out; gradients flow to query, key, value and a
    type 0/1 pse tensor through FlashAttentionScoreGradV2.

    Takes `flash_attention_score`'s parameters except `drop_mask`: with `keep_prob < 1` (or `dropout_p =
    1 - keep_prob`) a bit-packed mask is drawn from `generator` (SEMANTICS.md 5), saved and reused by the
    backward, so a seeded generator makes forward and backward reproducible.
    """
    if dropout_p is not None:
        keep_prob = 1.0 - float(dropout_p)
    drop_mask = None
    if 0.0 < keep_prob < 1.0:
        if input_layout == "TND":
            numel = drop_mask_numel(head_num, actual_seq_qlen=to_int_list(actual_seq_qlen, "actual_seq_qlen"),
                                    actual_seq_kvlen=to_int_list(actual_seq_kvlen, "actual_seq_kvlen"))
        else:
            numel = drop_mask_numel(head_num, **_dense_sizes(query, key, input_layout))
        drop_mask = gen_drop_mask(numel, keep_prob, generator=generator, device=query.device)
    options = dict(
        head_num=head_num, input_layout=input_layout, padding_mask=padding_mask, atten_mask=atten_mask,
        prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=keep_prob,
        pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode,
        pse_type=pse_type, softmax_layout=softmax_layout, backend=backend,
    )
    return _FlashAttentionFunction.apply(query, key, value, pse, drop_mask, options)


def _dense_sizes(query: torch.Tensor, key: torch.Tensor, layout: str) -> dict:
    b_axis, s_axis = {"BSH": (0, 1), "SBH": (1, 0), "BSND": (0, 1), "BNSD": (0, 2)}.get(layout, (0, 1))
    return {"batch": query.shape[b_axis], "seq_q": query.shape[s_axis], "seq_kv": key.shape[s_axis]}
