"""The merge rule (cann_attn.problem.merge) against attention over the union of key blocks, in float64.

Each block's (output, max, sum) is formed directly in float64 from logits and values (a row with no visible key
gets the FlashAttentionScore invalid-row values), so the expected merged result never goes through the code under
test.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cann_attn.problem.merge import empty_rows, lse_from_stats, merge_blocks, merge_lse
from cann_attn.problem.stats import FLT_MAX


def block_result(logits: torch.Tensor, values: torch.Tensor, visible: torch.Tensor):
    """float64 softmax attention of one block: logits [R, C], values [C, D], visible [R, C] bool."""
    masked = logits.masked_fill(~visible, -torch.inf)
    row_max = masked.max(dim=-1).values
    empty = ~visible.any(dim=-1)
    safe_max = torch.where(empty, torch.zeros_like(row_max), row_max)
    p = torch.exp(masked - safe_max.unsqueeze(-1))
    row_sum = p.sum(dim=-1)
    out = (p @ values) / torch.where(empty, torch.ones_like(row_sum), row_sum).unsqueeze(-1)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    row_max = torch.where(empty, torch.full_like(row_max, -FLT_MAX), row_max)
    row_sum = torch.where(empty, torch.full_like(row_sum, FLT_MAX), row_sum)
    return out, row_max, row_sum


def split_case(seed: int, rows: int, cols: tuple[int, ...], dim: int, p_hidden: float, scale: float):
    gen = torch.Generator().manual_seed(seed)
    total = sum(cols)
    logits = torch.randn(rows, total, generator=gen, dtype=torch.float64) * scale
    values = torch.randn(total, dim, generator=gen, dtype=torch.float64)
    visible = torch.rand(rows, total, generator=gen, dtype=torch.float64) >= p_hidden
    if rows > 1:
        visible[0] = False  # always one row that sees nothing at all
    return logits, values, visible


def blocks_of(logits, values, visible, cols):
    results, start = [], 0
    for c in cols:
        results.append(block_result(logits[:, start : start + c], values[start : start + c],
                                    visible[:, start : start + c]))
        start += c
    return results


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 7), cols=st.lists(st.integers(1, 6), min_size=2,
       max_size=5), dim=st.integers(1, 5), p_hidden=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
       scale=st.sampled_from([0.5, 4.0, 40.0]))
def test_folding_blocks_equals_attention_over_their_union(seed, rows, cols, dim, p_hidden, scale):
    logits, values, visible = split_case(seed, rows, tuple(cols), dim, p_hidden, scale)
    want_out, want_max, want_sum = block_result(logits, values, visible)
    blocks = [tuple(t.float() for t in b) for b in blocks_of(logits, values, visible, cols)]
    out, mx, sm = blocks[0]
    for nxt in blocks[1:]:
        out, mx, sm = merge_blocks(out, mx, sm, *nxt)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(mx.double(), want_max.float().double(), atol=0, rtol=0)
    torch.testing.assert_close(sm.double(), want_sum, atol=1e-6, rtol=2e-5)

    lse = [lse_from_stats(b[1], b[2]) for b in blocks]
    lse_out, lse_merged = merge_lse(lse, [b[0] for b in blocks])
    torch.testing.assert_close(lse_out.double(), want_out, atol=2e-6, rtol=2e-5)
    invalid = ~visible.any(dim=-1)
    want_lse = torch.where(invalid, torch.full_like(want_max, -torch.inf), want_max + torch.log(want_sum))
    torch.testing.assert_close(lse_merged.double(), want_lse, atol=1e-5, rtol=1e-6)


def invalid_block(rows: int, dim: int, dtype=torch.float32):
    return (torch.zeros(rows, dim, dtype=dtype), torch.full((rows,), -FLT_MAX, dtype=dtype),
            torch.full((rows,), FLT_MAX, dtype=dtype))


def test_a_valid_block_merged_with_an_invalid_one_is_unchanged_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    valid = (torch.randn(5, 4, generator=gen), torch.randn(5, generator=gen) * 30,
             torch.rand(5, generator=gen) * 9 + 1)
    for first, second in ((valid, invalid_block(5, 4)), (invalid_block(5, 4), valid)):
        out, mx, sm = merge_blocks(*first, *second)
        assert torch.equal(out, valid[0]) and torch.equal(mx, valid[1]) and torch.equal(sm, valid[2])


def test_two_invalid_blocks_give_an_invalid_row_not_an_infinite_sum():
    out, mx, sm = merge_blocks(*invalid_block(3, 2), *invalid_block(3, 2))
    assert torch.equal(out, torch.zeros(3, 2))
    assert torch.equal(mx, torch.full((3,), -FLT_MAX)) and torch.equal(sm, torch.full((3,), FLT_MAX))
    # other empty markers come back in the FlashAttentionScore convention
    sparse_empty = (torch.zeros(3, 2), torch.full((3,), -torch.inf), torch.zeros(3))
    out, mx, sm = merge_blocks(*sparse_empty, *sparse_empty)
    assert torch.equal(mx, torch.full((3,), -FLT_MAX)) and torch.equal(sm, torch.full((3,), FLT_MAX))


def test_other_empty_markers_contribute_nothing():
    """-inf maxima and zero sums (the sparse operators' invalid rows) are empty too."""
    out_v, max_v, sum_v = torch.ones(2, 3), torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    for mx, sm in ((torch.full((2,), -torch.inf), torch.zeros(2)), (torch.full((2,), -2e38), torch.zeros(2))):
        assert empty_rows(mx, sm).all()
        out, m, s = merge_blocks(torch.zeros(2, 3), mx, sm, out_v, max_v, sum_v)
        assert torch.equal(out, out_v) and torch.equal(m, max_v) and torch.equal(s, sum_v)


def test_nan_statistics_propagate():
    out, _, sm = merge_blocks(torch.ones(1, 2), torch.tensor([float("nan")]), torch.tensor([1.0]),
                               torch.ones(1, 2), torch.tensor([0.0]), torch.tensor([1.0]))
    assert torch.isnan(out).all() and torch.isnan(sm).all()


def test_lse_merge_of_one_live_part_is_unchanged_and_all_empty_rows_are_zero():
    live_out, live_lse = torch.randn(4, 8), torch.randn(4)
    empties = (torch.full((4,), -torch.inf), torch.full((4,), -FLT_MAX))
    for dead in empties:
        out, lse = merge_lse([dead, live_lse, dead], [torch.full((4, 8), 7.0), live_out, torch.zeros(4, 8)])
        assert torch.equal(lse, live_lse) and torch.equal(out, live_out)
        out, lse = merge_lse([dead, dead], [torch.zeros(4, 8), torch.zeros(4, 8)])
        assert torch.equal(out, torch.zeros(4, 8)) and torch.equal(lse, dead)
        assert not torch.isnan(lse).any()


def test_merge_is_symmetric_and_associative_in_float64():
    logits, values, visible = split_case(11, 6, (3, 4, 5), 3, 0.4, 6.0)
    a, b, c = blocks_of(logits, values, visible, (3, 4, 5))
    left = merge_blocks(*merge_blocks(*a, *b), *c)
    right = merge_blocks(*a, *merge_blocks(*b, *c))
    swapped = merge_blocks(*c, *merge_blocks(*b, *a))
    for x, y, z in zip(left, right, swapped, strict=True):
        assert x.dtype == torch.float64
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x, z, rtol=1e-12, atol=1e-12)
