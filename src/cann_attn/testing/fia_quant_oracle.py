"""Float64 oracle of FusedInferAttentionScore v2's quantised calls (docs/operators/fused_infer_attention_score.md,
"Quantised queries and fp8 caches"), written from op-plugin's npu_fused_infer_attention_score_v2 page: every
quantised operand stands for its value times its scale (the int8 MLA query per token and head, the int8 latent per
tensor, paged caches per cached token), and attention is then the float formula of `fia_oracle` over those float64
values (no intermediate rounding). The int8 MLA score is dequant_scale_query * dequant_scale_key * (q8 . k8 +
q_rope . k_rope): the rope product is scaled with the int8 one (ops-transformer's IncreFlashAttention MLA
full-quant kernel adds it before dequantising; MlaProlog's int8 query hands over query_rope pre-divided
accordingly), so the query rope stands for query_rope * dequant_scale_query * dequant_scale_key."""

from __future__ import annotations

import torch

from .fia_oracle import fia_oracle

__all__ = ["dequantised_mla_operands", "dequantised_paged_tokens", "dequantised_values", "int8_mla_oracle"]


def dequantised_values(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * scale in float64, `scale` broadcasting against x."""
    return x.to(torch.float64) * scale.to(torch.float64)


def dequantised_mla_operands(query, key, value, query_rope, dequant_scale_query, dequant_scale_key,
                             dequant_scale_value) -> tuple[torch.Tensor, ...]:
    """(query, key, value, query_rope) of the int8 MLA call as the float64 values they stand for: the query per
    token and head (`dequant_scale_query`: the query's shape without D; [B, S, N] for BSH, which packs the heads),
    key / value times their one scale, the query rope times dequant_scale_query * dequant_scale_key."""
    q = dequantised_values(query.reshape(*dequant_scale_query.shape, -1), dequant_scale_query.unsqueeze(-1))
    score_scale = dequant_scale_query.to(torch.float64) * dequant_scale_key.to(torch.float64).reshape(())
    q_rope = dequantised_values(query_rope.reshape(*dequant_scale_query.shape, -1), score_scale.unsqueeze(-1))
    return (q.reshape(query.shape), dequantised_values(key, dequant_scale_key.reshape(())),
            dequantised_values(value, dequant_scale_value.reshape(())), q_rope.reshape(query_rope.shape))


def dequantised_paged_tokens(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A paged cache with one scale per cached token (key/value_quant_mode 4: `scale` [block_num, block_size]) as
    the values it stands for, rounded once to the query's `dtype` as the anti-quantised caches of the page are
    (float64 tensor): [block_num, block_size, H] or [block_num, N, block_size, D]."""
    per_token = scale.unsqueeze(-1) if cache.dim() == 3 else scale[:, None, :, None]
    return dequantised_values(cache, per_token).to(dtype).to(torch.float64)


def int8_mla_oracle(query, key, value, *, query_rope, key_rope, dequant_scale_query, dequant_scale_key,
                    dequant_scale_value, num_heads: int, scale: float, input_layout: str, **kwargs):
    """(attention_out float64, softmax_lse) of the int8 MLA call over contiguous keys: query [.., N, 512] with
    `dequant_scale_query` per token and head (the query's shape without D; [B, S, N] for BSH), key/value the int8
    latent with one scale each."""
    q, k, v, q_rope = dequantised_mla_operands(query, key, value, query_rope, dequant_scale_query, dequant_scale_key,
                                               dequant_scale_value)
    return fia_oracle(q, k, v, query_rope=q_rope, key_rope=key_rope.to(torch.float64), num_heads=num_heads,
                      num_key_value_heads=1, scale=scale, input_layout=input_layout, **kwargs)
