"""Attention sinks (docs/semantics/sinks.md) in flash_attention_score, flash_attention_score_grad (dsink) and the
differentiable flash_attention, on every backend path: the reference backend's native loops, its PyTorch path
(CANN_ATTN_NATIVE=0) and Triton (the interpreter on CPU).

The golden is the float64 oracle with the sink as the gpt-oss formula states it (one more softmax column per row,
dropped before P V), and torch.autograd through it for dq, dk, dv and dsink.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cann_attn
import oracle
from dsa_utils import SFACase
from fa_grad_utils import DT_IDS, LAYOUTS, GradCase, valid_grad_modes
from oracle import FLT_MAX, make_compressed_mask
from test_fa_backward_hypothesis import _build, configs
from test_sparse_attention_hypothesis import sfa_configs

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PATHS = ("native", "pytorch", "triton")


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(params=PATHS)
def path(request, monkeypatch) -> dict:
    """Keyword arguments (and environment) selecting one backend path."""
    if request.param == "pytorch":
        monkeypatch.setenv("CANN_ATTN_NATIVE", "0")
    return {"backend": "triton"} if request.param == "triton" else {"backend": "reference"}


def _sink(n1: int, gen: torch.Generator, spread: float = 2.0) -> torch.Tensor:
    return (torch.randn(n1, generator=gen) * spread).float()


# ----------------------------------------------------------------------------------- the documented formula
def test_oracle_is_the_documented_formula(rng):
    """torch_npu's own example: softmax over [scale * Q K^T, sink] with the sink column dropped, times V."""
    q, k, v = (torch.randn(2, 3, 7, 8, generator=rng, dtype=torch.float64) for _ in range(3))
    sink = torch.linspace(-0.2, 3.0, 3, dtype=torch.float64)
    scores = q @ k.transpose(-1, -2) * 0.35
    probs = torch.softmax(torch.cat([scores, sink.view(1, 3, 1, 1).expand(2, 3, 7, 1)], -1), -1)[..., :-1]
    out, smax, ssum = oracle.fa_forward_oracle(q, k, v, 3, "BNSD", scale_value=0.35, sink=sink)
    torch.testing.assert_close(out, probs @ v, rtol=1e-12, atol=1e-12)
    row_max = torch.maximum(scores.amax(-1), sink.view(1, 3, 1))
    torch.testing.assert_close(smax[..., 0], row_max, rtol=1e-12, atol=1e-12)
    expected_sum = (scores - row_max[..., None]).exp().sum(-1) + (sink.view(1, 3, 1) - row_max).exp()
    torch.testing.assert_close(ssum[..., 0], expected_sum, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------ forward + grad against the oracle
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_dtypes_gqa(rng, path, layout, dtype):
    case = GradCase(layout, rng, n1=4, n2=2, sq=11, skv=14, dtype=dtype, q_lens=[11, 4, 7], kv_lens=[14, 4, 9])
    case.check(sink=_sink(4, rng), **path)


@pytest.mark.parametrize(("layout", "mode"), [(lay, m) for lay in ("BSND", "TND") for m in valid_grad_modes(lay)],
                         ids=str)
def test_sparse_modes(rng, layout, mode):
    case = GradCase(layout, rng, n1=2, n2=1, sq=13, skv=17, q_lens=[13, 5], kv_lens=[17, 8])
    extra = {"softmax_layout": "TND"} if layout == "TND" and mode % 2 else {}
    case.check(sparse_mode=mode, **case.mode_kwargs(mode), sink=_sink(2, rng), **extra)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=DT_IDS.get)
def test_sliding_window_gpt_oss(rng, path, dtype):
    """The gpt-oss call of MindSpeed-LLM: sparse_mode 4 (band: pre_tokens back, next_tokens 0), GQA, BSND."""
    case = GradCase("BSND", rng, b=1, n1=4, n2=1, sq=40, dtype=dtype)
    case.check(sparse_mode=4, atten_mask=make_compressed_mask(4), pre_tokens=7, next_tokens=0,
               sink=_sink(4, rng), **path)


def test_dropout_and_pse(rng, path):
    case = GradCase("BNSD", rng, n1=2, sq=12, skv=15)
    case.check(keep_prob=0.75, drop_mask=case.drop_mask(0.75), pse=case.pse_full(batch=1), pse_type=1,
               sink=_sink(2, rng), **path)


