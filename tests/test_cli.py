"""The ``cann-attn`` command line, run as a subprocess (the installed console script when present)."""

from __future__ import annotations

import os
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


def _fake_benchmarks(tmp_path: Path) -> dict[str, str]:
    """A benchmarks folder with a CPU suite that succeeds and a GPU-only suite that fails without CUDA."""
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "bench_cpu_case.py").write_text("print('cpu suite ran')\n")
    (folder / "bench_gpu_case.py").write_text("import sys\nprint('gpu suite ran')\nsys.exit(2)\n")
    return {**os.environ, "CANN_ATTN_BENCHMARKS": str(folder)}


def test_bench_all_skips_gpu_only_suites_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU suites run")
    env = _fake_benchmarks(tmp_path)
    proc = subprocess.run([*_cli(), "bench"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cpu suite ran" in proc.stdout and "gpu suite ran" not in proc.stdout
    assert "skipped (no CUDA device" in proc.stdout and "gpu_case" in proc.stdout


def test_bench_named_suite_reports_its_failure(tmp_path):
    env = _fake_benchmarks(tmp_path)
    proc = subprocess.run([*_cli(), "bench", "--suite", "gpu_case"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gpu suite ran" in proc.stdout and "exit status 2" in proc.stderr
