"""DSA sparse attention (sparse_flash_attention forward, sparse_flash_attention_grad backward) on the CPU.

DeepSeek-V3.2 shapes: B=1, S1=1024, S2=4096, N1=16, D=512 + rope 64 (value = the 512 latent, the same tensor as
key), K=512 entries per row, sparse_mode 3 (bottom-right causal: row t sees keys [0, 3073 + t)):
  sparse_block_size 1:  each row a random top-512 of its allowed tokens (all valid);
  sparse_block_size 64: each row the allowed blocks in order (49..65 of them), then -1.
fp32 and bf16 inputs. Besides, the fp32 forward in sparse_mode 0 (every row sees all 4096 keys: block 1 a random
top-512 of them, block 64 all 64 blocks); at block size 1 it does the same work as mode 3 (random top-512 of >= 3073
allowed tokens), at block size 64 every row selects every block (4096 tokens). And the fp32 forward of dispersed
blocks (sparse_mode 0, block 64): each row K / 64 = 8 random blocks of the 64, then -1 (512 tokens, block 1's
budget), so the rows of a tile select different blocks and their union is nearly the whole sequence.
Throughput with the sparse-MLA FLOP convention (Dqk = 576, Dv = 512):
  forward  = 2 * tokens * topk * N1 * (Dqk + Dv)
  backward = 2 * tokens * N1 * topk * (2 * Dv + 3 * Dqk)
with topk = the actual number of selected key tokens per row, averaged over rows (block 64: ~3585 tokens per row,
so that case does ~7x the work of block 1). The "nominal" numbers use topk = K * sparse_block_size, the kernel's
selection capacity (equal to the actual count for block 1). Ratios are against this machine's fp32 GEMM rate
measured in the same run: torch.mm of 2048 x 2048 fp32 timed alternately with each case, medians of both (a
shared machine's drifting speed then hits both alike); the ratio to the run's best-of GEMM rate is reported too.
Targets: forward >= 0.4, backward >= 0.3.
Peak memory: VmHWM of a fresh interpreter running one call (common.peak_rss; the high-water mark is reset
after the inputs are built, so "delta" is the call's own working memory). A few rows of every forward output are
checked against a float64 recomputation; a mismatch or an error makes the exit status 1 (with --strict, so does a
missed target).

    python benchmarks/bench_sparse_attention.py [--quick] [--out DIR] [--device cpu] [--strict]
        [--threads N] [--no-rss]

Writes DIR/sparse_attention_cpu.json and DIR/sparse_attention_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

import cann_attn

# --device choices (the first is the default); cann-attn bench reads this line to pass --device only where it
# applies.
DEVICES = ("cpu",)

B, S1, S2, N1, D, DR, K = 1, 1024, 4096, 16, 512, 64, 512
DQK, DV = D + DR, D
MODE = 3
# Extra rows (fp32 forward only) in sparse_mode 0: (block size, ...).
MODE0_BLOCK_SIZES = (1, 64)
# Block size of the dispersed-selection forward (sparse_mode 0, K / DISPERSED_BLOCK random blocks per row).
DISPERSED_BLOCK = 64
SCALE = DQK**-0.5
BLOCK_SIZES = (1, 64)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGETS = {"forward": 0.4, "backward": 0.3}
CHECK_ROWS = (0, 1, S1 // 2, S1 - 1)
CHECK_TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


# ----------------------------------------------------------------------------------------------------------
# GEMM rate and FLOPs
# ----------------------------------------------------------------------------------------------------------
def gemm_rate(repeats: int = 5, n: int = 2048) -> dict[str, float]:
    """Best-of-`repeats` GFLOP/s of torch.mm on n x n fp32 matrices (2 n^3 FLOPs)."""
    mm, flops = gemm_call(n)
    mm()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        mm()
        best = min(best, time.perf_counter() - start)
    return {"gflops": flops / best / 1e9, "best_s": best, "n": n, "repeats": repeats}


def gemm_call(n: int = 2048) -> tuple[Callable[[], Any], float]:
    """A torch.mm of two n x n fp32 matrices and its FLOPs (2 n^3): the yardstick timed beside each case."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    out = torch.empty(n, n)
    return (lambda: torch.mm(a, b, out=out)), 2.0 * n**3


