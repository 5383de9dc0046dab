"""The Triton DSA kernels read paged KV caches in place (docs/semantics/paged-kv.md): sparse attention forward and
the lightning indexer with a block_table, against the same keys laid out contiguously on the same backend and
against the reference backend. Garbage (NaN) in every block slot and table entry the rule says is never read."""

from __future__ import annotations

import os

import pytest
import torch

import cann_attn
from cann_attn.backends import dispatch_counts
from dsa_utils import IndexerCase, SFACase
from paged_utils import paginate

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (no CUDA)"),
]


def _paged(case: SFACase, page: int, gen: torch.Generator):
    i = case.inputs
    names = ["key"] + (["value"] if i["value"] is not i["key"] else []) + ["key_rope"]
    caches, table = paginate({n: [s.kv_rows(i[n]) for s in case.spans] for n in names}, page, gen)
    return caches["key"], caches.get("value", caches["key"]), caches["key_rope"], table


@pytest.mark.parametrize("layout,value_is_key,sparse_block_size", [("TND", True, 1), ("BSND", False, 16)])
def test_sfa_triton_reads_pages_in_place(layout, value_is_key, sparse_block_size, rng):
    if layout == "TND":
        case = SFACase("TND", gen=rng, q_lens=[2, 1], kv_lens=[37, 16], n1=2, d=16, d_rope=8,
                       value_is_key=value_is_key, k=5, block_size=sparse_block_size, style="random")
    else:
        case = SFACase("BSND", gen=rng, b=2, s1=2, s2=40, kv_lens=[40, 0], n1=2, d=16, d_rope=8, d_v=8,
                       value_is_key=value_is_key, k=3, block_size=sparse_block_size, style="random", mode=0)
    key, value, key_rope, table = _paged(case, 16, rng)
    i = case.inputs
    kw = {**case.kw, "actual_seq_lengths_kv": [s.kv_len for s in case.spans]}
    before = dispatch_counts[("sparse_flash_attention", "triton")]
    paged = cann_attn.sparse_flash_attention(i["query"], key, value, i["sparse_indices"], query_rope=i["query_rope"],
                                             key_rope=key_rope, block_table=table, backend="triton", **kw)
    assert dispatch_counts[("sparse_flash_attention", "triton")] == before + 1
    contiguous = case.forward(backend="triton")
    reference = case.forward(backend="reference")
    for name, a, b, r in zip(paged._fields, paged, contiguous, reference, strict=True):
        assert torch.equal(a, b), name  # same kernel, same keys, same order: identical
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=name)


def test_indexer_triton_reads_pages_in_place(rng):
    case = IndexerCase("TND", gen=rng, q_lens=[3, 2], kv_lens=[41, 18], n_idx=4, d_idx=16)
    caches, table = paginate({"key": [s.kv_rows(case.key_index) for s in case.spans]}, 16, rng)
    lens = [s.kv_len for s in case.spans]
    paged = cann_attn.lightning_indexer(case.query_index, caches["key"], case.weights, layout="TND",
                                        actual_seq_lengths_query=case.kw["actual_seq_lengths_query"],
                                        actual_seq_lengths_key=lens, block_table=table, sparse_count=6,
                                        return_value=True, backend="triton")
    contiguous = case.indexer(sparse_count=6, return_value=True, backend="triton")
    reference = case.indexer(sparse_count=6, return_value=True, backend="reference")
    assert torch.equal(paged.sparse_indices, contiguous.sparse_indices)
    assert torch.equal(paged.sparse_values, contiguous.sparse_values)
    assert torch.equal(paged.sparse_indices, reference.sparse_indices)


@pytest.mark.parametrize("sq,page,mask", [(1, 16, False), (3, 128, True)])
def test_fia_triton_reads_pages_in_place(sq, page, mask, rng, monkeypatch):
    """The dense kernel translates key positions through the table (no gather): decode, and a prefill with an
    explicit mask over the table's reach, equal to the contiguous call on the same kernel."""
    from cann_attn.ops import paged_infer
    from fia_cases import to_layout

    def no_gather(*args, **kwargs):
        raise AssertionError("the Triton path gathered the cache")

    lengths, n, nkv, d = [page + 7, 9], 4, 2, 16
    s = max(lengths)
    q = torch.randn(2, n, sq, d, generator=rng)
    k, v = torch.randn(2, nkv, s, d, generator=rng), torch.randn(2, nkv, s, d, generator=rng)
    per_seq = {name: [t[b, :, : lengths[b]].permute(1, 0, 2).flatten(1) for b in range(2)]
               for name, t in (("key", k), ("value", v))}
    caches, table = paginate(per_seq, page, rng)
    reach = table.shape[1] * page
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BSND", actual_seq_lengths_kv=lengths, scale=0.3,
              softmax_lse_flag=True, backend="triton")
    if mask:
        kw["atten_mask"] = torch.rand(2, 1, sq, reach, generator=rng) < 0.2
    monkeypatch.setattr(paged_infer.PagedKv, "group_bnsd", no_gather)
    paged = cann_attn.fused_infer_attention_score(to_layout(q, "BSND"), caches["key"], caches["value"],
                                                  block_table=table, block_size=page, **kw)
    if mask:
        kw["atten_mask"] = kw["atten_mask"][..., :s]
    contiguous = cann_attn.fused_infer_attention_score(to_layout(q, "BSND"), to_layout(k, "BSND"),
                                                       to_layout(v, "BSND"), **kw)
    for a, b in zip(paged, contiguous, strict=True):
        assert torch.equal(a, b)
