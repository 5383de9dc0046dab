"""PageAttention for FusedInferAttentionScore / IncreFlashAttention on the reference backend: a paged key/value
cache (BnBsH or BnNBsD, shuffled blocks, NaN in every slot and table entry no sequence uses) gives bit for bit the
result of the same keys laid out contiguously; one error test per documented constraint
(docs/semantics/paged-kv.md)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn.backends.reference import native
from fia_cases import rand, to_layout
from paged_utils import paginate

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("CANN_ATTN_BACKEND", "reference")


def _caches(k, v, lengths, page, gen, cache_layout, rope=None):
    """Paged caches of BNSD k/v [B, N2, S, D] (sequence b: its first lengths[b] positions)."""
    names = {"key": k, "value": v} | ({} if rope is None else {"key_rope": rope})
    per_seq = {name: [t[b, :, : lengths[b]].permute(1, 0, 2) for b in range(len(lengths))] for name, t in names.items()}
    caches, table = paginate(per_seq, page, gen)  # [block_num, page, N2, D]
    if cache_layout == "BnBsH":
        caches = {n: c.flatten(2) for n, c in caches.items()}
    else:
        caches = {n: c.permute(0, 2, 1, 3).contiguous() for n, c in caches.items()}
    return caches, table


def _both(layout, lengths, page, gen, *, cache_layout="BnBsH", n=4, nkv=2, sq=1, d=16, dtype=torch.float32,
          **kwargs):
    b = len(lengths)
    s = max(lengths) + 3
    q = rand((b, n, sq, d), dtype, gen)
    k, v = rand((b, nkv, s, d), dtype, gen), rand((b, nkv, s, d), dtype, gen)
    caches, table = _caches(k, v, lengths, page, gen, cache_layout)
    common = dict(num_heads=n, num_key_value_heads=nkv, input_layout=layout, actual_seq_lengths_kv=lengths,
                  scale=0.3, **{"softmax_lse_flag": True, **kwargs})
    contiguous = cann_attn.fused_infer_attention_score(to_layout(q, layout), to_layout(k, layout),
                                                       to_layout(v, layout), **common)
    paged = cann_attn.fused_infer_attention_score(to_layout(q, layout), caches["key"], caches["value"],
                                                  block_table=table, block_size=page, **common)
    return contiguous, paged


def _assert_equal(contiguous, paged):
    for a, b in zip(contiguous, paged, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("page", [16, 48, 512])
def test_decode_paged_equals_contiguous(layout, page, rng):
    _assert_equal(*_both(layout, [page + 5, 7, 2 * page + 1], page, rng))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_paged_half_equal_lengths_and_bnnbsd(dtype, rng):
    # Equal lengths: the attention computes the sequences in one batched run, and so does the paged path.
    _assert_equal(*_both("BNSD", [40, 40, 9], 16, rng, cache_layout="BnNBsD", dtype=dtype))


def test_decode_paged_with_mask_and_pse(rng):
    lengths, page = [20, 33], 16
    width_kv = (max(-(-n // page) for n in lengths) + 1) * page  # the table's reach: paginate adds one column
    mask = torch.rand(2, width_kv, generator=rng) < 0.3
    pse = torch.randn(2, 4, 1, width_kv, generator=rng)
    _assert_equal(*_both("BSND", lengths, page, rng, atten_mask=mask, pse_shift=pse))


@pytest.mark.parametrize("page", [128, 256])
def test_prefill_paged_equals_contiguous(page, rng):
    _assert_equal(*_both("BSND", [page + 9, 30], page, rng, sq=5, n=2, nkv=1))


def test_prefill_paged_causal_and_tnd(rng):
    """TND (packed) query with a BnNBsD cache: plain per-sequence key counts; sparse_mode 3 (compressed mask)."""
    lengths, q_lens, page = [50, 19], [3, 2], 16
    nkv, d = 1, 128
    q = torch.randn(sum(q_lens), 2, d, generator=rng)
    kv = [torch.randn(n, nkv, d, generator=rng) for n in lengths]
    vv = [torch.randn(n, nkv, d, generator=rng) for n in lengths]
    caches, table = paginate({"key": kv, "value": vv}, page, rng)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    common = dict(num_heads=2, num_key_value_heads=nkv, input_layout="TND", actual_seq_lengths=[3, 5],
                  sparse_mode=3, atten_mask=mask, scale=0.1, softmax_lse_flag=True)
    contiguous = cann_attn.fused_infer_attention_score(q, torch.cat(kv), torch.cat(vv), actual_seq_lengths_kv=[50, 69],
                                                       **common)
    paged = cann_attn.fused_infer_attention_score(q, caches["key"].permute(0, 2, 1, 3), caches["value"].permute(
        0, 2, 1, 3), block_table=table, block_size=page, actual_seq_lengths_kv=lengths, **common)
    _assert_equal(contiguous, paged)


def test_mla_decode_paged(rng):
    """MLA (D = 512, rope 64, N2 = 1): the latent cache serves as key and value, key_rope is a cache too."""
    lengths, page, n = [40, 17], 16, 2
    q = rand((2, n, 1, 512), torch.float32, rng)
    qr = rand((2, n, 1, 64), torch.float32, rng)
    k = rand((2, 1, 45, 512), torch.float32, rng)
    kr = rand((2, 1, 45, 64), torch.float32, rng)
    caches, table = _caches(k, k, lengths, page, rng, "BnBsH", rope=kr)
    common = dict(num_heads=n, num_key_value_heads=1, input_layout="BSND", actual_seq_lengths_kv=lengths, scale=0.05)
    contiguous = cann_attn.fused_infer_attention_score(
        to_layout(q, "BSND"), to_layout(k, "BSND"), to_layout(k, "BSND"), query_rope=to_layout(qr, "BSND"),
        key_rope=to_layout(kr, "BSND"), **common)
    paged = cann_attn.fused_infer_attention_score(
        to_layout(q, "BSND"), caches["key"], caches["key"], query_rope=to_layout(qr, "BSND"),
        key_rope=caches["key_rope"], block_table=table, block_size=page, **common)
    _assert_equal(contiguous, paged)


def test_incre_flash_attention_and_torch_npu_paged(rng):
    lengths, page = [30, 70, 5], 32
    q = rand((3, 4, 1, 16), torch.float32, rng)
    k, v = rand((3, 2, 72, 16), torch.float32, rng), rand((3, 2, 72, 16), torch.float32, rng)
    caches, table = _caches(k, v, lengths, page, rng, "BnBsH")
    contiguous = cann_attn.incre_flash_attention(to_layout(q, "BSH"), to_layout(k, "BSH"), to_layout(v, "BSH"),
                                                 actual_seq_lengths=lengths, num_heads=4, num_key_value_heads=2,
                                                 scale_value=0.25)
    paged = cann_attn.incre_flash_attention(to_layout(q, "BSH"), caches["key"], caches["value"], block_table=table,
                                            block_size=page, actual_seq_lengths=lengths, num_heads=4,
                                            num_key_value_heads=2, scale_value=0.25)
    assert torch.equal(contiguous, paged)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        to_layout(q, "BSH"), caches["key"], caches["value"], block_table=table, block_size=page,
        actual_seq_lengths_kv=lengths, num_heads=4, num_key_value_heads=2, scale=0.25, input_layout="BSH")
    assert torch.equal(out, contiguous)


def _paged_call(rng, **override):
    lengths, page = [20, 9], 16
    q = rand((2, 4, 1, 16), torch.float32, rng)
    k, v = rand((2, 2, 20, 16), torch.float32, rng), rand((2, 2, 20, 16), torch.float32, rng)
    caches, table = _caches(k, v, lengths, page, rng, "BnBsH")
    kw = dict(query=to_layout(q, "BSND"), key=caches["key"], value=caches["value"], block_table=table,
              block_size=page, actual_seq_lengths_kv=lengths, num_heads=4, num_key_value_heads=2,
              input_layout="BSND")
    kw.update({name: (v(kw) if callable(v) else v) for name, v in override.items()})
    return cann_attn.fused_infer_attention_score(**kw)


FIA_PAGE_ERRORS = {
    "block_size_mismatch": (dict(block_size=32), cann_attn.ParamInvalidError, "block_size: expected the caches"),
    "decode_block_not_16x": (dict(key=lambda kw: kw["key"][:, :8], value=lambda kw: kw["value"][:, :8],
                                  block_size=8), cann_attn.ParamInvalidError, "multiple of 16"),
    "kv_lengths_missing": (dict(actual_seq_lengths_kv=None), cann_attn.ParamNullptrError, "actual_seq_lengths_kv"),
    "table_dtype": (dict(block_table=lambda kw: kw["block_table"].long()), cann_attn.ParamInvalidError, "int32"),
    "table_columns": (dict(block_table=lambda kw: kw["block_table"][:, :1]), cann_attn.ParamInvalidError,
                      "at least 2 columns"),
    "table_used_out_of_range": (dict(block_table=lambda kw: torch.full_like(kw["block_table"], 99)),
                                cann_attn.ParamInvalidError, "block ids in"),
    "block_num_too_small": (dict(key=lambda kw: kw["key"][:2], value=lambda kw: kw["value"][:2]),
                            cann_attn.ParamInvalidError, "at least 3 blocks"),
    "bnnbsd_with_bsnd_query": (dict(key=lambda kw: kw["key"].view(-1, 16, 2, 16).permute(0, 2, 1, 3),
                                    value=lambda kw: kw["value"].view(-1, 16, 2, 16).permute(0, 2, 1, 3)),
                               cann_attn.ParamInvalidError, "BNSD or TND query"),
    "kv_padding": (dict(kv_padding_size=torch.tensor([1])), cann_attn.ParamInvalidError,
                   "not supported with PageAttention"),
    "value_cache_shape": (dict(value=lambda kw: kw["value"][:, :, :16]), cann_attn.ParamInvalidError, "value"),
}


@pytest.mark.parametrize("name", sorted(FIA_PAGE_ERRORS))
def test_fia_page_table_errors(name, rng):
    override, error, fragment = FIA_PAGE_ERRORS[name]
    with pytest.raises(error, match=fragment):
        _paged_call(rng, **override)


def test_prefill_block_size_rule(rng):
    """Q_S > 1: a multiple of 128 in [128, 512] (a 16-multiple that decode accepts is refused)."""
    q = rand((1, 2, 4, 16), torch.float32, rng)
    cache = torch.zeros(4, 64, 32)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(cann_attn.ParamInvalidError, match="multiple of 128"):
        cann_attn.fused_infer_attention_score(to_layout(q, "BSND"), cache, cache, block_table=table, block_size=64,
                                              actual_seq_lengths_kv=[70], num_heads=2, num_key_value_heads=2,
                                              input_layout="BSND")


def test_paged_fia_compiles(rng):
    """The custom op's fake gives the paged output shape ([block_num, block_size, H] caches pack the heads)."""
    lengths, page = [20, 9], 16
    q = rand((2, 4, 1, 16), torch.float32, rng)
    k, v = rand((2, 2, 20, 16), torch.float32, rng), rand((2, 2, 20, 16), torch.float32, rng)
    caches, table = _caches(k, v, lengths, page, rng, "BnBsH")

    def call(q, key, value, table):
        return cann_attn.fused_infer_attention_score(q, key, value, block_table=table, block_size=16,
                                                     actual_seq_lengths_kv=[20, 9], num_heads=4,
                                                     num_key_value_heads=2, input_layout="BSND")[0]

    eager = call(to_layout(q, "BSND"), caches["key"], caches["value"], table)
    compiled = torch.compile(call, fullgraph=True, backend="eager")(to_layout(q, "BSND"), caches["key"],
                                                                   caches["value"], table)
    assert torch.equal(eager, compiled)


