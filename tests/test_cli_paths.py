"""Every path ``cann-attn golden`` / ``compare`` builds stays in its directory and reads only regular files of a
bounded size; ``--out`` given as a symbolic link is written through to its target; a loaded input becomes the
case's dtype only when no value changes (docs/guides/golden.md, "Paths and files" and "Loaded inputs")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cann_attn.cli import main as cli_main
from cann_attn.cli import tensorio
from cli_utils import SMALL_FP16_FA as FA
from cli_utils import refused, run_main, write_case
from patience import HANG_SECONDS

# sparse_indices is an int32 input: index 37 of 64 keys, given as values or loaded from a file.
SFA = {
    "op": "sparse_flash_attention",
    "seed": 1,
    "inputs": {"query": {"shape": [1, 4, 2, 16], "dtype": "float16"},
               "key": {"shape": [1, 64, 1, 16], "dtype": "float16"},
               "value": {"shape": [1, 64, 1, 16], "dtype": "float16"},
               "sparse_indices": {"generator": "values", "dtype": "int32",
                                  "values": [[[[37, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]]}},
    "params": {"scale_value": 0.25, "layout": "BSND", "sparse_mode": 0, "sparse_block_size": 1},
}


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("g")
    assert cli_main.main(["golden", "--case", str(write_case(tmp, FA)), "--out", str(tmp / "golden")]) == 0
    return tmp / "golden"


# ------------------------------------------------------------------------------------------------------
# compare: the names of the golden's manifest
# ------------------------------------------------------------------------------------------------------
def _golden_naming(golden: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the golden whose attention_out entry is renamed `name`."""
    copy = tmp_path / "golden"
    copy.mkdir()
    for p in golden.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    manifest = json.loads((copy / "manifest.json").read_text())
    for entry in manifest["tensors"]:
        if entry["name"] == "attention_out":
            entry["name"] = name
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("name", ["../golden/attention_out", "{golden}/attention_out", "a/b", "..", "a\\b"])
def test_compare_refuses_a_tensor_name_that_is_not_a_file_name(golden, tmp_path, capsys, name):
    """Before: ACTUAL / NAME.npy was read wherever NAME led; with an empty ACTUAL, `../golden/attention_out`
    compared the golden with itself and passed (exit 0)."""
    copy = _golden_naming(golden, tmp_path, name.format(golden=tmp_path / "golden"))
    actual = tmp_path / "actual"
    actual.mkdir()
    refused(capsys, "compare", actual, copy, match="is not a file name")