def test_alibi_and_tnd_dropout(rng):
    case = GradCase("TND", rng, n1=2, q_lens=[9, 3], kv_lens=[12, 3])
    case.check(keep_prob=0.6, drop_mask=case.drop_mask(0.6), pse=case.slopes(), pse_type=2, sink=_sink(2, rng))


# -------------------------------------------------------------------------------------- fully masked rows
def test_fully_masked_rows(rng, path):
    """A row without visible keys still has the sink column: output 0, softmax_max = sink, softmax_sum = 1, and no
    gradient flows anywhere from it (its output does not depend on anything)."""
    case = GradCase("BNSD", rng, b=1, n1=2, sq=6, skv=5)
    mask = torch.zeros(6, 5, dtype=torch.bool)
    mask[[1, 4]] = True
    sink = torch.tensor([0.7, -2.5])
    fwd = case.forward(atten_mask=mask, sink=sink, **path)
    assert torch.equal(fwd.attention_out[:, :, [1, 4]], torch.zeros(1, 2, 2, case.dv))
    assert torch.equal(fwd.softmax_max[:, :, [1, 4]], sink.view(1, 2, 1, 1).expand(1, 2, 2, 8))
    assert torch.equal(fwd.softmax_sum[:, :, [1, 4]], torch.ones(1, 2, 2, 8))
    case.check(atten_mask=mask, sink=sink, **path)


def test_rows_without_any_key(rng):
    """Dense Skv = 0: no kernel visits the rows; they take the sink's statistics, output 0, dsink 0."""
    q, k, v = torch.randn(1, 2, 3, 4, generator=rng), torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 0, 4)
    sink = torch.tensor([1.5, -0.5])
    fwd = cann_attn.flash_attention_score(q, k, v, 2, "BNSD", sink=sink)
    assert torch.equal(fwd.attention_out, torch.zeros(1, 2, 3, 4))
    assert torch.equal(fwd.softmax_max, sink.view(1, 2, 1, 1).expand(1, 2, 3, 8))
    assert torch.equal(fwd.softmax_sum, torch.ones(1, 2, 3, 8))
    grads = cann_attn.flash_attention_score_grad(q, k, v, torch.randn(1, 2, 3, 4, generator=rng), 2, "BNSD",
                                                 sink=sink)
    assert torch.equal(grads.dsink, torch.zeros(2)) and torch.equal(grads.dq, torch.zeros_like(q))


def test_minus_infinity_sink_is_no_sink(rng, path):
    """exp(-inf) adds exactly 0 and leaves every maximum alone: bit-identical to the call without a sink, invalid
    rows included (they stay -FLT_MAX / FLT_MAX); dsink is 0."""
    case = GradCase("BSND", rng, b=1, n1=2, sq=9, skv=9)
    mask = make_compressed_mask(3)
    kw = {"atten_mask": mask, "sparse_mode": 3, **path}
    plain = case.forward(**kw)
    sunk = case.forward(sink=torch.full((2,), -math.inf), **kw)
    for a, b in zip(plain[:3], sunk[:3], strict=True):
        assert torch.equal(a, b)
    dy = torch.randn_like(plain.attention_out)
    g0 = cann_attn.flash_attention_score_grad(case.q, case.k, case.v, dy, 2, "BSND", **case.kw, **kw)
    g1 = cann_attn.flash_attention_score_grad(case.q, case.k, case.v, dy, 2, "BSND", **case.kw, **kw,
                                              sink=torch.full((2,), -math.inf))
    for name in ("dq", "dk", "dv"):
        assert torch.equal(getattr(g0, name), getattr(g1, name))
    assert torch.equal(g1.dsink, torch.zeros(2)) and g0.dsink is None


def test_a_large_sink_takes_the_mass(rng):
    """sink >> every logit: P_sink ~ 1, the output ~ 0, softmax_max = sink; a mutant that scales the sink (or adds it
    without the max) fails this."""
    case = GradCase("BNSD", rng, b=1, n1=2, sq=5, skv=5)
    fwd = case.forward(sink=torch.tensor([60.0, 60.0]))
    assert torch.equal(fwd.softmax_max, torch.full_like(fwd.softmax_max, 60.0))
    assert fwd.attention_out.abs().max() < 1e-20
    assert torch.all((fwd.softmax_sum - 1).abs() < 1e-20)


