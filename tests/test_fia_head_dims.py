"""FusedInferAttentionScore's packed layouts (TND) with the head sizes production calls beyond the documented
ones (docs/semantics/beyond-docs.md): D = 96, 256 and 512 without rope, against the float64 oracle
(cann_attn.testing.fia_oracle, written from the FIA pages); the paged decode equals the contiguous call bit for bit.

Gemma-4's sliding layers as cann-recipes-infer calls them (models/gemma_4/models/modeling_gemma4.py:723-772,
``_attn_tnd_sliding``): npu_fused_infer_attention_score_v2, ``input_layout="TND"``, head dim 256, 16 query / 8
key-value heads (GQA), ``sparse_mode=4`` with ``pre_tokens=sliding_window``, ``next_tokens=0`` and the compressed
mask; prefill over the new keys (``actual_seq_kvlen=actual_seq_qlen``) and decode over the paged cache viewed
``k_cache.view(*k_cache.shape[:2], -1)`` ([block_num, block_size, N*D]) with ``block_table`` / ``block_size``.
vLLM-Ascend calls TND with the model's head size (vllm_ascend/attention/attention_v1.py:939-942, ``full_graph_fia``).
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn import ParamInvalidError
from cann_attn.testing.fia_oracle import fia_oracle
from fia_cases import compare, rand
from paged_utils import paginate

pytestmark = pytest.mark.usefixtures("single_thread")

HEADS, KV_HEADS, WINDOW = 16, 8, 5


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("CANN_ATTN_BACKEND", "reference")


def _window_args(q_ends, kv_ends):
    return dict(num_query_heads=HEADS, num_key_value_heads=KV_HEADS, input_layout="TND", sparse_mode=4,
                pre_tokens=WINDOW, next_tokens=0, atten_mask=cann_attn.compressed_mask(4), actual_seq_qlen=q_ends,
                actual_seq_kvlen=kv_ends)


def _oracle(q, k, v, scale, kw):
    return fia_oracle(q, k, v, num_heads=HEADS, num_key_value_heads=KV_HEADS, scale=scale, input_layout="TND",
                      sparse_mode=4, pre_tokens=WINDOW, next_tokens=0, atten_mask=kw["atten_mask"],
                      actual_seq_lengths=kw["actual_seq_qlen"], actual_seq_lengths_kv=kw["actual_seq_kvlen"])[0]


@pytest.mark.parametrize("dim", [96, 256, 512])
def test_gemma4_style_prefill(dim):
    g = torch.Generator().manual_seed(dim)
    ends = [7, 16]
    q = rand((16, HEADS, dim), torch.bfloat16, g)
    k, v = rand((16, KV_HEADS, dim), torch.bfloat16, g), rand((16, KV_HEADS, dim), torch.bfloat16, g)
    kw = _window_args(ends, ends)
    out, _ = cann_attn.fused_infer_attention_score_v2(q, k, v, softmax_scale=dim**-0.5, **kw)
    compare(out, _oracle(q, k, v, dim**-0.5, kw), torch.bfloat16)


def test_gemma4_paged_decode_equals_contiguous_and_oracle():
    g = torch.Generator().manual_seed(4)
    dim, lengths, page = 256, [19, 6, 33], 16
    keys = [rand((n, KV_HEADS, dim), torch.bfloat16, g) for n in lengths]
    values = [rand((n, KV_HEADS, dim), torch.bfloat16, g) for n in lengths]
    caches, table = paginate({"k": keys, "v": values}, page, g)  # [block_num, block_size, N2, D]
    q = rand((3, HEADS, dim), torch.bfloat16, g)
    kw = _window_args([1, 2, 3], lengths)
    paged, _ = cann_attn.fused_infer_attention_score_v2(
        q, caches["k"].view(*caches["k"].shape[:2], -1), caches["v"].view(*caches["v"].shape[:2], -1),
        block_table=table, block_size=page, softmax_scale=1.0, **kw)
    cum = torch.tensor(lengths).cumsum(0).tolist()
    k, v = torch.cat(keys), torch.cat(values)
    contiguous, _ = cann_attn.fused_infer_attention_score_v2(q, k, v, softmax_scale=1.0, **{**kw,
                                                                                          "actual_seq_kvlen": cum})
    assert torch.equal(paged, contiguous)
    compare(paged, _oracle(q, k, v, 1.0, {**kw, "actual_seq_kvlen": cum}), torch.bfloat16)


@pytest.mark.parametrize("dims,message", [((320, 320), "query: layout TND without rope"),
                                          ((80, 80), "query: layout TND without rope"),
                                          ((256, 128), "value: expected head dim D=256")])
def test_other_packed_head_dims_stay_refused(dims, message):
    q = torch.zeros(4, 2, dims[0], dtype=torch.bfloat16)
    k, v = torch.zeros(4, 2, dims[0], dtype=torch.bfloat16), torch.zeros(4, 2, dims[1], dtype=torch.bfloat16)
    with pytest.raises(ParamInvalidError, match=message):
        cann_attn.fused_infer_attention_score_v2(q, k, v, num_query_heads=2, input_layout="TND",
                                                 actual_seq_qlen=[4], actual_seq_kvlen=[4])
