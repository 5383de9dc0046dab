"""``cann-attn golden`` and ``cann-attn compare``: golden data files, the round trip through compare, the metric
that fails on a perturbed output, bad case files (exit status 2, one line naming the field), nothing left behind
on failure, and every example case file of examples/cases/.

The end-to-end round trip and a bad case file run the installed command in a subprocess; the many small
variations call ``cann_attn.cli.main.main`` in-process (same code path, without a second of interpreter and
torch start-up per call).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cann_attn.cli import casefile, tensorio
from cann_attn.cli import cases as registry
from cann_attn.cli import main as cli_main
from cli_utils import run_main, write_case
from patience import HANG_SECONDS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "cases").glob("*.json"))
OPS = (
    "flash_attention_score",
    "flash_attention_var_len_score",
    "flash_attention_score_grad",
    "prompt_flash_attention",
    "sparse_flash_attention",
    "sparse_flash_attention_grad",
    "lightning_indexer",
    "sparse_lightning_indexer_grad_kl_loss",
    "fused_infer_attention_score",
    "incre_flash_attention",
    "atb_paged_attention",
    "atb_flash_attention_unpad",
)

SMALL_FA = {
    "op": "flash_attention_score",
    "seed": 11,
    "inputs": {
        "query": {"shape": [1, 64, 4, 32], "dtype": "bfloat16"},
        "key": {"shape": [1, 80, 2, 32], "dtype": "bfloat16"},
        "value": {"shape": [1, 80, 2, 32], "dtype": "bfloat16"},
        "atten_mask": {"generator": "compressed_mask"},
    },
    "params": {"head_num": 4, "input_layout": "BSND", "scale_value": 0.17677669529663687, "sparse_mode": 3},
}


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "cann-attn"
    if script.exists():
        return [str(script)]
    found = shutil.which("cann-attn")
    return [found] if found else [sys.executable, "-m", "cann_attn.cli.main"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*_cli(), *map(str, args)], capture_output=True, text=True, timeout=HANG_SECONDS, env=env)


@pytest.fixture(scope="module")
def small_golden(tmp_path_factory):
    """SMALL_FA written by the real command, with the operator's own outputs (--actual)."""
    tmp = tmp_path_factory.mktemp("golden")
    case = write_case(tmp, SMALL_FA)
    proc = _run("golden", "--case", case, "--out", tmp / "golden", "--actual", tmp / "actual")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp


# ------------------------------------------------------------------------------------------------------
# Round trip (subprocess)
# ------------------------------------------------------------------------------------------------------
def test_golden_writes_npy_bin_and_manifest(small_golden):
    golden = small_golden / "golden"
    manifest = json.loads((golden / "manifest.json").read_text())
    assert manifest["op"] == "flash_attention_score" and manifest["seed"] == 11
    assert manifest["params"] == SMALL_FA["params"] and manifest["cann_attn_version"]
    roles = {e["name"]: e["role"] for e in manifest["tensors"]}
    assert roles == {
        "query": "input",
        "key": "input",
        "value": "input",
        "atten_mask": "input",
        "attention_out": "output",
        "softmax_max": "output",
        "softmax_sum": "output",
        # the naive references of the secondary precision rule (docs/semantics/precision.md)
        "attention_out.naive": "naive",
        "softmax_max.naive": "naive",
        "softmax_sum.naive": "naive",
    }
    for entry in manifest["tensors"]:
        npy = np.load(golden / entry["files"]["npy"])
        raw = (golden / entry["files"]["bin"]).read_bytes()
        assert list(npy.shape) == entry["shape"] and len(raw) == entry["bin_bytes"]
        if entry["dtype"] == "bfloat16":  # .bin: raw 16-bit patterns; .npy: the same values as float32
            assert "raw 16-bit pattern" in entry["bin_dtype"] and entry["npy_dtype"] == "float32"
            bits = torch.from_numpy(np.frombuffer(raw, dtype="<u2").astype(np.int16))
            assert torch.equal(bits.view(torch.bfloat16).float(), torch.from_numpy(npy).reshape(-1))
        else:
            assert np.array_equal(np.frombuffer(raw, dtype=npy.dtype.newbyteorder("<")), npy.reshape(-1))
    assert not [p for p in small_golden.iterdir() if p.name.startswith(".")], "temporary directories left"