# ------------------------------------------------------------------------------------------ gradcheck, errors
@pytest.mark.parametrize(("layout", "kw"), [
    ("BSND", {"sparse_mode": 4, "atten_mask": make_compressed_mask(4), "pre_tokens": 2, "next_tokens": 0}),
    ("TND", {"actual_seq_qlen": [3, 5], "actual_seq_kvlen": [4, 6], "sparse_mode": 3,
             "atten_mask": make_compressed_mask(3)}),
])
def test_gradcheck_query_key_value_sink(rng, layout, kw):
    """torch.autograd.gradcheck in float64 of the differentiable flash_attention w.r.t. query, key, value and sink."""
    shapes = {"BSND": ((1, 5, 2, 4), (1, 5, 1, 4)), "TND": ((5, 2, 4), (6, 1, 4))}[layout]
    q = torch.randn(*shapes[0], generator=rng, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(*shapes[1], generator=rng, dtype=torch.float64).requires_grad_() for _ in range(2))
    sink = torch.randn(2, generator=rng, dtype=torch.float64).requires_grad_()

    def fn(q, k, v, sink):
        return cann_attn.flash_attention(q, k, v, 2, layout, scale_value=0.6, sink=sink, **kw)

    assert torch.autograd.gradcheck(fn, (q, k, v, sink))


def test_flash_attention_sink_is_a_leaf_with_dropout(rng):
    """Dropout: the mask is drawn once and reused; dsink still matches autograd through the oracle."""
    q, k, v = (torch.randn(1, 6, 2, 8, generator=rng).requires_grad_() for _ in range(3))
    sink = torch.tensor([0.3, -0.4], requires_grad=True)
    gen = torch.Generator().manual_seed(3)
    out = cann_attn.flash_attention(q, k, v, 2, "BSND", scale_value=0.3, keep_prob=0.7, generator=gen, sink=sink)
    out.backward(torch.ones_like(out))
    drop = cann_attn.gen_drop_mask(cann_attn.drop_mask_numel(2, actual_seq_qlen=[6], actual_seq_kvlen=[6]), 0.7,
                                   generator=torch.Generator().manual_seed(3))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    gold = oracle.fa_forward_oracle(*leaves[:3], 2, "BSND", scale_value=0.3, keep_prob=0.7, drop_mask=drop,
                                    sink=leaves[3])[0]
    torch.testing.assert_close(out.detach().double(), gold, rtol=1e-5, atol=1e-6)
    gold.backward(torch.ones_like(gold))
    for ours, theirs in zip((q, k, v, sink), leaves, strict=True):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(2, 1), torch.zeros(2, dtype=torch.float16), [0.0, 1.0]])
def test_bad_sink(rng, bad):
    q = torch.randn(1, 2, 4, 8, generator=rng)
    with pytest.raises(cann_attn.ParamInvalidError, match="sink"):
        cann_attn.flash_attention_score(q, q, q, 2, "BNSD", sink=bad)
    with pytest.raises(cann_attn.ParamInvalidError, match="sink"):
        cann_attn.flash_attention_score_grad(q, q, q, q, 2, "BNSD", sink=bad)


def test_no_sink_gives_no_dsink(rng):
    q = torch.randn(1, 2, 4, 8, generator=rng)
    assert cann_attn.flash_attention_score_grad(q, q, q, q, 2, "BNSD").dsink is None