def paired_ratio(row: dict[str, Any], call: Callable[[], Any], warmup: int, repeats: int, gemm: float) -> None:
    """Time `call` and the fp32 GEMM alternately (common.time_pair) and fill row's ms, GFLOP/s and ratios.

    `ratio` divides our median GFLOP/s by the GEMM's median GFLOP/s over the same interleaved window: the same
    statistic under the same machine conditions. `ratio_vs_best_gemm` divides by the run's best-of GEMM rate
    (`gemm`), the stricter yardstick of earlier versions of this benchmark, kept for comparison."""
    gemm_fn, gemm_flops = gemm_call()
    ours, ref = common.time_pair(call, gemm_fn, warmup, repeats)
    row.update(ms=ours["median_s"] * 1e3, times_s=ours["times_s"], gemm_times_s=ref["times_s"])
    row["gemm_paired_gflops"] = gemm_flops / ref["median_s"] / 1e9
    row["gflops"] = row["flops"] / ours["median_s"] / 1e9
    row["ratio"] = row["gflops"] / row["gemm_paired_gflops"]
    row["ratio_vs_best_gemm"] = row["gflops"] / gemm


def forward_flops(tokens: int, topk: float) -> float:
    return 2.0 * tokens * topk * N1 * (DQK + DV)


def backward_flops(tokens: int, topk: float) -> float:
    return 2.0 * tokens * N1 * topk * (2 * DV + 3 * DQK)


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------
def thresholds(mode: int | None = None) -> torch.Tensor:
    """thr(t): row t may see keys [0, thr): S2 - S1 + t + 1 in sparse_mode 3, S2 in mode 0 (default mode: MODE)."""
    if (MODE if mode is None else mode) == 0:
        return torch.full((S1,), S2)
    return torch.arange(S1) + (S2 - S1 + 1)


