"""Block-sparse attention whose rows select different blocks, on the CPU: the native per-row loops against the path
chosen before them (gather or union), and the measurement behind sparse_attention.NATIVE_UNION_RATIO.

  figure:     SparseFlashAttention fp32 forward and backward, B1 S1 1024 S2 4096 N1 16 D 512 + 64, block 64,
              sparse_mode 0, each row 8 random blocks of the 64 (bench_sparse_attention's dispersed selection):
              GFLOP/s (actual selected tokens) over a 2048^3 fp32 torch.mm's, both paths;
  threshold:  S1 256, each row 8 random blocks of a per-tile pool of 8..64 blocks (32-row tiles): time of the
              path chosen before over the native loops', against the union of a tile's blocks over the rows'
              selections.

The clock is this process's CPU time with one thread (on a shared machine wall-clock times move with the
neighbours' load); the two paths (NATIVE_UNION_RATIO 0, the native loops forced, and inf, the path chosen before) and
the GEMM are alternated in one process and the best of `--repeats` is kept.

    python benchmarks/bench_sparse_dispersed.py [--repeats N] [--out DIR] [--quick] [--strict]

--strict: exit 1 where the native forward runs below TARGET (0.45) of the GEMM rate.

Writes DIR/sparse_dispersed_blocks_cpu.json and .png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sparse_attention as sfa_bench
import common

from cann_attn.backends.reference import sparse_attention

# --device choices (cann-attn bench reads this line).
DEVICES = ("cpu",)
BLOCK = 64
# --strict: the native forward's GFLOP/s at least this fraction of the GEMM's.
TARGET = 0.45
PATHS = {"native": 0.0, "before": float("inf")}
CHOSEN_RATIO = sparse_attention.NATIVE_UNION_RATIO
POOLS = (8, 10, 12, 16, 24, 32, 64)


def _best_times(calls: dict[str, Any], repeats: int) -> dict[str, float]:
    """Best CPU time of each (path, name) call, the paths alternated with each other (and with the GEMM)."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        for path, ratio in PATHS.items():
            sparse_attention.NATIVE_UNION_RATIO = ratio
            for name, call in calls.items():
                start = time.process_time()
                call()
                key = name if name == "gemm" else f"{path} {name}"
                best[key] = min(best.get(key, float("inf")), time.process_time() - start)
    sparse_attention.NATIVE_UNION_RATIO = CHOSEN_RATIO
    return best


def _calls(inp: dict[str, Any], gemm=None) -> dict[str, Any]:
    forward = sfa_bench.forward_call(inp, BLOCK)
    out = forward()
    d_out = torch.randn(out.attention_out.shape, generator=torch.Generator().manual_seed(1))
    calls = {"forward": forward, "backward": sfa_bench.backward_call(inp, BLOCK, out, d_out)}
    return {**calls, "gemm": gemm} if gemm is not None else calls


def figure(repeats: int) -> dict[str, Any]:
    inp = sfa_bench.make_inputs(torch.float32, BLOCK, mode=0, dispersed=True)
    gemm, gemm_flops = sfa_bench.gemm_call(2048)
    best = _best_times(_calls(inp, gemm), repeats)
    gemm_gflops = gemm_flops / best["gemm"] / 1e9
    flops = {"forward": sfa_bench.forward_flops(sfa_bench.S1, inp["avg_topk"]),
             "backward": sfa_bench.backward_flops(sfa_bench.S1, inp["avg_topk"])}
    rows = [{"path": path, "which": which, "ms": best[f"{path} {which}"] * 1e3,
             "gflops": flops[which] / best[f"{path} {which}"] / 1e9,
             "ratio_to_gemm": flops[which] / best[f"{path} {which}"] / 1e9 / gemm_gflops}
            for path in PATHS for which in flops]
    return {"shape": f"B1 S1={sfa_bench.S1} S2={sfa_bench.S2} N1={sfa_bench.N1} D={sfa_bench.D}+{sfa_bench.DR}, "
                     f"block {BLOCK}, sparse_mode 0, {sfa_bench.K // BLOCK} random blocks per row",
            "avg_topk": inp["avg_topk"], "gemm_gflops": gemm_gflops, "rows": rows}


