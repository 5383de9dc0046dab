"""How partial attention results over disjoint key blocks combine into the result over their union
(docs/operators/ring_attention_update.md, docs/operators/attention_update.md; invalid rows:
docs/semantics/invalid-rows.md).

Two equivalent forms of the same rule:

- softmax statistics (RingAttentionUpdate, context-parallel rings): block k gives, per query row, its normalised
  output O_k, the max m_k of its scaled logits and the sum s_k of exp(logit - m_k). Then
  m = max_k m_k, w_k = s_k * exp(m_k - m), s = sum_k w_k, O = sum_k O_k * w_k / s.
- log-sum-exp (AttentionUpdate, decode split over sequence-parallel ranks): lse_k = m_k + log(s_k), then
  lse = log(sum_k exp(lse_k)) and O = sum_k O_k * exp(lse_k - lse).

A block in which a row sees no key ("empty" for that row) must contribute nothing. FlashAttentionScore marks such a
row with output 0, max = -FLT_MAX and sum = +FLT_MAX; the sparse operators write sum = 0; -inf maxima / lse values
mean the same. Taken literally the formula turns two such rows into sum = inf (FLT_MAX + FLT_MAX) or 0/0, so the
rule here is explicit: merging with an empty block returns the other block unchanged (bit for bit), and merging two
empty blocks gives an invalid row again (output 0, max -FLT_MAX, sum +FLT_MAX). NaN statistics are not empty: they
propagate.

Everything here works on fp32 (or float64) statistics, rows on the second-to-last axis of an output ([..., S, D]) and
one statistic per row ([..., S]), i.e. FlashAttentionScore's softmax_max / softmax_sum without their 8 repeated lanes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .stats import FLT_MAX

__all__ = ["empty_lse_rows", "empty_rows", "lse_from_stats", "merge_blocks", "merge_lse"]


def empty_rows(softmax_max: torch.Tensor, softmax_sum: torch.Tensor) -> torch.Tensor:
    """Rows of a block that saw no key: max at or below -FLT_MAX (the invalid-row max or -inf) or a zero sum."""
    return (softmax_max <= -FLT_MAX) | (softmax_sum == 0)


def empty_lse_rows(lse: torch.Tensor) -> torch.Tensor:
    """LSE rows that saw no key: -inf, or at or below -FLT_MAX (an invalid row's -FLT_MAX + log(FLT_MAX) rounds to
    -FLT_MAX in fp32)."""
    return lse <= -FLT_MAX


def lse_from_stats(softmax_max: torch.Tensor, softmax_sum: torch.Tensor) -> torch.Tensor:
    """log-sum-exp of a row from its max and sum; empty rows give -inf."""
    lse = softmax_max + torch.log(softmax_sum)
    return torch.where(empty_rows(softmax_max, softmax_sum), torch.full_like(lse, -torch.inf), lse)


def merge_blocks(
    out_a: torch.Tensor,
    max_a: torch.Tensor,
    sum_a: torch.Tensor,
    out_b: torch.Tensor,
    max_b: torch.Tensor,
    sum_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine two blocks' (output [..., S, D], max [..., S], sum [..., S]) into those of their union.

    Computed in the statistics' dtype (fp32, or float64 for goldens); `out_a` / `out_b` are promoted to it and the
    merged output is returned in that dtype (callers cast back). Empty rows: see the module docstring.
    """
    stat_dtype = torch.promote_types(max_a.dtype, torch.float32)
    max_a, sum_a, max_b, sum_b = (t.to(stat_dtype) for t in (max_a, sum_a, max_b, sum_b))
    out_a, out_b = out_a.to(stat_dtype), out_b.to(stat_dtype)
    empty_a, empty_b = empty_rows(max_a, sum_a), empty_rows(max_b, sum_b)

    merged_max = torch.maximum(max_a, max_b)
    # Empty rows take the other block's values below; only the rows where both blocks saw keys use the blend, so the
    # exponent arguments are finite there (or NaN, which must propagate).
    weight_a = sum_a * torch.exp(max_a - merged_max)
    weight_b = sum_b * torch.exp(max_b - merged_max)
    merged_sum = weight_a + weight_b
    # Each weight is at most its block's sum, but two sums near FLT_MAX add up to inf (the merged sum then is inf,
    # as the true value exceeds the format), and w / inf = 0 would zero the output. There the blend's ratios come
    # from the halved weights, an exact scaling: the output stays the weighted mean. Other rows keep their bits.
    half = torch.where(merged_sum.isinf() & weight_a.isfinite() & weight_b.isfinite(), 0.5, 1.0)
    weight_a, weight_b = weight_a * half, weight_b * half
    total = weight_a + weight_b
    blended = out_a * (weight_a / total).unsqueeze(-1) + out_b * (weight_b / total).unsqueeze(-1)

    both = empty_a & empty_b
    invalid_max = torch.full_like(merged_max, -FLT_MAX)
    invalid_sum = torch.full_like(merged_sum, FLT_MAX)
    out = torch.where(empty_b.unsqueeze(-1), out_a, torch.where(empty_a.unsqueeze(-1), out_b, blended))
    out = torch.where(both.unsqueeze(-1), torch.zeros_like(out), out)
    new_max = torch.where(both, invalid_max, torch.where(empty_b, max_a, torch.where(empty_a, max_b, merged_max)))
    new_sum = torch.where(both, invalid_sum, torch.where(empty_b, sum_a, torch.where(empty_a, sum_b, merged_sum)))
    return out, new_max, new_sum


def merge_lse(lse: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine K partial results (lse_k [...], out_k [..., D]) into (out [..., D], lse [...]).

    lse = lse_max + log(sum_k exp(lse_k - lse_max)), out = sum_k out_k * exp(lse_k - lse) (AttentionUpdate's
    formula). Empty parts (lse at or below -FLT_MAX, -inf included) get weight 0, so a single non-empty part is
    returned unchanged; a row empty in every part has output 0 and lse = the largest given lse (-inf or -FLT_MAX:
    what the formula gives there, never NaN). Computed in fp32 (float64 when lse is float64).
    """
    stat_dtype = torch.promote_types(lse[0].dtype, torch.float32)
    lse_stack = torch.stack([t.to(stat_dtype) for t in lse])
    out_stack = torch.stack([t.to(stat_dtype) for t in outs])
    empty = empty_lse_rows(lse_stack)
    all_empty = empty.all(dim=0)

    lse_max = lse_stack.max(dim=0).values
    shift = torch.where(all_empty, torch.zeros_like(lse_max), lse_max)
    terms = torch.where(empty, torch.zeros_like(lse_stack), torch.exp(lse_stack - shift))
    total = terms.sum(dim=0)
    merged_lse = torch.where(all_empty, lse_max, shift + torch.log(total))
    weights = torch.where(empty | all_empty, torch.zeros_like(lse_stack), torch.exp(lse_stack - merged_lse))
    # An empty part's output is not read: 0 * (its garbage, even inf/NaN) must not reach the result.
    out_stack = torch.where(weights.unsqueeze(-1) == 0, torch.zeros_like(out_stack), out_stack)
    out = (out_stack * weights.unsqueeze(-1)).sum(dim=0)
    return out, merged_lse
