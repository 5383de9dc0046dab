"""The built wheel is complete: built from a copy of the project (nothing written into the source tree), without
network (``--no-build-isolation``), installed into a temporary target, it runs an operator from outside the source
tree, compiling the native C loops it carries (docs/guides/backends.md, "Installing")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cann_attn.backends.reference import native
from patience import HANG_SECONDS

ROOT = Path(__file__).resolve().parents[1]

USE_INSTALLED = """
import cann_attn, torch
from cann_attn.backends.reference import native
assert cann_attn.__file__.startswith(TARGET), cann_attn.__file__
assert native.SOURCE.is_file() and native.library() is not None, "the native loops did not build from the wheel"
assert native.library_path().is_file() and str(native.library_path()).startswith(CACHE)
q = torch.randn(1, 2, 16, 32)
out = cann_attn.flash_attention(q, q, q, 2, "BNSD", scale_value=0.5)
reference = torch.softmax(q @ q.transpose(-1, -2) * 0.5, -1) @ q
assert torch.allclose(out, reference, atol=1e-5), (out - reference).abs().max()
print("ok", native.library_path().name)
"""


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_SECONDS, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.skipif(native.library() is None, reason="needs a C compiler for the native loops")
def test_wheel_carries_the_c_source_and_builds_it_outside_the_source_tree(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
          "--wheel-dir", str(tmp_path / "dist"), str(project)])
    wheel = next((tmp_path / "dist").glob("cann_attn-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.rsplit("/", 1)[1] for n in names if n.startswith("cann_attn/backends/reference/native/")}
    assert {p.name for p in native.sources()} <= shipped, "a C source the library includes is not in the wheel"
    assert not [n for n in names if n.endswith((".so", ".pyc"))]
    assert any(n.endswith("entry_points.txt") for n in names)

    target, cache, elsewhere = tmp_path / "site", tmp_path / "cache", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target", str(target),
          str(wheel)])
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), CANN_ATTN_CACHE_DIR=str(cache), CANN_ATTN_NATIVE="1")
    script = f"TARGET, CACHE = {str(target)!r}, {str(cache)!r}\n" + USE_INSTALLED
    result = _run([sys.executable, "-c", script], cwd=elsewhere, env=env)
    assert result.stdout.split()[0] == "ok"
