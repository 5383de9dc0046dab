"""Paged KV caches (block_table, layout_kv/layout_key "PA_BSND") for SparseFlashAttention and LightningIndexer on
the reference backend: bit for bit equal to the same keys laid out contiguously, whatever the table, with garbage
(NaN, -1, out-of-range ids) wherever docs/semantics/paged-kv.md says nothing is read; one error test per
documented block_table constraint."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn.problem.page_table import DSA_BLOCK_SIZES, page_table
from dsa_utils import BF16, F16, F32, IndexerCase, SFACase
from paged_utils import paginate

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    """These tests state the reference backend's bit-for-bit equality, whatever CANN_ATTN_BACKEND says."""
    monkeypatch.setenv("CANN_ATTN_BACKEND", "reference")
# Block sizes of a PA_BSND cache: multiples of 16 up to 1024 (npu_sparse_flash_attention / npu_lightning_indexer).
BLOCK_SIZES = (16, 48, 128, 1024)


def _paged_sfa(case: SFACase, page: int, gen: torch.Generator, **paginate_kw):
    """(paged keyword arguments, block_table) holding the case's keys in a shuffled paged cache."""
    i = case.inputs
    names = ["key"] + (["value"] if i["value"] is not i["key"] else []) + (["key_rope"] if i["key_rope"] is not None
                                                                            else [])
    caches, table = paginate({n: [s.kv_rows(i[n]) for s in case.spans] for n in names}, page, gen, **paginate_kw)
    key = caches["key"]
    kw = dict(key=key, value=caches.get("value", key), key_rope=caches.get("key_rope"), block_table=table,
              actual_seq_lengths_kv=[s.kv_len for s in case.spans])
    return kw, table


def _sfa_both(case: SFACase, page: int, gen: torch.Generator, **paginate_kw):
    contiguous = case.forward()
    paged_kw, _ = _paged_sfa(case, page, gen, **paginate_kw)
    i = case.inputs
    kw = {**case.kw, "actual_seq_lengths_kv": paged_kw.pop("actual_seq_lengths_kv")}
    paged = cann_attn.sparse_flash_attention(i["query"], paged_kw.pop("key"), paged_kw.pop("value"),
                                             i["sparse_indices"], query_rope=i["query_rope"], **kw, **paged_kw)
    return contiguous, paged


def _assert_bitwise(a, b) -> None:
    for name, x, y in zip(a._fields, a, b, strict=True):
        if x is None:
            assert y is None, name
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name


# ------------------------------------------------------------------------------------------------------
# SparseFlashAttention
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", BLOCK_SIZES)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sfa_paged_equals_contiguous(layout, page, rng):
    # Different lengths per sequence, partially filled last blocks, a sequence spanning several blocks.
    if layout == "TND":
        case = SFACase("TND", gen=rng, q_lens=[3, 1, 2], kv_lens=[page + 5, 7, 2 * page], n1=4, d=16, d_rope=8,
                       value_is_key=True, k=6, style="random")
    else:
        case = SFACase("BSND", gen=rng, b=3, s1=3, s2=2 * page + 3, q_lens=[3, 2, 0], kv_lens=[2 * page + 3, 9, 0],
                       n1=4, d=16, d_rope=8, value_is_key=True, k=6, style="topk")
    _assert_bitwise(*_sfa_both(case, page, rng))


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("sparse_block_size", [1, 16])
@pytest.mark.parametrize("value_is_key", [True, False])
def test_sfa_paged_dtypes_blocks_and_values(dtype, sparse_block_size, value_is_key, rng):
    case = SFACase("TND", gen=rng, q_lens=[4, 2], kv_lens=[45, 70], n1=2, d=16, d_rope=8, value_is_key=value_is_key,
                   d_v=8, k=5, block_size=sparse_block_size, dtype=dtype, style="random", mode=3)
    _assert_bitwise(*_sfa_both(case, 32, rng))