def make_indices(bs: int, seed: int = 0, mode: int | None = None,
                 dispersed: bool = False) -> tuple[torch.Tensor, float]:
    """sparse_indices [1, S1, 1, K] (int32) and the average number of selected key tokens per row. `dispersed`
    (block size > 1): each row K // bs distinct random allowed blocks, then -1."""
    thr = thresholds(mode)
    if dispersed and bs > 1:
        gen = torch.Generator().manual_seed(seed)
        n_blocks = (thr + bs - 1) // bs
        count = min(K // bs, int(n_blocks.min()))
        keys = torch.rand(S1, int(n_blocks.max()), generator=gen)
        keys = keys.masked_fill(torch.arange(keys.shape[1]).view(1, -1) >= n_blocks.view(-1, 1), -1.0)
        idx = torch.full((S1, K), -1, dtype=torch.int64)
        idx[:, :count] = keys.topk(count, dim=-1).indices
        ends = torch.minimum((idx[:, :count] + 1) * bs, thr.view(-1, 1))
        avg = float((ends - idx[:, :count] * bs).sum(-1).float().mean())
    elif bs == 1:
        gen = torch.Generator().manual_seed(seed)
        keys = torch.rand(S1, S2, generator=gen)
        keys = keys.masked_fill(torch.arange(S2).view(1, -1) >= thr.view(-1, 1), -1.0)
        idx = keys.topk(K, dim=-1).indices  # K random allowed tokens per row (every row allows >= 3073)
        avg = float(torch.clamp(thr, max=K).float().mean())
    else:
        n_blocks = (thr + bs - 1) // bs
        entries = torch.arange(K).view(1, -1)
        idx = torch.where(entries < n_blocks.view(-1, 1), entries, -1)
        # tokens: every allowed block, the last one clipped at thr -> thr tokens per row (while n_blocks <= K)
        avg = float(torch.minimum(thr, n_blocks.clamp(max=K) * bs).float().mean())
    return idx.to(torch.int32).view(B, S1, 1, K), avg


def make_inputs(dtype: torch.dtype, bs: int, seed: int = 0, mode: int | None = None,
                dispersed: bool = False) -> dict[str, Any]:
    mode = MODE if mode is None else mode
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(B, S2, 1, D, generator=gen).to(dtype)
    idx, avg = make_indices(bs, seed, mode, dispersed)
    return {
        "query": torch.randn(B, S1, N1, D, generator=gen).to(dtype),
        "key": latent,
        "value": latent,  # DSA: the same 512-dim latent serves as key and value
        "query_rope": torch.randn(B, S1, N1, DR, generator=gen).to(dtype),
        "key_rope": torch.randn(B, S2, 1, DR, generator=gen).to(dtype),
        "sparse_indices": idx,
        "avg_topk": avg,
        "mode": mode,
        "selection": "dispersed" if dispersed and bs > 1 else "topk" if bs == 1 else "leading",
    }


def forward_call(inp: dict[str, Any], bs: int):
    def call():
        return cann_attn.sparse_flash_attention(
            inp["query"], inp["key"], inp["value"], inp["sparse_indices"], SCALE, query_rope=inp["query_rope"],
            key_rope=inp["key_rope"], sparse_block_size=bs, sparse_mode=inp["mode"], layout="BSND")

    return call


def backward_call(inp: dict[str, Any], bs: int, fwd, d_out: torch.Tensor):
    def call():
        return cann_attn.sparse_flash_attention_grad(
            inp["query"], inp["key"], inp["value"], inp["sparse_indices"], d_out, fwd.attention_out,
            fwd.softmax_max, fwd.softmax_sum, SCALE, sparse_block_size=bs, query_rope=inp["query_rope"],
            key_rope=inp["key_rope"], sparse_mode=inp["mode"], layout="BSND")

    return call


def check_rows(inp: dict[str, Any], bs: int, out: torch.Tensor) -> tuple[bool, float]:
    """Recompute CHECK_ROWS in float64 from the selection rule (all examined entries are valid and precede the
    -1 padding here; blocks clipped at thr) and compare with the forward output."""
    thr = thresholds(inp["mode"])
    worst = 0.0
    for t in CHECK_ROWS:
        entries = [int(e) for e in inp["sparse_indices"][0, t, 0].tolist()]
        n = min(K, math.ceil(int(thr[t]) / bs))
        tokens = []
        for e in entries[:n]:
            if e == -1:
                break
            tokens.extend(range(e * bs, min(e * bs + bs, int(thr[t]))))
        pos = torch.tensor(tokens)
        q = torch.cat([inp["query"][0, t], inp["query_rope"][0, t]], -1).double()
        k = torch.cat([inp["key"][0, pos, 0], inp["key_rope"][0, pos, 0]], -1).double()
        p = torch.softmax(SCALE * q @ k.T, dim=-1)
        ref = p @ inp["value"][0, pos, 0].double()
        worst = max(worst, float((out[0, t].double() - ref).abs().max()))
    return worst <= CHECK_TOL[inp["query"].dtype], worst


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: write 5 to /proc/self/clear_refs), so that the
    peak measured around the call is the call's own, not that of building its inputs. False where unsupported."""
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------------------
# Peak memory (child side of common.peak_rss)
# ----------------------------------------------------------------------------------------------------------
def rss_case(dtype: str, bs: int, which: str, threads: int | None = None, mode: int | None = None,
             dispersed: bool = False):
    """Build the inputs (and, for the backward, the forward outputs) and return the call to measure."""
    if threads:
        torch.set_num_threads(threads)
    inp = make_inputs(DTYPES[dtype], bs, mode=mode, dispersed=dispersed)
    if which == "forward":
        return forward_call(inp, bs), {"which": which, "peak_reset": reset_peak_rss()}
    fwd = forward_call(inp, bs)()
    d_out = torch.randn(fwd.attention_out.shape, generator=torch.Generator().manual_seed(1)).to(DTYPES[dtype])
    return backward_call(inp, bs, fwd, d_out), {"which": which, "peak_reset": reset_peak_rss()}


