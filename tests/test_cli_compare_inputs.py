"""``cann-attn compare`` / ``golden`` on hostile or malformed input: a manifest names only files of its own
directory (no ``..``, no absolute path, no symbolic link leading out), and every malformed file is a one-line error
with exit status 2, checked before anything is allocated (an empty ``.npy``, a ``.npy`` header claiming more data
than the file holds, JSON nested deeply enough to exhaust the parser's stack)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cann_attn.cli import main as cli_main
from cann_attn.cli import tensorio
from cli_utils import SMALL_FP16_FA as CASE
from cli_utils import refused, run_main


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("g")
    case = tmp / "case.json"
    case.write_text(json.dumps(CASE))
    assert cli_main.main(["golden", "--case", str(case), "--out", str(tmp / "golden"), "--actual",
                          str(tmp / "actual")]) == 0
    return tmp


def _manifest_pointing(tmp_path: Path, golden: Path, rewrite) -> Path:
    """An ACTUAL directory holding only a manifest whose file names are rewritten."""
    manifest = json.loads((golden / "actual" / "manifest.json").read_text())
    for entry in manifest["tensors"]:
        entry["files"] = {kind: rewrite(name) for kind, name in entry["files"].items()}
    actual = tmp_path / "actual"
    actual.mkdir()
    (actual / "manifest.json").write_text(json.dumps(manifest))
    return actual


def test_manifest_entries_cannot_climb_out(golden, tmp_path, capsys):
    """Before: a manifest naming ../golden/FILE passed every tensor with zero error."""
    actual = _manifest_pointing(tmp_path, golden, lambda name: f"../../{golden.name}/golden/{name}")
    refused(capsys, "compare", actual, golden / "golden", match="is not a name inside the manifest's directory")


def test_manifest_entries_cannot_be_absolute(golden, tmp_path, capsys):
    actual = _manifest_pointing(tmp_path, golden, lambda name: str(golden / "golden" / name))
    refused(capsys, "compare", actual, golden / "golden", match="is not a name inside the manifest's directory")


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links")
def test_symlinks_leading_out_are_refused(golden, tmp_path, capsys):
    actual = tmp_path / "linked"
    actual.mkdir()
    (actual / "manifest.json").write_text((golden / "actual" / "manifest.json").read_text())
    for name in ("attention_out", "softmax_max", "softmax_sum"):
        for ext in ("npy", "bin"):
            (actual / f"{name}.{ext}").symlink_to(golden / "golden" / f"{name}.{ext}")
    refused(capsys, "compare", actual, golden / "golden", match="leads outside")
    manifest_only = tmp_path / "manifest_link"
    manifest_only.mkdir()
    (manifest_only / "manifest.json").symlink_to(golden / "actual" / "manifest.json")
    refused(capsys, "compare", manifest_only, golden / "golden", match="leads outside")
    # a link inside the directory is fine
    inner = tmp_path / "inner"
    inner.mkdir()
    for p in (golden / "actual").iterdir():
        (inner / f"real_{p.name}").write_bytes(p.read_bytes())
        (inner / p.name).symlink_to(inner / f"real_{p.name}")
    assert run_main(capsys, "compare", inner, golden / "golden")[0] == 0


def _only(golden: Path, tmp_path: Path, npy_bytes: bytes) -> Path:
    """An ACTUAL directory without manifest: attention_out.npy replaced by `npy_bytes`, the rest copied."""
    actual = tmp_path / "bare"
    actual.mkdir()
    for name in ("softmax_max", "softmax_sum"):
        (actual / f"{name}.npy").write_bytes((golden / "actual" / f"{name}.npy").read_bytes())
    (actual / "attention_out.npy").write_bytes(npy_bytes)
    return actual


def _npy_with_shape(shape: tuple[int, ...], data: bytes) -> bytes:
    header = {"descr": "<f2", "fortran_order": False, "shape": shape}
    text = repr(header).encode()
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data


def test_empty_npy(golden, tmp_path, capsys):
    refused(capsys, "compare", _only(golden, tmp_path, b""), golden / "golden", match="not a readable .npy file")


def test_npy_header_claiming_a_huge_shape_is_refused_before_allocation(golden, tmp_path, capsys):
    bogus = _npy_with_shape((2**40, 2**20), b"\x00" * 64)
    refused(capsys, "compare", _only(golden, tmp_path, bogus), golden / "golden", match="the header says")


def test_truncated_npy(golden, tmp_path, capsys):
    full = np.lib.format.header_data_from_array_1_0(np.zeros((1, 16, 2, 16), np.float16))
    bogus = _npy_with_shape(full["shape"], b"\x00" * 100)
    refused(capsys, "compare", _only(golden, tmp_path, bogus), golden / "golden", match="the file holds 100 bytes")


def test_deeply_nested_json(golden, tmp_path, capsys):
    deep = "[" * 100_000 + "]" * 100_000
    case = tmp_path / "case.json"
    case.write_text(deep)
    refused(capsys, "golden", "--case", case, "--out", tmp_path / "out", match="nested deeper than")
    actual = tmp_path / "actual"
    actual.mkdir()
    (actual / "manifest.json").write_text(deep)
    refused(capsys, "compare", actual, golden / "golden", match="nested deeper than")
    # brackets inside strings do not count
    assert tensorio.load_json('{"a": "' + "[" * 200 + '\\"["}') == {"a": "[" * 200 + '"['}
