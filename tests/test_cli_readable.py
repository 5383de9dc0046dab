"""What the commands show: tables readable at 80-160 columns with nothing cut, a visible reason on every output that
passes by the secondary (flash-attn) rule, the same two rules in ``compare``, ``bench`` writing to a folder of the
user's (default ./cann_attn_bench), and the torch_npu operator names accepted by ``golden`` and ``verify``."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from cann_attn.cli import cases as registry
from cann_attn.cli import compare, verify
from cann_attn.cli.metrics import TensorMetrics
from cli_utils import run_main
from patience import HANG_SECONDS

ROOT = Path(__file__).resolve().parents[1]


def _terminal(width: int) -> Console:
    return Console(force_terminal=True, width=width, file=io.StringIO(), color_system=None)


_ROWS = [
    verify.Row("flash_attention_score_grad", "sink_band_mode4_gqa", "bf16", "BSND B1 N8/2 S128 D64", "dq",
               ascend=True, max_abs=8.79e-3, max_rel=1.84, time_ms=402.3, backend="reference"),
    verify.Row("flash_attention_score_grad", "sink_band_mode4_gqa", "bf16", "BSND B1 N8/2 S128 D64", "dsink",
               ascend=False, fa_rule=True, max_abs=6.25e-3, max_rel=1.14e-2, time_ms=402.3, backend="reference",
               note="8 rel / 7 abs > t", reason="flash-attn rule: max err 6.25e-03 <= 2 x naive 5.04e-02 + 1e-5"),
]


@pytest.mark.parametrize("width", [80, 100, 160])
def test_verify_table_fits_the_terminal_without_cutting(width):
    out = _terminal(width)
    verify.render(_ROWS, out, "cann-attn verify (cpu)")
    text = out.file.getvalue()
    assert "…" not in text and "..." not in text
    assert max(len(line) for line in text.splitlines()) <= width
    flat = " ".join(text.split())
    for value in ("sink_band_mode4_gqa", "BSND B1 N8/2 S128 D64", "8.79e-03", "1.84e+00", "6.25e-03", "402.3",
                  "flash-attn rule: max err 6.25e-03 <= 2 x naive 5.04e-02 + 1e-5"):
        assert " ".join(value.split()) in flat, value


@pytest.mark.parametrize("width", [80, 120])
def test_compare_table_fits_the_terminal_without_cutting(width):
    m = TensorMetrics("attention_out", "bfloat16", (2, 1024, 16, 128), "float", numel=4194304, max_abs=3.05e-5,
                      max_rel=7.63e-3, threshold=4e-3, n_rel_fail=12, n_abs_fail=0, allowed=16777.2, mere=1.2e-4,
                      mare=7.63e-3, mere_limit=2**-7)
    out = _terminal(width)
    compare.render([m], False, out, "cann-attn compare (flash_attention_score): actual vs golden golden")
    text = out.file.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    for value in ("[2, 1024, 16, 128]", "3.05e-05", "7.63e-03", "1.678e+04", "pass (t=0.004)", "PASS"):
        assert value in text, value


def test_piped_tables_stay_full(capsys):
    verify.render(_ROWS, Console(file=sys.stdout, soft_wrap=True), "t")  # not a terminal: one line per row
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and all("sink_band_mode4_gqa" in line for line in lines[3:])


def test_a_row_passing_by_the_second_rule_says_why(capsys):
    verify.render(_ROWS, Console(file=sys.stdout, soft_wrap=True), "t")
    dsink = capsys.readouterr().out.splitlines()[-1]
    assert "over t (8 rel / 7 abs > t)" in dsink and "FAIL" not in dsink
    assert "pass (flash-attn rule: max err 6.25e-03 <= 2 x naive 5.04e-02 + 1e-5)" in dsink


SINK_GRAD = {
    "op": "npu_fusion_attention_grad",  # the torch_npu name, as an alias
    "seed": 0,
    "inputs": {"query": {"shape": [1, 128, 8, 64], "dtype": "bfloat16"},
               "key": {"shape": [1, 128, 2, 64], "dtype": "bfloat16"},
               "value": {"shape": [1, 128, 2, 64], "dtype": "bfloat16"},
               "dy": {"shape": [1, 128, 8, 64], "dtype": "bfloat16"},
               "atten_mask": {"generator": "compressed_mask"},
               "sink": {"shape": [8], "dtype": "float32", "std": 2.0}},
    "params": {"head_num": 8, "input_layout": "BSND", "scale_value": 0.125, "sparse_mode": 4, "pre_tokens": 32,
               "next_tokens": 0},
}


def _golden_and_actual(tmp_path, capsys, case_json: dict):
    """`cann-attn golden` of a case with our outputs as the actual: (golden dir, actual dir, manifest)."""
    case = tmp_path / "case.json"
    case.write_text(json.dumps(case_json))
    golden, actual = tmp_path / "golden", tmp_path / "actual"
    rc, out, err = run_main(capsys, "golden", "--case", case, "--out", golden, "--actual", actual)
    assert rc == 0, out + err
    return golden, actual, json.loads((golden / "manifest.json").read_text())


def test_compare_applies_the_second_rule_with_its_reason(tmp_path, capsys):
    """dsink of a sink gradient misses the Ascend rule in bf16 but is no worse than the naive computation: compare
    passes it by the flash-attn rule (golden writes the naive reference) and says so; without that reference,
    the Ascend rule alone fails it."""
    golden, actual, manifest = _golden_and_actual(tmp_path, capsys, SINK_GRAD)
    assert manifest["op"] == "flash_attention_score_grad"
    assert {e["name"] for e in manifest["tensors"] if e["role"] == "naive"} >= {"dq.naive", "dsink.naive"}
    rc, out, err = run_main(capsys, "compare", actual, golden)
    assert rc == 0, out + err
    dsink = next(line for line in out.splitlines() if line.startswith("dsink "))
    assert "over t" in dsink and "PASS (flash-attn rule)" in dsink
    verdict = next(line for line in out.splitlines() if line.startswith("verdict: dsink:"))
    assert "PASS by the flash-attn rule" in verdict and "flash-attn rule: max err" in verdict, out
    assert "Ascend rule over:" in verdict and " rel and " in verdict and " abs > t=" in verdict, out
    assert all("FAIL" not in line for line in out.splitlines() if line.startswith("verdict:")), out
    rc, out, _ = run_main(capsys, "compare", actual, golden, "--json", "-")
    row = next(t for t in json.loads(out)["tensors"] if t["name"] == "dsink")
    assert rc == 0 and row["by_second_rule"] and not row["ascend_pass"] and row["flash_attn_pass"]
    manifest["tensors"] = [e for e in manifest["tensors"] if e["role"] != "naive"]
    (golden / "manifest.json").write_text(json.dumps(manifest))
    rc, out, _ = run_main(capsys, "compare", actual, golden)
    assert rc == 1 and "dsink: Ascend rule" in out


def test_torch_npu_names_are_aliases(tmp_path, capsys):
    from cann_attn.torch_npu import _registry

    for npu_name, name in registry.TORCH_NPU_NAMES.items():
        assert npu_name in _registry.OPS, npu_name
        assert name in registry.OPERATORS or any(c.op == name for c in registry.CASES), name
    example = ROOT / "examples" / "cases" / "flash_attention_score.json"
    rc, out, err = run_main(capsys, "golden", "--op", "npu_fusion_attention", "--case", example, "--out",
                            tmp_path / "g")
    assert rc == 0, out + err
    assert json.loads((tmp_path / "g" / "manifest.json").read_text())["op"] == "flash_attention_score"
    rc, out, err = run_main(capsys, "verify", "--op", "npu_incre_flash_attention", "--case", "paged")
    assert rc == 0 and "incre_flash_attention" in out, out + err


def test_bench_writes_to_a_folder_outside_the_source_tree(tmp_path):
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "bench_echo.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--out')\np.add_argument('--quick', "
        "action='store_true')\nprint('echo ran with out', p.parse_args().out)\n")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "CANN_ATTN_BENCHMARKS": str(folder), "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "cann_attn.cli", "bench", "--suite", "echo"], cwd=work,
                          capture_output=True, text=True, timeout=HANG_SECONDS, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "echo ran with out cann_attn_bench" in proc.stdout
    assert f"results in {work / 'cann_attn_bench'}" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "cann_attn.cli", "bench", "--suite", "echo", "--out",
                           str(tmp_path / "mine")], cwd=work, capture_output=True, text=True, timeout=HANG_SECONDS,
                          env=env)
    assert proc.returncode == 0 and f"echo ran with out {tmp_path / 'mine'}" in proc.stdout, proc.stderr


FIA_PREFILL = {
    "op": "fused_infer_attention_score",
    "seed": 0,
    "inputs": {name: {"shape": [1, 2, 64 if name == "query" else 96, 64], "dtype": "bfloat16"}
               for name in ("query", "key", "value")},
    "params": {"num_heads": 2, "input_layout": "BNSD", "scale": 0.125},
}


def test_fia_gets_the_flash_attn_rule_like_pfa(tmp_path, capsys):
    """FusedInferAttentionScore with float inputs writes the naive reference of attention_out (PromptFlashAttention's
    secondary rule; none for the fp32 softmax_lse), and compare judges by it an output the Ascend rule rejects."""
    golden, actual, manifest = _golden_and_actual(tmp_path, capsys, FIA_PREFILL)
    naive = {e["name"] for e in manifest["tensors"] if e["role"] == "naive"}
    assert naive == {"attention_out.naive"}
    reference = np.load(golden / "attention_out.naive.npy")
    exact = np.load(golden / "attention_out.npy")
    # an output 1.9 times as far from the golden as the naive computation: beyond the Ascend allowance
    off = exact.astype(np.float64) + 1.9 * (reference.astype(np.float64) - exact)
    np.save(actual / "attention_out.npy", off.astype(exact.dtype))
    _, out, _ = run_main(capsys, "compare", actual, golden, "--json", "-")
    row = next(t for t in json.loads(out)["tensors"] if t["name"] == "attention_out")
    assert row["flash_attn_pass"] is not None and not row["ascend_pass"]
    assert row["passed"] and row["verdict"].startswith("PASS by the flash-attn rule"), row["verdict"]
