"""``cann-attn golden`` / ``compare`` for MlaProlog (npu_mla_prolog_v3: the caches it writes in place are the
outputs kv_cache_out / kr_cache_out) and FIA v2's quantised calls (the int8 MLA query, query_quant_mode 3; paged
caches with per-token scales, key/value_quant_mode 4): the round trip passes, a perturbed output fails, the inputs
written are those of the call (docs/guides/golden.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cann_attn.cli import tensorio
from cli_utils import run_main, write_case

ROOT = Path(__file__).resolve().parents[1]
PROLOG = ROOT / "examples" / "cases" / "mla_prolog.json"
INT8_QUERY = ROOT / "examples" / "cases" / "fused_infer_attention_score_v2_int8_query.json"
PER_TOKEN = ROOT / "examples" / "cases" / "fused_infer_attention_score_v2_per_token_cache.json"

# deepseek_r1's C8 decode (weight_quant_mode 2, kv_cache_quant_mode 1, query_quant_mode 1) in fp32, over PA_NZ pools
# whose int8 latent is read in groups of 32 channels (docs/operators/mla_prolog.md)
C8_FP32 = {
    "op": "mla_prolog",
    "seed": 7,
    "inputs": {
        "token_x": {"shape": [4, 64], "dtype": "int8"},
        "weight_dq": {"shape": [64, 32], "dtype": "int8"},
        "weight_uq_qr": {"shape": [32, 160], "dtype": "int8"},
        "weight_uk": {"shape": [2, 16, 64], "dtype": "float32", "std": 0.25},
        "weight_dkv_kr": {"shape": [64, 128], "dtype": "int8"},
        "rmsnorm_gamma_cq": {"shape": [32], "dtype": "float32", "mean": 1.0, "std": 0.1},
        "rmsnorm_gamma_ckv": {"shape": [64], "dtype": "float32", "mean": 1.0, "std": 0.1},
        "rope_sin": {"shape": [4, 64], "dtype": "float32", "generator": "uniform"},
        "rope_cos": {"shape": [4, 64], "dtype": "float32", "generator": "uniform"},
        "kv_cache": {"shape": [2, 16, 1, 64], "dtype": "int8"},
        "kr_cache": {"shape": [2, 16, 1, 64], "dtype": "float32"},
        "cache_index": {"generator": "values", "dtype": "int64", "values": [3, 17, 4, 30]},
        "dequant_scale_x": {"shape": [4, 1], "dtype": "float32", "generator": "uniform", "low": 0.005,
                            "high": 0.01},
        "dequant_scale_w_dq": {"shape": [1, 32], "dtype": "float32", "generator": "uniform", "low": 1e-4,
                               "high": 1e-3},
        "dequant_scale_w_uq_qr": {"shape": [1, 160], "dtype": "float32", "generator": "uniform", "low": 1e-4,
                                  "high": 1e-3},
        "dequant_scale_w_dkv_kr": {"shape": [1, 128], "dtype": "float32", "generator": "uniform", "low": 1e-4,
                                   "high": 1e-3},
        "quant_scale_ckv": {"generator": "values", "dtype": "float32", "values": [30.0]},
    },
    "params": {"cache_mode": "PA_NZ", "query_norm_flag": True, "weight_quant_mode": 2, "kv_cache_quant_mode": 1,
               "query_quant_mode": 1},
}


def _round_trip(capsys, case: Path, tmp_path: Path) -> tuple[Path, Path]:
    golden, actual = tmp_path / "golden", tmp_path / "actual"
    rc, out, err = run_main(capsys, "golden", "--case", case, "--out", golden, "--actual", actual)
    assert rc == 0, out + err
    rc, out, err = run_main(capsys, "compare", actual, golden)
    assert rc == 0 and "PASS" in out, out + err
    return golden, actual


def _perturbed_fails(capsys, golden: Path, actual: Path, tmp_path: Path, name: str, change) -> str:
    perturbed = tmp_path / "perturbed"
    shutil.copytree(actual, perturbed)
    np.save(perturbed / f"{name}.npy", change(np.load(perturbed / f"{name}.npy")))  # compare reads the .npy
    rc, out, err = run_main(capsys, "compare", perturbed, golden)
    assert rc == 1 and "FAIL: 1 of" in out and f"  {name}: " in out, out + err
    return out


def test_mla_prolog_golden_holds_the_caches_before_and_after(capsys, tmp_path):
    golden, actual = _round_trip(capsys, PROLOG, tmp_path)
    manifest = tensorio.read_manifest(golden)
    roles = {e["name"]: e["role"] for e in manifest["tensors"]}
    assert roles["kv_cache"] == "input" and roles["kv_cache_out"] == roles["kr_cache_out"] == "output"
    slots = json.loads(PROLOG.read_text())["inputs"]["cache_index"]["values"]
    for cache in ("kv_cache", "kr_cache"):
        before = np.load(golden / f"{cache}.npy").reshape(-1, 64)
        after = np.load(golden / f"{cache}_out.npy").reshape(-1, 64)
        untouched = np.ones(len(before), dtype=bool)
        untouched[slots] = False
        assert np.array_equal(before[untouched], after[untouched]), cache
        assert not np.array_equal(before[slots], after[slots]), f"{cache}: the input file is the cache after the call"
    # a row the call must not write, changed: compare fails on it
    def stray_write(cache):
        cache = cache.copy()
        cache[0, 0, 0, :] += 8.0  # slot 0 is not in cache_index
        return cache

    _perturbed_fails(capsys, golden, actual, tmp_path, "kv_cache_out", stray_write)


def test_mla_prolog_c8_round_trip_and_int8_query_two_steps_off_fails(capsys, tmp_path):
    case = write_case(tmp_path, C8_FP32)
    golden, actual = _round_trip(capsys, case, tmp_path)
    outputs = {e["name"]: e["dtype"] for e in tensorio.read_manifest(golden)["tensors"] if e["role"] == "output"}
    assert outputs["query"] == "int8" and outputs["kv_cache_out"] == "int8" and outputs["kr_cache_out"] == "float32"
    assert outputs["dequant_scale_q_nope"] == "float32"
    assert np.load(golden / "dequant_scale_q_nope.npy").shape == (4, 2, 1)
    out = _perturbed_fails(capsys, golden, actual, tmp_path, "query",
                           lambda q: np.clip(q.astype(np.int16) + 2, -128, 127).astype(np.int8))
    assert "int8 steps" in out


@pytest.mark.parametrize("case", [INT8_QUERY, PER_TOKEN], ids=["int8_mla_query", "per_token_cache"])
def test_fia_v2_quantised_round_trip_and_perturbed_output_fails(capsys, tmp_path, case):
    golden, actual = _round_trip(capsys, case, tmp_path)
    _perturbed_fails(capsys, golden, actual, tmp_path, "attention_out", lambda o: o * 1.05 + 0.01)



FP8 = ROOT / "examples" / "cases" / "fused_infer_attention_score_v2_fp8_cache.json"


def test_fp8_cache_files_hold_the_raw_bytes_and_load_back(capsys, tmp_path):
    """float8_e4m3fn inputs (qwen3_moe's per-token fp8 caches): the .bin holds the raw bytes, the .npy the exact
    values as float32; a golden from those files (--inputs) is the same golden."""
    golden, _ = _round_trip(capsys, FP8, tmp_path)
    entry = next(e for e in tensorio.read_manifest(golden)["tensors"] if e["name"] == "key")
    assert entry["dtype"] == "float8_e4m3fn" and entry["npy_dtype"] == "float32" and entry["bin_bytes"] == 6 * 16 * 128
    raw = torch.from_numpy(np.fromfile(golden / "key.bin", dtype=np.uint8)).view(torch.float8_e4m3fn)
    assert torch.equal(raw.float().view(6, 16, 128), torch.from_numpy(np.load(golden / "key.npy")))
    again = tmp_path / "again"
    rc, out, err = run_main(capsys, "golden", "--case", FP8, "--out", again, "--inputs", golden)
    assert rc == 0, out + err
    for name in ("attention_out", "softmax_lse"):
        assert np.array_equal(np.load(again / f"{name}.npy"), np.load(golden / f"{name}.npy")), name


def test_mla_prolog_golden_refuses_the_packed_rows(capsys, tmp_path):
    """kv_cache_quant_mode 3's rows mix int8, bf16 and float32 bytes: no golden rule compares them, so the case is
    refused (exit 2, one line naming the parameter) instead of written with a meaningless int8 comparison."""
    case = json.loads(PROLOG.read_text())
    case["inputs"].update({
        "weight_uq_qr": {"shape": [32, 160], "dtype": "int8"},
        "dequant_scale_w_uq_qr": {"shape": [1, 160], "dtype": "float32", "generator": "uniform", "low": 0.001,
                                  "high": 0.002},
        "kv_cache": {"shape": [2, 16, 1, 64 + 128 + 8], "dtype": "int8"},
        "kr_cache": {"shape": [1, 2, 1, 0], "dtype": "bfloat16"},
        "k_nope_clip_alpha": {"generator": "values", "dtype": "float32", "values": [1.0]}})
    case["params"].update(weight_quant_mode=1, kv_cache_quant_mode=3, ckvkr_repo_mode=1, quant_scale_repo_mode=1,
                          tile_size=32)
    rc, out, err = run_main(capsys, "golden", "--case", write_case(tmp_path, case), "--out", tmp_path / "g")
    assert rc == 2 and "params.kv_cache_quant_mode: 3 writes packed rows" in err, out + err
    assert not (tmp_path / "g").exists()
