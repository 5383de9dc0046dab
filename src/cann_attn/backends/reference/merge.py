"""Reference computation of the merge operators: the rule of cann_attn.problem.merge applied to canonical rows
(outputs [R, D], statistics [R]), in float32 (float64 for float64 inputs), cast back to the output dtype."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...problem.merge import merge_blocks, merge_lse


def ring_update(out_a: torch.Tensor, max_a: torch.Tensor, sum_a: torch.Tensor, out_b: torch.Tensor,
                max_b: torch.Tensor, sum_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [R, D] in out_a's dtype, max [R], sum [R]) of the union of two blocks."""
    out, new_max, new_sum = merge_blocks(out_a, max_a, sum_a, out_b, max_b, sum_b)
    return out.to(out_a.dtype), new_max, new_sum


def lse_update(lse: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [R, D] in the parts' dtype, lse [R]) of K parts."""
    out, merged = merge_lse(lse, outs)
    return out.to(outs[0].dtype), merged
