"""IncreFlashAttention (torch_npu.npu_incre_flash_attention): decode attention, Q_S = 1
(docs/operators/incre_flash_attention.md).

The decode branch of FusedInferAttentionScore under IFA's argument names: `actual_seq_lengths` are the key/value
lengths, `antiquant_scale` / `antiquant_offset` the combined per-channel (or per-tensor) KV factors, and
`inner_precise` defaults to 1. The output alone is returned.
"""

from __future__ import annotations

import torch

from ..errors import ParamInvalidError, describe
from ..traceable import traced_as_custom_op
from .fused_infer_attention_score import fused_infer_attention_score, renamed_errors

IFA_LAYOUTS = ("BSH", "BSND", "BNSD")
IFA_NAMES = {"actual_seq_lengths_kv": "actual_seq_lengths", "scale": "scale_value"}


@traced_as_custom_op
def incre_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    pse_shift: torch.Tensor | None = None,
    actual_seq_lengths=None,
    antiquant_scale: torch.Tensor | None = None,
    antiquant_offset: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    dequant_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    dequant_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    kv_padding_size: torch.Tensor | None = None,
    num_heads: int = 1,
    scale_value: float = 1.0,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    block_size: int = 0,
    inner_precise: int = 1,
    backend: str = "auto",
) -> torch.Tensor:
    """softmax(scale_value * q K^T + pse_shift, masked) V for one query token per batch (Q_S = 1), over each batch's
    first `actual_seq_lengths[b]` keys (docs/operators/incre_flash_attention.md). Output: the query's shape, dtype
    int8 with quant_scale2, else the query's."""
    if padding_mask is not None:
        raise ParamInvalidError(f"padding_mask: reserved by the documentation (leave it None), got "
                                f"{describe(padding_mask)}")
    if not isinstance(input_layout, str) or input_layout not in IFA_LAYOUTS:
        raise ParamInvalidError(f"input_layout: expected one of {list(IFA_LAYOUTS)}, got {input_layout!r}")
    if isinstance(query, torch.Tensor) and query.dim() in (3, 4):
        seq = query.shape[2] if input_layout == "BNSD" else query.shape[1]
        if seq != 1:
            raise ParamInvalidError(f"query: IncreFlashAttention computes one query token (S=1), got "
                                    f"{describe(query)} in layout {input_layout}")
    for name, t in (("dequant_scale1", dequant_scale1), ("quant_scale1", quant_scale1),
                    ("dequant_scale2", dequant_scale2)):
        if t is not None:
            raise ParamInvalidError(f"{name}: int8 query/key/value are not supported by IncreFlashAttention, got "
                                    f"{describe(t)}")
    with renamed_errors(IFA_NAMES):
        out, _ = fused_infer_attention_score(
            query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, actual_seq_lengths_kv=actual_seq_lengths,
            quant_scale2=quant_scale2, quant_offset2=quant_offset2, antiquant_scale=antiquant_scale,
            antiquant_offset=antiquant_offset, block_table=block_table, kv_padding_size=kv_padding_size,
            num_heads=num_heads, scale=scale_value, input_layout=input_layout,
            num_key_value_heads=num_key_value_heads, block_size=block_size, inner_precise=inner_precise,
            backend=backend,
        )
    return out
