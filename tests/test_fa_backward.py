"""flash_attention_score_grad (FlashAttentionScoreGradV2) and the differentiable flash_attention.

The golden is torch.autograd through the independent float64 oracle (on the same, possibly rounded, inputs);
dq, dk, dv and dpse are compared with the docs/semantics/precision.md rules (Ascend rule, else the flash-attn rule
against autograd through the oracle's code run in the input dtype). Every grad call runs twice: with the
forward's softmax_max / softmax_sum / attention_out, and without them (the recomputation path).
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
import oracle
from fa_grad_utils import DT_IDS, LAYOUTS, GradCase, oracle_grads, valid_grad_modes
from oracle import INT_MAX, assert_close_to_oracle, fa_forward_oracle, full_mask, make_compressed_mask, tnd_cum

LOW = (torch.float16, torch.bfloat16)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


pytestmark = pytest.mark.usefixtures("single_thread")


def _causal(mode: int = 3) -> dict:
    return {"atten_mask": make_compressed_mask(mode), "sparse_mode": mode}


# --------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_and_dtypes(rng, layout, dtype):
    GradCase(layout, rng, sq=12, skv=19, dtype=dtype, q_lens=[12, 5, 9], kv_lens=[19, 7, 9]).check()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_and_dtypes_causal(rng, layout, dtype):
    GradCase(layout, rng, sq=17, skv=17, dtype=dtype, q_lens=[17, 6], kv_lens=[17, 11]).check(**_causal(3))


@pytest.mark.parametrize("mode", [None, 3, 8])
@pytest.mark.parametrize("softmax_layout", ["", "TND"], ids=["sl_default", "sl_TND"])
def test_tnd_softmax_layouts(rng, softmax_layout, mode):
    """The grad reads the statistics in the layout they were produced with (docs/semantics/softmax-stats.md)."""
    case = GradCase("TND", rng, q_lens=[9, 4, 13, 1], kv_lens=[11, 4, 13, 6])
    kw = {} if mode is None else {**case.mode_kwargs(mode), "sparse_mode": mode}
    case.check(softmax_layout=softmax_layout, **kw)


# ---------------------------------------------------------------------------------------- sparse modes
@pytest.mark.parametrize(
    ("layout", "mode"), [(lay, m) for lay in LAYOUTS for m in valid_grad_modes(lay)], ids=lambda x: str(x)
)
def test_sparse_modes(rng, layout, mode):
    case = GradCase(layout, rng, sq=13, skv=21, q_lens=[13, 5, 9], kv_lens=[21, 5, 16])
    extra = {"softmax_layout": "TND"} if layout == "TND" and mode % 2 else {}
    case.check(sparse_mode=mode, **case.mode_kwargs(mode), **extra)


@pytest.mark.parametrize("mode", [2, 3, 4])
@pytest.mark.parametrize("dtype", LOW, ids=DT_IDS.get)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sparse_modes_low_precision(rng, layout, dtype, mode):
    case = GradCase(layout, rng, sq=24, skv=24, dtype=dtype, q_lens=[24, 9], kv_lens=[24, 15])
    case.check(sparse_mode=mode, **case.mode_kwargs(mode))


@pytest.mark.filterwarnings("ignore:sparse_mode=.* without atten_mask:UserWarning")  # on purpose
@pytest.mark.parametrize("mode", [1, 2, 3, 4, 5, 6])
def test_no_atten_mask_means_full_attention(rng, mode):
    """FA family: without atten_mask, sparse_mode / pre / next are ignored (full attention, every mode)."""
    case = GradCase("BSND", rng, sq=9, skv=13)
    (res,), _, dy = case.check(sparse_mode=mode, pre_tokens=1, next_tokens=0, prefix=case.prefix(), stats=(False,))
    full = cann_attn.flash_attention_score_grad(case.q, case.k, case.v, dy, case.n1, case.layout, **case.kw)
    for name in ("dq", "dk", "dv"):
        torch.testing.assert_close(getattr(res, name), getattr(full, name))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8], ids=["bool", "uint8"])
@pytest.mark.parametrize("shape", ["SqSkv", "1SqSkv", "B1SqSkv", "11SqSkv", "BNSqSkv"])
def test_mode1_full_mask_shapes(rng, shape, mask_dtype):
    b, n, sq, skv = 2, 2, 9, 14
    case = GradCase("BSND", rng, b=b, n1=n, sq=sq, skv=skv)
    dims = {
        "SqSkv": (sq, skv),
        "1SqSkv": (1, sq, skv),
        "B1SqSkv": (b, 1, sq, skv),
        "11SqSkv": (1, 1, sq, skv),
        "BNSqSkv": (b, n, sq, skv),
    }[shape]
    case.check(sparse_mode=1, atten_mask=full_mask(dims, gen=rng, p=0.4, dtype=mask_dtype), stats=(True,))


def test_mode5_uses_mask_content(rng):
    """Mode 5: the given full mask's content decides (prefix still required)."""
    case = GradCase("BSH", rng, b=2, n1=2, sq=10, skv=12)
    case.check(sparse_mode=5, prefix=[4, 6], atten_mask=full_mask((2, 1, 10, 12), gen=rng, p=0.5))


