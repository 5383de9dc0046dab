"""Calls through the torch_npu shim that used to fail with a raw error or to be accepted silently: each now raises a
typed error naming the parameter as torch_npu spells it, or computes what the docs say (docs/semantics/errors.md,
docs/semantics/sinks.md, docs/guides/torch_npu.md)."""

from __future__ import annotations

import math

import pytest
import torch

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn.errors import ParamInvalidError
from test_kv_quant_sfa import KvQuantCase
from test_quant_indexer import QuantCase

pytestmark = pytest.mark.usefixtures("single_thread")


# ------------------------------------------------------------------------------------------- FIA v2 out_dtype
@pytest.mark.parametrize("out_dtype", ["float16", True, 1.0, torch.complex64, 99])
def test_fia_v2_out_dtype_must_be_a_dtype_or_its_number(out_dtype):
    """Before: "float16" and 1.0 gave the custom op's raw RuntimeError; True was taken as ScalarType 1 (int8)."""
    q, kv = torch.randn(2, 1, 32).half(), torch.randn(2, 5, 32).half()
    with pytest.raises(ParamInvalidError, match=r"\] out_dtype: expected a torch.dtype"):
        torch_npu.npu_fused_infer_attention_score_v2(q, kv, kv, num_query_heads=2, out_dtype=out_dtype)


# --------------------------------------------------------------------------------------- non-finite scales
def _scale_calls(scale: float):
    q = torch.randn(1, 4, 2, 8).half()
    tokens = torch.randn(4, 2, 8).half()
    lens = torch.tensor([4], dtype=torch.int32)
    return {
        "_npu_flash_attention_unpad": lambda: torch_npu._npu_flash_attention_unpad(
            tokens, tokens, tokens, lens, scale, 2, 2, torch.empty_like(tokens)),
        "flash_attention_score": lambda: cann_attn.flash_attention_score(q, q, q, 2, "BSND", scale_value=scale),
        "prompt_flash_attention": lambda: cann_attn.prompt_flash_attention(q, q, q, num_heads=2, input_layout="BSND",
                                                                           scale_value=scale),
        "fused_infer_attention_score": lambda: cann_attn.fused_infer_attention_score(q, q, q, num_heads=2,
                                                                                     input_layout="BSND", scale=scale),
        "sparse_flash_attention": lambda: cann_attn.sparse_flash_attention(
            q, q[:, :, :1], q[:, :, :1], torch.zeros(1, 4, 1, 2, dtype=torch.int32), scale, sparse_mode=0),
    }


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("op", sorted(_scale_calls(1.0)))
def test_non_finite_scales_are_refused(op, scale):
    """Before: every one of these returned an all-NaN output."""
    with pytest.raises(ParamInvalidError, match=r"\] scale(_value)?: expected a finite float"):
        _scale_calls(scale)[op]()


# ---------------------------------------------------------------------------------------------------- sinks
def _sink_call(sink: torch.Tensor):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 2, 64, generator=g).bfloat16()
    k, v = torch.randn(6, 2, 64, generator=g).bfloat16(), torch.randn(6, 2, 64, generator=g).bfloat16()
    return torch_npu.npu_fused_infer_attention_score_v2(
        q, k, v, num_query_heads=2, input_layout="TND", actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6],
        learnable_sink=sink, return_softmax_lse=True)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_learnable_sink_nan_or_plus_inf_is_refused(bad):
    """Before: accepted silently (every row of the head came back NaN)."""
    with pytest.raises(ParamInvalidError, match=r"\] learnable_sink: expected finite logits or -inf"):
        _sink_call(torch.tensor([0.5, bad], dtype=torch.bfloat16))
    with pytest.raises(ParamInvalidError, match=r"\] sink: expected finite logits or -inf"):
        q = torch.randn(1, 4, 2, 8)
        cann_attn.flash_attention_score(q, q, q, 2, "BSND", sink=torch.tensor([0.0, bad]))


def test_learnable_sink_minus_inf_is_no_sink():
    out, lse = _sink_call(torch.full((2,), -math.inf, dtype=torch.bfloat16))
    plain, plain_lse = _sink_call(None)
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)


# -------------------------------------------------------------------------------------- layout_query named
def _layout_query_calls(layout: str):
    g = torch.Generator().manual_seed(5)
    kvq = KvQuantCase("BSND", g)
    qli = QuantCase("BSND", g, d=128)
    q = torch.randn(1, 4, 2, 16).half()
    idx = torch.zeros(1, 4, 1, 2, dtype=torch.int32)
    return {
        "npu_sparse_flash_attention": lambda: torch_npu.npu_sparse_flash_attention(
            q, q[:, :, :1], q[:, :, :1], idx, 0.25, layout_query=layout, sparse_mode=0),
        "npu_lightning_indexer": lambda: torch_npu.npu_lightning_indexer(
            q, q[:, :, :1], torch.ones(1, 4, 2).half(), layout_query=layout, sparse_count=2, sparse_mode=0),
        "npu_kv_quant_sparse_flash_attention": lambda: torch_npu.npu_kv_quant_sparse_flash_attention(
            kvq.query, kvq.key, kvq.key, kvq.sparse_indices, kvq.scale, 2, 2, layout_query=layout,
            attention_mode=2),
        "npu_quant_lightning_indexer": lambda: torch_npu.npu_quant_lightning_indexer(
            qli.query, qli.key, qli.weights, qli.query_scale, qli.key_scale, 0, 0, layout_query=layout,
            sparse_count=4, sparse_mode=0),
    }


