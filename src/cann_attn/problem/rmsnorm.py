"""RMSNorm as the MLA pre-processing applies it (docs/operators/mla_prolog.md, "RMSNorm").

RmsNorm(x) = gamma * x / sqrt(mean(x^2) + epsilon), the mean over the last axis (the N of the formula is the row
width: Hcq for the query latent, Hckv for the key/value latent).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> torch.Tensor:
    """RmsNorm of every row of x [..., H] with gamma [H], in x's dtype (pass the computation dtype)."""
    return gamma.to(x.dtype) * (x / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + epsilon))
