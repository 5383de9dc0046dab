"""Edges of the compute and tooling layers that the rest of the suite let pass: the ALiBi underflow skip's bound,
the online-softmax correction of rows without keys yet, the exp2 flush floor, SFA NaN statistics, the precision
standard's cuts and allowances, torch_npu defaults and TND trailing zeros, float64 indexer ties, verify's rules.
Each test was written against a mutant of that code (a one-token change) that survived the suite."""

from __future__ import annotations

import math

import pytest
import torch

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn.cli.metrics import measure
from cann_attn.cli.verify import Row
from cann_attn.testing.precision import ascend_rule, mere_mare
from dsa_utils import SFACase
from oracle import check_fa_result


# ----------------------------------------------------------------------------------------------------------
# ALiBi underflow tile skip: the bound must include |scale| |q| |k| (mutants M05, M06)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, -1.0])
def test_alibi_far_tile_with_a_large_logit_is_not_skipped(scale: float) -> None:
    """One far key whose q.k outweighs the ALiBi bias (distance 1000, slope 1/4: bias -250; scale q.k = +400) holds
    the row's maximum. The underflow skip may only drop a tile when even |scale| |q| |k| + bias is below the
    running maximum: dropping the |q| |k| term, or using scale instead of |scale| (negative scale), skips that
    tile and loses the row's dominant key."""

    gen = torch.Generator().manual_seed(11)
    sq = skv = 1024
    q = 0.1 * torch.randn(1, sq, 1, 16, generator=gen)
    k = 0.1 * torch.randn(1, skv, 1, 16, generator=gen)
    v = torch.randn(1, skv, 1, 16, generator=gen)
    q[0, 1000, 0] = 0.0
    q[0, 1000, 0, 0] = 20.0 * math.copysign(1.0, scale)
    k[0, 0, 0] = 0.0
    k[0, 0, 0, 0] = 20.0
    # Causal: 256 x 256 tiles, visited nearest the diagonal first, so the far tile [0, 256) of rows [768, 1024)
    # comes last, when the running maxima are already set.
    kwargs = dict(pse=torch.tensor([0.25]), pse_type=2, scale_value=scale, atten_mask=cann_attn.compressed_mask(3),
                  sparse_mode=3)
    result = cann_attn.flash_attention_score(q, k, v, 1, "BSND", backend="reference", **kwargs)
    # The row's output is (almost exactly) the far key's value.
    torch.testing.assert_close(result.attention_out[0, 1000, 0], v[0, 0, 0], rtol=1e-4, atol=1e-4)
    check_fa_result(result, q, k, v, 1, "BSND", **kwargs)


# ----------------------------------------------------------------------------------------------------------
# Online softmax: a row still without a visible key over several key tiles (mutant M09)
# ----------------------------------------------------------------------------------------------------------
def test_row_masked_over_several_key_tiles_stays_zero_and_finite() -> None:
    """Explicit mask, Skv = 800 (four 256-wide key tiles): row 3 is fully masked (an invalid row: output 0,
    sentinel statistics) and row 5 sees only column 790 (last tile). The online-softmax correction of a row whose
    running maximum is still -inf must be 0, not exp(-inf - -inf) = NaN."""

    gen = torch.Generator().manual_seed(5)
    sq, skv = 32, 800
    q = torch.randn(1, sq, 2, 16, generator=gen)
    k = torch.randn(1, skv, 2, 16, generator=gen)
    v = torch.randn(1, skv, 2, 16, generator=gen)
    mask = torch.rand(sq, skv, generator=gen) < 0.5  # True = masked
    mask[3] = True
    mask[5] = True
    mask[5, 790] = False
    kwargs = dict(atten_mask=mask, sparse_mode=0, scale_value=0.25)
    result = cann_attn.flash_attention_score(q, k, v, 2, "BSND", backend="reference", **kwargs)
    assert bool(torch.isfinite(result.attention_out).all())
    assert bool((result.attention_out[0, 3] == 0).all())
    torch.testing.assert_close(result.attention_out[0, 5], v[0, 790], rtol=1e-5, atol=1e-5)
    check_fa_result(result, q, k, v, 2, "BSND", **kwargs)


# ----------------------------------------------------------------------------------------------------------
# softmax_exp: only terms below 2^-126 are flushed (mutant M15: EXP2_FLOOR raised)
# ----------------------------------------------------------------------------------------------------------
def test_small_but_normal_softmax_terms_are_not_flushed() -> None:
    """Logits [0, -40 ln 2] (pse_type 0 bias, zero query): the second key's term is 2^-40, far above fp32's
    2^-126 flush floor; with value 2^40 it contributes 1 to the output."""

    q = torch.zeros(1, 1, 1, 8)
    k = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(0))
    v = torch.zeros(1, 2, 1, 8)
    v[0, 1] = 2.0**40
    pse = torch.tensor([0.0, -40.0 * math.log(2.0)]).view(1, 1, 1, 2)
    kwargs = dict(pse=pse, pse_type=0, scale_value=1.0)
    result = cann_attn.flash_attention_score(q, k, v, 1, "BSND", backend="reference", **kwargs)
    torch.testing.assert_close(result.attention_out, torch.ones(1, 1, 1, 8), rtol=1e-4, atol=0.0)
    check_fa_result(result, q, k, v, 1, "BSND", **kwargs)