# ------------------------------------------------------------------------------------------- torch_npu shim
def test_torch_npu_gpt_oss_call(rng):
    """MindSpeed-LLM's gpt-oss attention: npu_fusion_attention(..., sparse_mode=4, sink=module.sinks.float()),
    differentiable (autograd gives the sink its gradient); the grad spellings return dsink."""
    from cann_attn import torch_npu

    b, s, n, d = 1, 10, 4, 8
    q = torch.randn(b, s, n * d, generator=rng).requires_grad_()
    k, v = (torch.randn(b, s, 2 * d, generator=rng).requires_grad_() for _ in range(2))
    sinks = torch.nn.Parameter(torch.randn(n, generator=rng).to(torch.bfloat16))
    mask = cann_attn.compressed_mask(4)
    kw = dict(atten_mask=mask, sparse_mode=4, pre_tockens=3, next_tockens=0)
    out, smax, ssum, *_ = torch_npu.npu_fusion_attention(q, k, v, n, "BSH", scale=d**-0.5, sink=sinks.float(), **kw)
    dy = torch.randn(out.shape, generator=rng)
    out.backward(dy)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.detach().float().requires_grad_()
    ref = cann_attn.flash_attention(*leaves, n, "BSH", scale_value=d**-0.5, atten_mask=mask, sparse_mode=4,
                                    pre_tokens=3, next_tokens=0, sink=sink_leaf)
    assert torch.equal(out.detach(), ref.detach())
    ref.backward(dy)
    for ours, theirs in zip((q, k, v), leaves, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    assert sinks.grad.dtype == torch.bfloat16  # the float() cast's backward rounds dsink to the parameter's dtype
    torch.testing.assert_close(sinks.grad, sink_leaf.grad.to(torch.bfloat16), rtol=0, atol=0)
    grads = torch_npu.npu_fusion_attention_grad(q, k, v, dy, n, "BSH", softmax_max=smax, softmax_sum=ssum,
                                                attention_in=out.detach(), scale_value=d**-0.5,
                                                sink=sinks.detach().float(), **kw)
    assert len(grads) == 5 and grads[3] is None
    torch.testing.assert_close(grads[4], sink_leaf.grad, rtol=1e-5, atol=1e-6)
    v2 = torch_npu.npu_fusion_attention_grad_v2(q, k, v, dy, n, "BSH", softmax_max=smax, softmax_sum=ssum,
                                                attention_in=out.detach(), scale_value=d**-0.5, atten_mask=mask,
                                                sparse_mode=4, pre_tokens=3, next_tokens=0,
                                                sink=sinks.detach().float())
    assert len(v2) == 7 and torch.equal(v2[6], grads[4])
    no_sink = torch_npu.npu_fusion_attention_grad(q, k, v, dy, n, "BSH", scale_value=0.3)[4]
    assert no_sink.shape == (0,) and no_sink.dtype == torch.float32  # op-plugin: an empty dsink without sink


# ----------------------------------------------------------------------------------------------- hypothesis
@pytest.mark.filterwarnings("ignore:sparse_mode=.* without atten_mask:UserWarning")  # on purpose
@settings(max_examples=200, deadline=None)
@given(cfg=configs(), data=st.data())
def test_hypothesis_grad_with_sink(cfg, data):
    """The FA grad fuzzing configurations (layouts, GQA, every sparse mode and mask, pse, dropout, TND lengths with
    zeros, fully masked rows, statistics given or recomputed) with a sink drawn per head, -inf included."""
    case, kw = _build(cfg)
    case.kw.update(scale_value=kw.pop("scale_value"))
    values = data.draw(st.lists(st.one_of(st.floats(-6, 6, width=32), st.just(-math.inf)), min_size=cfg["n1"],
                                max_size=cfg["n1"]))
    case.check(stats=(cfg["with_stats"],), naive=False, sink=torch.tensor(values, dtype=torch.float32), **kw)


def test_statistics_match_invalid_row_convention_without_sink(rng):
    """Sanity of the helpers: without a sink fully masked rows keep -FLT_MAX / FLT_MAX."""
    case = GradCase("BNSD", rng, b=1, n1=1, sq=3, skv=3)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask[1] = True
    fwd = case.forward(atten_mask=mask)
    assert fwd.softmax_max[0, 0, 1, 0] == -FLT_MAX and fwd.softmax_sum[0, 0, 1, 0] == FLT_MAX


# ------------------------------------------------------------------------------ SparseFlashAttention (sinks)
@pytest.mark.parametrize(("layout", "mode", "block_size", "dtype"), [
    ("BSND", 3, 1, torch.float32), ("BSND", 0, 8, torch.bfloat16), ("TND", 3, 1, torch.float16),
    ("TND", 0, 8, torch.float32)], ids=str)
def test_sfa_sinks(rng, path, layout, mode, block_size, dtype):
    """Forward (statistics include the sinks), grad with d_sinks; a row with every entry -1 and, BSND, rows beyond
    the actual query length (those stay uncomputed: 0, -2e38, 0)."""
    lens = {"q_lens": [5, 3], "kv_lens": [12, 7]} if layout == "BSND" else {"q_lens": [6, 0, 4], "kv_lens": [20, 0, 9]}
    case = SFACase(layout, gen=rng, b=2, s1=6, s2=20, n1=4, block_size=block_size, mode=mode, dtype=dtype,
                   sinks=_sink(4, rng), **lens)
    empty_row = (0, 1) if layout == "BSND" else (1,)  # batch 0 row 1 / token 1: every entry -1
    case.inputs["sparse_indices"][empty_row] = -1
    fwd, _ = case.check() if path["backend"] == "reference" else (None, None)
    if path["backend"] == "triton":
        fwd = case.check_forward(case.forward(backend="triton"))
        case.check_grads(case.grad(fwd, backend="triton"))
    if layout == "BSND":  # row 5 of batch 1 is beyond its actual length 3
        assert bool((fwd.softmax_sum[1, 0, 4] == 0).all()) and bool((fwd.attention_out[1, 4] == 0).all())
    stat = (0, 0, 1) if layout == "BSND" else (0, 1)
    assert torch.equal(fwd.softmax_max[stat], case.sinks) and torch.equal(fwd.softmax_sum[stat], torch.ones(4))


def test_sfa_sinks_minus_infinity_is_no_sinks(rng):
    case = SFACase("BSND", gen=rng, b=1, s1=5, s2=9, n1=2, sinks=torch.full((2,), -math.inf))
    plain = SFACase("BSND", gen=torch.Generator().manual_seed(1), b=1, s1=5, s2=9, n1=2)
    plain.inputs = case.inputs
    for a, b in zip(case.forward(), plain.forward(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(case.grad().d_sinks, torch.zeros(2))


def test_sparse_attention_sinks_leaf_and_torch_npu(rng):
    """cann_attn.sparse_attention: the sinks get their gradient (DSA latent as key and value); torch_npu's
    npu_sparse_flash_attention takes sinks (no gradient to them, as op-plugin's derivatives say)."""
    from cann_attn import torch_npu

    case = SFACase("BSND", gen=rng, b=1, s1=6, s2=10, n1=4, value_is_key=True, sinks=_sink(4, rng))
    i = case.inputs
    q, latent, qr, kr = (i[n].clone().requires_grad_() for n in ("query", "key", "query_rope", "key_rope"))
    sinks = case.sinks.clone().requires_grad_()
    out = cann_attn.sparse_attention(q, latent, latent, i["sparse_indices"], case.kw["scale_value"], query_rope=qr,
                                     key_rope=kr, sinks=sinks)
    out.backward(case.d_out)
    golden = case.oracle_grads()
    torch.testing.assert_close(sinks.grad.double(), golden["d_sinks"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(latent.grad.double(), golden["d_key"] + golden["d_value"], rtol=1e-5, atol=1e-5)
    npu = torch_npu.npu_sparse_flash_attention(i["query"], i["key"], i["value"], i["sparse_indices"],
                                               case.kw["scale_value"], query_rope=i["query_rope"],
                                               key_rope=i["key_rope"], return_softmax_lse=True, sinks=case.sinks)
    assert torch.equal(npu[0], out.detach()) and torch.equal(npu[1], case.forward().softmax_max)
    grads = torch_npu.npu_sparse_flash_attention_grad(i["query"], i["key"], i["value"], i["sparse_indices"],
                                                      case.d_out, npu[0], npu[1], npu[2], case.kw["scale_value"], 1,
                                                      query_rope=i["query_rope"], key_rope=i["key_rope"])
    assert len(grads) == 5
    torch.testing.assert_close(grads[0], q.grad, rtol=0, atol=0)


@settings(max_examples=200, deadline=None)
@given(cfg=sfa_configs(), data=st.data())
def test_hypothesis_sfa_with_sinks(cfg, data):
    """The SFA fuzzing configurations (layouts, lengths, block sizes, modes, -1 anywhere, duplicates, rope or not,
    value == key or not) with sinks drawn per head, -inf included."""
    cfg = dict(cfg)
    gen = torch.Generator().manual_seed(cfg.pop("seed"))
    values = data.draw(st.lists(st.one_of(st.floats(-6, 6, width=32), st.just(-math.inf)), min_size=cfg["n1"],
                                max_size=cfg["n1"]))
    SFACase(cfg.pop("layout"), gen=gen, sinks=torch.tensor(values, dtype=torch.float32), **cfg).check()
