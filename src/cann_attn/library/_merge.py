"""Custom ops of the context-parallel merges: RingAttentionUpdate and AttentionUpdate
(docs/operators/ring_attention_update.md, docs/operators/attention_update.md)."""

import torch
from torch import Tensor

from ..ops.attention_update import AttentionUpdateResult
from ..ops.attention_update import attention_update as _eager_attention_update
from ..ops.ring_attention_update import RingAttentionUpdateResult
from ..ops.ring_attention_update import ring_attention_update as _eager_ring_attention_update
from ..problem.lengths import to_int_list
from ._outputs import _empty_like_none, _none_if_placeholder


# ============================================================== RingAttentionUpdate and AttentionUpdate (merges)
@torch.library.custom_op("cann_attn::ring_attention_update", mutates_args=())
def _ring_update_op(
    prev_attn_out: Tensor, prev_softmax_max: Tensor, prev_softmax_sum: Tensor, cur_attn_out: Tensor,
    cur_softmax_max: Tensor, cur_softmax_sum: Tensor, actual_seq_qlen: list[int] | None = None,
    input_layout: str = "SBH", input_softmax_layout: str = "", backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """RingAttentionUpdate -> (attn_out, softmax_max, softmax_sum)."""
    return tuple(_eager_ring_attention_update(
        prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max, cur_softmax_sum,
        actual_seq_qlen=actual_seq_qlen, input_layout=input_layout, input_softmax_layout=input_softmax_layout,
        backend=backend,
    ))


@_ring_update_op.register_fake
def _(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max, cur_softmax_sum,
      actual_seq_qlen=None, input_layout="SBH", input_softmax_layout="", backend="auto"):
    return (torch.empty_like(prev_attn_out), torch.empty_like(prev_softmax_max),
            torch.empty_like(prev_softmax_sum))


def ring_attention_update(
    prev_attn_out: Tensor, prev_softmax_max: Tensor, prev_softmax_sum: Tensor, cur_attn_out: Tensor,
    cur_softmax_max: Tensor, cur_softmax_sum: Tensor, *, actual_seq_qlen=None, input_layout: str = "SBH",
    input_softmax_layout: str = "", backend: str = "auto",
) -> RingAttentionUpdateResult:
    """``cann_attn.ring_attention_update`` through the ``cann_attn::ring_attention_update`` custom op."""
    return RingAttentionUpdateResult(*torch.ops.cann_attn.ring_attention_update(
        prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max, cur_softmax_sum,
        to_int_list(actual_seq_qlen, "actual_seq_qlen"), input_layout, input_softmax_layout, backend,
    ))


@torch.library.custom_op("cann_attn::attention_update", mutates_args=())
def _attention_update_op(lse: list[Tensor], local_out: list[Tensor], update_type: int, backend: str = "auto"
                         ) -> tuple[Tensor, Tensor]:
    """AttentionUpdate -> (out, lse_out); lse_out is an empty (0,) tensor when update_type == 0."""
    result = _eager_attention_update(lse, local_out, update_type, backend=backend)
    lse_out = result.lse_out if result.lse_out is not None else _empty_like_none(lse[0])
    return result.out, lse_out


@_attention_update_op.register_fake
def _(lse, local_out, update_type, backend="auto"):
    lse_out = torch.empty_like(lse[0]) if update_type == 1 else _empty_like_none(lse[0])
    return torch.empty_like(local_out[0]), lse_out


def attention_update(lse, local_out, update_type: int, *, backend: str = "auto") -> AttentionUpdateResult:
    """``cann_attn.attention_update`` through the ``cann_attn::attention_update`` custom op (lse_out None when
    update_type == 0)."""
    out, lse_out = torch.ops.cann_attn.attention_update(list(lse), list(local_out), update_type, backend)
    return AttentionUpdateResult(out, _none_if_placeholder(lse_out, update_type == 1))
