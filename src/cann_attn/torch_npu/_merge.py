"""torch_npu's merge operators of context-parallel attention (docs/operators/ring_attention_update.md,
docs/operators/attention_update.md); signatures as op-plugin's op_plugin_functions.yaml.

They call the cann_attn operators, which validate eagerly (errors name the parameter, not a schema cast) and turn
into the ``cann_attn::*`` custom ops while torch.compile traces."""

from __future__ import annotations

from torch import Tensor

from ..ops.attention_update import attention_update
from ..ops.ring_attention_update import ring_attention_update
from ._registry import npu_op

NPU_RING_ATTENTION_UPDATE_SCHEMAS = {
    ("current",): (
        "npu_ring_attention_update(Tensor prev_attn_out, Tensor prev_softmax_max, Tensor prev_softmax_sum, "
        "Tensor cur_attn_out, Tensor cur_softmax_max, Tensor cur_softmax_sum, *, Tensor? actual_seq_qlen=None, "
        'str input_layout="SBH", str input_softmax_layout="") -> (Tensor, Tensor, Tensor)'
    ),
}

NPU_ATTENTION_UPDATE_SCHEMAS = {
    ("7.2", "7.3", "26.0", "current"): (
        "npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type) -> (Tensor, Tensor)"
    ),
}


@npu_op(NPU_RING_ATTENTION_UPDATE_SCHEMAS)
def npu_ring_attention_update(
    prev_attn_out: Tensor, prev_softmax_max: Tensor, prev_softmax_sum: Tensor, cur_attn_out: Tensor,
    cur_softmax_max: Tensor, cur_softmax_sum: Tensor, *, actual_seq_qlen: Tensor | None = None,
    input_layout: str = "SBH", input_softmax_layout: str = "",
) -> tuple[Tensor, Tensor, Tensor]:
    """torch_npu.npu_ring_attention_update -> (attn_out, softmax_max, softmax_sum). ``actual_seq_qlen`` (TND):
    int64 cumulative lengths from 0, ``[0, S_1, S_1 + S_2, ..., T]``."""
    return tuple(ring_attention_update(
        prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max, cur_softmax_sum,
        actual_seq_qlen=actual_seq_qlen, input_layout=input_layout, input_softmax_layout=input_softmax_layout,
    ))


@npu_op(NPU_ATTENTION_UPDATE_SCHEMAS)
def npu_attention_update(lse: list[Tensor], local_out: list[Tensor], update_type: int
                         ) -> tuple[Tensor, Tensor | None]:
    """torch_npu.npu_attention_update -> (out, lse_out); lse_out is None when ``update_type == 0`` (op-plugin leaves
    that output undefined)."""
    return tuple(attention_update(lse, local_out, update_type))