@pytest.mark.parametrize("mode", [0, 3])
def test_sfa_paged_without_rope_and_modes(mode, rng):
    case = SFACase("BSND", gen=rng, b=2, s1=2, s2=40, kv_lens=[40, 17], n1=2, d=16, d_rope=None, k=8, mode=mode,
                   style="dup")
    _assert_bitwise(*_sfa_both(case, 16, rng))


def _with_gaps(cache: torch.Tensor) -> torch.Tensor:
    """The same cache as a view whose blocks do not follow one another in memory (NaN between them): the docs allow
    caches that are non-contiguous along the block axis."""
    return torch.cat([cache, torch.full_like(cache, float("nan"))], dim=1)[:, : cache.shape[1]]


def test_sfa_and_indexer_paged_cache_with_gaps_between_blocks(rng):
    case = SFACase("TND", gen=rng, q_lens=[2, 1], kv_lens=[16 * 5 + 5, 30], n1=2, d=8, d_rope=4, value_is_key=True,
                   k=16, style="random")
    contiguous = case.forward()
    paged, table = _paged_sfa(case, 16, rng)
    key, key_rope = _with_gaps(paged["key"]), _with_gaps(paged["key_rope"])
    i = case.inputs
    out = cann_attn.sparse_flash_attention(i["query"], key, key, i["sparse_indices"], query_rope=i["query_rope"],
                                           key_rope=key_rope, block_table=table,
                                           **{**case.kw, "actual_seq_lengths_kv": paged["actual_seq_lengths_kv"]})
    _assert_bitwise(contiguous, out)
    indexer = IndexerCase("TND", gen=rng, q_lens=[2, 1], kv_lens=[16 * 5 + 5, 30], n_idx=2, d_idx=8)
    cache, table, lens = _paged_indexer(indexer, 16, rng)
    paged_li = cann_attn.lightning_indexer(indexer.query_index, _with_gaps(cache), indexer.weights, layout="TND",
                                           block_table=table, actual_seq_lengths_query=indexer.kw[
                                               "actual_seq_lengths_query"], actual_seq_lengths_key=lens,
                                           sparse_count=32, return_value=True)
    _assert_bitwise(indexer.indexer(sparse_count=32, return_value=True), paged_li)


def test_sfa_paged_reads_no_garbage(rng):
    """Huge values instead of NaN in every unused slot and block: an output that read them would be off by far."""
    case = SFACase("TND", gen=rng, q_lens=[2, 3], kv_lens=[20, 33], n1=2, d=16, d_rope=8, value_is_key=True, k=8,
                   style="random")
    _assert_bitwise(*_sfa_both(case, 16, rng, garbage=3e38, spare_blocks=4, extra_columns=3))


@settings(max_examples=12, deadline=None)
@given(page=st.integers(1, 64).map(lambda m: 16 * m), seed=st.integers(0, 2**16), layout=st.sampled_from(["BSND",
                                                                                                          "TND"]))
def test_sfa_paged_any_documented_block_size(page, seed, layout):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 2 * page + 2, (2,), generator=gen).tolist()
    if layout == "TND":
        case = SFACase("TND", gen=gen, q_lens=[2, 1], kv_lens=lens, n1=2, d=8, d_rope=4, value_is_key=True, k=4,
                       style="random")
    else:
        case = SFACase("BSND", gen=gen, b=2, s1=2, s2=max(lens), kv_lens=lens, n1=2, d=8, d_rope=4, value_is_key=True,
                       k=4, style="random")
    _assert_bitwise(*_sfa_both(case, page, gen))
    indexer = IndexerCase("BSND", gen=gen, b=2, s1=2, s2=max(lens), kv_lens=lens, n_idx=2, d_idx=8)
    cache, table, kv_lens = _paged_indexer(indexer, page, gen)
    paged = cann_attn.lightning_indexer(indexer.query_index, cache, indexer.weights, block_table=table,
                                        actual_seq_lengths_key=kv_lens, sparse_count=5, return_value=True)
    _assert_bitwise(indexer.indexer(sparse_count=5, return_value=True), paged)


