"""DSA lightning indexer on the CPU: the SparseLightningIndexerGradKLLoss op (loss + indexer gradients) and the
lightning_indexer forward (scores + top-k).

B=1, S1=1024, S2=4096, N1=16 main-attention heads with D=512 + rope 64, Nidx1=8 indexer heads with Didx=128,
K=512 (sparse_count), sparse_mode 3. The KL op gets the top-512 indices of lightning_indexer and the softmax
statistics of sparse_flash_attention over that selection (computed once, in fp32, outside the timing).
FLOPs of the KL op (our convention, stated in the JSON): 2 * tokens * K * (N1 * Dqk + 3 * Nidx1 * Didx) with
Dqk = 576 -- the main-attention logits of the selected keys (target p) plus the index scores, d_query_index and
d_key_index GEMMs. Its ratio to this machine's fp32 GEMM rate (torch.mm 2048 x 2048 timed alternately with the
op, medians of both; also reported against the run's best-of GEMM rate) has the target >= 0.3. The
lightning_indexer forward is timed and reported with FLOPs 2 * Nidx1 * Didx * (allowed (row, key) pairs) (the score
GEMM; no target). fp32 and bf16 inputs. Peak memory: VmHWM of a fresh interpreter running one call (reset after
the inputs are built). Outputs are sanity-checked (finite loss and gradients; top-k of a few rows vs a float64
recomputation up to rounding); an error or a mismatch makes the exit status 1 (with --strict, so does a missed
target).

    python benchmarks/bench_indexer.py [--quick] [--out DIR] [--device cpu] [--strict]
        [--threads N] [--no-rss]

Writes DIR/indexer_cpu.json and DIR/indexer_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from bench_sparse_attention import gemm_rate, paired_ratio, ratio_plot, reset_peak_rss

import cann_attn

# --device choices (the first is the default); cann-attn bench reads this line to pass --device only where it
# applies.
DEVICES = ("cpu",)

B, S1, S2, N1, D, DR = 1, 1024, 4096, 16, 512, 64
NIDX, DIDX, K = 8, 128, 512
DQK = D + DR
MODE = 3
SCALE = DQK**-0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGET_KL = 0.3
CHECK_ROWS = (0, 1, S1 // 2, S1 - 1)


def kl_flops(tokens: int = B * S1) -> float:
    return 2.0 * tokens * K * (N1 * DQK + 3 * NIDX * DIDX)


def indexer_flops() -> float:
    allowed = (torch.arange(S1) + (S2 - S1 + 1)).clamp(max=S2)
    return 2.0 * NIDX * DIDX * float(allowed.sum())


def make_inputs(dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """Indexer inputs, main-attention inputs, top-K indices and SFA statistics (fp32 SFA over the selection)."""
    gen = torch.Generator().manual_seed(seed)
    f32 = {
        "query": torch.randn(B, S1, N1, D, generator=gen),
        "key": torch.randn(B, S2, 1, D, generator=gen),
        "query_rope": torch.randn(B, S1, N1, DR, generator=gen),
        "key_rope": torch.randn(B, S2, 1, DR, generator=gen),
        "query_index": torch.randn(B, S1, NIDX, DIDX, generator=gen),
        "key_index": torch.randn(B, S2, 1, DIDX, generator=gen),
        "weights": torch.randn(B, S1, NIDX, generator=gen) * (NIDX**-0.5 * DIDX**-0.5),
    }
    inp = {name: t.to(dtype) for name, t in f32.items()}
    inp["sparse_indices"] = cann_attn.lightning_indexer(inp["query_index"], inp["key_index"], inp["weights"],
                                                        sparse_count=K, sparse_mode=MODE).sparse_indices
    # statistics of the main attention over the same selection; computed on the input-dtype values in fp32
    as32 = {n: inp[n].float() for n in ("query", "key", "query_rope", "key_rope")}
    fwd = cann_attn.sparse_flash_attention(as32["query"], as32["key"], as32["key"], inp["sparse_indices"], SCALE,
                                           query_rope=as32["query_rope"], key_rope=as32["key_rope"],
                                           sparse_mode=MODE)
    inp["softmax_max"], inp["softmax_sum"] = fwd.softmax_max, fwd.softmax_sum
    return inp


def kl_call(inp: dict[str, Any]):
    def call():
        return cann_attn.sparse_lightning_indexer_grad_kl_loss(
            inp["query"], inp["key"], inp["query_index"], inp["key_index"], inp["weights"], inp["sparse_indices"],
            inp["softmax_max"], inp["softmax_sum"], SCALE, query_rope=inp["query_rope"], key_rope=inp["key_rope"],
            sparse_mode=MODE, layout="BSND")

    return call


def indexer_call(inp: dict[str, Any]):
    def call():
        return cann_attn.lightning_indexer(inp["query_index"], inp["key_index"], inp["weights"], sparse_count=K,
                                           sparse_mode=MODE, return_value=True)

    return call


def check_topk(inp: dict[str, Any], indices: torch.Tensor) -> tuple[bool, float]:
    """CHECK_ROWS: the chosen K keys are allowed, distinct, and no unchosen key scores higher (float64 scores,
    up to a rounding tolerance). Returns (passed, worst violation)."""
    worst = 0.0
    for t in CHECK_ROWS:
        allowed = min(S2, S2 - S1 + t + 1)
        q = inp["query_index"][0, t].double()
        k = inp["key_index"][0, :allowed, 0].double()
        scores = (inp["weights"][0, t].double()[:, None] * torch.relu(q @ k.T)).sum(0)
        chosen = indices[0, t, 0].long()
        n = min(K, allowed)
        if bool((chosen[n:] != -1).any()) or chosen[:n].unique().numel() != n or bool((chosen[:n] >= allowed).any()):
            return False, float("inf")
        rest = torch.ones(allowed, dtype=torch.bool)
        rest[chosen[:n]] = False
        if bool(rest.any()):
            worst = max(worst, float(scores[rest].max() - scores[chosen[:n]].min()))
    tol = 1e-3 if inp["query_index"].dtype == torch.float32 else 5e-2
    return worst <= tol, worst


def rss_case(dtype: str, which: str, threads: int | None = None):
    if threads:
        torch.set_num_threads(threads)
    inp = make_inputs(DTYPES[dtype])
    call = kl_call(inp) if which == "kl_grad" else indexer_call(inp)
    return call, {"which": which, "peak_reset": reset_peak_rss()}


def run(dtype_name: str, warmup: int, repeats: int, gemm: float, rss: bool, threads: int | None, progress,
        task) -> list[dict[str, Any]]:
    rows = []
    try:
        inp = make_inputs(DTYPES[dtype_name])
        setup_error = None
    except Exception as exc:
        inp, setup_error = None, f"{type(exc).__name__}: {exc}"
    for which, flops, target in (("kl_grad", kl_flops(), TARGET_KL), ("indexer_fwd", indexer_flops(), None)):
        progress.update(task, description=f"{dtype_name} {which}")
        row = {"dtype": dtype_name, "which": which, "flops": flops, "target": target,
               "shape": f"B{B} S1={S1} S2={S2} N1={N1} D={D}+{DR} Nidx1={NIDX} Didx={DIDX} K={K} mode {MODE}"}
        try:
            if setup_error:
                raise RuntimeError(f"input setup failed: {setup_error}")
            call = kl_call(inp) if which == "kl_grad" else indexer_call(inp)
            res = call()
            if which == "kl_grad":
                ok = all(bool(torch.isfinite(t).all()) for t in res)
                row.update(check_passed=ok, check_detail=f"loss {float(res.loss):.4g}, finite={ok}")
            else:
                ok, worst = check_topk(inp, res.sparse_indices)
                row.update(check_passed=ok, check_detail=f"worst score gap {worst:.1e}")
            paired_ratio(row, call, warmup, repeats, gemm)
            row["error"] = None
            row["passed"] = None if target is None else row["ratio"] >= target
            if rss:
                mem = common.peak_rss(__file__, "rss_case", {"dtype": dtype_name, "which": which, "threads": threads})
                row.update(peak_rss_mb=mem["peak_mb"], rss_before_mb=mem["before_mb"], rss_delta_mb=mem["delta_mb"])
        except Exception as exc:
            row.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=3),
                       passed=False if target is not None else None, check_passed=False)
        rows.append(row)
        progress.advance(task)
    return rows


def print_table(results, gemm: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"DSA indexer on CPU ({results[0]['shape']}); fp32 GEMM {gemm['gflops']:.1f} GFLOP/s",
                  header_style="bold")
    for col in ("op", "dtype", "ms", "GFLOP/s", "ratio to GEMM", "vs best GEMM", "target", "ok", "peak RSS MB (delta)",
                "check"):
        table.add_column(col, justify="left" if col in ("op", "dtype", "check") else "right")
    for r in results:
        op = "KL loss + grads" if r["which"] == "kl_grad" else "lightning_indexer fwd"
        target = "-" if r["target"] is None else f">= {r['target']}"
        if r.get("error"):
            table.add_row(op, r["dtype"], "-", "-", "-", "-", target, "[bold red]ERROR[/]", "-", r["error"][:70])
            continue
        ok = "-" if r["passed"] is None else ("[green]yes[/]" if r["passed"] else "[bold red]no[/]")
        rss = "-" if "peak_rss_mb" not in r else f"{r['peak_rss_mb']:.0f} ({r['rss_delta_mb']:+.0f})"
        check = ("[green]ok[/] " if r["check_passed"] else "[bold red]MISMATCH[/] ") + r["check_detail"]
        table.add_row(op, r["dtype"], f"{r['ms']:.0f}", f"{r['gflops']:.2f}", f"{r['ratio']:.3f}",
                      f"{r['ratio_vs_best_gemm']:.3f}", target, ok, rss, check)
    console.print(table)
    console.print("KL FLOPs = 2*tokens*K*(N1*Dqk + 3*Nidx1*Didx); indexer FLOPs = 2*Nidx1*Didx*allowed pairs.",
                  highlight=False)


def main(argv=None) -> int:
    parser = common.cli_parser(__doc__, "no warm-up, 1 timed call, fewer GEMM repeats", devices=DEVICES,
                               threads=True, no_rss=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = common.console(180)
    warmup, repeats = (0, 1) if args.quick else (1, 5)
    busy = common.busy_warning()
    if busy:
        console.print(f"[yellow]warning[/]: {busy}", highlight=False)
    gemm = gemm_rate(3 if args.quick else 7)
    memory_before = common.memory_copy_bandwidth()
    progress = Progress(TextColumn("[bold]bench indexer"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
    results = []
    with progress:
        task = progress.add_task("", total=2 * len(DTYPES))
        for dtype_name in DTYPES:
            results += run(dtype_name, warmup, repeats, gemm["gflops"], not args.no_rss, args.threads, progress,
                           task)
    gemm_after = gemm_rate(3)
    print_table(results, gemm, console)
    console.print(f"memory copy bandwidth: {memory_before:.1f} GB/s before the cases, "
                  f"{common.memory_copy_bandwidth():.1f} GB/s after (the gather-bound cases slow down when it drops)",
                  highlight=False)
    payload = {
        "benchmark": "indexer",
        "device": "cpu",
        "machine": common.machine_info("cpu"),
        "busy_warning": busy,
        "settings": {"warmup": warmup, "repeats": repeats, "quick": args.quick, "B": B, "S1": S1, "S2": S2,
                     "N1": N1, "D": D, "D_rope": DR, "Nidx1": NIDX, "Didx": DIDX, "K": K, "sparse_mode": MODE,
                     "scale": SCALE, "target_kl_ratio": TARGET_KL,
                     "indices": "lightning_indexer top-512 (mode 3)",
                     "statistics": "fp32 sparse_flash_attention over the same selection (outside the timing)"},
        "gemm_fp32": gemm,
        "gemm_fp32_after": gemm_after,
        "memory_copy_gbps_before": memory_before,  # machine["memory_copy_gbps"] is measured after the run
        "flop_convention": {
            "kl_grad": "2*tokens*K*(N1*Dqk + 3*Nidx1*Didx), Dqk = 576 (main logits of the selected keys for the "
                       "target p; index scores, d_query_index and d_key_index GEMMs)",
            "indexer_fwd": "2*Nidx1*Didx*(allowed (row, key) pairs), the index-score GEMM",
            "ratio": "median GFLOP/s divided by the median fp32 torch.mm 2048x2048 GFLOP/s, timed alternately "
                     "with the case (gemm_paired_gflops); ratio_vs_best_gemm: divided by the run's best-of rate",
        },
        "results": results,
    }
    out_dir = Path(args.out)
    json_path = common.write_json(out_dir / "indexer_cpu.json", payload)
    png_path = ratio_plot(
        out_dir / "indexer_cpu.png", [f"{r['dtype']} {r['which']}" for r in results],
        [r.get("gflops") for r in results], gemm["gflops"], [r.get("ratio") for r in results],
        [r["target"] for r in results],
        f"DSA indexer, S1={S1} S2={S2} K={K} ({payload['machine']['cpu']}, {payload['machine']['torch_threads']} "
        "threads)")
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""), highlight=False)
    failed = [r for r in results if r.get("error") or not r.get("check_passed")]
    if failed:
        console.print("[bold red]errors / mismatches[/]: " + ", ".join(f"{r['dtype']} {r['which']}" for r in failed),
                      highlight=False)
        return 1
    return 1 if args.strict and any(r["passed"] is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