def test_compare_golden_with_itself_and_with_the_operator(small_golden):
    golden, actual = small_golden / "golden", small_golden / "actual"
    proc = _run("compare", golden, golden)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: 3/3 tensors" in proc.stdout
    proc = _run("compare", actual, golden)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("attention_out", "softmax_max", "softmax_sum"):
        assert name in proc.stdout
    assert "PASS" in proc.stdout and "FAIL" not in proc.stdout


def test_compare_perturbed_output_fails_naming_the_metric(small_golden, tmp_path):
    perturbed = tmp_path / "perturbed"
    shutil.copytree(small_golden / "actual", perturbed)
    out = np.load(perturbed / "attention_out.npy")
    np.save(perturbed / "attention_out.npy", out * 1.05 + 0.01)  # bf16 values as float32, like the golden's
    proc = _run("compare", perturbed, small_golden / "golden")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL: 1 of 3 tensors fail" in proc.stdout
    assert "attention_out: Ascend rule:" in proc.stdout and "rel err > 0.004" in proc.stdout


def test_bad_case_file_subprocess_exit_2_one_line(tmp_path):
    case = write_case(tmp_path, {**SMALL_FA, "op": "no_such_op"})
    parent = tmp_path / "results"
    parent.mkdir()
    proc = _run("golden", "--case", case, "--out", parent / "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cann-attn: error:") and "op: unknown operator" in lines[0]
    assert list(parent.iterdir()) == []


# ------------------------------------------------------------------------------------------------------
# compare: files, .bin, strict, missing tensors (in-process)
# ------------------------------------------------------------------------------------------------------
def test_compare_files_npy_and_bin(small_golden, capsys):
    golden, actual = small_golden / "golden", small_golden / "actual"
    for a, g in (("npy", "npy"), ("bin", "npy"), ("bin", "bin"), ("npy", "bin")):
        rc, out, err = run_main(capsys, "compare", actual / f"attention_out.{a}", golden / f"attention_out.{g}")
        assert rc == 0, (a, g, out, err)
        assert "bfloat16" in out  # thresholds of the manifest's dtype, not of the float32 .npy carrier
    # The bf16 .bin read as fp16 is not the golden's dtype: it fails before any metric.
    rc, out, _ = run_main(capsys, "compare", actual / "attention_out.bin", golden / "attention_out.npy", "--dtype",
                          "fp16")
    assert rc == 1 and "dtype float16 != expected bfloat16" in out
    # Wrong size for the dtype: bad input.
    rc, _, err = run_main(capsys, "compare", actual / "attention_out.bin", golden / "attention_out.npy", "--dtype",
                          "fp32")
    assert rc == 2 and "bytes, expected" in err and len(err.strip().splitlines()) == 1


def test_compare_fails_an_actual_of_another_dtype(small_golden, tmp_path, capsys):
    """A lower-precision (or integer-truncated) actual is not measured against a golden rounded to its dtype: the
    dtypes must agree (torch_npu's assertRtolEqual fails on differing dtypes too)."""
    golden = small_golden / "golden" / "softmax_sum.npy"
    g = np.load(golden)
    np.save(tmp_path / "fp16.npy", g.astype(np.float16))
    rc, out, _ = run_main(capsys, "compare", tmp_path / "fp16.npy", golden)
    assert rc == 1 and "dtype float16 != expected float32" in out
    rc, out, _ = run_main(capsys, "compare", tmp_path / "fp16.npy", golden, "--json", tmp_path / "r.json")
    assert rc == 1 and not json.loads((tmp_path / "r.json").read_text())["passed"]
    np.save(tmp_path / "same.npy", g)
    assert run_main(capsys, "compare", tmp_path / "same.npy", golden)[0] == 0