# ----------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------
def run(dtype_name: str, bs: int, warmup: int, repeats: int, gemm: float, rss: bool, threads: int | None,
        progress, task, mode: int = MODE, directions: tuple[str, ...] = ("forward", "backward"),
        dispersed: bool = False) -> list[dict[str, Any]]:
    dtype = DTYPES[dtype_name]
    inp = make_inputs(dtype, bs, mode=mode, dispersed=dispersed)
    tokens, avg, nominal = B * S1, inp["avg_topk"], float(K * bs)
    rows = []
    base = {"dtype": dtype_name, "sparse_block_size": bs, "sparse_mode": mode, "selection": inp["selection"],
            "avg_topk": avg, "nominal_topk": nominal,
            "shape": f"B{B} S1={S1} S2={S2} N1={N1} D={D}+{DR} K={K} mode {mode}"}
    fwd = None
    for which in directions:
        progress.update(task, description=f"{dtype_name} bs={bs} mode {mode} {inp['selection']} {which}")
        row = {**base, "which": which, "target": TARGETS[which]}
        flops_fn = forward_flops if which == "forward" else backward_flops
        row["flops"], row["nominal_flops"] = flops_fn(tokens, avg), flops_fn(tokens, nominal)
        try:
            if which == "forward":
                call = forward_call(inp, bs)
                fwd = call()
                row["check_passed"], row["check_max_abs_diff"] = check_rows(inp, bs, fwd.attention_out)
            else:
                if fwd is None:
                    raise RuntimeError("no forward output (the forward failed)")
                d_out = torch.randn(fwd.attention_out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
                call = backward_call(inp, bs, fwd, d_out)
                grads = call()
                finite = all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
                row["check_passed"], row["check_max_abs_diff"] = finite, None
            paired_ratio(row, call, warmup, repeats, gemm)
            row["nominal_gflops"] = row["nominal_flops"] / row["ms"] * 1e-6
            row["nominal_ratio"] = row["nominal_gflops"] / row["gemm_paired_gflops"]
            row["passed"] = row["ratio"] >= row["target"]
            row["error"] = None
            if rss:
                mem = common.peak_rss(__file__, "rss_case", {"dtype": dtype_name, "bs": bs, "which": which,
                                                             "threads": threads, "mode": mode,
                                                             "dispersed": dispersed})
                row.update(peak_rss_mb=mem["peak_mb"], rss_before_mb=mem["before_mb"], rss_delta_mb=mem["delta_mb"])
        except Exception as exc:  # a failing case is reported, the others still run
            row.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=3),
                       passed=False, check_passed=False)
        rows.append(row)
        progress.advance(task)
    return rows


