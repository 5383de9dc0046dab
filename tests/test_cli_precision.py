"""``cann-attn golden --precision npu`` and ``compare`` against both goldens (docs/guides/golden.md): an output that
differs from the float64 golden only by the NPU pipeline's rounding passes, with a note saying so; one that differs
from both fails."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cann_attn.cli import main as cli_main
from cann_attn.testing.npu_recipes import op_plugin_pfa_golden

# Logits near 128 (D = 128, Q and K with standard deviation 128^0.5): fp16 rounding of Q K^T moves whole rows.
SCALE = 1 / math.sqrt(128)
CASE = {
    "op": "prompt_flash_attention",
    "seed": 0,
    "inputs": {
        "query": {"shape": [1, 2, 64, 128], "dtype": "float16", "generator": "normal", "std": 128**0.5},
        "key": {"shape": [1, 2, 192, 128], "dtype": "float16", "generator": "normal", "std": 128**0.5},
        "value": {"shape": [1, 2, 192, 128], "dtype": "float16"},
    },
    "params": {"num_heads": 2, "input_layout": "BNSD", "scale_value": SCALE},
}


def _main(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main.main([str(a) for a in args])
    return rc, capsys.readouterr().out


@pytest.fixture(scope="module")
def npu_golden(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("npu_golden")
    case = tmp / "case.json"
    case.write_text(json.dumps(CASE))
    assert cli_main.main(["golden", "--case", str(case), "--out", str(tmp / "golden"), "--precision", "npu"]) == 0
    return tmp / "golden"


def _actual(directory, out: torch.Tensor):
    directory.mkdir()
    np.save(directory / "attention_out.npy", out.numpy())
    return directory


def _inputs(golden):
    return [torch.from_numpy(np.load(golden / f"{n}.npy")) for n in ("query", "key", "value")]


def test_golden_writes_the_npu_pipeline_golden_beside_the_float64_one(npu_golden):
    manifest = json.loads((npu_golden / "manifest.json").read_text())
    roles = {e["name"]: e["role"] for e in manifest["tensors"]}
    assert roles["attention_out"] == "output" and roles["attention_out.npu"] == "npu_output"
    assert manifest["precision"] == "npu" and "npu" in manifest["npu_golden"]
    exact = np.load(npu_golden / "attention_out.npy")
    npu = np.load(npu_golden / "attention_out.npu.npy")
    assert npu.dtype == exact.dtype == np.float16
    assert float(np.abs(npu.astype(np.float64) - exact).max()) > 0.1  # the rounding matters in this case


def _copy_golden(npu_golden, target, keep):
    """A copy of the golden directory with only the manifest entries whose role is in `keep`."""
    target.mkdir()
    manifest = json.loads((npu_golden / "manifest.json").read_text())
    manifest["tensors"] = [e for e in manifest["tensors"] if e["role"] in keep]
    for entry in manifest["tensors"]:
        for name in entry["files"].values():
            (target / name).write_bytes((npu_golden / name).read_bytes())
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def test_an_npu_like_output_passes_the_npu_golden_by_two_ulps(npu_golden, tmp_path, capsys):
    """op-plugin's own golden recipe stands in for the NPU: 0.2 off the float64 golden, within 2 ulps of the npu one
    (where the double-thousandth rule, below one fp16 ulp for |x| >= 1, would fail it)."""
    actual = _actual(tmp_path / "npu_like", op_plugin_pfa_golden(*_inputs(npu_golden), SCALE).half())
    rc, out = _main(capsys, "compare", actual, npu_golden, "--json", tmp_path / "report.json")
    assert rc == 0, out
    line = next(line for line in out.splitlines() if line.startswith("verdict: attention_out:"))
    # the float64 golden's naive reference already passes it (flash-attn rule); the npu row is in the JSON record
    assert line.startswith("verdict: attention_out: PASS by the flash-attn rule"), out
    assert "Ascend rule over:" in line and "FAIL" not in line, out
    record = json.loads((tmp_path / "report.json").read_text())["tensors"][0]
    assert record["passed"] and not record["ascend_pass"]
    assert record["npu_golden"]["passed"] and record["npu_golden"]["ulp_pass"]
    assert not record["npu_golden"]["ascend_pass"]


def test_rounding_explains_a_float64_failure(npu_golden, tmp_path, capsys):
    """Without the naive reference (the secondary rule) the float64 golden fails the same output; the npu-pipeline
    golden passes it and says the difference is the kernel's rounding."""
    golden = _copy_golden(npu_golden, tmp_path / "golden", {"input", "output", "npu_output"})
    actual = _actual(tmp_path / "npu_like", op_plugin_pfa_golden(*_inputs(npu_golden), SCALE).half())
    rc, out = _main(capsys, "compare", actual, golden)
    assert rc == 0, out
    line = next(line for line in out.splitlines() if line.startswith("verdict: attention_out:"))
    assert "PASS by the npu-pipeline golden" in line and "the NPU kernel's rounding" in line, out


def test_an_output_off_both_goldens_fails(npu_golden, tmp_path, capsys):
    golden = _copy_golden(npu_golden, tmp_path / "golden", {"input", "output", "npu_output"})
    near = op_plugin_pfa_golden(*_inputs(npu_golden), SCALE)
    actual = _actual(tmp_path / "wrong", (near * 1.01).half())
    rc, out = _main(capsys, "compare", actual, golden)
    assert rc == 1, out
    line = next(line for line in out.splitlines() if line.startswith("verdict: attention_out:"))
    assert line.startswith("verdict: attention_out: FAIL") and "not explained by the kernel's rounding" in line, out
    assert "not within 2 ulps of the npu-pipeline golden" in line, out


def test_without_npu_golden_compare_is_unchanged(npu_golden, tmp_path, capsys):
    """A golden without NAME.npu (no --precision npu) gives a single row and the float64 verdict."""
    plain = _copy_golden(npu_golden, tmp_path / "plain", {"input", "output"})
    actual = _actual(tmp_path / "npu_like", op_plugin_pfa_golden(*_inputs(npu_golden), SCALE).half())
    rc, out = _main(capsys, "compare", actual, plain)
    assert rc == 1 and ".npu" not in out
