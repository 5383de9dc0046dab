"""QuantLightningIndexer against the independent float64 oracle of cann_attn.testing.dsa_quant_oracle
(docs/operators/quant_dsa.md): int8 and float8_e4m3fn, BSND / TND, paged (PA_BSND) and contiguous keys, sparse_mode
0 / 3, per-batch lengths including 0, -1 padding, paged equal to contiguous bit for bit, the torch_npu spelling,
hypothesis fuzzing, mutants (scale placement, block mapping) caught, one error per documented constraint."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn.backends.reference import indexer as kernel
from cann_attn.testing import dsa_quant_oracle as oracle
from matrix_sample import fuzz_examples
from paged_utils import paginate
from test_indexer import assert_topk_consistent

pytestmark = pytest.mark.usefixtures("single_thread")

F16, F32, BF16, I8, FP8 = torch.float16, torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn
SCALE_DTYPES = {I8: (F16, F16, F16), FP8: (BF16, F32, F32)}
LENGTHS = {"BSND": ([7, 0, 3], [11, 6, 2]), "TND": ([6, 0, 3, 2], [9, 4, 5, 2])}


class QuantCase:
    """Random quantised indexer inputs; `exact=True` draws small integers and dyadic scales/weights so every score is
    exact in fp32 (the top-k, ties included, must then equal the oracle's exactly)."""

    def __init__(self, layout, gen, *, dtype=I8, h=None, d=128, exact=False, signed_scales=False, s1=7, s2=11):
        self.layout, self.dtype = layout, dtype
        h = (8 if dtype == FP8 else 4) if h is None else h  # float8_e4m3fn: N1 in 8, 16, 24, 32, 64
        q_lens, kv_lens = LENGTHS[layout]
        w_dt, qs_dt, ks_dt = SCALE_DTYPES[dtype]
        if layout == "BSND":
            q_lead, kv_lead = (len(q_lens), s1), (len(kv_lens), s2)
            self.kw = dict(layout="BSND", actual_seq_lengths_query=q_lens, actual_seq_lengths_key=kv_lens)
        else:
            q_lead, kv_lead = (sum(q_lens),), (sum(kv_lens),)
            ends = lambda lens: [sum(lens[: i + 1]) for i in range(len(lens))]  # noqa: E731
            self.kw = dict(layout="TND", actual_seq_lengths_query=ends(q_lens), actual_seq_lengths_key=ends(kv_lens))
        self.q_lens, self.kv_lens = q_lens, kv_lens
        hi = 4 if exact else 127

        def ints(*shape):
            v = torch.randint(-hi, hi + 1, shape, generator=gen)
            return v.to(torch.float32).to(dtype) if dtype == FP8 else v.to(dtype)

        def scales(*shape, dt):
            v = (torch.randint(1, 9, shape, generator=gen) / 8.0) if exact else torch.rand(shape, generator=gen) + 0.05
            if signed_scales:
                v = v * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
            return v.to(dt)

        self.query, self.key = ints(*q_lead, h, d), ints(*kv_lead, 1, d)
        self.weights = scales(*q_lead, h, dt=w_dt)
        self.query_scale = scales(*q_lead, h, dt=qs_dt)
        self.key_scale = scales(*kv_lead, 1, dt=ks_dt)

    def args(self):
        return self.query, self.key, self.weights, self.query_scale, self.key_scale

    def run(self, **kw):
        return cann_attn.quant_lightning_indexer(*self.args(), **{**self.kw, **kw})

    def scores(self, sparse_mode):
        return oracle.quant_index_scores_oracle(*self.args(), sparse_mode=sparse_mode, **self.kw)

    def paged(self, gen, block_size=16):
        """(key cache, key-scale cache, block_table) holding each sequence's actual keys."""
        starts = [sum(self.kv_lens[:b]) for b in range(len(self.kv_lens))]
        if self.layout == "BSND":
            keys = [self.key[b, :n] for b, n in enumerate(self.kv_lens)]
            key_scales = [self.key_scale[b, :n] for b, n in enumerate(self.kv_lens)]
        else:
            keys = [self.key[s : s + n] for s, n in zip(starts, self.kv_lens, strict=True)]
            key_scales = [self.key_scale[s : s + n] for s, n in zip(starts, self.kv_lens, strict=True)]
        caches, table = paginate({"key": keys, "scale": key_scales}, block_size, gen)
        return caches["key"], caches["scale"], table

    def run_paged(self, gen, block_size=16, **kw):
        key_cache, scale_cache, table = self.paged(gen, block_size)
        lens = dict(self.kw, actual_seq_lengths_key=self.kv_lens, block_table=table, layout_key="PA_BSND")
        return cann_attn.quant_lightning_indexer(self.query, key_cache, self.weights, self.query_scale, scale_cache,
                                                 **{**lens, **kw})


@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("dtype", [I8, FP8])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_exact_scores_give_the_oracle_top_k(layout, dtype, mode, rng):
    """Integer-valued inputs with dyadic scales: fp32 scores are exact, so indices (ties to the smaller index)
    equal the oracle's; sequences with 0 queries or keys and rows beyond the lengths are all -1."""
    case = QuantCase(layout, rng, dtype=dtype, exact=True)
    got = case.run(sparse_count=5, sparse_mode=mode)
    want = oracle.top_k_oracle(case.scores(mode), 5)
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(got, want)
    assert (got == -1).any()


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_random_scales_top_k_consistent(layout, signed, rng):
    """Full-range int8 and random scales (negative ones too: the ReLU comes after the scales): the selected keys
    are the top of the oracle's float64 scores up to fp32 rounding."""
    case = QuantCase(layout, rng, signed_scales=signed)
    got = case.run(sparse_count=4, sparse_mode=3)
    scores = case.scores(3)
    assert_topk_consistent(got, scores, 4, rel_tol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_paged_equals_contiguous_bit_for_bit(layout, block_size, rng):
    case = QuantCase(layout, rng, s2=40) if layout == "BSND" else QuantCase(layout, rng)
    for mode in (0, 3):
        assert torch.equal(case.run_paged(rng, block_size, sparse_count=6, sparse_mode=mode),
                           case.run(sparse_count=6, sparse_mode=mode))


def test_torch_npu_spelling(rng):
    case = QuantCase("BSND", rng)
    key_cache, scale_cache, table = case.paged(rng)
    got = torch_npu.npu_quant_lightning_indexer(
        case.query, key_cache, case.weights, case.query_scale, scale_cache, 0, 0,
        actual_seq_lengths_query=torch.tensor(case.q_lens, dtype=torch.int32),
        actual_seq_lengths_key=torch.tensor(case.kv_lens, dtype=torch.int32), block_table=table,
        layout_query="BSND", layout_key="PA_BSND", sparse_count=4, sparse_mode=3)
    assert torch.equal(got, case.run(sparse_count=4, sparse_mode=3))


@pytest.mark.parametrize("signed", [False, True])
def test_mutant_scale_on_the_wrong_head_is_caught(signed, rng, monkeypatch):
    """Scale placement: a kernel that applies head h's query scale to head H-1-h must differ from the oracle (both
    the folded path of non-negative scales and the general one)."""
    case = QuantCase("BSND", rng, exact=True, signed_scales=signed)
    assert torch.equal(case.run(sparse_count=5, backend="reference"), oracle.top_k_oracle(case.scores(3), 5))
    original = kernel.index_scores
    monkeypatch.setattr(kernel, "index_scores", lambda q, k, w, qs=None, ks=None: original(
        q, k, w, None if qs is None else qs.flip(-1), ks))
    assert not torch.equal(case.run(sparse_count=5, backend="reference"), oracle.top_k_oracle(case.scores(3), 5))


def test_mutant_block_mapping_is_caught(rng, monkeypatch):
    """Block mapping: key scales read from the neighbouring logical block (a wrong table lookup) must change the
    paged result."""
    case = QuantCase("BSND", rng, s2=40, exact=True)
    want = case.run(sparse_count=6, backend="reference")
    original = kernel.top_k_sequence

    def mutant(*a, k_scale=None, **kw):
        return original(*a, k_scale=None if k_scale is None else k_scale.roll(16), **kw)

    monkeypatch.setattr(kernel, "top_k_sequence", mutant)
    assert not torch.equal(case.run_paged(rng, 16, sparse_count=6, backend="reference"), want)


@settings(max_examples=fuzz_examples(20), deadline=None)
@given(s1=st.integers(1, 6), s2=st.integers(1, 20), h=st.integers(1, 4), k=st.integers(1, 8),
       mode=st.sampled_from([0, 3]), fp8=st.booleans(), seed=st.integers(0, 2**16))
def test_hypothesis_exact_top_k(s1, s2, h, k, mode, fp8, seed):
    gen = torch.Generator().manual_seed(seed)
    h = FP8_HEADS[h - 1] if fp8 else h
    case = QuantCase("BSND", gen, dtype=FP8 if fp8 else I8, h=h, exact=True, s1=s1, s2=s2)
    case.kw.update(actual_seq_lengths_query=None, actual_seq_lengths_key=None)
    case.query, case.key = case.query[:1], case.key[:1]
    case.weights, case.query_scale, case.key_scale = case.weights[:1], case.query_scale[:1], case.key_scale[:1]
    assert torch.equal(case.run(sparse_count=k, sparse_mode=mode), oracle.top_k_oracle(case.scores(mode), k))


def _call(case, **changes):
    args = dict(query=case.query, key=case.key, weights=case.weights, query_dequant_scale=case.query_scale,
                key_dequant_scale=case.key_scale)
    kw = dict(case.kw)
    for name, value in changes.items():
        (args if name in args else kw)[name] = value
    return cann_attn.quant_lightning_indexer(*args.values(), **kw)


@pytest.mark.parametrize("change, param", [
    (lambda c: dict(query=c.query.to(torch.int16)), "query"),
    (lambda c: dict(key=c.key.to(torch.float32).to(FP8)), "key"),
    (lambda c: dict(weights=c.weights.to(BF16)), "weights"),
    (lambda c: dict(query_dequant_scale=c.query_scale.float()), "query_dequant_scale"),
    (lambda c: dict(query_quant_mode=1), "query_quant_mode"),
    (lambda c: dict(key_quant_mode=2), "key_quant_mode"),
    (lambda c: dict(query_dtype=290), "query_dtype"),
    (lambda c: dict(key_dtype=290), "key_dtype"),
    (lambda c: dict(pre_tokens=100), "pre_tokens"),
    (lambda c: dict(next_tokens=0), "next_tokens"),
    (lambda c: dict(sparse_count=2049), "sparse_count"),
    (lambda c: dict(sparse_count=0), "sparse_count"),
    (lambda c: dict(sparse_mode=1), "sparse_mode"),
    (lambda c: dict(layout="BNSD"), "layout"),
    (lambda c: dict(layout_key="TND"), "layout_key"),
    (lambda c: dict(key=c.key.expand(-1, -1, 2, -1)), "key"),
    (lambda c: dict(key=c.key[..., :8]), "key"),
    # "参数query中的D和参数key中的D值相等为128"; before: D = 64 was accepted.
    (lambda c: dict(query=c.query[..., :64], key=c.key[..., :64]), "query: expected head dim D = 128"),
    (lambda c: dict(key_dequant_scale=c.key_scale[:, :5]), "key_dequant_scale"),
    (lambda c: dict(query_dequant_scale=c.query_scale[..., :2]), "query_dequant_scale"),
    (lambda c: dict(weights=torch.full_like(c.weights, 60000.0), query_dequant_scale=torch.full_like(
        c.query_scale, 2.0)), "query_dequant_scale"),
    (lambda c: dict(actual_seq_lengths_key=[12, 1, 1]), "actual_seq_lengths_key"),
    (lambda c: dict(block_table=torch.zeros(3, 1, dtype=torch.int32), layout_key="BSND"), "block_table"),
])
def test_errors_name_the_parameter(change, param, rng):
    case = QuantCase("BSND", rng)
    with pytest.raises(cann_attn.ParamInvalidError, match=param):
        _call(case, **change(case))


FP8_HEADS = (8, 16, 24, 32, 64)


@pytest.mark.parametrize("dtype, heads, accepted", [
    (I8, 1, True), (I8, 5, True), (I8, 64, True), (I8, 65, False), (I8, 128, False),
    *[(FP8, h, True) for h in FP8_HEADS], (FP8, 4, False), (FP8, 12, False), (FP8, 48, False), (FP8, 128, False),
])
def test_query_head_count_rule(dtype, heads, accepted, rng):
    """"N1支持[1, 64]"; with float8_e4m3fn (Ascend 950 only) "query N1仅支持8、16、24、32、64"."""
    case = QuantCase("BSND", rng, dtype=dtype, h=heads, exact=True)
    if accepted:
        assert torch.equal(case.run(sparse_count=3), oracle.top_k_oracle(case.scores(3), 3))
    else:
        with pytest.raises(cann_attn.ParamInvalidError, match=r"query: expected N1 \(heads\)"):
            case.run(sparse_count=3)


def test_paged_block_size_rule(rng):
    case = QuantCase("BSND", rng)
    key_cache, scale_cache, table = case.paged(rng, block_size=8)
    with pytest.raises(cann_attn.ParamInvalidError, match="block"):
        cann_attn.quant_lightning_indexer(case.query, key_cache, case.weights, case.query_scale, scale_cache,
                                          block_table=table, actual_seq_lengths_key=case.kv_lens)


def test_missing_scale_is_nullptr(rng):
    case = QuantCase("BSND", rng)
    with pytest.raises(cann_attn.ParamNullptrError, match="key_dequant_scale"):
        cann_attn.quant_lightning_indexer(case.query, case.key, case.weights, case.query_scale, None)