# ----------------------------------------------------------------------------------------------------------
# SFA: a row that selected a NaN key keeps NaN statistics, not the empty-row sentinel (mutant M21)
# ----------------------------------------------------------------------------------------------------------
def test_sfa_row_selecting_a_nan_key_has_nan_max_not_the_sentinel() -> None:
    """Row t > 0 selects token t only, row 0 nothing (so the tile is not all valid); key 5 is NaN. Row 5 has a valid
    selected key, so its softmax_max is NaN like the oracle's, not -2e38 (docs/semantics/invalid-rows.md keeps the
    sentinel for rows with nothing selected)."""

    case = SFACase("BSND", gen=torch.Generator().manual_seed(2), b=1, s1=8, s2=12, n1=2, d=8, d_rope=4, k=4,
                   mode=3)
    idx = case.inputs["sparse_indices"]
    idx.fill_(-1)
    for t in range(1, 8):  # row 0 selects nothing: the tile is not all valid (the sentinel branch runs)
        idx[0, t, 0, 0] = t
    case.inputs["key"][0, 5] = float("nan")
    fwd = case.forward()
    _, (g_out, g_max, g_sum) = case.oracle()
    assert torch.equal(fwd.attention_out.isnan(), g_out.isnan())
    assert bool(g_max.isnan().any())
    assert torch.equal(fwd.softmax_max.isnan(), g_max.isnan())
    assert torch.equal(fwd.softmax_sum.isnan(), g_sum.isnan())


# ----------------------------------------------------------------------------------------------------------
# MERE / MARE small-value cut: inclusive, at 2^-11 / 2^-8 / 2^-14 (mutants M32, M33)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,cut", [(torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8),
                                       (torch.float32, 2.0**-14)])
def test_mere_mare_cut_is_inclusive_at_the_documented_value(dtype: torch.dtype, cut: float) -> None:
    """A golden element exactly at the cut counts (|g| >= cut); half of it does not."""
    golden = torch.tensor([cut, 1.0, cut / 2], dtype=dtype)
    actual = torch.tensor([2 * cut, 1.0, cut], dtype=dtype)
    mere, mare, passed = mere_mare(actual, golden)
    rel = cut / (cut + 1e-7)
    assert mare == pytest.approx(rel)
    assert mere == pytest.approx(rel / 2)
    assert not passed


# ----------------------------------------------------------------------------------------------------------
# metrics: int8 --strict allowance is max(1, floor(0.1% of numel)) (mutant M35)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("numel,off,strict_pass", [(2000, 2, True), (2000, 3, False), (500, 1, True),
                                                   (500, 2, False)])
def test_int8_strict_allowance(numel: int, off: int, strict_pass: bool) -> None:

    golden = torch.zeros(numel, dtype=torch.int8)
    actual = golden.clone()
    actual[:off] = 1
    m = measure("out", actual, golden)
    assert m.passed(strict=False)
    assert m.passed(strict=True) is strict_pass


# ----------------------------------------------------------------------------------------------------------
# torch_npu wrappers (mutants M40, M41)
# ----------------------------------------------------------------------------------------------------------
def test_tnd_trailing_zero_lengths_keep_the_batch_count() -> None:
    """[2, 5, 9, 0, 0] is five batches (two left out), not three: given for the query lengths only, with the key
    lengths in the empty-sequence form [2, 5, 9, 9, 9], the call is valid (five sequences on both sides) and equals
    the empty-sequence form on both sides (forward, statistics, gradients)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(9, 2, 8, generator=gen) for _ in range(3))
    dy = torch.randn(9, 2, 8, generator=gen)
    results = []
    for q_ends in ([2, 5, 9, 0, 0], [2, 5, 9, 9, 9]):
        kv_ends = [2, 5, 9, 9, 9]
        out, smax, ssum = torch_npu.npu_fusion_attention(q, k, v, 2, "TND", scale=0.3, actual_seq_qlen=q_ends,
                                                         actual_seq_kvlen=kv_ends)[:3]
        grads = torch_npu.npu_fusion_attention_grad(
            q, k, v, dy, 2, "TND", softmax_max=smax, softmax_sum=ssum, attention_in=out, scale_value=0.3,
            actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends)
        results.append((out, smax, ssum, *grads[:3]))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_npu_prompt_flash_attention_default_next_tokens_is_zero() -> None:
    """torch_npu's npu_prompt_flash_attention defaults next_tokens to 0: with an all-zero mode-0 mask only
    j <= i is visible (docs/semantics/masks.md)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 6, 16, generator=gen) for _ in range(3))
    mask = torch.zeros(6, 6, dtype=torch.bool)
    out = torch_npu.npu_prompt_flash_attention(q, k, v, atten_mask=mask, num_heads=2, scale_value=0.25)
    causal = cann_attn.prompt_flash_attention(q, k, v, atten_mask=mask, num_heads=2, scale_value=0.25,
                                              pre_tokens=torch_npu.PFA_PRE_TOKENS, next_tokens=0)
    full = cann_attn.prompt_flash_attention(q, k, v, atten_mask=mask, num_heads=2, scale_value=0.25,
                                            pre_tokens=torch_npu.PFA_PRE_TOKENS, next_tokens=2**31 - 1)
    assert not torch.equal(causal, full)
    assert torch.equal(out, causal)


