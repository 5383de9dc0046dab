"""examples/infer_dsa_layer.py: one DeepSeek-V3.2-style layer (npu_mla_prolog_v3 -> npu_quant_lightning_indexer ->
npu_kv_quant_sparse_flash_attention over paged caches) equal, stage by stage, to the same layer in float64."""

from __future__ import annotations

import json

import pytest

from example_modules import loaded_example

pytestmark = pytest.mark.usefixtures("single_thread")

SMALL = ["--batch", "2", "--prompt", "20", "--steps", "1", "--heads", "2", "--top-k", "8"]


@pytest.fixture(scope="module")
def layer_example():
    yield from loaded_example("infer_dsa_layer")


def test_prefill_and_decode_equal_the_float64_layer(layer_example, tmp_path):
    summary = layer_example.main([*SMALL, "--json", str(tmp_path / "layer.json")])
    assert [s["step"] for s in summary["steps"]] == ["prefill", "decode 1"]
    assert summary["steps"][0]["tokens"] == sum(summary["prompt_lengths"]) and summary["steps"][1]["tokens"] == 2
    assert all(s["attention"] < 1e-2 and s["out"] < 1e-2 for s in summary["steps"])
    assert json.loads((tmp_path / "layer.json").read_text())["prompt_lengths"] == summary["prompt_lengths"]


def test_a_latent_written_to_the_wrong_slot_is_caught(layer_example, monkeypatch):
    """A prolog that writes every token one slot further on: the attention reads an unwritten (NaN) row or the
    float64 layer disagrees."""
    original = layer_example.torch_npu.npu_mla_prolog_v3

    def shifted(*args, cache_index, **kwargs):
        return original(*args, cache_index=(cache_index + 1) % args[9].shape[0:2].numel(), **kwargs)

    monkeypatch.setattr(layer_example.torch_npu, "npu_mla_prolog_v3", shifted)
    with pytest.raises(AssertionError):
        layer_example.main(SMALL)