def test_sfa_paged_through_torch_npu(rng):
    """The DSA inference call: TND query, PA_BSND cache (key = value = the latent), per-sequence KV lengths."""
    case = SFACase("TND", gen=rng, q_lens=[2, 1], kv_lens=[40, 18], n1=4, d=16, d_rope=8, value_is_key=True, k=6,
                   style="topk")
    contiguous = case.forward()
    paged, table = _paged_sfa(case, 16, rng)
    i = case.inputs
    out, smax, ssum = torch_npu.npu_sparse_flash_attention(
        i["query"], paged["key"], paged["value"], i["sparse_indices"], case.kw["scale_value"], block_table=table,
        actual_seq_lengths_query=torch.tensor(case.kw["actual_seq_lengths_query"], dtype=torch.int32),
        actual_seq_lengths_kv=torch.tensor(paged["actual_seq_lengths_kv"], dtype=torch.int32),
        query_rope=i["query_rope"], key_rope=paged["key_rope"], layout_query="TND", layout_kv="PA_BSND",
        attention_mode=2)
    assert torch.equal(out, contiguous.attention_out) and smax.shape == (0,) and ssum.shape == (0,)
    # Beyond the documentation (vLLM's DCP merges; docs/semantics/beyond-docs.md): the statistics over the paged
    # cache are those over the contiguous keys. CANN_ATTN_STRICT_DOCS=1 refuses the call (test_strict_docs.py).
    out, smax, ssum = torch_npu.npu_sparse_flash_attention(
        i["query"], paged["key"], paged["value"], i["sparse_indices"], case.kw["scale_value"], block_table=table,
        actual_seq_lengths_query=case.kw["actual_seq_lengths_query"],
        actual_seq_lengths_kv=paged["actual_seq_lengths_kv"], query_rope=i["query_rope"],
        key_rope=paged["key_rope"], layout_query="TND", layout_kv="PA_BSND", attention_mode=2,
        return_softmax_lse=True)
    assert torch.equal(out, contiguous.attention_out)
    assert torch.equal(smax, contiguous.softmax_max) and torch.equal(ssum, contiguous.softmax_sum)


def test_sfa_paged_has_no_gradient(rng):
    case = SFACase("BSND", gen=rng, b=1, s1=2, s2=20, n1=2, d=8, d_rope=None, value_is_key=True, k=4)
    paged, table = _paged_sfa(case, 16, rng)
    query = case.inputs["query"].clone().requires_grad_()
    out = cann_attn.library.sparse_flash_attention(query, paged["key"], paged["value"], case.inputs["sparse_indices"],
                                                   0.3, block_table=table,
                                                   actual_seq_lengths_kv=paged["actual_seq_lengths_kv"]).attention_out
    with pytest.raises(cann_attn.ParamInvalidError, match="paged"):
        out.sum().backward()


# ------------------------------------------------------------------------------------------------------
# LightningIndexer
# ------------------------------------------------------------------------------------------------------
def _paged_indexer(case: IndexerCase, page: int, gen: torch.Generator, **paginate_kw):
    caches, table = paginate({"key": [s.kv_rows(case.key_index) for s in case.spans]}, page, gen, **paginate_kw)
    return caches["key"], table, [s.kv_len for s in case.spans]