@pytest.mark.parametrize(("sq", "skv"), [(11, 17), (17, 11)])
@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_mode6_prefix_extremes(rng, layout, sq, skv):
    case = GradCase(layout, rng, sq=sq, skv=skv, q_lens=[sq, 6, 11], kv_lens=[skv, 9, 11])
    for fractions in ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)):
        case.check(sparse_mode=6, atten_mask=make_compressed_mask(6), prefix=case.prefix(fractions), stats=(True,))


@pytest.mark.parametrize(("pre", "nxt"), [(5, 0), (0, 5), (10, -3), (-3, 10), (INT_MAX, 0), (0, INT_MAX)], ids=str)
@pytest.mark.parametrize("layout", ["BSH", "TND"])
def test_mode0_band(rng, layout, pre, nxt):
    case = GradCase(layout, rng, sq=16, skv=22, q_lens=[14, 20, 5], kv_lens=[19, 11, 5])
    zeros = torch.zeros((case.max_sq, case.max_skv), dtype=torch.bool)  # only the band masks
    case.check(sparse_mode=0, atten_mask=zeros, pre_tokens=pre, next_tokens=nxt)


@pytest.mark.parametrize(("pre", "nxt"), [(4, 2), (0, 0), (-2, 6), (7, -3), (INT_MAX, 1)], ids=str)
@pytest.mark.parametrize(("sq", "skv"), [(14, 22), (22, 14)])
def test_mode4_band(rng, sq, skv, pre, nxt):
    case = GradCase("BNSD", rng, sq=sq, skv=skv)
    case.check(sparse_mode=4, atten_mask=make_compressed_mask(4), pre_tokens=pre, next_tokens=nxt)


@pytest.mark.parametrize("mode", [7, 8])
def test_modes_7_8_band_batch(rng, mode):
    """Band batch: mode 7 = last sequence with Sq_b > 0, mode 8 = the first (zero-length ones skipped)."""
    case = GradCase("TND", rng, q_lens=[0, 7, 12, 9, 0], kv_lens=[3, 10, 12, 14, 2])
    case.check(sparse_mode=mode, atten_mask=make_compressed_mask(mode), next_tokens=-1 if mode == 7 else 3)


# ------------------------------------------------------------------------------------------------- pse
PSE_SHAPES = ["full", "row_broadcast", "batch_broadcast"]


def _pse(case: GradCase, form: str) -> torch.Tensor:
    if form == "full":
        return case.pse_full()
    if form == "row_broadcast":
        return case.pse_full(rows=1)
    return case.pse_full(batch=1)


@pytest.mark.parametrize("form", PSE_SHAPES)
@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_pse_tensor(rng, layout, pse_type, form):
    case = GradCase(layout, rng, b=2, n1=3, sq=11, skv=15)
    mask = _causal(3) if form != "full" else {}
    case.check(pse=_pse(case, form), pse_type=pse_type, **mask)


@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("dtype", LOW, ids=DT_IDS.get)
def test_pse_tensor_low_precision(rng, dtype, pse_type):
    case = GradCase("SBH", rng, b=2, n1=2, sq=16, skv=16, dtype=dtype)
    case.check(pse=case.pse_full(), pse_type=pse_type, **_causal(2))


