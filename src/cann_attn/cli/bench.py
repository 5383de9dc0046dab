"""``cann-attn bench``: run the benchmark scripts of the repository's ``benchmarks/`` folder.

Each suite NAME is the script ``benchmarks/bench_NAME.py``; it runs in a subprocess with the same Python.
The options given here are passed on: every script accepts ``--quick``, ``--strict`` and ``--out DIR``
(default ``benchmarks/results/``); those that can run on a GPU also accept ``--device cpu|cuda``, which is
passed only when given. Suites named ``gpu_*`` measure CUDA kernels only: ``--suite all`` skips them (and says
so) where no CUDA device is available, while naming one explicitly still runs it and reports its failure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from . import UsageError


def benchmarks_dir() -> Path | None:
    """``$CANN_ATTN_BENCHMARKS``, else ``benchmarks/`` of the source checkout, else of the working
    directory (None if none has ``bench_*.py`` scripts)."""
    candidates = []
    if os.environ.get("CANN_ATTN_BENCHMARKS"):
        candidates.append(Path(os.environ["CANN_ATTN_BENCHMARKS"]))
    candidates += [Path(__file__).resolve().parents[3] / "benchmarks", Path.cwd() / "benchmarks"]
    return next((c for c in candidates if c.is_dir() and any(c.glob("bench_*.py"))), None)


GPU_ONLY_PREFIX = "gpu_"


def suites(directory: Path) -> dict[str, Path]:
    return {p.stem.removeprefix("bench_"): p for p in sorted(directory.glob("bench_*.py"))}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run the benchmarks (ratios against PyTorch, JSON + PNG results)",
        description="Run the benchmark scripts benchmarks/bench_<suite>.py (each prints a table and "
        "writes JSON and PNG results).",
    )
    p.add_argument("--suite", default="all", help="suite name (e.g. fa_forward) or 'all' (default)")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), help="device to benchmark on (default: the script's, cpu)"
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--out", metavar="DIR", help="results folder (default: benchmarks/results)")
    p.add_argument("--strict", action="store_true", help="exit status 1 when a performance target is missed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    directory = benchmarks_dir()
    if directory is None:
        raise UsageError(
            "benchmarks/ folder not found (run from the repository root or set CANN_ATTN_BENCHMARKS)"
        )
    available = suites(directory)
    if args.suite != "all" and args.suite not in available:
        raise UsageError(f"--suite: unknown suite {args.suite!r} (known: {', '.join(available)}, all)")
    chosen = available if args.suite == "all" else {args.suite: available[args.suite]}
    status = 0
    if args.suite == "all" and args.device != "cuda" and not cuda_available():
        skipped = [name for name in chosen if name.startswith(GPU_ONLY_PREFIX)]
        if skipped:
            print(f"== skipped (no CUDA device; they measure GPU kernels only): {', '.join(skipped)}", flush=True)
        chosen = {name: script for name, script in chosen.items() if name not in skipped}
    for name, script in chosen.items():
        cmd = [sys.executable, str(script)]
        if args.device:
            cmd += ["--device", args.device]
        if args.quick:
            cmd.append("--quick")
        if args.strict:
            cmd.append("--strict")
        if args.out:
            cmd += ["--out", args.out]
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            print(f"== {name}: exit status {rc}", file=sys.stderr, flush=True)
            status = 1
    return status