@pytest.mark.parametrize("page", BLOCK_SIZES)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("mode", [0, 3])
def test_indexer_paged_equals_contiguous(layout, mode, page, rng):
    if layout == "TND":
        case = IndexerCase("TND", gen=rng, q_lens=[3, 2], kv_lens=[page + 3, 6], n_idx=4, d_idx=16)
    else:
        case = IndexerCase("BSND", gen=rng, b=3, s1=3, s2=page + 9, q_lens=[3, 1, 2], kv_lens=[page + 9, 0, 5],
                           n_idx=4, d_idx=16)
    cache, table, lens = _paged_indexer(case, page, rng)
    contiguous = case.indexer(sparse_count=7, sparse_mode=mode, return_value=True)
    paged = cann_attn.lightning_indexer(case.query_index, cache, case.weights, layout=layout, block_table=table,
                                        actual_seq_lengths_query=case.kw.get("actual_seq_lengths_query"),
                                        actual_seq_lengths_key=lens, sparse_count=7, sparse_mode=mode,
                                        return_value=True)
    _assert_bitwise(contiguous, paged)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_indexer_paged_half_and_torch_npu(dtype, rng):
    case = IndexerCase("TND", gen=rng, q_lens=[2, 3], kv_lens=[37, 20], n_idx=4, d_idx=16, dtype=dtype)
    cache, table, lens = _paged_indexer(case, 16, rng, garbage=6e4)
    contiguous = case.indexer(sparse_count=9)
    idx, values = torch_npu.npu_lightning_indexer(
        case.query_index, cache, case.weights, actual_seq_lengths_query=case.kw["actual_seq_lengths_query"],
        actual_seq_lengths_key=torch.tensor(lens, dtype=torch.int32), block_table=table, layout_query="TND",
        layout_key="PA_BSND", sparse_count=9)
    assert torch.equal(idx, contiguous.sparse_indices) and values.shape == (0,)
    with pytest.raises(cann_attn.ParamInvalidError, match="return_value"):
        torch_npu.npu_lightning_indexer(case.query_index, cache, case.weights,
                                        actual_seq_lengths_query=case.kw["actual_seq_lengths_query"],
                                        actual_seq_lengths_key=lens, block_table=table, layout_query="TND",
                                        layout_key="PA_BSND", return_value=True)


# ------------------------------------------------------------------------------------------------------
# The page-table rule and its documented constraints
# ------------------------------------------------------------------------------------------------------
def test_page_table_maps_positions_to_blocks_and_slots():
    table = torch.tensor([[3, 0, -1], [1, 2, 99]], dtype=torch.int32)
    pages = page_table(table, block_size=16, block_count=4, kv_lengths=[20, 32], batch=2, rule=DSA_BLOCK_SIZES,
                       lengths_param="actual_seq_lengths_kv")
    blocks, slots = pages.locate(0, torch.tensor([0, 15, 16, 19]))
    assert blocks.tolist() == [3, 3, 0, 0] and slots.tolist() == [0, 15, 0, 3]
    assert pages.physical_rows(1).tolist() == list(range(16, 48))
    assert [pages.blocks_used(b) for b in range(2)] == [2, 2]


def _sfa_paged_call(rng, **override):
    case = SFACase("TND", gen=rng, q_lens=[2, 1], kv_lens=[20, 9], n1=2, d=8, d_rope=4, value_is_key=True, k=4)
    paged, table = _paged_sfa(case, 16, rng)
    i = case.inputs
    kw = dict(query=i["query"], key=paged["key"], value=paged["value"], sparse_indices=i["sparse_indices"],
              scale_value=0.2, query_rope=i["query_rope"], key_rope=paged["key_rope"],
              actual_seq_lengths_query=case.kw["actual_seq_lengths_query"],
              actual_seq_lengths_kv=paged["actual_seq_lengths_kv"], layout="TND", block_table=table)
    kw.update({k: (v(kw) if callable(v) else v) for k, v in override.items()})
    return cann_attn.sparse_flash_attention(**kw)


