"""Registers, spills and shared memory of every Triton kernel specialization compiled for sm_90 (no GPU needed).

Records the launches of representative op calls (`cann_attn.backends.triton.aot`), compiles each specialization
for GPUTarget("cuda", 90, 32) with its default config, and every config of each kernel's autotune list once (on
the kernel's first recorded spec: bf16 D=128 for the dense kernels, N1=128 / latent 512 / rope 64 for DSA), then
prints a table and writes benchmarks/results/triton_kernels_sm90.json.

"spill" is the cubin's stack frame per thread (cuobjdump --dump-resource-usage): these kernels have no local
arrays, so it is where ptxas put registers it could not keep. "smem>227K" marks configs a Hopper GPU cannot
launch (the autotuner would drop them with OutOfResources; a fixed launch would fail).

    PYTHONPATH=src .venv/bin/python benchmarks/kernel_report.py [--all-configs]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cann_attn.backends.triton import aot

RESULTS = Path(__file__).parent / "results" / "triton_kernels_sm90.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all-configs", action="store_true",
                        help="every config for every spec (thousands of compiles; hours on 2 cores)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    console = Console(width=220)
    missing = aot.toolchain_missing()
    if missing:
        raise SystemExit(missing)
    start = time.perf_counter()
    specs = aot.record_subprocess()
    plan = specs if args.all_configs else aot.select_configs(specs)
    results = aot.compile_subprocess(plan, workers=args.workers)
    elapsed = time.perf_counter() - start

    table = Table(title=f"Triton kernels on sm_90: {len(specs)} specializations, {len(results)} compiles")
    for col in ("kernel / specialization", "config", "default", "regs", "spill B", "smem KB", "flags", "variants"):
        table.add_column(col, overflow="fold")
    for r in results:
        flags = []
        if not r.ok:
            flags.append("[red]COMPILE FAILED[/]")
        if r.over_smem:
            flags.append("[red]smem>227K[/]")
        if r.spill_bytes > 0:
            flags.append("[yellow]spills[/]" if r.spill_bytes < 1024 else "[red]heavy spills[/]")
        table.add_row(r.spec, r.config, "*" if r.default else "", str(r.regs), str(r.spill_bytes),
                      f"{r.smem / 1024:.1f}", " ".join(flags), "; ".join(r.variants[:3]))
    console.print(table)

    ok = [r for r in results if r.ok]
    console.print(f"compiled {len(ok)}/{len(results)} in {elapsed:.0f} s; "
                  f"{sum(r.spill_bytes > 0 for r in ok)} spill, {sum(r.over_smem for r in ok)} exceed 227 KB smem")
    for kernel in sorted({r.kernel for r in results}):
        rows = [r for r in ok if r.kernel == kernel]
        fits = [r for r in rows if not r.over_smem]
        best = min(fits, key=lambda r: r.spill_bytes, default=None)
        console.print(f"  {kernel}: {len(rows)} compiles, spill {min(r.spill_bytes for r in rows)}.."
                      f"{max(r.spill_bytes for r in rows)} B, smem {min(r.smem for r in rows) // 1024}.."
                      f"{max(r.smem for r in rows) // 1024} KB, {len(rows) - len(fits)} over smem"
                      + (f"; least spill within smem: {best.config} ({best.spill_bytes} B)" if best else
                         "; [red]no config fits in smem[/]"))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"target": "cuda sm_90", "smem_limit_bytes": aot.SMEM_LIMIT_BYTES,
                                   "results": [dataclasses.asdict(r) for r in results]}, indent=1))
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