@pytest.mark.parametrize("layout,shape", [("SBH", (6, 2, 16)), ("BNSD", (2, 2, 6, 8)), ("BSND", (2, 6, 2, 8))])
@pytest.mark.parametrize("keep_prob", [1.0, 0.9])
def test_fusion_attention_numels_per_layout(layout: str, shape: tuple[int, ...], keep_prob: float) -> None:
    """numels = B * N1 * Sq * Skv with B and S read from the layout's own axes (SBH: S first), B != S here."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    numels = torch_npu.npu_fusion_attention(q, k, v, 2, layout, scale=0.3, keep_prob=keep_prob)[6]
    assert numels == 2 * 2 * 6 * 6


# ----------------------------------------------------------------------------------------------------------
# metrics: MERE/MARE keep exactly-equal finite elements in the mean (mutant M48)
# ----------------------------------------------------------------------------------------------------------
def test_measure_mere_averages_over_equal_elements_too() -> None:
    """Only elements holding the same NON-finite value on both sides are dropped from MERE; exactly equal finite
    elements count with rel 0 (three of four exact: MERE = rel / 4)."""

    golden = torch.ones(4)
    actual = torch.tensor([1.0, 1.0, 1.0, 1.0 + 2.0**-10])
    m = measure("out", actual, golden)
    rel = 2.0**-10 / (1.0 + 1e-7)
    assert m.mare == pytest.approx(rel)
    assert m.mere == pytest.approx(rel / 4)


# ----------------------------------------------------------------------------------------------------------
# indexer, float64: ties to the smaller index with many keys (mutant M50: unstable sort)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("s2", [257, 1023])
def test_float64_indexer_ties_with_many_keys(s2: int) -> None:
    """float64 inputs take the sort path: with 1023 keys, every copy of a key scores exactly alike and the copies
    selected must be the smallest indices, in increasing order."""
    gen = torch.Generator().manual_seed(1)
    s1, n_idx, d, groups, k = 8, 4, 16, 4, 200
    qi = torch.randn(1, s1, n_idx, d, generator=gen, dtype=torch.float64)
    w = torch.randn(1, s1, n_idx, generator=gen, dtype=torch.float64)
    base = torch.randn(1, groups, 1, d, generator=gen, dtype=torch.float64)
    ki = base.repeat(1, -(-s2 // groups), 1, 1)[:, :s2].contiguous()
    res = cann_attn.lightning_indexer(qi, ki, w, sparse_count=k, sparse_mode=0)
    for t in range(s1):
        row = res.sparse_indices[0, t, 0].tolist()
        for g in range(groups):
            members = [i for i in row if i >= 0 and i % groups == g]
            assert members == list(range(g, s2, groups))[: len(members)], f"row {t}, key {g}: {members[:8]}"


# ----------------------------------------------------------------------------------------------------------
# precision: the golden is cast to the actual's dtype first (mutant M52)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ascend_rule_casts_the_golden_to_the_actual_dtype(dtype: torch.dtype) -> None:
    """An actual equal to the float64 golden rounded to its own dtype has no error at all
    (docs/semantics/precision.md)."""

    golden = torch.randn(1000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    golden[:10] = 1e-9  # rounds to 0 in fp16
    ok, details = ascend_rule(golden.to(dtype), golden)
    assert ok
    assert details["max_abs_err"] == 0.0 and details["n_rel_fail"] == 0 and details["n_abs_fail"] == 0
    mere, mare, passed = mere_mare(golden.to(dtype), golden)
    assert mere == 0.0 and mare == 0.0 and passed


# ----------------------------------------------------------------------------------------------------------
# verify: an output that fails the Ascend rule but passes the flash-attn rule passes (mutant M53)
# ----------------------------------------------------------------------------------------------------------
def test_verify_row_passes_by_the_flash_attn_rule() -> None:

    base = dict(op="flash_attention_score", case="c", dtype="fp16", shape="s", output="attention_out")
    assert Row(**base, ascend=False, fa_rule=True).passed
    assert not Row(**base, ascend=False, fa_rule=False).passed
    assert not Row(**base, ascend=False, fa_rule=None).passed
    assert Row(**base, ascend=True).passed
