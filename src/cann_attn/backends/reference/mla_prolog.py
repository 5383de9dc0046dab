"""Reference computation of MlaProlog on token rows (docs/operators/mla_prolog.md).

The products and norms run in float32 (float64 for float64 inputs) and are rounded to the input dtype where the
operator keeps its intermediates in it: after x W^DQ, after the query RmsNorm (also the query_norm output), after
c^Q W^UQQR, after x W^DKVKR, and at the outputs. For float32 / float64 inputs the roundings change nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ...problem.quant import round_to_int8
from ...problem.rmsnorm import rms_norm
from ...problem.rope import interleaved_rope

if TYPE_CHECKING:
    from ...ops.mla_prolog import MlaPrologProblem


class MlaPrologRows(NamedTuple):
    """Per token row, in the input dtype: query [T, N, Hckv], query_rope [T, N, Dr], query_norm [T, Hcq] (c^Q),
    latent [T, Hckv] and key_rope [T, Dr] (what goes into the caches)."""

    query: torch.Tensor
    query_rope: torch.Tensor
    query_norm: torch.Tensor
    latent: torch.Tensor
    key_rope: torch.Tensor
    query_norm_scale: torch.Tensor | None  # float32 [T, 1] when c^Q is quantised (query_norm is then int8)


def mla_prolog(problem: MlaPrologProblem, x: torch.Tensor, weight_dq: torch.Tensor, weight_uq_qr: torch.Tensor,
               weight_uk: torch.Tensor, weight_dkv_kr: torch.Tensor, gamma_cq: torch.Tensor, gamma_ckv: torch.Tensor,
               sin: torch.Tensor, cos: torch.Tensor, dequant_scale_w_uq_qr: torch.Tensor | None = None,
               smooth_scales_cq: torch.Tensor | None = None) -> MlaPrologRows:
    """The rows of x [T, He] (sin / cos [T, Dr])."""
    dtype = x.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32

    def kept(t: torch.Tensor) -> torch.Tensor:
        """t as the operator keeps it between its stages: rounded to the input dtype, widened again."""
        return t.to(dtype).to(compute)

    p = problem
    xc = x.to(compute)
    sin_c, cos_c = sin.to(compute), cos.to(compute)
    c_q = kept(p.qc_qr_scale * rms_norm(kept(xc @ weight_dq.to(compute)), gamma_cq, p.epsilon_cq))
    q_norm, q_norm_scale = c_q.to(dtype), None
    if p.quantized_uq_qr:
        q_norm, q_norm_scale = quantize_per_token(c_q, smooth_scales_cq)
        # int8 x int8 sums are exact in float64 (an fp32 sum of 1536 products can exceed 2^24), then dequantised
        exact = (q_norm.double() @ weight_uq_qr.double()).to(compute)
        up = exact * q_norm_scale * dequant_scale_w_uq_qr.to(compute)
        q_norm_scale = q_norm_scale.to(torch.float32)
    else:
        up = c_q @ weight_uq_qr.to(compute)
    per_head = kept(up).view(-1, p.heads, p.nope_dim + p.rope_dim)
    q_nope, q_rope = per_head[..., : p.nope_dim], per_head[..., p.nope_dim :]
    query = torch.einsum("tnd,ndc->tnc", q_nope, weight_uk.to(compute)).contiguous()  # [T, N, Hckv] rows
    query_rope = interleaved_rope(q_rope, cos_c.unsqueeze(1), sin_c.unsqueeze(1))
    kv = kept(xc @ weight_dkv_kr.to(compute))
    latent = p.kc_scale * rms_norm(kv[:, : p.latent], gamma_ckv, p.epsilon_ckv)
    key_rope = interleaved_rope(kv[:, p.latent :], cos_c, sin_c)
    return MlaPrologRows(query.to(dtype), query_rope.to(dtype), q_norm, latent.to(dtype), key_rope.to(dtype),
                         q_norm_scale)


def quantize_per_token(c_q: torch.Tensor, smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic int8 quantisation of the query latent rows (the design note's formula): v = c^Q * smooth,
    scale = max |v| / 127 per row ([T, 1], in c_q's dtype), int8 round(v / scale), ties to even; a zero row gives
    zeros."""
    v = c_q if smooth is None else c_q * smooth.to(c_q.dtype).reshape(1, -1)
    scale = v.abs().amax(dim=-1, keepdim=True) / 127
    values = round_to_int8(torch.where(scale > 0, v / torch.where(scale > 0, scale, 1), 0))
    return values, scale