@pytest.mark.parametrize("pse_batch", [1, 3], ids=["pse_b1", "pse_bB"])
@pytest.mark.parametrize("pse_type", [0, 1])
def test_pse_tnd(rng, pse_type, pse_batch):
    """TND pse [B or 1, N1, maxSq, maxSkv]: sequence b uses the bottom-right [Sq_b, Skv_b] block."""
    case = GradCase("TND", rng, q_lens=[8, 3, 11], kv_lens=[13, 3, 11])
    pse = case.pse_full(batch=pse_batch)
    case.check(pse=pse, pse_type=pse_type, softmax_layout="TND" if pse_type else "", **_causal(3))


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "pse_type"), [(2, 0), (3, 1), (0, 1)], ids=["mode2_type0", "mode3_type1", "mode0"])
def test_pse_compressed(rng, mode, pse_type):
    """Compressed 1024-row pse (Sq == Skv slightly > 1024, lower-triangular attention: modes 2/3, or 0 with
    next_tokens <= 0): dpse accumulates into the element each (i, j) read. One small head: slow."""
    sq = 1030
    case = GradCase("BNSD", rng, b=1, n1=1, sq=sq, skv=sq, d=8)
    pse = case.randn(1, 1, 1024, sq)
    if mode == 0:
        kw = {"sparse_mode": 0, "atten_mask": torch.zeros(sq, sq, dtype=torch.bool), "next_tokens": 0}
    else:
        kw = _causal(mode)
    case.check(pse=pse, pse_type=pse_type, stats=(True,), **kw)


@pytest.mark.parametrize(("q_start", "kv_start"), [(None, None), ([3], [1]), ([0], [5])], ids=str)
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes_N", "slopes_BN"])
@pytest.mark.parametrize("pse_type", [2, 3])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_alibi(rng, layout, pse_type, per_batch, q_start, kv_start):
    case = GradCase(layout, rng, b=2, n1=4, n2=2, sq=10, skv=13, q_lens=[10, 6], kv_lens=[13, 9])
    mask = _causal(3) if per_batch else {}
    case.check(pse=case.slopes(per_batch), pse_type=pse_type, q_start_idx=q_start, kv_start_idx=kv_start, **mask)


@pytest.mark.parametrize("dtype", LOW, ids=DT_IDS.get)
def test_alibi_low_precision(rng, dtype):
    case = GradCase("BSH", rng, b=1, n1=4, sq=20, skv=20, dtype=dtype)
    case.check(pse=case.slopes(), pse_type=2, q_start_idx=[2], kv_start_idx=[0], **_causal(2))


# --------------------------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("ascend_padding", [False, True], ids=["exact_len", "ascend_len"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropout(rng, layout, ascend_padding):
    case = GradCase(layout, rng, sq=11, skv=14, q_lens=[11, 0, 6], kv_lens=[14, 3, 6])
    case.check(keep_prob=0.8, drop_mask=case.drop_mask(0.8, ascend_padding))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_dropout_with_pse_and_mask(rng, dtype):
    case = GradCase("BNSD", rng, b=2, n1=2, sq=12, skv=12, dtype=dtype)
    case.check(
        keep_prob=0.8,
        drop_mask=case.drop_mask(0.8),
        pse=case.pse_full(rows=1),
        pse_type=1,
        **case.mode_kwargs(4),
        sparse_mode=4,
    )


