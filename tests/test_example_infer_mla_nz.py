"""examples/infer_mla_nz.py: a DeepSeek-R1-style absorbed MLA layer (npu_mla_prolog_v3 with cache_mode "PA_NZ" ->
npu_fused_infer_attention_score_v2 TND_NTD over the bf16 NZ cache views, cann-recipes-infer
models/deepseek_r1/models/modeling_deepseek.py:1251-1310) equal, stage by stage, to the same layer in float64, and the
attention over the NZ caches bit for bit the attention over ND caches holding the same tokens."""

from __future__ import annotations

import json

import pytest

from example_modules import loaded_example

# prefill, one decode step, one MTP step of 2 tokens per sequence
SMALL = ["--batch", "2", "--prompt", "18", "--steps", "1", "--mtp", "2", "--heads", "2"]


@pytest.fixture(scope="module")
def mla_example():
    yield from loaded_example("infer_mla_nz")


@pytest.mark.usefixtures("single_thread")
def test_prefill_decode_and_mtp_equal_the_float64_layer(mla_example, tmp_path):
    summary = mla_example.main([*SMALL, "--json", str(tmp_path / "mla.json")])
    assert [s["step"] for s in summary["steps"]] == ["prefill", "decode 1", "MTP 2"]
    assert [s["tokens"] for s in summary["steps"]] == [sum(summary["prompt_lengths"]), 2, 4]
    assert all(s["attention"] < 1e-2 and s["out"] < 1e-2 for s in summary["steps"])
    assert json.loads((tmp_path / "mla.json").read_text())["prompt_lengths"] == summary["prompt_lengths"]


@pytest.mark.usefixtures("single_thread")
def test_a_cache_written_in_nd_order_is_caught(mla_example, monkeypatch):
    """A prolog that writes the caches in ND (PA_BSND) order while FIA reads them as NZ: the attention reads the
    wrong channels (or unwritten NaN slots) and the float64 layer disagrees."""
    original = mla_example.torch_npu.npu_mla_prolog_v3

    def nd_order(*args, cache_mode, **kwargs):
        return original(*args, cache_mode="PA_BSND", **kwargs)

    monkeypatch.setattr(mla_example.torch_npu, "npu_mla_prolog_v3", nd_order)
    with pytest.raises(AssertionError):
        mla_example.main(SMALL)