@pytest.mark.parametrize("op", sorted(_layout_query_calls("BSND")))
def test_layout_query_errors_name_layout_query(op):
    """Before: the errors named `layout`, which torch_npu's functions do not take."""
    with pytest.raises(ParamInvalidError, match=r"\] layout_query: "):
        _layout_query_calls("BNSD")[op]()


# ------------------------------------------------------------------------------------ dropout mask size
def test_dropout_gen_mask_size_takes_0_dim_integer_tensors():
    """op-plugin's own test passes a 0-dim tensor inside the int[] size; torch accepts it. Before: refused."""
    x = torch.zeros(2, dtype=torch.float16)
    want = torch_npu._npu_dropout_gen_mask(x, [3, 100], 0.3, 7, 0)
    got = torch_npu._npu_dropout_gen_mask(x, [torch.tensor(3), torch.tensor(100, dtype=torch.int32)], 0.3, 7, 0)
    assert torch.equal(got, want)
    for bad in ([torch.tensor(3.0), 100], [torch.tensor([3]), 100], [True, 100], [-1, 100]):
        with pytest.raises(ParamInvalidError, match=r"\] size: "):
            torch_npu._npu_dropout_gen_mask(x, bad, 0.3, 7, 0)


# ------------------------------------------------------------------------------------ scalars of the wrong type
def _wrong_type_calls():
    q = torch.randn(1, 4, 2, 16).half()
    kv, idx = q[:, :, :1], torch.zeros(1, 4, 1, 2, dtype=torch.int32)
    q3, kv3 = torch.randn(2, 1, 32).half(), torch.randn(2, 5, 32).half()
    weights = torch.ones(1, 4, 2).half()
    return {
        ("npu_sparse_flash_attention", "scale_value"): lambda: torch_npu.npu_sparse_flash_attention(
            q, kv, kv, idx, "x", sparse_mode=0),
        ("npu_sparse_flash_attention", "return_softmax_lse"): lambda: torch_npu.npu_sparse_flash_attention(
            q, kv, kv, idx, 0.25, sparse_mode=0, return_softmax_lse="no"),
        ("npu_fused_infer_attention_score_v2", "softmax_scale"): lambda: torch_npu.npu_fused_infer_attention_score_v2(
            q3, kv3, kv3, num_query_heads=2, softmax_scale="x"),
        ("npu_fused_infer_attention_score_v2", "return_softmax_lse"):
            lambda: torch_npu.npu_fused_infer_attention_score_v2(q3, kv3, kv3, num_query_heads=2,
                                                                 return_softmax_lse="no"),
        ("npu_fused_infer_attention_score", "scale"): lambda: torch_npu.npu_fused_infer_attention_score(
            q3, kv3, kv3, num_heads=2, scale="x"),
        ("npu_fused_infer_attention_score", "softmax_lse_flag"): lambda: torch_npu.npu_fused_infer_attention_score(
            q3, kv3, kv3, num_heads=2, softmax_lse_flag="no"),
        ("npu_prompt_flash_attention", "scale_value"): lambda: torch_npu.npu_prompt_flash_attention(
            q3, kv3, kv3, num_heads=2, scale_value="x"),
        ("npu_incre_flash_attention", "scale_value"): lambda: torch_npu.npu_incre_flash_attention(
            q3, kv3, kv3, num_heads=2, scale_value="x"),
        ("npu_fusion_attention", "scale"): lambda: torch_npu.npu_fusion_attention(q, q, q, 2, "BSND", scale="x"),
        ("npu_fusion_attention", "keep_prob"): lambda: torch_npu.npu_fusion_attention(q, q, q, 2, "BSND",
                                                                                       keep_prob="x"),
        ("npu_lightning_indexer", "sparse_count"): lambda: torch_npu.npu_lightning_indexer(
            q, kv, weights, sparse_count="x", sparse_mode=0),
        ("npu_lightning_indexer", "layout_query"): lambda: torch_npu.npu_lightning_indexer(
            q, kv, weights, layout_query=3, sparse_count=2, sparse_mode=0),
    }


@pytest.mark.parametrize("case", sorted(_wrong_type_calls()), ids="-".join)
def test_scalars_of_the_wrong_type_are_typed_errors_naming_them(case):
    """Before: float('x') / torch's schema check raised raw ValueError / TypeError / RuntimeError, and a string flag
    such as return_softmax_lse='no' was taken as True."""
    with pytest.raises(ParamInvalidError, match=rf"\] {case[1]}: expected"):
        _wrong_type_calls()[case]()
