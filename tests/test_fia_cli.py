"""``cann-attn verify`` and ``cann-attn golden`` cover FusedInferAttentionScore (v1, v2) and IncreFlashAttention."""

from __future__ import annotations

import json

import pytest

from cann_attn.cli import main as cli_main


@pytest.mark.parametrize("op", ["fused_infer_attention_score", "fused_infer_attention_score_v2",
                                "incre_flash_attention"])
def test_verify_cases_pass(op, capsys):
    rc = cli_main.main(["verify", "--op", op])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert op in out and "OK" in out


CASES = {
    "fused_infer_attention_score": {
        "inputs": {"query": {"shape": [2, 1, 64], "dtype": "float16"},
                   "key": {"shape": [2, 24, 32], "dtype": "float16"},
                   "value": {"shape": [2, 24, 32], "dtype": "float16"}},
        "params": {"num_heads": 4, "num_key_value_heads": 2, "input_layout": "BSH", "scale": 0.25,
                   "actual_seq_lengths_kv": [24, 5], "softmax_lse_flag": True},
    },
    "incre_flash_attention": {
        "inputs": {"query": {"shape": [2, 4, 1, 32], "dtype": "bfloat16"},
                   "key": {"shape": [2, 2, 30, 32], "dtype": "int8"},
                   "value": {"shape": [2, 2, 30, 32], "dtype": "int8"},
                   "antiquant_scale": {"shape": [2, 2, 1, 32], "dtype": "bfloat16", "generator": "uniform",
                                       "low": 0.01, "high": 0.03}},
        "params": {"num_heads": 4, "num_key_value_heads": 2, "input_layout": "BNSD", "scale_value": 0.17,
                   "actual_seq_lengths": [30, 9]},
    },
}


@pytest.mark.parametrize("op", list(CASES))
def test_golden_round_trip(op, tmp_path, capsys):
    case = tmp_path / "case.json"
    case.write_text(json.dumps({"op": op, "seed": 3, **CASES[op]}))
    assert cli_main.main(["golden", "--case", str(case), "--out", str(tmp_path / "golden"), "--actual",
                          str(tmp_path / "actual")]) == 0
    manifest = json.loads((tmp_path / "golden" / "manifest.json").read_text())
    assert "attention_out" in json.dumps(manifest)
    capsys.readouterr()
    assert cli_main.main(["compare", str(tmp_path / "actual"), str(tmp_path / "golden")]) == 0
    assert "PASS" in capsys.readouterr().out
