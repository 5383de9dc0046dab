"""The native loops built with AddressSanitizer and UBSan, run under the operator tests that reach them and the
thread stress test (docs/guides/backends.md, "Threads"): an out-of-bounds access, a use after free or undefined
behaviour in attention_loops.c aborts the run where it happens, instead of a later `free(): corrupted ...`.

The library is built by the ordinary loader (`$CC` carries the sanitizer flags; the cache key includes it) into a
temporary cache, and the child Python preloads the sanitizer runtimes (Python itself is not instrumented). Leak
checking is off: CPython and PyTorch keep allocations until exit by design.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cann_attn
from cann_attn.backends.reference import native
from patience import HANG_SECONDS

TESTS = Path(__file__).resolve().parent
UNDER_SANITIZERS = ["test_thread_safety.py", "test_native_kernels.py", "test_masked_logits.py", "test_nan_rows.py",
                    "test_decode_native.py", "test_decode_dots.py", "test_int8_query_dots.py"]
SANITIZE = "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
RUNTIMES = ("libasan.so", "libubsan.so")


def _runtime(name: str) -> str | None:
    """The compiler's copy of a sanitizer runtime (cc prints the bare name when it has none)."""
    found = subprocess.run(["cc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


def _sanitized_env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CC=f"cc {SANITIZE}", CANN_ATTN_CACHE_DIR=str(cache), LD_PRELOAD=" ".join(map(_runtime, RUNTIMES)),
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1", UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
               PYTHONPATH=os.pathsep.join([str(Path(cann_attn.__file__).parents[1]), env.get("PYTHONPATH", "")]),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop(native.ENV_SWITCH, None)
    return env


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("cc") is None,
                    reason="needs x86-64 and a C compiler")
def test_native_loops_under_address_sanitizer(tmp_path: Path) -> None:
    if not all(map(_runtime, RUNTIMES)):
        pytest.skip("the C compiler has no AddressSanitizer / UBSan runtime")
    env = _sanitized_env(tmp_path / "cache")
    probe = subprocess.run([sys.executable, "-c", "from cann_attn.backends.reference import native; "
                            "lib = native.library(); print(lib is not None and hasattr(lib, '__asan_init'))"],
                           env=env, capture_output=True, text=True, timeout=HANG_SECONDS, cwd=tmp_path)
    assert probe.stdout.strip().endswith("True"), f"no ASan-instrumented library loaded:\n{probe.stderr[-3000:]}"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "not triton",
                          *(str(TESTS / name) for name in UNDER_SANITIZERS)],
                         env=env, capture_output=True, text=True, timeout=HANG_SECONDS, cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "Sanitizer" not in output and "runtime error" not in output, output[-6000:]