def ratio_plot(path: str | Path, labels: list[str], gflops: list[float | None], gemm: float,
               ratios: list[float | None], targets: list[float | None], title: str) -> Path | None:
    """Two panels: our GFLOP/s beside the fp32 GEMM rate, and the ratio to GEMM with the targets (dashed).
    (common.bar_plot labels its ratio panel "speed-up vs PyTorch", which these ratios are not.)"""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(labels) + 3), 8.0))
    x = list(range(len(labels)))
    ax.bar(x, [0.0 if g is None else g for g in gflops], 0.6, label="cann_attn (actual topk)")
    ax.axhline(gemm, color="tab:orange", linestyle="--", label=f"fp32 torch.mm 2048^3: {gemm:.1f} GFLOP/s")
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    colors = ["tab:gray" if r is None or t is None else ("tab:green" if r >= t else "tab:red")
              for r, t in zip(ratios, targets, strict=True)]
    ax2.bar(x, [0.0 if r is None else r for r in ratios], 0.6, color=colors)
    for xi, t in zip(x, targets, strict=True):
        if t is not None:
            ax2.hlines(t, xi - 0.4, xi + 0.4, colors="black", linestyles="dashed")
    for xi, r in zip(x, ratios, strict=True):
        if r is None:
            ax2.text(xi, 0.0, "error", ha="center", va="bottom", fontsize=8, color="tab:red")
    ax2.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("ratio to fp32 GEMM rate (dashed: target)")
    ax2.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_table(results, gemm: dict, console) -> None:
    from rich.table import Table

    shape = results[0]["shape"].rsplit(" mode", 1)[0]
    table = Table(title=f"DSA sparse attention on CPU ({shape}); fp32 GEMM {gemm['gflops']:.1f} GFLOP/s",
                  header_style="bold")
    for col in ("dtype", "bs", "mode", "direction", "ms", "avg topk", "GFLOP/s", "ratio", "vs best GEMM", "target",
                "ok", "nominal GFLOP/s", "nominal ratio", "peak RSS MB (delta)", "check"):
        table.add_column(col, justify="left" if col in ("dtype", "direction") else "right")
    for r in results:
        mode = f"{r['sparse_mode']}{' dispersed' if r['selection'] == 'dispersed' else ''}"
        case = (r["dtype"], str(r["sparse_block_size"]), mode, r["which"])
        if r.get("error"):
            table.add_row(*case, "-", f"{r['avg_topk']:.0f}", "-", "-", "-", f">= {r['target']}", "[bold red]ERROR[/]",
                          "-", "-", "-", r["error"][:60])
            continue
        ok = "[green]yes[/]" if r["passed"] else "[bold red]no[/]"
        rss = "-" if "peak_rss_mb" not in r else f"{r['peak_rss_mb']:.0f} ({r['rss_delta_mb']:+.0f})"
        check = "[green]ok[/]" if r["check_passed"] else "[bold red]MISMATCH[/]"
        if r["check_max_abs_diff"] is not None:
            check += f" ({r['check_max_abs_diff']:.1e})"
        table.add_row(*case, f"{r['ms']:.0f}", f"{r['avg_topk']:.0f}", f"{r['gflops']:.2f}", f"{r['ratio']:.3f}",
                      f"{r['ratio_vs_best_gemm']:.3f}", f">= {r['target']}", ok, f"{r['nominal_gflops']:.2f}",
                      f"{r['nominal_ratio']:.3f}", rss, check)
    console.print(table)
    console.print("ratio = our median GFLOP/s (actual selected tokens) / median fp32 torch.mm GFLOP/s timed "
                  "alternately with the case; vs best GEMM: / the run's best-of torch.mm rate; nominal: topk = K * bs.",
                  highlight=False)