def _pool_indices(pool: int, rows: int) -> torch.Tensor:
    """Each row 8 random blocks of its 32-row tile's pool of `pool` consecutive blocks, then -1."""
    gen = torch.Generator().manual_seed(0)
    per_row, n_blocks = sfa_bench.K // BLOCK, sfa_bench.S2 // BLOCK
    idx = torch.full((rows, sfa_bench.K), -1, dtype=torch.int64)
    for t in range(rows):
        start = (t // 32 * 7) % (n_blocks - pool + 1)
        idx[t, :per_row] = start + torch.randperm(pool, generator=gen)[:per_row]
    return idx.to(torch.int32).view(1, rows, 1, -1)


def threshold(repeats: int, rows: int) -> list[dict[str, Any]]:
    saved = sfa_bench.S1
    sfa_bench.S1 = rows
    try:
        results = []
        for pool in POOLS:
            inp = sfa_bench.make_inputs(torch.float32, BLOCK, mode=0)
            inp["sparse_indices"] = _pool_indices(pool, rows)
            selection = sparse_attention.row_selection(inp["sparse_indices"][0, :, 0], torch.arange(rows),
                                                       sparse_mode=0, seq_q=rows, seq_kv=sfa_bench.S2,
                                                       block_size=BLOCK)
            counts = sparse_attention._union_block_counts(selection, sparse_attention.ROW_TILE,
                                                          sfa_bench.S2 // BLOCK)
            union = sum(c * sparse_attention.ROW_TILE for c in counts) / int(selection.entry_valid.sum())
            best = _best_times(_calls(inp), repeats)
            results.append({"pool_blocks": pool, "union_over_selected": union,
                            **{f"{key.replace(' ', '_')}_s": t for key, t in best.items()},
                            "forward_before_over_native": best["before forward"] / best["native forward"],
                            "backward_before_over_native": best["before backward"] / best["native backward"]})
            print(f"  pool {pool:>2}: union / selected {union:.2f}, before / native: forward "
                  f"{results[-1]['forward_before_over_native']:.2f}, backward "
                  f"{results[-1]['backward_before_over_native']:.2f}", flush=True)
        return results
    finally:
        sfa_bench.S1 = saved


def plot(path: Path, fig_data: dict[str, Any], sweep: list[dict[str, Any]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = fig_data["rows"]
    left.bar(range(len(rows)), [r["ratio_to_gemm"] for r in rows],
             color=["tab:gray" if r["path"] == "before" else "tab:green" for r in rows])
    left.set_xticks(range(len(rows)), [f"{r['which']}\n{r['path']}" for r in rows])
    for i, r in enumerate(rows):
        left.text(i, r["ratio_to_gemm"], f"{r['ratio_to_gemm']:.2f}", ha="center", va="bottom")
    left.set_ylabel("GFLOP/s / fp32 GEMM GFLOP/s (1 thread)")
    left.set_title(fig_data["shape"], fontsize=8)
    x = [r["union_over_selected"] for r in sweep]
    right.plot(x, [r["forward_before_over_native"] for r in sweep], "o-", label="forward")
    right.plot(x, [r["backward_before_over_native"] for r in sweep], "s-", label="backward")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.axvline(CHOSEN_RATIO, color="tab:red", linestyle="--", label=f"NATIVE_UNION_RATIO {CHOSEN_RATIO}")
    right.set_xlabel("union of a tile's blocks / blocks its rows select")
    right.set_ylabel("time before / time of the native loops")
    right.set_title("native per-row loops vs the path chosen before (1 thread)", fontsize=9)
    right.legend()
    return common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = common.cli_parser(__doc__, "one repeat, 64-row threshold sweep", devices=DEVICES)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each path (best kept)")
    args = parser.parse_args(argv)
    args.out = Path(args.out)
    torch.set_num_threads(1)
    repeats = 1 if args.quick else args.repeats
    fig_data = figure(repeats)
    for r in fig_data["rows"]:
        print(f"  {r['which']:<8} {r['path']:<6} {r['ms']:8.1f} ms  {r['ratio_to_gemm']:.3f} of the GEMM rate")
    sweep = threshold(max(1, repeats - 2), 64 if args.quick else 256)
    payload = {"benchmark": "sparse_dispersed_blocks", "device": "cpu", "machine": common.machine_info("cpu"),
               "busy_warning": common.busy_warning(),
               "clock": f"process CPU time, one thread, best of {repeats} (threshold sweep: {max(1, repeats - 2)}), "
                        "the paths alternated in one process",
               "paths": {"native": "NATIVE_UNION_RATIO 0: the native per-row loops (forced)",
                         "before": "NATIVE_UNION_RATIO inf: the gather / union path chosen before"},
               "figure": fig_data, "threshold": sweep}
    json_path = common.write_json(args.out / "sparse_dispersed_blocks_cpu.json", payload)
    png_path = plot(args.out / "sparse_dispersed_blocks_cpu.png", fig_data, sweep)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    native_forward = next(r for r in fig_data["rows"] if r["path"] == "native" and r["which"] == "forward")
    return 1 if args.strict and native_forward["ratio_to_gemm"] < TARGET else 0


if __name__ == "__main__":
    sys.exit(main())