def test_compare_fails_nan_and_inf_the_golden_lacks(small_golden, tmp_path, capsys):
    """One NaN (or inf) among thousands of elements is far below the rule's t * numel allowance, yet fails:
    docs/semantics/invalid-rows.md promises finite outputs and assertRtolEqual rejects mismatching NaN positions."""
    golden = small_golden / "golden" / "softmax_max.npy"
    g = np.load(golden)
    for bad in (np.nan, np.inf):
        a = g.copy()
        a.reshape(-1)[3] = bad
        np.save(tmp_path / "bad.npy", a)
        rc, out, _ = run_main(capsys, "compare", tmp_path / "bad.npy", golden, "--json", tmp_path / "r.json")
        assert rc == 1 and "1 NaN/inf values where the golden holds other values" in out, out
        text = (tmp_path / "r.json").read_text()
        report = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
        assert report["tensors"][0]["max_abs"] == "Infinity"  # strict JSON: no bare Infinity / NaN


def test_compare_mere_mare_undefined_without_golden_elements_above_the_cut(tmp_path, capsys):
    """MERE / MARE average over |golden| >= the cut: with no such element there is nothing to average (null, "-"),
    not a perfect 0."""
    np.save(tmp_path / "g.npy", np.zeros(64, dtype=np.float32))
    np.save(tmp_path / "a.npy", np.full(64, 1e-6, dtype=np.float32))
    rc, _, _ = run_main(capsys, "compare", tmp_path / "a.npy", tmp_path / "g.npy", "--json", tmp_path / "r.json")
    tensor = json.loads((tmp_path / "r.json").read_text())["tensors"][0]
    assert rc == 0 and tensor["mere"] is None and tensor["mare"] is None


def test_compare_dir_with_bin_only_actual_and_json(small_golden, tmp_path, capsys):
    actual = tmp_path / "bins"
    actual.mkdir()
    for name in ("attention_out", "softmax_max", "softmax_sum"):
        shutil.copy(small_golden / "actual" / f"{name}.bin", actual)
    report = tmp_path / "report.json"
    rc, out, _ = run_main(capsys, "compare", actual, small_golden / "golden", "--json", report)
    assert rc == 0, out
    data = json.loads(report.read_text())
    assert data["passed"] and [t["name"] for t in data["tensors"]] == ["attention_out", "softmax_max", "softmax_sum"]
    assert all(t["kind"] == "float" and t["ascend_pass"] for t in data["tensors"])


def test_compare_strict_gates_mere_mare_and_missing_tensor_fails(small_golden, tmp_path, capsys):
    golden = small_golden / "golden"
    actual = tmp_path / "actual"
    actual.mkdir()
    # 20 elements of the bf16 output 50% off: within the Ascend rule's allowance (4e-3 x 8192 = 32 elements),
    # far over the bf16 MARE limit (10 x 2^-7).
    out = np.load(golden / "attention_out.npy")
    flat = out.reshape(-1).copy()
    big = np.flatnonzero(np.abs(flat) > 0.1)[:20]
    flat[big] *= 1.5
    np.save(actual / "attention_out.npy", flat.reshape(out.shape))
    shutil.copy(golden / "softmax_sum.npy", actual)
    rc, out_text, _ = run_main(capsys, "compare", actual, golden)
    assert rc == 1 and "softmax_max: missing" in out_text
    shutil.copy(golden / "softmax_max.npy", actual)
    rc, out_text, _ = run_main(capsys, "compare", actual, golden)
    assert rc == 0, out_text
    assert "MERE/MARE over their limits for attention_out" in out_text
    rc, out_text, _ = run_main(capsys, "compare", actual, golden, "--strict")
    assert rc == 1 and "attention_out: MARE" in out_text and "Ascend rule:" not in out_text


def test_compare_missing_tensor_listed_in_actual_manifest_fails_with_exit_1(small_golden, tmp_path, capsys):
    """As without a manifest: a missing tensor is a row of the table and exit status 1, not bad usage."""
    actual = tmp_path / "actual"
    shutil.copytree(small_golden / "actual", actual)
    for suffix in ("npy", "bin"):
        (actual / f"softmax_max.{suffix}").unlink()
    report = tmp_path / "report.json"
    rc, out, err = run_main(capsys, "compare", actual, small_golden / "golden", "--json", report)
    assert rc == 1, out + err
    assert "FAIL: 1 of 3 tensors fail" in out and "softmax_max: missing: softmax_max.npy, softmax_max.bin" in out
    tensors = {t["name"]: t for t in json.loads(report.read_text())["tensors"]}
    assert not tensors["softmax_max"]["passed"] and tensors["attention_out"]["passed"]