# ---------------------------------------------------------------------------------- GQA / MQA / Dv < Dqk
@pytest.mark.parametrize("n2", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gqa_mqa(rng, layout, n2):
    case = GradCase(layout, rng, n1=4, n2=n2, sq=10, skv=13, q_lens=[10, 4], kv_lens=[13, 8])
    case.check(**_causal(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DT_IDS.get)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dv_smaller_than_dqk(rng, layout, dtype):
    case = GradCase(layout, rng, n1=4, n2=2, sq=9, skv=12, d=16, dv=8, dtype=dtype, q_lens=[9, 5], kv_lens=[12, 5])
    case.check(pse=case.pse_full(rows=1) if layout != "TND" else case.pse_full(), pse_type=0)


# ------------------------------------------------------------------------------------------ odd lengths
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal3"])
@pytest.mark.parametrize(("sq", "skv"), [(1, 1), (1, 97), (97, 1), (97, 200), (200, 97)], ids=str)
def test_odd_lengths(rng, sq, skv, causal):
    case = GradCase("BSND", rng, b=1, n1=2, sq=sq, skv=skv, d=16)
    case.check(**(_causal(3) if causal else {}))


@pytest.mark.parametrize("dtype", LOW, ids=DT_IDS.get)
def test_odd_lengths_low_precision(rng, dtype):
    case = GradCase("BSH", rng, b=1, n1=2, sq=97, skv=200, d=16, dtype=dtype)
    case.check(**_causal(3))


# ------------------------------------------------------------------------------------- TND zero lengths
@pytest.mark.parametrize("mode", [None, 3, 7, 8])
@pytest.mark.parametrize(
    ("q_lens", "kv_lens"),
    [([5, 0, 7, 0], [6, 4, 7, 3]), ([0, 4, 6, 0, 0], [3, 4, 6, 0, 0])],
    ids=["middle_zero", "leading_trailing_zero"],
)
def test_tnd_zero_length_sequence(rng, q_lens, kv_lens, mode):
    case = GradCase("TND", rng, q_lens=q_lens, kv_lens=kv_lens)
    kw = {} if mode is None else {**case.mode_kwargs(mode), "sparse_mode": mode}
    results, _, _ = case.check(keep_prob=0.8, drop_mask=case.drop_mask(0.8), **kw)
    starts = [0, *tnd_cum(kv_lens)[:-1]]
    for res in results:
        for b, (sq, skv) in enumerate(zip(q_lens, kv_lens, strict=True)):
            if sq == 0:  # keys of a sequence without queries get no gradient
                assert torch.equal(res.dk[starts[b] : starts[b] + skv], torch.zeros_like(res.dk[:skv]))
                assert torch.equal(res.dv[starts[b] : starts[b] + skv], torch.zeros_like(res.dv[:skv]))


# ------------------------------------------------------------------------------------------ invalid rows
def _bnsd_rows_zero(t: torch.Tensor, rows) -> bool:
    return bool((t[:, :, rows] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_invalid_rows_mode3_sq_gt_skv(rng, dtype):
    """Mode 3 with Sq > Skv: rows i < Sq - Skv see nothing -> exactly 0 gradient, no NaN/inf."""
    case = GradCase("BNSD", rng, b=2, n1=2, sq=12, skv=7, dtype=dtype)
    results, golden, _ = case.check(**_causal(3))
    assert _bnsd_rows_zero(golden["dq"], slice(0, 5))
    for res in results:
        assert _bnsd_rows_zero(res.dq, slice(0, 5)), "dq of invalid rows must be exactly 0"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=DT_IDS.get)
def test_invalid_rows_explicit_mask(rng, dtype):
    case = GradCase("BNSD", rng, b=2, n1=2, sq=9, skv=11, dtype=dtype)
    mask = full_mask((2, 1, 9, 11), gen=rng, p=0.3)
    mask[0, :, 3] = True  # batch 0, row 3: fully masked
    mask[1] = True  # batch 1: everything masked
    results, _, _ = case.check(sparse_mode=1, atten_mask=mask, pse=case.pse_full(), pse_type=1)
    for res in results:
        assert bool((res.dq[0, :, 3] == 0).all()) and bool((res.dq[1] == 0).all())
        assert bool((res.dk[1] == 0).all()) and bool((res.dv[1] == 0).all())
        assert bool((res.dpse[0, :, 3] == 0).all()) and bool((res.dpse[1] == 0).all())


def test_invalid_rows_band_and_never_visible_keys(rng):
    """Mode 4 with pre=3, next=-2 (Sq == Skv): rows 0 and 1 see nothing; keys > Sq - 3 are never seen."""
    sq = 10
    case = GradCase("BSND", rng, b=1, n1=2, sq=sq, skv=sq)
    results, _, _ = case.check(sparse_mode=4, atten_mask=make_compressed_mask(4), pre_tokens=3, next_tokens=-2)
    for res in results:
        assert bool((res.dq[:, :2] == 0).all())
        assert bool((res.dk[:, sq - 1 :] == 0).all()) and bool((res.dv[:, sq - 1 :] == 0).all())


@pytest.mark.parametrize("softmax_layout", ["", "TND"], ids=["sl_default", "sl_TND"])
def test_invalid_rows_tnd_mode3_sq_gt_skv(rng, softmax_layout):
    case = GradCase("TND", rng, q_lens=[9, 4], kv_lens=[5, 6])
    results, _, _ = case.check(softmax_layout=softmax_layout, **_causal(3))
    for res in results:
        assert bool((res.dq[:4] == 0).all()), "TND sequence 0: rows 0..3 have no visible key"


# ---------------------------------------------------------------------------------- statistics semantics
def test_grad_uses_given_statistics_without_renormalisation(rng):
    """P = exp(S - max) / sum from the given statistics (docs/semantics/softmax-stats.md): doubling sum halves dV
    exactly."""
    case = GradCase("BNSD", rng, b=1, n1=2, sq=8, skv=8)
    fwd = case.forward()
    dy = case.randn(*fwd.attention_out.shape)
    kw = {**case.kw, "attention_in": fwd.attention_out}
    base = cann_attn.flash_attention_score_grad(
        case.q, case.k, case.v, dy, case.n1, case.layout, **kw, softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum
    )
    doubled = cann_attn.flash_attention_score_grad(
        case.q,
        case.k,
        case.v,
        dy,
        case.n1,
        case.layout,
        **kw,
        softmax_max=fwd.softmax_max,
        softmax_sum=fwd.softmax_sum * 2,
    )
    torch.testing.assert_close(doubled.dv, base.dv / 2, rtol=1e-5, atol=1e-6)


def test_grad_accepts_oracle_statistics(rng):
    """Statistics from the oracle (cast to fp32) give the same gradients as the op's own."""
    case = GradCase("TND", rng, q_lens=[6, 9], kv_lens=[8, 9])
    kw = {**case.kw, **_causal(3)}
    out, smax, ssum = fa_forward_oracle(case.q, case.k, case.v, case.n1, "TND", **kw)
    dy = case.randn(*out.shape)
    res = cann_attn.flash_attention_score_grad(
        case.q,
        case.k,
        case.v,
        dy,
        case.n1,
        "TND",
        softmax_max=smax.float().contiguous(),
        softmax_sum=ssum.float().contiguous(),
        attention_in=out.float(),
        **kw,
    )
    golden = oracle_grads(case.q, case.k, case.v, dy, case.n1, "TND", **kw)
    for name in ("dq", "dk", "dv"):
        assert_close_to_oracle(getattr(res, name), golden[name], name=name)


def test_empty_query_gives_empty_dq_and_zero_dkdv(rng):
    q = torch.randn(1, 2, 0, 8, generator=rng)
    k = torch.randn(1, 2, 5, 8, generator=rng)
    v = torch.randn(1, 2, 5, 8, generator=rng)
    dy = torch.randn(1, 2, 0, 8, generator=rng)
    res = cann_attn.flash_attention_score_grad(q, k, v, dy, 2, "BNSD")
    assert res.dq.shape == q.shape
    assert torch.equal(res.dk, torch.zeros_like(k)) and torch.equal(res.dv, torch.zeros_like(v))


@pytest.mark.parametrize("with_pse", [False, True])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_empty_key_gives_zero_gradients(rng, layout, with_pse):
    """Dense Skv = 0 with Sq > 0: the forward's invalid-row statistics (docs/semantics/invalid-rows.md) and the
    recomputation path both give dq = 0 (and an all-zero dpse), with no NaN from the -FLT_MAX / +FLT_MAX statistics."""
    case = GradCase(layout, rng, b=2, n1=2, sq=6, skv=0)
    kw = {**case.kw}
    if with_pse:
        kw.update(pse=case.randn(2, 2, 6, 0), pse_type=1)
    fwd = cann_attn.flash_attention_score(case.q, case.k, case.v, case.n1, layout, **kw)
    assert torch.all(fwd.softmax_max == -oracle.FLT_MAX) and torch.all(fwd.softmax_sum == oracle.FLT_MAX)
    dy = case.randn(*fwd.attention_out.shape)
    given = {"softmax_max": fwd.softmax_max, "softmax_sum": fwd.softmax_sum, "attention_in": fwd.attention_out}
    for stats in (given, {}):
        res = cann_attn.flash_attention_score_grad(case.q, case.k, case.v, dy, case.n1, layout, **stats, **kw)
        assert torch.equal(res.dq, torch.zeros_like(case.q))
        assert res.dk.shape == case.k.shape and res.dv.shape == case.v.shape
        assert (res.dpse is None) != with_pse and (res.dpse is None or res.dpse.shape == kw["pse"].shape)


@pytest.mark.parametrize(
    ("layout", "form"),
    [("BSND", "expanded"), ("BSND", "transposed"), ("SBH", "mixed"), ("TND", "expanded"), ("TND", "transposed")],
)
def test_non_contiguous_statistics(rng, layout, form):
    """softmax_max / softmax_sum may be non-contiguous (GradV2 table: 非连续Tensor supported) and give exactly the
    gradients of their contiguous copies; TND with softmax_layout "TND" (a true [T, N1, 8]) too. "mixed": only
    softmax_max is strided, so the two statistics do not share strides."""
    case = GradCase(layout, rng, sq=9, skv=11, q_lens=[9, 4], kv_lens=[11, 6])
    extra = {"softmax_layout": "TND"} if layout == "TND" else {}
    fwd = case.forward(**_causal(3), **extra)
    dy = case.randn(*fwd.attention_out.shape)
    kw = {**case.kw, **_causal(3), **extra, "attention_in": fwd.attention_out}
    ref = cann_attn.flash_attention_score_grad(case.q, case.k, case.v, dy, case.n1, layout, **kw,
                                               softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum)

    def strided(t: torch.Tensor) -> torch.Tensor:
        # "expanded": one value per row, broadcast over the 8 lanes (stride 0)
        out = t[..., :1].expand(t.shape) if form == "expanded" else _non_contiguous(t)
        assert not out.is_contiguous() and torch.equal(out, t)
        return out

    smax = strided(fwd.softmax_max)
    ssum = fwd.softmax_sum.clone() if form == "mixed" else strided(fwd.softmax_sum)
    res = cann_attn.flash_attention_score_grad(case.q, case.k, case.v, dy, case.n1, layout, **kw,
                                               softmax_max=smax, softmax_sum=ssum)
    for name in ("dq", "dk", "dv"):
        torch.testing.assert_close(getattr(res, name), getattr(ref, name), rtol=0, atol=0)


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a strided (non-contiguous) tensor."""
    out = torch.empty(*t.shape[::-1], dtype=t.dtype).permute(*reversed(range(t.dim())))
    out.copy_(t)
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "TND"])
def test_non_contiguous_inputs(rng, layout):
    """query/key/value/dy/pse/attention_in may be non-contiguous (documented 非连续Tensor: supported)."""
    case = GradCase(layout, rng, sq=9, skv=11, q_lens=[9, 4], kv_lens=[11, 6])
    pse = case.pse_full()
    kw = {**case.kw, "pse": pse, **_causal(3)}
    fwd = case.forward(pse=pse, **_causal(3))
    dy = case.randn(*fwd.attention_out.shape)
    stats = {"softmax_max": fwd.softmax_max, "softmax_sum": fwd.softmax_sum}
    ref = cann_attn.flash_attention_score_grad(
        case.q, case.k, case.v, dy, case.n1, layout, attention_in=fwd.attention_out, **stats, **kw
    )
    nc = [_non_contiguous(t) for t in (case.q, case.k, case.v, dy)]
    res = cann_attn.flash_attention_score_grad(
        *nc,
        case.n1,
        layout,
        attention_in=_non_contiguous(fwd.attention_out),
        **stats,
        **{**kw, "pse": _non_contiguous(pse)},
    )
    for name in ("dq", "dk", "dv", "dpse"):
        torch.testing.assert_close(getattr(res, name), getattr(ref, name), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ flash_attention: autograd, gradcheck
def _qkv64(layout, gen, **kw):
    return [t.requires_grad_() for t in oracle.make_qkv(layout, gen=gen, dtype=torch.float64, **kw)]


def _gradcheck(fn, inputs):
    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-6, rtol=1e-4)


GRADCHECK_CASES = {  # tiny shapes: gradcheck evaluates the op twice per input element
    "no_mask": ("BNSD", {"sq": 4, "skv": 5}, {}),
    "causal3_sq_gt_skv": ("BSH", {"sq": 5, "skv": 3}, _causal(3)),
    "causal3_sq_lt_skv": ("BSND", {"sq": 3, "skv": 5}, _causal(3)),
    "band4": (
        "SBH",
        {"sq": 5, "skv": 5},
        {"atten_mask": make_compressed_mask(4), "sparse_mode": 4, "pre_tokens": 2, "next_tokens": 1},
    ),
    "gqa": ("BSH", {"n1": 4, "n2": 2, "sq": 3, "skv": 4, "d": 2}, _causal(2)),
    "dv_lt_dqk": ("SBH", {"d": 3, "dv": 2, "sq": 4, "skv": 5}, {}),
    "tnd_varlen": ("TND", {"q_lens": [2, 0, 3], "kv_lens": [2, 3, 4]}, _causal(3)),
}


@pytest.mark.parametrize("name", list(GRADCHECK_CASES))
def test_gradcheck_flash_attention(rng, name):
    layout, shape, kw = GRADCHECK_CASES[name]
    shape = {"b": 1, "n1": 2, "d": 3, **shape}
    inputs = _qkv64(layout, rng, **shape)
    kw = {"scale_value": 0.5, **kw}
    if layout == "TND":
        kw.update(actual_seq_qlen=tnd_cum(shape["q_lens"]), actual_seq_kvlen=tnd_cum(shape["kv_lens"]))
    n1 = shape["n1"]
    _gradcheck(lambda q, k, v: cann_attn.flash_attention(q, k, v, n1, layout, **kw), inputs)


@pytest.mark.parametrize(
    ("pse_type", "rows"), [(1, 1), (0, 4), (1, 4)], ids=["type1_bcast", "type0_full", "type1_full"]
)
def test_gradcheck_flash_attention_pse(rng, pse_type, rows):
    q, k, v = _qkv64("BNSD", rng, b=1, n1=2, sq=4, skv=5, d=3)
    pse = torch.randn(1, 2, rows, 5, generator=rng, dtype=torch.float64).requires_grad_()
    kw = {"scale_value": 0.5, "pse_type": pse_type, **_causal(3)}
    _gradcheck(lambda q, k, v, p: cann_attn.flash_attention(q, k, v, 2, "BNSD", pse=p, **kw), [q, k, v, pse])


@pytest.mark.parametrize("pse_type", [2, 3])
def test_gradcheck_flash_attention_alibi(rng, pse_type):
    q, k, v = _qkv64("BSND", rng, b=2, n1=2, sq=4, skv=5, d=3)
    slopes = torch.tensor([0.5, 0.25])
    kw = {"pse": slopes, "pse_type": pse_type, "q_start_idx": [2], "kv_start_idx": [1], "scale_value": 0.5}
    _gradcheck(lambda q, k, v: cann_attn.flash_attention(q, k, v, 2, "BSND", **kw), [q, k, v])


@pytest.mark.parametrize("layout", ["BSH", "TND"])
def test_gradcheck_flash_attention_dropout(rng, layout):
    shape = {"b": 1, "n1": 2, "sq": 5, "skv": 6, "d": 3, "q_lens": [5, 3], "kv_lens": [6, 4]}
    inputs = _qkv64(layout, rng, **shape)
    kw = {"scale_value": 0.5, "keep_prob": 0.8}
    if layout == "TND":
        kw.update(actual_seq_qlen=[5, 8], actual_seq_kvlen=[6, 10])

    def fn(q, k, v):  # a fresh generator with the same seed: the same mask on every evaluation
        return cann_attn.flash_attention(q, k, v, 2, layout, generator=torch.Generator().manual_seed(1234), **kw)

    _gradcheck(fn, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DT_IDS.get)
def test_flash_attention_backward_matches_oracle(rng, dtype):
    """loss.backward through flash_attention gives the oracle's gradients for q, k, v and pse."""
    case = GradCase("BSH", rng, b=2, n1=4, n2=2, sq=12, skv=15, dtype=dtype)
    pse = case.pse_full(batch=1)
    kw = {**case.kw, "pse": pse, "pse_type": 1, **_causal(3)}
    inputs = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v, pse)]
    out = cann_attn.flash_attention(*inputs[:3], case.n1, "BSH", **{**kw, "pse": inputs[3]})
    dy = case.randn(*out.shape)
    out.backward(dy)
    golden = oracle_grads(case.q, case.k, case.v, dy, case.n1, "BSH", **kw)
    naive = oracle_grads(case.q, case.k, case.v, dy, case.n1, "BSH", same_dtype=True, **kw)
    for name, t in zip(("dq", "dk", "dv", "dpse"), inputs, strict=True):
        assert t.grad is not None and t.grad.dtype == dtype
        assert_close_to_oracle(t.grad, golden[name], naive[name] if dtype != torch.float32 else None, name=name)


# ------------------------------------------------------------------------- flash_attention dropout_p
def _dropout_run(q, k, v, layout, seed, **kw):
    return cann_attn.flash_attention(
        q, k, v, 2, layout, dropout_p=0.2, generator=torch.Generator().manual_seed(seed), **kw
    )


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_dropout_p_reproducible_with_seeded_generator(rng, layout):
    q, k, v = oracle.make_qkv(layout, gen=rng, b=2, n1=2, sq=16, skv=16, d=8, q_lens=[16, 9], kv_lens=[16, 12])
    kw = {"actual_seq_qlen": [16, 25], "actual_seq_kvlen": [16, 28]} if layout == "TND" else {}
    a = _dropout_run(q, k, v, layout, 5, **kw)
    b = _dropout_run(q, k, v, layout, 5, **kw)
    c = _dropout_run(q, k, v, layout, 6, **kw)
    assert torch.equal(a, b), "same seed must give the same output"
    assert not torch.allclose(a, c), "different seeds must give different dropout masks"


@pytest.mark.parametrize("layout", ["SBH", "TND"])
def test_dropout_p_backward_uses_forward_mask(rng, layout):
    """The mask drawn in the forward is the one the backward uses: both match the oracle given the mask
    regenerated by gen_drop_mask with the same seed and drop_mask_numel."""
    b, n1, sq, skv, seed = 2, 2, 10, 13, 77
    q_lens, kv_lens = [10, 4], [13, 7]
    q, k, v = oracle.make_qkv(layout, gen=rng, b=b, n1=n1, sq=sq, skv=skv, d=8, q_lens=q_lens, kv_lens=kv_lens)
    kw = {"scale_value": 8**-0.5, **_causal(3)}
    if layout == "TND":
        kw.update(actual_seq_qlen=tnd_cum(q_lens), actual_seq_kvlen=tnd_cum(kv_lens))
        numel = cann_attn.drop_mask_numel(n1, actual_seq_qlen=tnd_cum(q_lens), actual_seq_kvlen=tnd_cum(kv_lens))
    else:
        numel = cann_attn.drop_mask_numel(n1, batch=b, seq_q=sq, seq_kv=skv)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _dropout_run(*inputs, layout, seed, **kw)
    dy = torch.randn(out.shape, generator=rng)
    out.backward(dy)
    mask = cann_attn.gen_drop_mask(numel, 0.8, generator=torch.Generator().manual_seed(seed))
    gold_out = fa_forward_oracle(q, k, v, n1, layout, keep_prob=0.8, drop_mask=mask, **kw)[0]
    assert_close_to_oracle(out, gold_out, name="attention_out")
    golden = oracle_grads(q, k, v, dy, n1, layout, keep_prob=0.8, drop_mask=mask, **kw)
    for name, t in zip(("dq", "dk", "dv"), inputs, strict=True):
        assert_close_to_oracle(t.grad, golden[name], name=name)
    # and not the gradient of a different mask
    other = cann_attn.gen_drop_mask(numel, 0.8, generator=torch.Generator().manual_seed(seed + 1))
    other_golden = oracle_grads(q, k, v, dy, n1, layout, keep_prob=0.8, drop_mask=other, **kw)
    assert not torch.allclose(inputs[2].grad.double(), other_golden["dv"], atol=1e-4)