@pytest.mark.skipif(native.library() is None, reason="the in-place read is the native decode loop's")
def test_decode_reads_the_cache_in_place(rng, monkeypatch):
    """Decode without mask or pse takes the reference decode loop over the cache views (no gather): the same loop,
    rows and bits as with contiguous caches."""
    from cann_attn.backends.reference import decode_forward
    from cann_attn.ops import paged_infer

    tables = []
    original = decode_forward.forward

    def recording(*args, block_table=None, **kwargs):
        tables.append(block_table)
        return original(*args, block_table=block_table, **kwargs)

    def no_gather(*args, **kwargs):
        raise AssertionError("the decode path gathered the cache")

    monkeypatch.setattr(decode_forward, "forward", recording)
    monkeypatch.setattr(paged_infer.PagedKv, "group_bnsd", no_gather)
    _assert_equal(*_both("BSND", [70, 16, 33], 16, rng, dtype=torch.bfloat16))
    assert len(tables) == 2 and tables[0] is None and tables[1] is not None  # contiguous, then paged


@settings(max_examples=10, deadline=None)
@given(page=st.integers(1, 32).map(lambda m: 16 * m), seed=st.integers(0, 2**16),
       layout=st.sampled_from(["BSH", "BSND", "BNSD"]), lse=st.booleans())
def test_decode_paged_any_documented_block_size(page, seed, layout, lse):
    """Q_S = 1: any multiple of 16 up to 512; random lengths (partial last blocks, several blocks)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2 * page + 2, (3,), generator=gen).tolist()
    _assert_equal(*_both(layout, lengths, page, gen, n=2, nkv=1, d=16, softmax_lse_flag=lse))
