"""``cann-attn bench``: run the benchmark scripts of the repository's ``benchmarks/`` folder.

Each suite NAME is the script ``benchmarks/bench_NAME.py``; it runs in a subprocess with the same Python, its
output streamed line by line under a progress bar (suites done, the running suite, elapsed time; on a
terminal). The options given here are passed on: every script accepts ``--quick``, ``--strict`` and
``--out DIR``. Results go to ``--out`` (default ``./cann_attn_bench`` in the working directory: a run never
overwrites the results committed in the repository's ``benchmarks/results/`` unless that folder is named).

A script names the devices it measures on in a module-level ``DEVICES = (...)`` line (read here without
importing the script; its first device is its default), and takes ``--device`` among them: fa_forward and
fa_backward cpu or cuda, the CPU benchmarks (pfa, sparse_attention, indexer) cpu, the ``gpu_*`` suites cuda. A
script without that line runs on cuda if named ``gpu_*``, else on the CPU, and gets no ``--device``.

Checked before any suite runs (bad usage: exit status 2): ``--out`` can be written, ``--device cuda`` has a CUDA
device, and a suite named with ``--suite`` runs on the ``--device`` given. ``--suite all`` runs the suites that
run on the ``--device`` given (and says which it skips); without ``--device``, each suite on its default device,
skipping the CUDA-only suites (and saying so) where no CUDA device is available. A suite named explicitly without
``--device`` always runs (a CUDA-only one reports its failure without CUDA).
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from . import UsageError
from .tensorio import check_output


def benchmarks_dir() -> Path | None:
    """``$CANN_ATTN_BENCHMARKS``, else ``benchmarks/`` of the source checkout, else of the working
    directory (None if none has ``bench_*.py`` scripts)."""
    candidates = []
    if os.environ.get("CANN_ATTN_BENCHMARKS"):
        candidates.append(Path(os.environ["CANN_ATTN_BENCHMARKS"]))
    candidates += [Path(__file__).resolve().parents[3] / "benchmarks", Path.cwd() / "benchmarks"]
    return next((c for c in candidates if c.is_dir() and any(c.glob("bench_*.py"))), None)


GPU_ONLY_PREFIX = "gpu_"
DEFAULT_OUT = "cann_attn_bench"


def suites(directory: Path) -> dict[str, Path]:
    return {p.stem.removeprefix("bench_"): p for p in sorted(directory.glob("bench_*.py"))}


def suite_devices(name: str, script: Path) -> tuple[tuple[str, ...], bool]:
    """The devices a suite measures on (the first: its default) and whether its script takes ``--device``: its
    module-level ``DEVICES = ("cpu", ...)`` line, else ("cuda",) for ``gpu_*`` suites and ("cpu",) for the others
    (no --device)."""
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        tree = ast.Module(body=[], type_ignores=[])
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "DEVICES"):
            try:
                devices = ast.literal_eval(node.value)
            except ValueError:
                break
            if isinstance(devices, (tuple, list)) and devices and all(d in ("cpu", "cuda") for d in devices):
                return tuple(devices), True
            break
    return (("cuda",) if name.startswith(GPU_ONLY_PREFIX) else ("cpu",)), False


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run the benchmarks (ratios against PyTorch, JSON + PNG results)",
        description="Run the benchmark scripts benchmarks/bench_<suite>.py (each prints a table and "
        "writes JSON and PNG results). The scripts belong to the source checkout and are not installed with the "
        "package: run from the checkout's root, or set CANN_ATTN_BENCHMARKS to its benchmarks/ folder.",
    )
    p.add_argument("--suite", default="all", help="suite name (e.g. fa_forward) or 'all' (default)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="device to benchmark on (default: each suite's own; with --suite all, only the suites that run on it)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                   help=f"results folder (default: ./{DEFAULT_OUT} in the working directory)")
    p.add_argument("--strict", action="store_true", help="exit status 1 when a performance target is missed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    directory = benchmarks_dir()
    if directory is None:
        raise UsageError(
            "benchmarks/ folder not found: the benchmark scripts are not installed with the package; run from the "
            "root of a source checkout or set CANN_ATTN_BENCHMARKS to its benchmarks/ folder"
        )
    available = suites(directory)
    if args.suite != "all" and args.suite not in available:
        raise UsageError(f"--suite: unknown suite {args.suite!r} (known: {', '.join(available)}, all)")
    check_output(Path(args.out), "--out")
    devices = {name: suite_devices(name, script) for name, script in available.items()}
    if args.suite != "all" and args.device and args.device not in devices[args.suite][0]:
        others = [n for n, (d, _) in devices.items() if args.device in d]
        raise UsageError(
            f"--device {args.device}: suite {args.suite} runs on {' / '.join(devices[args.suite][0])} only "
            f"(suites for {args.device}: {', '.join(others) or 'none'})"
        )
    if args.device == "cuda" and not cuda_available():
        raise UsageError("--device cuda: CUDA is not available (PyTorch build or machine)")
    if args.suite != "all":
        chosen = {args.suite: available[args.suite]}
    elif args.device:
        skipped = [name for name in available if args.device not in devices[name][0]]
        if skipped:
            print(f"== skipped (they do not run on {args.device}): {', '.join(skipped)}", flush=True)
        chosen = {name: script for name, script in available.items() if name not in skipped}
    else:
        chosen = dict(available)
        cuda_only = [name for name in chosen if "cpu" not in devices[name][0]]
        if cuda_only and not cuda_available():
            print(f"== skipped (no CUDA device; they measure GPU kernels only): {', '.join(cuda_only)}", flush=True)
            chosen = {name: script for name, script in chosen.items() if name not in cuda_only}
    status = 0
    progress = Progress(SpinnerColumn(), TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.description}"), console=Console(stderr=True),
                        transient=True, redirect_stdout=False, redirect_stderr=False)
    on_screen = sys.stdout.isatty() and progress.console.is_terminal

    def emit(line: str) -> None:
        if on_screen:  # above the live progress bar
            progress.console.print(line.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
        else:
            sys.stdout.write(line if line.endswith("\n") else line + "\n")
            sys.stdout.flush()

    with progress:
        task = progress.add_task("", total=len(chosen))
        for name, script in chosen.items():
            cmd = [sys.executable, str(script)]
            if args.device and devices[name][1]:
                cmd += ["--device", args.device]
            if args.quick:
                cmd.append("--quick")
            if args.strict:
                cmd.append("--strict")
            cmd += ["--out", args.out]
            emit(f"== {name}: {' '.join(cmd)}")
            progress.update(task, description=name)
            rc = _stream(cmd, emit)
            if rc != 0:
                print(f"== {name}: exit status {rc}", file=sys.stderr, flush=True)
                status = 1
            progress.advance(task)
    print(f"== results in {Path(args.out).resolve()}", flush=True)
    return status


def _stream(cmd: list[str], emit: Callable[[str], None]) -> int:
    """Run a suite, passing its output on line by line as it comes (unbuffered), so that a long suite shows its
    progress; its exit status."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, bufsize=1, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            emit(line)
    return proc.returncode