def test_inputs_directory_refuses_a_symlink_leading_out(golden, tmp_path, capsys):
    """The NAME.npy files of an --inputs directory without manifest stay in that directory."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "query.npy").symlink_to(golden / "query.npy")
    params_only = write_case(tmp_path, {k: v for k, v in FA.items() if k != "inputs"})
    refused(capsys, "golden", "--case", params_only, "--out", tmp_path / "o", "--inputs", inputs,
            match="leads outside")
    assert not (tmp_path / "o").exists()


def test_compare_without_manifest_refuses_a_symlink_leading_out(golden, tmp_path, capsys):
    actual = tmp_path / "actual"
    actual.mkdir()
    for name in ("attention_out", "softmax_max", "softmax_sum"):
        (actual / f"{name}.npy").symlink_to(golden / f"{name}.npy")
    refused(capsys, "compare", actual, golden, match="leads outside")


# ------------------------------------------------------------------------------------------------------
# Only regular files, of a bounded size
# ------------------------------------------------------------------------------------------------------
def _subprocess_cli(*args) -> subprocess.CompletedProcess:
    """A call that must return at once: in a subprocess, so that a regression (reading /dev/zero forever) fails the
    test instead of hanging the run (the limit only catches a hang, tests/patience.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "cann_attn.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=HANG_SECONDS, env=env)


@pytest.mark.skipif(not Path("/dev/zero").exists() or not hasattr(os, "mkfifo"), reason="no /dev/zero or FIFOs")
def test_case_file_must_be_a_regular_file(tmp_path):
    """Before: --case /dev/zero never returned and grew without bound; a FIFO blocked forever."""
    fifo = tmp_path / "case.fifo"
    os.mkfifo(fifo)
    for case in ("/dev/zero", fifo):
        proc = _subprocess_cli("golden", "--case", case, "--out", tmp_path / "out")
        assert proc.returncode == 2 and "not a regular file" in proc.stderr, proc.stderr
        assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_tensor_files_must_be_regular_files(golden, tmp_path, capsys):
    fifo = tmp_path / "query.npy"
    os.mkfifo(fifo)
    case = write_case(tmp_path, FA)
    refused(capsys, "golden", "--case", case, "--out", tmp_path / "o", "--inputs", f"query={fifo}",
             match="not a regular file")
    # a .npy that is a link to a device
    dev = tmp_path / "dev.npy"
    dev.symlink_to("/dev/zero")
    refused(capsys, "compare", dev, golden / "attention_out.npy", match="not a regular file")


def test_files_larger_than_the_bound_are_refused_before_reading(golden, tmp_path, capsys, monkeypatch):
    case = write_case(tmp_path, FA)
    monkeypatch.setattr(tensorio, "MAX_JSON_BYTES", 64)
    refused(capsys, "golden", "--case", case, "--out", tmp_path / "o", match="bytes, more than")
    monkeypatch.undo()
    # an --inputs file larger than --max-bytes (alone, and from a golden directory)
    params_only = write_case(tmp_path, {k: v for k, v in FA.items() if k != "inputs"}, "params.json")
    for inputs in ([golden / "query.npy", golden / "key.npy", golden / "value.npy"], [golden]):
        refused(capsys, "golden", "--case", params_only, "--out", tmp_path / "o", "--max-bytes", "1000",
                 "--inputs", *inputs, match="bytes, more than")
    assert run_main(capsys, "golden", "--case", params_only, "--out", tmp_path / "o", "--inputs", golden)[0] == 0


# ------------------------------------------------------------------------------------------------------
# --out as a symbolic link
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("existing", [False, True])
def test_out_symlink_is_written_through_to_its_target(tmp_path, capsys, existing):
    """Before: the link was renamed to .NAME.PID.old, left behind, and a directory put in its place."""
    target = tmp_path / "real"
    if existing:
        target.mkdir()
        (target / "stale").write_text("x")
    link = tmp_path / "out"
    link.symlink_to(target)
    case = write_case(tmp_path, FA)
    args = ["golden", "--case", case, "--out", link] + (["--force"] if existing else [])
    rc, _, err = run_main(capsys, *args)
    assert rc == 0, err
    assert link.is_symlink() and (target / "manifest.json").is_file() and not (target / "stale").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case.json", "out", "real"]
    # --actual alike
    (tmp_path / "actual").symlink_to(tmp_path / "real_actual")
    rc, _, err = run_main(capsys, "golden", "--case", case, "--out", tmp_path / "g2", "--actual", tmp_path / "actual")
    assert rc == 0, err
    assert (tmp_path / "actual").is_symlink() and (tmp_path / "real_actual" / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actual", "case.json", "g2", "out", "real", "real_actual"]


# ------------------------------------------------------------------------------------------------------
# Loaded inputs and case values: no silent conversion
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case,name,array,dtypes",
    [
        (SFA, "sparse_indices", np.array([[[[4294967333, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]], np.int64),
         "int64 to int32"),
        (SFA, "sparse_indices", np.array([[[[37.7, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]], np.float32),
         "float32 to int32"),
        (FA, "query", np.full((1, 16, 2, 16), 1e6, np.float64), "float64 to float16"),
    ],
)
def test_lossy_input_conversion_is_refused(tmp_path, capsys, case, name, array, dtypes):
    """Before: int64 4294967333 became int32 37, float32 37.7 became 37 and float64 1e6 became fp16 inf (an all-NaN
    golden), exit 0."""
    path = tmp_path / f"{name}.npy"
    np.save(path, array)
    err = refused(capsys, "golden", "--case", write_case(tmp_path, case), "--out", tmp_path / "o", "--inputs", path,
                   match=dtypes)
    assert str(path) in err and "not exactly" in err
    assert not (tmp_path / "o").exists()


def test_lossless_input_conversion_is_taken(tmp_path, capsys):
    """int64 (NumPy's default integers) holding int32 values, float64 holding fp16 values: converted."""
    np.save(tmp_path / "sparse_indices.npy", np.array([[[[37, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]], np.int64))
    np.save(tmp_path / "query.npy", np.full((1, 4, 2, 16), 0.5, np.float64))
    rc, _, err = run_main(capsys, "golden", "--case", write_case(tmp_path, SFA), "--out", tmp_path / "o", "--inputs",
                       tmp_path / "sparse_indices.npy", tmp_path / "query.npy")
    assert rc == 0, err
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    dtypes = {e["name"]: e["dtype"] for e in manifest["tensors"]}
    assert dtypes["sparse_indices"] == "int32" and dtypes["query"] == "float16"
    assert np.load(tmp_path / "o" / "sparse_indices.npy")[0, 0, 0, 0] == 37


@pytest.mark.parametrize("values,dtype,message", [
    (37.9, "int32", "37.9"),
    (2**31, "int32", "2147483648"),
    (70000, "float16", "70000"),
    (2, "bool", "2"),
])
def test_case_values_must_be_exactly_representable(tmp_path, capsys, values, dtype, message):
    """Before: values 37.9 for an int32 input became 37, 70000 for float16 became inf."""
    case = json.loads(json.dumps(SFA))
    spec = case["inputs"]["sparse_indices"]
    spec["values"][0][0][0][0] = values
    spec["dtype"] = dtype
    err = refused(capsys, "golden", "--case", write_case(tmp_path, case), "--out", tmp_path / "o",
                   match="inputs.sparse_indices.values")
    assert message in err and dtype in err


def test_exact_conversion_rule():
    import torch

    from cann_attn.cli import casefile

    # case values: integers exact, floats rounded to the nearest as a decimal literal means, but never to inf
    assert casefile.values_tensor([[1, 2**62]]).dtype == torch.int64
    assert casefile._values_problem(casefile.values_tensor([0.1, 1e-9]), torch.float16) == ""
    assert "inf" in casefile._values_problem(casefile.values_tensor([1, 1e39]), torch.float32)
    with pytest.raises(ValueError):
        casefile.values_tensor([0.5, 2**60 + 1])

    convert = tensorio.exact_conversion_problem
    assert convert(torch.tensor([1.5, float("nan"), -0.0]), torch.bfloat16) == ""
    assert convert(torch.tensor([2**24 + 1], dtype=torch.int64), torch.float32) != ""
    assert convert(torch.tensor([float("inf")], dtype=torch.float64), torch.float16) == ""
    assert convert(torch.tensor([1.0, 0.0]), torch.bool) == ""
    assert convert(torch.tensor([0.5]), torch.bool) != ""