def main(argv=None) -> int:
    parser = common.cli_parser(__doc__, "no warm-up, 1 timed call, fewer GEMM repeats", devices=DEVICES,
                               threads=True, no_rss=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = common.console(200)
    warmup, repeats = (0, 1) if args.quick else (1, 5)
    busy = common.busy_warning()
    if busy:
        console.print(f"[yellow]warning[/]: {busy}", highlight=False)
    gemm = gemm_rate(3 if args.quick else 7)
    memory_before = common.memory_copy_bandwidth()
    progress = Progress(TextColumn("[bold]bench sparse attention"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.description}"), console=Console(stderr=True),
                        transient=True)
    results = []
    with progress:
        task = progress.add_task("", total=2 * len(DTYPES) * len(BLOCK_SIZES) + len(MODE0_BLOCK_SIZES) + 1)
        for dtype_name in DTYPES:
            for bs in BLOCK_SIZES:
                results += run(dtype_name, bs, warmup, repeats, gemm["gflops"], not args.no_rss, args.threads,
                               progress, task)
        for bs in MODE0_BLOCK_SIZES:
            results += run("fp32", bs, warmup, repeats, gemm["gflops"], not args.no_rss, args.threads, progress,
                           task, mode=0, directions=("forward",))
        results += run("fp32", DISPERSED_BLOCK, warmup, repeats, gemm["gflops"], not args.no_rss, args.threads,
                       progress, task, mode=0, directions=("forward",), dispersed=True)
    gemm_after = gemm_rate(3)  # the machine may be shared: a second measurement shows the drift
    print_table(results, gemm, console)
    console.print(f"memory copy bandwidth: {memory_before:.1f} GB/s before the cases, "
                  f"{common.memory_copy_bandwidth():.1f} GB/s after (the gather-bound cases slow down when it drops)",
                  highlight=False)

    payload = {
        "benchmark": "sparse_attention",
        "device": "cpu",
        "machine": common.machine_info("cpu"),
        "busy_warning": busy,
        "settings": {"warmup": warmup, "repeats": repeats, "quick": args.quick, "B": B, "S1": S1, "S2": S2,
                     "N1": N1, "D": D, "D_rope": DR, "K": K, "sparse_mode": MODE,
                     "mode0_forward_block_sizes": list(MODE0_BLOCK_SIZES), "scale": SCALE,
                     "block_sizes": list(BLOCK_SIZES), "value_is_key": True, "targets": TARGETS,
                     "indices": {"1": "random top-512 of the allowed tokens per row (all valid)",
                                 "64": "the allowed blocks in order, then -1",
                                 "dispersed": f"block {DISPERSED_BLOCK}, mode 0: K / {DISPERSED_BLOCK} random "
                                              "blocks per row, then -1"},
                     "mode0": "every row sees all S2 keys: the same rules over [0, S2)"},
        "gemm_fp32": gemm,
        "gemm_fp32_after": gemm_after,
        "memory_copy_gbps_before": memory_before,  # machine["memory_copy_gbps"] is measured after the run
        "flop_convention": {
            "forward": "2*tokens*topk*N1*(Dqk+Dv), Dqk=576, Dv=512 (sparse MLA)",
            "backward": "2*tokens*N1*topk*(2*Dv+3*Dqk)",
            "topk": "actual selected key tokens per row, averaged (avg_topk); nominal_*: topk = K * block size",
            "ratio": "median GFLOP/s divided by the median fp32 torch.mm 2048x2048 GFLOP/s, timed alternately "
                     "with the case (gemm_paired_gflops); ratio_vs_best_gemm: divided by the run's best-of rate",
        },
        "results": results,
    }
    out_dir = Path(args.out)
    json_path = common.write_json(out_dir / "sparse_attention_cpu.json", payload)
    png_path = ratio_plot(
        out_dir / "sparse_attention_cpu.png",
        [f"{r['dtype']} bs={r['sparse_block_size']} mode {r['sparse_mode']}"
         f"{' dispersed' if r['selection'] == 'dispersed' else ''} {r['which']}" for r in results],
        [r.get("gflops") for r in results], gemm["gflops"], [r.get("ratio") for r in results],
        [r["target"] for r in results],
        f"DSA sparse attention, S1={S1} S2={S2} N1={N1} K={K} ({payload['machine']['cpu']}, "
        f"{payload['machine']['torch_threads']} threads)")
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""), highlight=False)
    failed = [r for r in results if r.get("error") or not r.get("check_passed")]
    if failed:
        console.print("[bold red]errors / mismatches[/]: " + ", ".join(
            f"{r['dtype']} bs={r['sparse_block_size']} mode {r['sparse_mode']} {r['which']}" for r in failed),
            highlight=False)
        return 1
    return 1 if args.strict and any(not r["passed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
