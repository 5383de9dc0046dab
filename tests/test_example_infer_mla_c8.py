"""examples/infer_mla_c8.py: DeepSeek-R1's C8 decode (cann-recipes-infer models/deepseek_r1/models/modeling_deepseek.py
:1240-1318: npu_dynamic_quant tokens, int8 weights, npu_mla_prolog_v3 with weight_quant_mode=2, kv_cache_quant_mode=1,
query_quant_mode=1 into an int8 "PA_NZ" latent pool, then npu_fused_infer_attention_score_v2 with query_quant_mode=3
over its 32-channel NZ view) equal to the attention of its own int8 outputs taken as the values they stand for, and
within the int8 roundings of the same layer in float64."""

from __future__ import annotations

import pytest

from example_modules import loaded_example

# prefill, one decode step, one MTP step of 2 tokens per sequence
SMALL = ["--batch", "2", "--prompt", "18", "--steps", "1", "--mtp", "2", "--heads", "2"]


@pytest.fixture(scope="module")
def c8_example():
    yield from loaded_example("infer_mla_c8")


@pytest.mark.usefixtures("single_thread")
def test_prefill_decode_and_mtp_compose_the_scales(c8_example):
    summary = c8_example.main(SMALL)
    assert [s["step"] for s in summary["steps"]] == ["prefill", "decode 1", "MTP 2"]
    assert all(s["own"] < 1e-2 and s["attention"] < 1e-1 and s["out"] < 1e-1 for s in summary["steps"])


@pytest.mark.usefixtures("single_thread")
def test_an_attention_that_leaves_the_rope_product_unscaled_is_caught(c8_example, monkeypatch):
    """The rope product added after dequantising the int8 one (the query rope taken as it is, not times
    dequant_scale_query * dequant_scale_key): the scores of every head change and the check fails."""
    original = c8_example.torch_npu.npu_fused_infer_attention_score_v2

    def rope_unscaled(*args, query_rope, dequant_scale_query, dequant_scale_key, **kwargs):
        unscaled = query_rope.float() / (dequant_scale_query[..., None] * dequant_scale_key)
        return original(*args, query_rope=unscaled.to(query_rope.dtype), dequant_scale_query=dequant_scale_query,
                        dequant_scale_key=dequant_scale_key, **kwargs)

    monkeypatch.setattr(c8_example.torch_npu, "npu_fused_infer_attention_score_v2", rope_unscaled)
    with pytest.raises(AssertionError):
        c8_example.main(SMALL)
