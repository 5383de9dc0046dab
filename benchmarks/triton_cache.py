"""A Triton kernel cache for sm_90 built without a GPU, to copy to an H100/H200 machine (benchmarks/gpu_checks.sh).

    python benchmarks/triton_cache.py build [--dir .triton_cache] [--specs FILE] [--all-configs] [--workers N]
    python benchmarks/triton_cache.py check [--dir .triton_cache]

`build` records the kernels' specialisations (`cann_attn.backends.triton.aot.record`, in Triton's interpreter) or
reads them from `--specs` (a JSON list of aot.KernelSpec), compiles each with `triton.compile` for
GPUTarget("cuda", 90, 32) through the ptxas Triton bundles, with TRITON_CACHE_DIR pointing at `--dir`, and writes
`manifest.json` beside the entries: the Triton, Python and torch versions, the target and what was compiled. A JIT
launch on the GPU finds an entry when its cache key matches, and that key hashes Triton's version and sources, its
compiled library (built per Python version), the ptxas version, the kernel source, the specialisation and the
options: a cache built here is only of use where Triton and Python match the machine's. `check` compares the
manifest with this interpreter and says whether the cache can serve (exit 0 either way; gpu_checks.sh logs it).
Copy the folder (it is git-ignored) into the GPU machine's checkout as `.triton_cache`.

A cache built with Triton 3.9.0 on Python 3.11 does not serve a machine with Triton 3.6.0 on Python 3.12, so
gpu_checks.sh does not rely on a prebuilt cache; it compiles on the machine, one config per autotuner on its first
pass (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".triton_cache"
MANIFEST = "manifest.json"


def versions() -> dict[str, str | None]:
    """What a cache entry's validity depends on, as far as it can be read without a GPU."""
    out: dict[str, str | None] = {"python": ".".join(platform.python_version_tuple()[:2])}
    for name in ("triton", "torch"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def cubin_count(folder: Path) -> int:
    return sum(1 for _ in folder.rglob("*.cubin")) if folder.exists() else 0


def build(folder: Path, specs_file: Path | None, all_configs: bool, workers: int) -> dict:
    """Compile the specialisations into `folder` (TRITON_CACHE_DIR of the compiling subprocess) and write the
    manifest; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(folder.resolve())  # inherited by aot's compile subprocess
    from cann_attn.backends.triton import aot

    missing = aot.toolchain_missing()
    if missing:
        raise SystemExit(f"cannot compile for sm_90 here: {missing}")
    if specs_file is None:
        specs = aot.record_subprocess()
    else:
        specs = [aot.KernelSpec.from_json(d) for d in json.loads(specs_file.read_text())]
    before, start = cubin_count(folder), time.perf_counter()
    results = aot.compile_subprocess(specs, all_configs=all_configs, workers=workers)
    manifest = {
        **versions(),
        "target": {"backend": "cuda", "arch": aot.TARGET_ARCH, "warp_size": 32},
        "specs": len(specs),
        "compiles": len(results),
        "failed": [f"{r.spec} | {r.config}" for r in results if not r.ok],
        "new_cubins": cubin_count(folder) - before,
        "cubins": cubin_count(folder),
        "seconds": round(time.perf_counter() - start, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def check(folder: Path) -> tuple[bool, str]:
    """(usable, message): whether the cache in `folder` was built for this Triton and Python."""
    here = versions()
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        return False, f"no prebuilt Triton cache manifest in {folder}: kernels compile here ({here})"
    built = json.loads(manifest_path.read_text())
    differ = [f"{k} {built.get(k)} there, {here[k]} here" for k in ("triton", "python") if built.get(k) != here[k]]
    if differ:
        return False, f"prebuilt Triton cache not usable ({'; '.join(differ)}): kernels compile here"
    return True, (f"prebuilt Triton cache usable: {built['cubins']} kernels built {built['created']} for "
                  f"sm_{built['target']['arch']} with Triton {here['triton']} / Python {here['python']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the specialisations for sm_90 into DIR")
    b.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    b.add_argument("--specs", type=Path, default=None, help="aot.KernelSpec JSON list (default: record them now)")
    b.add_argument("--all-configs", action="store_true", help="every autotune config (default: the first only)")
    b.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    c = sub.add_parser("check", help="whether the cache in DIR fits this Triton and Python")
    c.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    if args.command == "build":
        print(json.dumps(build(args.dir, args.specs, args.all_configs, args.workers), indent=2))
        return 0
    _, message = check(args.dir)
    print(f"{versions()}; TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR', '(default)')}")
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
