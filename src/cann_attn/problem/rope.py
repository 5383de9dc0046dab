"""The rotary position embedding of the MLA pre-processing (docs/operators/mla_prolog.md, "RoPE").

MlaProlog rotates the rope channels of the query heads and of the key with per-token `cos` / `sin` rows of the
rope width Dr. Its input channels pair up as (x0, x1), (x2, x3), ... (the interleaved convention of the
DeepSeek checkpoints), and its output is written in the half-split order: pair i's rotated first element at
channel i, its second at channel Dr/2 + i. With the cos/sin rows a caller builds for the half-split form
(`cos = [c_0 .. c_{Dr/2-1}, c_0 .. c_{Dr/2-1}]`, the same for sin) that is

    y = p * cos + rotate_half(p) * sin,   p = [x0, x2, ..., x_{Dr-2}, x1, x3, ..., x_{Dr-1}],
    rotate_half(p) = [-x1, -x3, ..., -x_{Dr-1}, x0, x2, ..., x_{Dr-2}].

Queries and keys get the same channel order, so their dot products are those of the interleaved rotation.
"""

from __future__ import annotations

import torch


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [..., Dr] (interleaved channel pairs) with cos / sin broadcastable to x; the result is in the
    half-split channel order, in the dtype the three promote to."""
    evens, odds = x[..., 0::2], x[..., 1::2]
    paired = torch.cat([evens, odds], dim=-1)
    rotated = torch.cat([-odds, evens], dim=-1)
    return paired * cos + rotated * sin
