"""The "npu" precision mode's fused fp16 tile passes (native npu_tiles.c: the softmax step from the float64 scores
to the float64 probabilities, the running output's rescale and add) give the bits of the separate passes they
replace: alone, against those passes on tiles with every special value, and through the operators, against the
unfused path, at several key blocks, with masks, pse, GQA, both roundings of every stage and both vector widths."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import cann_attn
from cann_attn.backends.reference import npu_attention
from cann_attn.backends.reference.softmax_exp import EXP2_FLOOR, LOG2E
from cann_attn.problem import precision as prec

native = pytest.importorskip("cann_attn.backends.reference.native")
if native.library() is None:
    pytest.skip("no native library on this machine", allow_module_level=True)

AVX512 = [False, True] if native.set_avx512(True) else [False]


@pytest.fixture(params=AVX512, ids=lambda on: "avx512" if on else "avx2")
def avx512(request):
    assert native.set_avx512(request.param) == request.param
    yield request.param
    native.set_avx512(not native._switched_off(native.AVX512_SWITCH))


def _fp16_ties(g: torch.Generator, n: int, amp: float) -> torch.Tensor:
    """n float64 values exactly halfway between two neighbouring fp16 values (random fp16 values and the next one
    out), of magnitudes around `amp`."""
    h = (torch.randn(n, generator=g) * amp).half()
    outward = (h.view(torch.int16) + 1).view(torch.float16)
    return (h.double() + outward.double()) / 2


def _telling_ties(x: torch.Tensor) -> torch.Tensor:
    """Where positive fp32 `x` lies halfway between two normal fp16 values, the lower one even: half to even rounds
    down, half away up."""
    return ((x.view(torch.int32) & 0x1FFF) == 0x1000) & (x >= 2.0**-14) & (x.half().float() < x)


def _exp_ties(cols: int) -> torch.Tensor:
    """Logits x < 0 (fp16 values) whose exponential in the softmax step (shift 0) is a tie of `_telling_ties`: the
    probabilities' rounding decides them (a few among the ~20000 candidates). `cols` of them, repeated,
    the first replaced by 0 (the row's maximum)."""
    x = torch.arange(0x8001, 0xCC50, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    e = torch.cat([torch.zeros(1), x]).unsqueeze(0)
    native.fa_softmax_step(e, torch.tensor([-math.inf]), torch.zeros(1), torch.empty(1), LOG2E, EXP2_FLOOR)
    e = e[0, 1:]
    tie = _telling_ties(e)
    assert bool(tie.any())
    row = x[tie].repeat(cols // int(tie.sum()) + 1)[:cols]
    row[0] = 0.0
    return row


def _tile_scores(rows: int, cols: int, seed: int) -> torch.Tensor:
    """float64 scores of every scale: ordinary sums, values past fp16's range, fp16 subnormals, ties of fp16 and
    values just off them (their round to odd decides), signed zeros, and a row of logits whose exponentials are
    fp16 ties (with the scale 1)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 6
    s[1] *= 2e4  # logits overflow to inf: NaN rows
    s[2] *= 1e-6  # fp16 subnormal scores
    s[3] = _fp16_ties(g, cols, 4.0)
    s[4] = s[3] * (1 + 2.0**-40)
    s[5, ::3] = -0.0
    s[9] = _exp_ties(cols).double()
    return s


@pytest.mark.parametrize("cols", [7, 45, 1024, 1100])
@pytest.mark.parametrize("scale", [1.0, 0.75])  # 0.75: many logits on fp16 ties
# (scores, logits, P) ties away: the kernel's, and two more, so that every two flags differ in one case
@pytest.mark.parametrize("away", [(False, False, True), (True, False, False), (False, True, False)],
                         ids=["even-even-away", "away-even-even", "even-away-even"])
@pytest.mark.parametrize("with_logits", [False, True], ids=["from-scores", "given-logits"])
def test_softmax_step_is_the_separate_passes(avx512, cols, scale, away, with_logits):
    """npu_fp16_softmax_step against npu_round_wide_fp16 (or the given logits), fa_softmax_step and npu_round, then
    the widening to float64: P, row max, row sum and correction bit for bit; running maxima of -inf, below and
    above the tile's; fully masked rows; a row count and widths off every vector width."""
    scores_away, logits_away, p_away = away
    rows = 13
    s = _tile_scores(rows, cols, seed=cols)
    g = torch.Generator().manual_seed(1)
    # running maxima: -inf where the tile's own logits must decide (ties, NaN), else below and above the tile's
    m0 = torch.tensor([-math.inf, -math.inf, 3.0, -math.inf, -math.inf, 0.5, 1e4, -math.inf, 8.0, -math.inf, 1.0,
                       2.0, 30.0])
    l0 = torch.rand(rows, generator=g) * 4
    logits = None
    if with_logits:
        logits = native.npu_round_wide_fp16(s, scores_away, scale, logits_away)
        logits[6] = -math.inf  # a fully masked row
        logits[7, : cols // 2] = -math.inf
        logits[8] += torch.randn(cols, generator=g) * 3  # a pse-like shift off the fp16 grid
    want_logits = logits.clone() if with_logits else native.npu_round_wide_fp16(s, scores_away, scale, logits_away)
    want_m, want_l, want_c = m0.clone(), l0.clone(), torch.empty(rows)
    native.fa_softmax_step(want_logits, want_m, want_l, want_c, LOG2E, EXP2_FLOOR)
    want_p = native.npu_round(want_logits, True, p_away).double()

    got_m, got_l, got_c = m0.clone(), l0.clone(), torch.empty(rows)
    native.npu_fp16_softmax_step(s, logits, got_m, got_l, got_c, LOG2E, EXP2_FLOOR, scores_away=scores_away,
                                 scale=scale, logits_away=logits_away, p_away=p_away)
    assert torch.isnan(want_p[1]).any() and (want_p[6] == 0).all()  # the special rows do what they are for
    assert torch.equal(s.view(torch.int64), want_p.view(torch.int64))
    for got, want in ((got_m, want_m), (got_l, want_l), (got_c, want_c)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("dim", [5, 36, 128])
# (products, rescale, running output) ties away: the kernel's, and two more, so that every two flags differ once
@pytest.mark.parametrize("away", [(False, True, False), (True, False, False), (False, False, True)],
                         ids=["even-away-even", "away-even-even", "even-even-away"])
def test_running_output_update_is_the_casts(avx512, dim, away):
    """npu_fp16_accumulate against the Casts: acc <- acc_cast(acc_cast(acc * rescale_cast(c)) + products_cast(P V)),
    with corrections 0, 1, fp16 ties and few-bit factors (ties of the rescaled output), ties of the products,
    overflow to inf."""
    products_away, rescale_away, acc_away = away
    rows = 11
    g = torch.Generator().manual_seed(dim)
    cast = {flag: prec.Cast(torch.float16, prec.HALF_AWAY if flag else prec.HALF_EVEN) for flag in (False, True)}
    acc0 = cast[False](torch.randn(rows, dim, generator=g) * 30)
    acc0[0] = 6e4
    products = torch.randn(rows, dim, generator=g, dtype=torch.float64) * 40
    products[1] = _fp16_ties(g, dim, 20.0)
    products[2] = products[1] * (1 - 2.0**-45)
    products[0] = 3e4
    correction = torch.rand(rows, generator=g)
    correction[3], correction[4], correction[0] = 0.0, 1.0, 1.0
    correction[5:8] = torch.tensor([0.75, 0.625, 0.5 + 2.0**-11])
    correction[8:10] = _fp16_ties(g, 2, 0.3).float()
    scaled = cast[acc_away](acc0 * cast[rescale_away](correction).unsqueeze(-1))
    want = cast[acc_away](scaled + cast[products_away](products))

    got = acc0.clone()
    native.npu_fp16_accumulate(got, products, correction, products_away=products_away, rescale_away=rescale_away,
                               acc_away=acc_away)
    assert torch.isinf(want[0]).all()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


# --- through the operators: the fused path against the unfused one ----------------------------------------------

STAGES = ("scores", "logits", "probabilities", "products", "accumulator", "rescale")


def _flipped(pipeline: prec.AttentionPipeline, stages) -> prec.AttentionPipeline:
    """`pipeline` with the fp16 `stages` (names of `STAGES`) rounding the other way."""
    roundings = {prec.HALF_EVEN: prec.HALF_AWAY, prec.HALF_AWAY: prec.HALF_EVEN}
    casts = pipeline.stages()
    return dataclasses.replace(pipeline, **{name: prec.Cast(torch.float16, roundings[casts[name].rounding])
                                            for name in stages})


def _run(monkeypatch, fused: bool, flip, **call) -> list[torch.Tensor]:
    """(output, lse) of a FusedInferAttentionScore prefill in the npu mode, fp16 high performance with the stages
    `flip` rounding the other way (a pse keeps that pipeline: only the fused pass's handling of given logits is
    tested by it), fused or not."""
    original = prec.pfa_pipeline
    calls = []

    def pipeline(dtype, inner_precise, pse=False):
        return _flipped(original(dtype, inner_precise), flip)

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    step = native.npu_fp16_softmax_step
    with monkeypatch.context() as patch:
        patch.setattr(prec, "pfa_pipeline", pipeline)
        patch.setattr(native, "npu_fp16_softmax_step", counted)
        if not fused:
            patch.setattr(npu_attention, "_fused_fp16_step", lambda *args: False)
        with cann_attn.precision("npu"):
            out, lse = cann_attn.fused_infer_attention_score(**call, input_layout="BNSD", inner_precise=1,
                                                             softmax_lse_flag=True)
    assert bool(calls) == fused
    return [out.view(torch.int16), lse.view(torch.int32)]


def _inputs(sq=300, skv=2500, heads=4, heads_kv=2, dim=36, seed=0):
    """q and k on the grid of 2^-6 (exact sums of ~14 bits: the scores' fp16 rounding meets ties), v ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randint(-96, 97, (1, heads, sq, dim), generator=g) * 2.0**-6).half()
    k = (torch.randint(-96, 97, (1, heads_kv, skv, dim), generator=g) * 2.0**-6).half()
    v = torch.randn(1, heads_kv, skv, dim, generator=g).half()
    return q, k, v


def _case(name: str):
    q, k, v = _inputs()
    sq, skv = q.shape[2], k.shape[2]
    # scale 0.75 (exact in fp16): many logits fp16(score) * 0.75 are ties
    call = dict(query=q, key=k, value=v, num_heads=4, num_key_value_heads=2, scale=0.75)
    if name == "causal":
        call.update(atten_mask=torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq + 1), sparse_mode=0)
    elif name == "random-mask":
        g = torch.Generator().manual_seed(5)
        mask = torch.rand(sq, skv, generator=g) < 0.3
        mask[7] = True  # a row without keys
        call.update(atten_mask=mask, sparse_mode=0)
    elif name == "band":
        call.update(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), sparse_mode=4, pre_tokens=900,
                    next_tokens=1500)
    elif name == "pse":
        call.update(pse_shift=(torch.randn(1, 4, sq, skv, generator=torch.Generator().manual_seed(6)) * 2).half())
    return call


@pytest.mark.parametrize("case", ["none", "causal", "random-mask", "band", "pse"])
@pytest.mark.parametrize("flip", [(), STAGES], ids=["kernel-roundings", "flipped-roundings"])
def test_fused_path_is_bitwise_the_unfused_one(monkeypatch, avx512, case, flip):
    """Sq 300 (partial query tiles; without a mask the fused path's are 256 rows high, the unfused path's 128), Skv
    2500 (three key blocks of 1024, the last partial), GQA 4 / 2, D 36: the output and lse bit for bit, with the
    pipeline's roundings and with every fp16 stage's rounding flipped."""
    call = _case(case)
    fused, unfused = _run(monkeypatch, True, flip, **call), _run(monkeypatch, False, flip, **call)
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)


def _correction_tie() -> float:
    """A logit d > 0 (an fp16 value) whose rescale factor e^(0 - d) in the softmax step is a tie of
    `_telling_ties`."""
    d = torch.arange(0x0001, 0x4C50, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    corr = torch.empty(len(d))
    native.fa_softmax_step(d.clone().unsqueeze(-1), torch.zeros(len(d)), torch.ones(len(d)), corr, LOG2E, EXP2_FLOOR)
    tie = _telling_ties(corr)
    return float(d[tie][0])


def _tie_case() -> dict:
    """Three equal query rows (q = e0, scale 1: the logits are k[:, 0]; one row would take the decode kernel) over
    two key blocks whose probabilities, P V sums and rescale factor are fp16 ties, each seen by its own output
    column: in the first block keys of logit 0 (P 1) and of exp ties (P a tie), and one of P 0.5 whose value 2^-10
    makes column 0's sum 1 + 2^-11 (a tie); in the second a key of logit d whose rescale factor e^-d is a tie, which
    carries the first block's columns (4..15: twelve values, so that the factor's two roundings show after the
    division). The other keys' P rounds to 0."""
    skv, dim = 1500, 16
    q = torch.zeros(1, 1, 3, dim)
    q[..., 0] = 1
    k = torch.zeros(1, 1, skv, dim)
    v = torch.zeros(1, 1, skv, dim)
    k[..., 0] = -30.0
    ties = _exp_ties(3)[1:]
    k[0, 0, 0, 0], v[0, 0, 0, 0] = 0.0, 1.0
    k[0, 0, 1:3, 0] = ties
    v[0, 0, 1, 1] = v[0, 0, 2, 2] = 1.0
    k[0, 0, 3, 0], v[0, 0, 3, 0] = -0.69287109375, 2.0**-10  # e^-0.6929 rounds to 0.5 either way
    k[0, 0, 4:16, 0] = -torch.arange(1, 13) / 7  # P's that the rescale carries into columns 4..15
    v[0, 0, 4:16, 4:16] = torch.eye(12)
    k[0, 0, 1024, 0], v[0, 0, 1024, 3] = _correction_tie(), 1.0
    return dict(query=q.half(), key=k.half(), value=v.half(), num_heads=1, num_key_value_heads=1, scale=1.0)


@pytest.mark.parametrize("stage", ["probabilities", "products", "rescale"])
def test_fused_path_rounds_ties_as_the_pipeline_says(monkeypatch, avx512, stage):
    """On ties of P, of the P V sums and of the rescale factor (`_tie_case`), the fused path follows the pipeline's
    rounding of each stage as the unfused one does (and the case tells the two roundings of that stage apart)."""
    call = _tie_case()
    fused, unfused = _run(monkeypatch, True, (stage,), **call), _run(monkeypatch, False, (stage,), **call)
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(fused[0], _run(monkeypatch, True, (), **call)[0])