PAGE_ERRORS = {
    # name: (override, error type, message fragment)
    "table_dtype": (dict(block_table=lambda kw: kw["block_table"].long()), cann_attn.ParamInvalidError, "int32"),
    "table_rank": (dict(block_table=lambda kw: kw["block_table"].reshape(-1)), cann_attn.ParamInvalidError, "2-D"),
    "table_rows": (dict(block_table=lambda kw: kw["block_table"][:1]), cann_attn.ParamInvalidError,
                   "one row per sequence"),
    "table_columns": (dict(block_table=lambda kw: kw["block_table"][:, :1]), cann_attn.ParamInvalidError,
                      "at least 2 columns"),
    "table_negative_used": (dict(block_table=lambda kw: kw["block_table"].clone().index_fill_(
        1, torch.tensor([0]), -1)), cann_attn.ParamInvalidError, "block ids in"),
    "table_out_of_range_used": (dict(block_table=lambda kw: kw["block_table"].clone().index_fill_(
        1, torch.tensor([0]), kw["key"].shape[0])), cann_attn.ParamInvalidError, "block ids in"),
    "block_num_too_small": (dict(key=lambda kw: kw["key"][:2], value=lambda kw: kw["key"][:2],
                                 key_rope=lambda kw: kw["key_rope"][:2]), cann_attn.ParamInvalidError,
                            "at least 3 blocks"),
    "block_size_not_16x": (dict(key=lambda kw: kw["key"][:, :8], value=lambda kw: kw["key"][:, :8],
                                key_rope=lambda kw: kw["key_rope"][:, :8]), cann_attn.ParamInvalidError,
                           "multiple of 16"),
    "kv_lengths_missing": (dict(actual_seq_lengths_kv=None), cann_attn.ParamNullptrError, "actual_seq_lengths_kv"),
    "kv_lengths_negative": (dict(actual_seq_lengths_kv=[20, -1]), cann_attn.ParamInvalidError,
                            "actual_seq_lengths_kv"),
    "kv_lengths_count": (dict(actual_seq_lengths_kv=[]), cann_attn.ParamInvalidError,
                         "one value per sequence \\(B=2\\)"),
    "layout_kv_unknown": (dict(layout_kv="BNSD"), cann_attn.ParamInvalidError, "layout_kv"),
    "table_missing": (dict(block_table=None, layout_kv="PA_BSND"), cann_attn.ParamNullptrError, "block_table"),
    "table_with_contiguous_layout": (dict(layout_kv="TND"), cann_attn.ParamInvalidError, "only with layout_kv"),
    "cache_rank": (dict(key=lambda kw: kw["key"][:, :, 0], value=lambda kw: kw["key"][:, :, 0]),
                   cann_attn.ParamInvalidError, "block_num, block_size, 1, D"),
    "sparse_block_not_dividing": (dict(sparse_block_size=32), cann_attn.ParamInvalidError, "divisor"),
    "rope_cache_shape": (dict(key_rope=lambda kw: kw["key_rope"][:-1]), cann_attn.ParamInvalidError, "key_rope"),
}


@pytest.mark.parametrize("name", sorted(PAGE_ERRORS))
def test_sfa_page_table_errors(name, rng):
    override, error, fragment = PAGE_ERRORS[name]
    with pytest.raises(error, match=fragment):
        _sfa_paged_call(rng, **override)


def test_indexer_page_table_errors(rng):
    case = IndexerCase("BSND", gen=rng, b=2, s1=2, s2=20, kv_lens=[20, 5], n_idx=2, d_idx=8)
    cache, table, lens = _paged_indexer(case, 16, rng)

    def call(**kw):
        args = dict(block_table=table, actual_seq_lengths_key=lens, sparse_count=4)
        args.update(kw)
        return cann_attn.lightning_indexer(case.query_index, args.pop("key", cache), case.weights, **args)

    with pytest.raises(cann_attn.ParamNullptrError, match="actual_seq_lengths_key"):
        call(actual_seq_lengths_key=None)
    with pytest.raises(cann_attn.ParamInvalidError, match="int32"):
        call(block_table=table.long())
    with pytest.raises(cann_attn.ParamInvalidError, match="at least 2 columns"):
        call(block_table=table[:, :1])
    with pytest.raises(cann_attn.ParamInvalidError, match="multiple of 16"):
        call(key=cache[:, :8])
    with pytest.raises(cann_attn.ParamInvalidError, match="1024"):
        call(key=torch.zeros(3, 1040, 1, 8))
    with pytest.raises(cann_attn.ParamInvalidError, match="only with layout_key"):
        call(layout_key="BSND")
    with pytest.raises(cann_attn.ParamInvalidError, match="block ids in"):
        call(block_table=torch.full_like(table, 7))
