"""The ``cann-attn`` command line, run as a subprocess (the installed console script when present)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "cann-attn"
    if script.exists():
        return [str(script)]
    found = shutil.which("cann-attn")
    return [found] if found else [sys.executable, "-m", "cann_attn.cli.main"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*_cli(), *args], capture_output=True, text=True, timeout=timeout)


def test_help():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "verify" in proc.stdout and "bench" in proc.stdout


@pytest.mark.parametrize(
    "args", [["no-such-command"], [], ["verify", "--op", "no_such_op"], ["verify", "--bogus"]]
)
def test_bad_usage_exits_2_with_one_line(args):
    proc = _run(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cann-attn: error:"), proc.stderr


def test_verify_quick_flash_attention_score():
    proc = _run("verify", "--quick", "--op", "flash_attention_score", timeout=60)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "flash_attention_score" in proc.stdout and "OK" in proc.stdout


def test_verify_names_the_backend_of_each_case():
    proc = _run("verify", "--quick", "--op", "flash_attention_score", "--case", "gqa", "--backend", "reference")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "backend reference" in proc.stdout and "│ reference" in proc.stdout


def test_verify_list():
    proc = _run("verify", "--list")
    assert proc.returncode == 0, proc.stderr
    assert "doc_example" in proc.stdout