def _rewrite_manifest(directory: Path, edit) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_compare_actual_manifest_is_the_source_of_truth(small_golden, tmp_path, capsys):
    golden = small_golden / "golden"
    both = tmp_path / "both"
    shutil.copytree(small_golden / "actual", both)
    good_bin = (both / "attention_out.bin").read_bytes()
    # A perturbed .bin next to an intact .npy, both listed: both are measured, the .bin fails.
    bits = np.frombuffer(good_bin, dtype="<u2").astype(np.int16).copy()
    values = torch.from_numpy(bits).view(torch.bfloat16) * 1.05 + 0.01
    values.view(torch.int16).numpy().astype("<u2").tofile(both / "attention_out.bin")
    rc, out, _ = run_main(capsys, "compare", both, golden)
    assert rc == 1 and "FAIL: 1 of 3 tensors fail" in out and "attention_out: Ascend rule:" in out, out
    assert "attention_out.npy and attention_out.bin (both listed in" in out
    assert "(attention_out.npy passes, attention_out.bin fails); the row is attention_out.bin's" in out
    # The manifest lists only the .bin files: a .npy next to them is ignored.
    _rewrite_manifest(both, lambda m: [e["files"].pop("npy") for e in m["tensors"]])
    rc, out, _ = run_main(capsys, "compare", both, golden)
    assert rc == 1 and "attention_out: Ascend rule:" in out and "differ" not in out, out
    (both / "attention_out.bin").write_bytes(good_bin)
    np.save(both / "softmax_sum.npy", np.zeros_like(np.load(golden / "softmax_sum.npy")))
    rc, out, _ = run_main(capsys, "compare", both, golden)
    assert rc == 0 and "PASS: 3/3 tensors" in out, out
    # A tensor the manifest does not list is missing, even if NAME.npy is there.
    _rewrite_manifest(both, lambda m: m.update(tensors=[e for e in m["tensors"] if e["name"] != "softmax_sum"]))
    rc, out, _ = run_main(capsys, "compare", both, golden)
    assert rc == 1 and "softmax_sum: missing:" in out and "does not list softmax_sum" in out, out


