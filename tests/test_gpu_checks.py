"""What of benchmarks/gpu_checks.sh can be checked without a GPU: its plan (--dry-run: the benchmarks before the
tests, within ten minutes), the first-config autotune switch it sets, and the sm_90 Triton cache it can use when one
is copied to the GPU machine (benchmarks/triton_cache.py): built here, a second build finds every kernel in it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from patience import HANG_SECONDS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})})


def test_script_parses_and_its_plan_puts_the_figures_first_within_the_command_limit():
    assert _run(["bash", "-n", str(SCRIPT)]).returncode == 0
    plan = _run(["bash", str(SCRIPT), "--dry-run"], env={"OUT": "/nonexistent/never-written"})
    assert plan.returncode == 0, plan.stderr
    steps = re.findall(r"^\s*(\d+):(\d+)-\s*(\d+):(\d+)\s+(\S+)\s+(\d+)s", plan.stdout, re.M)
    names = [s[4] for s in steps]
    assert names == ["gpu_info", "bench_gpu_dense", "bench_gpu_dsa", "gpu_tests", "gpu_context_parallel"]
    ends = {s[4]: int(s[2]) * 60 + int(s[3]) for s in steps}
    assert ends["bench_gpu_dsa"] <= 6 * 60  # both figures within 6 minutes of the script's start
    assert sum(int(s[5]) for s in steps) <= 600
    assert "CANN_ATTN_TRITON_AUTOTUNE=first" in plan.stdout
    # A budget pushed over the whole run's ten minutes is refused.
    over = _run(["bash", str(SCRIPT), "--dry-run"], env={"TESTS_SECONDS": "500"})
    assert over.returncode == 1 and "over the 10-minute limit of the whole run" in over.stderr


def test_plan_runs_every_gpu_test_file():
    """Each tests/test_gpu_*.py with GPU tests is named in one of the plan's steps, so none is left out of a run
    (this file, whose tests need no GPU, aside)."""
    plan = _run(["bash", str(SCRIPT), "--dry-run"], env={"OUT": "/nonexistent/never-written"}).stdout
    named = set(re.findall(r"tests/(test_gpu_\w+\.py)", plan))
    files = {path.name for path in (ROOT / "tests").glob("test_gpu_*.py")} - {Path(__file__).name}
    assert files - named == set(), f"GPU test files missing from {SCRIPT.name}"


@pytest.mark.parametrize(("switch", "expected"), [("first", 1), ("all", None)])
def test_first_config_switch_trims_every_autotuner(switch: str, expected: int | None):
    pytest.importorskip("triton")
    code = ("from cann_attn.backends.triton import sparse_attention as s, jit, dense_backward as b;"
            "print(len(s._sfa_fwd_tuned.configs), len(s._sfa_bwd_atomic_tuned.configs),"
            " len(jit.tuning_configs(b._configs('BLOCK_N', 'BLOCK_M'))))")
    got = _run([sys.executable, "-c", code], env={"CANN_ATTN_TRITON_AUTOTUNE": switch}, timeout=HANG_SECONDS)
    assert got.returncode == 0, got.stderr
    counts = [int(x) for x in got.stdout.split()]
    assert counts == [1, 1, 1] if expected == 1 else min(counts) > 1


# One small recorded specialisation (`python -m cann_attn.backends.triton.aot record FILE` lists them all): the
# backward's row-sum kernel, bf16 D=128. If the kernel's signature changes, record it again.
DELTA_SPEC = {
    "module": "dense_backward", "kernel": "_delta_kernel",
    "signature": {"O": "*bf16", "DY": "*bf16", "DELTA": "*fp32", "TAB": "*i64", "soh": "i32", "sos": "i32",
                  "sod": "constexpr", "sdyh": "i32", "sdys": "i32", "sdyd": "constexpr", "DV": "constexpr",
                  "BLOCK_DV": "constexpr", "OFF_ALIGN": "constexpr", "BLOCK_M": "constexpr"},
    "constexprs": {"sod": 1, "sdyd": 1, "DV": 128, "BLOCK_DV": 128, "OFF_ALIGN": 16, "BLOCK_M": 64},
    "divisible": ["O", "DY", "DELTA", "TAB", "soh", "sos", "sdyh", "sdys"],
    "configs": [{"constexprs": {}, "num_warps": 4, "num_stages": 3}], "autotuned": False, "variants": ["bf16 d128"],
}


def test_cache_built_here_for_sm90_is_found_by_a_second_build(tmp_path: Path):
    pytest.importorskip("triton")
    from cann_attn.backends.triton import aot

    if aot.toolchain_missing():
        pytest.skip(f"no sm_90 toolchain: {aot.toolchain_missing()}")
    specs, cache = tmp_path / "specs.json", tmp_path / "cache"
    specs.write_text(json.dumps([DELTA_SPEC]))
    build = [sys.executable, "benchmarks/triton_cache.py", "build", "--dir", str(cache), "--specs", str(specs),
             "--workers", "1"]
    first = _run(build)
    assert first.returncode == 0, first.stderr
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["failed"] == [] and manifest["new_cubins"] == 1 and manifest["target"]["arch"] == 90
    second = _run(build)
    assert second.returncode == 0, second.stderr
    assert json.loads((cache / "manifest.json").read_text())["new_cubins"] == 0  # every kernel found in the cache
    check = _run([sys.executable, "benchmarks/triton_cache.py", "check", "--dir", str(cache)])
    assert "prebuilt Triton cache usable: 1 kernels" in check.stdout
    # A cache built for another Triton is reported unusable (its keys hash Triton's version and library).
    (cache / "manifest.json").write_text(json.dumps({**manifest, "triton": "0.0.0"}))
    check = _run([sys.executable, "benchmarks/triton_cache.py", "check", "--dir", str(cache)])
    assert "not usable (triton 0.0.0 there" in check.stdout
