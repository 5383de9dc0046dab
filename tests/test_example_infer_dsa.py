"""Smoke test for examples/infer_dsa.py (DSA prefill + decode over a growing paged cache, checked step by step
against the same layer without paging)."""

from __future__ import annotations

import json

import pytest

from example_modules import loaded_example

pytest.importorskip("matplotlib")

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def infer_dsa():
    yield from loaded_example("infer_dsa")


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("CANN_ATTN_BACKEND", "reference")  # the bit-for-bit check is the reference backend's


def test_prefill_and_decode_match_the_unpaged_layer(infer_dsa, tmp_path):
    summary = infer_dsa.main(["--batch", "3", "--prompt", "40", "--steps", "5", "--d-model", "32", "--n-heads", "2",
                              "--d-latent", "16", "--d-rope", "8", "--idx-heads", "2", "--idx-dim", "128",
                              "--top-k", "12", "--block-size", "16", "--out", str(tmp_path)])
    assert summary["bitwise"] and summary["checked_steps"] == 6
    lengths = summary["prompt_lengths"]
    assert len(set(lengths)) == 3 and any(n % 16 for n in lengths)  # different lengths, partial last blocks
    # The cache grew block by block: every sequence owns exactly the blocks its tokens need.
    assert summary["blocks_used"] == sum(-(-(n + 5) // 16) for n in lengths) < summary["blocks_in_pool"]
    assert all(v > 0 for v in summary["decode_tokens_per_s"].values())
    assert len(summary["decode_step_ms"]["paged"]) == 5
    assert (tmp_path / "infer_dsa.png").stat().st_size > 0
    assert json.loads((tmp_path / "infer_dsa.json").read_text())["checked_steps"] == 6


def test_a_paged_read_of_an_unwritten_slot_would_be_caught(infer_dsa, monkeypatch):
    """The unwritten slots hold NaN: a layer that read one (here: the table pointing one block off) fails the
    step-by-step comparison."""
    cfg = infer_dsa.Config(batch=2, prompt=20, steps=2, d_model=32, n_heads=2, d_latent=16, d_rope=8, idx_heads=2,
                           idx_dim=128, top_k=8, block_size=16)
    original = infer_dsa.PagedCache.append

    def append_then_corrupt(self, b, values):
        original(self, b, values)
        self.table[b, 0] = self.table[b, 0] if b else self.free[0]

    monkeypatch.setattr(infer_dsa.PagedCache, "append", append_then_corrupt)
    with pytest.raises(AssertionError, match="differ"):
        infer_dsa.run(cfg, None, verbose=False)


QUANT_ARGS = ["--quant", "--d-latent", "512", "--batch", "3", "--prompt", "40", "--steps", "4", "--d-model", "32",
              "--n-heads", "2", "--idx-heads", "2", "--idx-dim", "128", "--top-k", "12", "--block-size", "16"]


def test_quant_mode_matches_the_dequantised_float_layer(infer_dsa, tmp_path):
    """--quant: int8 latent rows (656 bytes) and an int8 indexer cache read by quant_lightning_indexer and
    kv_quant_sparse_flash_attention; every step equals the dequantised computation without paging (indices from
    float64 index scores, attention bit for bit)."""
    summary = infer_dsa.main([*QUANT_ARGS, "--out", str(tmp_path)])
    assert summary["bitwise"] and summary["checked_steps"] == 5 and summary["config"]["quant"]
    assert summary["cache_bytes_per_token"] == 656 + 128 + 2  # latent row, int8 indexer key (D 128), fp16 scale


def test_quant_mode_catches_a_wrong_tile_scale(infer_dsa, monkeypatch, tmp_path):
    """A cache writer that stores the tile scales in the wrong order makes the int8 layer differ from the
    dequantised one: the step-by-step check can fail."""
    original = infer_dsa.pack_latent_rows
    monkeypatch.setattr(infer_dsa, "pack_latent_rows", lambda q, r, s: original(q, r, s.flip(-1)))
    with pytest.raises(AssertionError, match="differ"):
        infer_dsa.main([*QUANT_ARGS, "--steps", "1", "--out", str(tmp_path)])
