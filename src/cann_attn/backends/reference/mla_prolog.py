"""Reference computation of MlaProlog on token rows (docs/operators/mla_prolog.md).

The products and norms run in float32 (float64 for float64 inputs) and are rounded to the input dtype where the
operator keeps its intermediates in it: after x W^DQ, after the query RmsNorm (also the query_norm output), after
c^Q W^UQQR, after x W^DKVKR, and at the outputs. For float32 / float64 inputs the roundings change nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

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


def mla_prolog(problem: MlaPrologProblem, x: torch.Tensor, weight_dq: torch.Tensor, weight_uq_qr: torch.Tensor,
               weight_uk: torch.Tensor, weight_dkv_kr: torch.Tensor, gamma_cq: torch.Tensor, gamma_ckv: torch.Tensor,
               sin: torch.Tensor, cos: torch.Tensor) -> MlaPrologRows:
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
    per_head = kept(c_q @ weight_uq_qr.to(compute)).view(-1, p.heads, p.nope_dim + p.rope_dim)
    q_nope, q_rope = per_head[..., : p.nope_dim], per_head[..., p.nope_dim :]
    query = torch.einsum("tnd,ndc->tnc", q_nope, weight_uk.to(compute)).contiguous()  # [T, N, Hckv] rows
    query_rope = interleaved_rope(q_rope, cos_c.unsqueeze(1), sin_c.unsqueeze(1))
    kv = kept(xc @ weight_dkv_kr.to(compute))
    latent = p.kc_scale * rms_norm(kv[:, : p.latent], gamma_ckv, p.epsilon_ckv)
    key_rope = interleaved_rope(kv[:, p.latent :], cos_c, sin_c)
    return MlaPrologRows(query.to(dtype), query_rope.to(dtype), c_q.to(dtype), latent.to(dtype), key_rope.to(dtype))