@pytest.mark.parametrize(
    "tensors,message",
    [
        ([1], "expected an object"),
        ([{"role": "output", "dtype": "float32", "files": {"npy": "x.npy"}}], "name: missing"),
        ([{"name": "x", "dtype": "float32", "shape": "abc", "files": {"npy": "x.npy"}}],
         'x: shape: expected a list of non-negative integers, got "abc"'),
        ([{"name": "x", "dtype": "float99", "shape": [1], "files": {"npy": "x.npy"}}], "x: dtype: missing or unknown"),
        ([{"name": "x", "dtype": "float32", "shape": [1], "files": ["x.npy"]}], "x: files: expected an object"),
        ([{"name": "x", "dtype": "float32", "files": {"bin": "x.bin"}}], "x: shape: missing (needed to read x.bin)"),
    ],
)
def test_malformed_manifest_is_a_usage_error(small_golden, tmp_path, capsys, tensors, message):
    bad = tmp_path / "bad"
    shutil.copytree(small_golden / "actual", bad)
    _rewrite_manifest(bad, lambda m: m.update(tensors=tensors))
    for args in (
        ["compare", bad, small_golden / "golden"],
        ["compare", small_golden / "golden", bad],
        ["compare", small_golden / "golden" / "attention_out.npy", bad / "attention_out.npy"],
        ["golden", "--case", write_case(tmp_path, _without(SMALL_FA, "inputs")), "--out", tmp_path / "o", "--inputs",
         bad],
    ):
        rc, out, err = run_main(capsys, *args)
        assert rc == 2, (args, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and f"manifest.json: tensors[0]: {message}" in lines[0], (args, err)


@pytest.mark.parametrize("target", ["/nonexistent/dir/report.json", "{tmp}", "/dev/null/report.json"])
def test_compare_unwritable_json_is_a_usage_error_before_comparing(small_golden, tmp_path, capsys, target):
    golden = small_golden / "golden"
    rc, out, err = run_main(capsys, "compare", golden, golden, "--json", target.format(tmp=tmp_path))
    assert rc == 2 and out == "", (out, err)  # before the table
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cann-attn: error: --json:"), err


@pytest.mark.parametrize(
    "args,message",
    [
        (["compare", "{golden}", "{golden}/attention_out.npy"], "both be files or both be directories"),
        (["compare", "{golden}/nope.npy", "{golden}/attention_out.npy"], "no such file or directory"),
        (["compare", "{golden}", "{golden}", "--dtype", "fp17"], "--dtype: unknown dtype"),
        (["compare", "{golden}", "{parent}"], "has no manifest.json"),
    ],
)
def test_compare_bad_usage_exit_2(small_golden, capsys, args, message):
    fmt = {"golden": small_golden / "golden", "parent": small_golden}
    rc, _, err = run_main(capsys, *(a.format(**fmt) for a in args))
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------------------------------
# golden: bad case files (in-process), nothing left behind, --inputs
# ------------------------------------------------------------------------------------------------------
def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def _with_input(name: str, spec: dict) -> dict:
    return {**SMALL_FA, "inputs": {**SMALL_FA["inputs"], name: spec}}


BAD_CASES = {
    "unknown_op": ({**SMALL_FA, "op": "flash_attn"}, "op: unknown operator 'flash_attn'"),
    "missing_op": (_without(SMALL_FA, "op"), "op: missing"),
    "missing_param": (
        {**SMALL_FA, "params": _without(SMALL_FA["params"], "head_num")},
        "params.head_num: missing (required by flash_attention_score)",
    ),
    "unknown_param": ({**SMALL_FA, "params": {**SMALL_FA["params"], "scale": 1.0}}, "params.scale: not a parameter"),
    "param_type": ({**SMALL_FA, "params": {**SMALL_FA["params"], "head_num": "4"}}, "params.head_num: expected an"),
    "missing_input": (
        {**SMALL_FA, "inputs": _without(SMALL_FA["inputs"], "value")},
        "inputs.value: missing (required by flash_attention_score)",
    ),
    "unknown_input": (_with_input("queries", {"shape": [1], "dtype": "fp16"}), "inputs.queries: not a tensor input"),
    "missing_shape": (_with_input("query", {"dtype": "bfloat16"}), "inputs.query.shape: missing"),
    "negative_shape": (
        _with_input("query", {"shape": [1, -64, 4, 32], "dtype": "bfloat16"}),
        "inputs.query.shape: expected a list of non-negative integers, got [1, -64, 4, 32]",
    ),
    "bad_dtype": (
        _with_input("query", {"shape": [1, 64, 4, 32], "dtype": "float17"}),
        'inputs.query.dtype: unknown dtype "float17"',
    ),
    "missing_dtype": (_with_input("query", {"shape": [1, 64, 4, 32]}), "inputs.query.dtype: missing"),
    "bad_generator": (
        _with_input("query", {"shape": [1, 64, 4, 32], "dtype": "bf16", "generator": "gauss"}),
        'inputs.query.generator: unknown generator "gauss"',
    ),
    "shape_rejected_by_op": (
        _with_input("key", {"shape": [1, 80, 2, 16], "dtype": "bfloat16"}),
        "cann_attn.flash_attention_score rejects this case: [161002] key",
    ),
    "unknown_field": ({**SMALL_FA, "parameters": {}}, "parameters: unknown field"),
    "seed_over_64_bits": ({**SMALL_FA, "seed": 2**70}, "seed: expected an integer in [0, 2**63 - 1], got 1180591"),
    "nan_scale_value": (  # the operator would take it and return NaN everywhere
        {**SMALL_FA, "params": {**SMALL_FA["params"], "scale_value": float("nan")}},
        "params.scale_value: expected a finite number, got NaN",
    ),
    "infinite_scale_value": (
        {**SMALL_FA, "params": {**SMALL_FA["params"], "scale_value": float("-inf")}},
        "params.scale_value: expected a finite number, got -Infinity",
    ),
    "infinite_generator_option": (
        _with_input("query", {"shape": [1, 64, 4, 32], "dtype": "bf16", "std": float("inf")}),
        "inputs.query.std: expected a finite number, got Infinity",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_bad_case_file_exit_2_one_line_naming_the_field(name, tmp_path, capsys):
    case, message = BAD_CASES[name]
    path = write_case(tmp_path, case)
    parent = tmp_path / "results"
    parent.mkdir()
    rc, out, err = run_main(capsys, "golden", "--case", path, "--out", parent / "out")
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cann-attn: error:") and message in lines[0], err
    assert list(parent.iterdir()) == [], "nothing may be written for a bad case"


def test_invalid_json_and_missing_file(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text('{"op": "flash_attention_score",')
    rc, _, err = run_main(capsys, "golden", "--case", path, "--out", tmp_path / "out")
    assert rc == 2 and "not valid JSON" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run_main(capsys, "golden", "--case", tmp_path / "none.json", "--out", tmp_path / "out")
    assert rc == 2 and "--case: cannot read" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.json"]


def test_binary_case_file_is_a_usage_error(small_golden, tmp_path, capsys):
    rc, _, err = run_main(capsys, "golden", "--case", small_golden / "golden" / "query.npy", "--out", tmp_path / "out")
    assert rc == 2 and "not a JSON case file (not UTF-8 text)" in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", ["--out", "--actual"])
@pytest.mark.parametrize("target", ["/dev/null/x", "/proc/cann-attn-no-such-dir", "{file}/sub"])
def test_unwritable_output_is_a_usage_error_before_any_work(tmp_path, capsys, monkeypatch, option, target):
    if target.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("no /proc")
    (tmp_path / "file").write_text("x")
    target = target.format(file=tmp_path / "file")

    def no_work(*args, **kwargs):
        raise AssertionError("the case was loaded before the output paths were checked")

    monkeypatch.setattr("cann_attn.cli.golden.load_case", no_work)
    args = ["--out", target] if option == "--out" else ["--out", tmp_path / "golden", "--actual", target]
    rc, out, err = run_main(capsys, "golden", "--case", write_case(tmp_path, SMALL_FA), *args)
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cann-attn: error: {option}: cannot write"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case.json", "file"]


def test_staged_open_failure_is_a_usage_error():
    staged = tensorio.Staged(Path("/dev/null/x"))
    with pytest.raises(tensorio.UsageError, match="--out: cannot create /dev/null/x"):
        staged.open()


def test_failure_while_writing_leaves_nothing(tmp_path, capsys, monkeypatch):
    path = write_case(tmp_path, SMALL_FA)
    parent = tmp_path / "results"
    parent.mkdir()
    calls = []

    def failing_write(directory, name, t, role, **extra):
        calls.append(name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_write(directory, name, t, role, **extra)

    real_write = tensorio.write_tensor
    monkeypatch.setattr("cann_attn.cli.golden.write_tensor", failing_write)
    with pytest.raises(OSError):
        cli_main.main(["golden", "--case", str(path), "--out", str(parent / "out"), "--actual", str(parent / "act")])
    assert len(calls) == 3 and list(parent.iterdir()) == []


def test_existing_out_needs_force(small_golden, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    path = write_case(tmp_path, SMALL_FA)
    rc, _, err = run_main(capsys, "golden", "--case", path, "--out", out)
    assert rc == 2 and "--force" in err and (out / "keep.txt").exists()
    rc, _, err = run_main(capsys, "golden", "--case", path, "--out", out, "--force")
    assert rc == 0, err
    assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()
    # Same case, same seed: the same bytes as the subprocess run.
    for name in ("query.bin", "attention_out.bin"):
        assert (out / name).read_bytes() == (small_golden / "golden" / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case.json", "out"]


def test_inputs_from_golden_dir_and_npy_files(small_golden, tmp_path, capsys):
    golden = small_golden / "golden"
    params_only = write_case(tmp_path, _without(SMALL_FA, "inputs", "seed"))
    rc, _, err = run_main(capsys, "golden", "--case", params_only, "--out", tmp_path / "a", "--inputs", golden)
    assert rc == 0, err
    names = ("query", "key", "value", "atten_mask")
    files = [golden / f"{n}.npy" for n in names[:2]] + [f"value={golden / 'value.npy'}", golden / "atten_mask.npy"]
    rc, _, err = run_main(capsys, "golden", "--case", params_only, "--out", tmp_path / "b", "--inputs", *files)
    assert rc == 0, err
    for d in ("a", "b"):
        manifest = json.loads((tmp_path / d / "manifest.json").read_text())
        assert all("loaded from" in e["source"] for e in manifest["tensors"] if e["role"] == "input")
        for name in ("attention_out", "softmax_max", "softmax_sum"):
            assert (tmp_path / d / f"{name}.bin").read_bytes() == (golden / f"{name}.bin").read_bytes()
    # One tensor replaced: the others are still those of the seeded case (the replaced one is drawn all the same).
    full = write_case(tmp_path, SMALL_FA, "full.json")
    rc, _, err = run_main(capsys, "golden", "--case", full, "--out", tmp_path / "c", "--inputs", golden / "query.npy")
    assert rc == 0, err
    for name in ("key.bin", "value.bin", "attention_out.bin"):
        assert (tmp_path / "c" / name).read_bytes() == (golden / name).read_bytes()
    rc, _, err = run_main(capsys, "golden", "--case", params_only, "--out", tmp_path / "d", "--inputs",
                          golden / "qq.npy")
    assert rc == 2 and "no such file" in err


# ------------------------------------------------------------------------------------------------------
# Every example case file: golden, the operator's outputs, compare (in-process)
# ------------------------------------------------------------------------------------------------------
def test_examples_cover_every_operator():
    """examples/cases/ holds a case for every operator `cann-attn golden` supports (docs/guides/golden.md)."""
    ops = {json.loads(p.read_text())["op"] for p in EXAMPLES}
    missing = set(registry.OPERATORS) - ops
    assert not missing, f"operators without an example case file in examples/cases/: {sorted(missing)}"
    assert ops <= set(registry.OPERATORS)
    int8 = [json.loads(p.read_text()) for p in EXAMPLES if "int8" in p.name]
    assert int8 and int8[0]["inputs"]["query"]["dtype"] == "int8"


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_round_trip(example, tmp_path, capsys):
    golden, actual = tmp_path / "golden", tmp_path / "actual"
    rc, out, err = run_main(capsys, "golden", "--case", example, "--out", golden, "--actual", actual)
    assert rc == 0, out + err
    manifest = tensorio.read_manifest(golden)
    outputs = [e["name"] for e in manifest["tensors"] if e["role"] == "output"]
    assert outputs and manifest["op"] == json.loads(example.read_text())["op"]
    rc, out, err = run_main(capsys, "compare", actual, golden)
    assert rc == 0, out + err
    assert f"PASS: {len(outputs)}/{len(outputs)} tensors" in out


# ------------------------------------------------------------------------------------------------------
# Sizes checked before allocation (casefile.MAX_GENERATED_BYTES, --max-bytes)
# ------------------------------------------------------------------------------------------------------
def _no_allocation(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was drawn before the sizes were checked")

    for name in ("randn", "rand", "randint", "randperm"):
        monkeypatch.setattr(torch, name, refuse)


HUGE_CASES = {  # (case, options, message)
    "huge_key": (
        _with_input("key", {"shape": [64, 2**20, 64, 128], "dtype": "bfloat16"}),
        (),
        "inputs.key.shape: [64, 1048576, 64, 128] is 549755813888 elements, 4398046511104 bytes as drawn (with "
        "65536 bytes of other inputs); the generated inputs may total 4294967296 bytes (--max-bytes)",
    ),
    "over_int64_elements": (
        _with_input("query", {"shape": [2**40, 2**40, 1, 32], "dtype": "bfloat16"}),
        (),
        "inputs.query.shape: [1099511627776, 1099511627776, 1, 32] is 38685626227668133590597632 elements",
    ),
    "total_over_max_bytes": (SMALL_FA, ("--max-bytes", "100000"), "inputs.key.shape: [1, 80, 2, 32] is 5120 elements"),
    "drop_mask_over_max_bytes": (
        {**_with_input("drop_mask", {"generator": "drop_mask"}),
         "params": {**SMALL_FA["params"], "keep_prob": 0.9}},
        ("--max-bytes", "200000"),
        "inputs.drop_mask: the dropout mask is 20480 elements, 163840 bytes as drawn (with 147456 bytes of other",
    ),
}


@pytest.mark.parametrize("name", list(HUGE_CASES))
def test_generated_sizes_checked_before_allocation_exit_2_naming_the_input(name, tmp_path, capsys, monkeypatch):
    case, options, message = HUGE_CASES[name]
    path = write_case(tmp_path, case)
    if name != "drop_mask_over_max_bytes":  # the drop mask's size follows the drawn query and key
        _no_allocation(monkeypatch)
    rc, out, err = run_main(capsys, "golden", "--case", path, "--out", tmp_path / "out", *options)
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cann-attn: error:") and message in lines[0], err
    assert not (tmp_path / "out").exists()


def test_max_bytes_must_be_a_positive_integer(tmp_path, capsys):
    rc, out, err = run_main(capsys, "golden", "--case", write_case(tmp_path, SMALL_FA), "--out", tmp_path / "out",
                         "--max-bytes", "0")
    assert rc == 2 and "--max-bytes" in err and "expected a positive integer, got '0'" in err, (out, err)


def test_repeat_last_draws_one_value_per_row(tmp_path):
    """repeat_last: the 8 lanes of a softmax statistic hold one value (ring_attention_update refuses differing
    lanes); the option takes true or false only."""
    path = tmp_path / "case.json"
    stat = {"shape": [1, 2, 4, 8], "dtype": "float32", "repeat_last": True}
    path.write_text(json.dumps({"op": "ring_attention_update", "seed": 3, "inputs": {"prev_softmax_max": stat},
                                "params": {}}))
    spec = casefile.load_case(path).tensors["prev_softmax_max"]
    drawn = casefile._generate(spec, torch.Generator().manual_seed(0), {}, {}, "ring_attention_update")
    assert drawn.shape == (1, 2, 4, 8) and torch.equal(drawn, drawn[..., :1].expand_as(drawn))
    assert drawn[..., 0].unique().numel() == 8
    path.write_text(json.dumps({"op": "ring_attention_update", "inputs": {"prev_softmax_max": {
        **stat, "repeat_last": 1}}, "params": {}}))
    with pytest.raises(casefile.CaseError, match=r"inputs.prev_softmax_max.repeat_last: expected true or false"):
        casefile.load_case(path)


def test_kv_quant_rows_are_the_documented_combined_rows():
    """kv_quant_rows: int8 latent, the rope in the query's dtype and four fp32 scales, as bytes of one row."""
    spec = casefile.TensorSpec("key", "kv_quant_rows", torch.int8, (2, 3, 1, 656), {})
    query = torch.zeros(1, dtype=torch.bfloat16)
    rows = casefile._generate(spec, torch.Generator().manual_seed(0), {"query": query}, {}, "")
    assert rows.dtype == torch.int8 and rows.shape == (2, 3, 1, 656)
    scales = rows[..., 640:].contiguous().view(torch.uint8).view(torch.float32)
    rope = rows[..., 512:640].contiguous().view(torch.uint8).view(torch.bfloat16)
    assert scales.shape[-1] == 4 and bool(((scales > 0) & (scales < 1 / 64)).all()) and rope.isfinite().all()
    bad = casefile.TensorSpec("key", "kv_quant_rows", torch.int8, (2, 3, 1, 576), {})
    with pytest.raises(casefile.CaseError, match=r"kv_quant_rows gives int8 or float8_e4m3fn rows \[..., 656\]"):
        casefile._generate(bad, torch.Generator(), {"query": query}, {}, "")
