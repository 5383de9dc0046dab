"""torch_npu._npu_paged_attention (ATB paged decode) against FIA decode over the same paged cache, on the CPU
reference backend, with PyTorch's scaled_dot_product_attention over gathered keys as the outside baseline.

Case (docs/operators/atb_attention.md; vLLM decode shapes): one query token for each of B=8 sequences with
4096..1024 keys, GQA 32/8 heads, D=128, caches [blocks, 128, 8, 128] shuffled in the pool, float16 and bfloat16.
The same cache serves both operators: `_npu_paged_attention` takes it as [blocks, block_size, KVN, D], FIA as the
BnBsH view [blocks, block_size, KVN * D]. The outputs are checked equal. Times: calls interleaved (ATB, FIA,
PyTorch, ATB, ...), best of N ("min"); target ATB time <= 1.1 x FIA time.

    python benchmarks/bench_atb.py [--quick] [--out DIR] [--threads N] [--strict]

Writes DIR/atb_cpu.json and DIR/atb_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

import cann_attn.torch_npu as torch_npu

DEVICES = ("cpu",)
TARGET = 1.1  # ATB time / FIA time
PAGE = 128


def decode_case(dtype: str, quick: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    batch, heads, heads_kv, d = (4, 16, 4, 128) if quick else (8, 32, 8, 128)
    top = 2048 if quick else 4096
    kv_lens = [top - (top * 3 // 4) * b // max(batch - 1, 1) for b in range(batch)]
    needed = [-(-n // PAGE) for n in kv_lens]
    blocks = sum(needed) + 2
    key_cache = torch.randn(blocks, PAGE, heads_kv, d, generator=gen).to(dt)
    value_cache = torch.randn(blocks, PAGE, heads_kv, d, generator=gen).to(dt)
    perm = torch.randperm(blocks, generator=gen)
    table = torch.full((batch, max(needed) + 1), -1, dtype=torch.int32)
    starts = torch.tensor([0, *needed]).cumsum(0).tolist()
    for b, n in enumerate(needed):
        table[b, :n] = perm[starts[b] : starts[b] + n].to(torch.int32)
    context_lens = torch.tensor(kv_lens, dtype=torch.int32)
    query = torch.randn(batch, heads, d, generator=gen).to(dt)
    out = torch.empty(batch, heads, d, dtype=dt)
    scale = d ** -0.5

    def atb():
        torch_npu._npu_paged_attention(query, key_cache, value_cache, heads_kv, heads, scale, table, context_lens,
                                       out)
        return out

    def fia():
        return torch_npu.npu_fused_infer_attention_score(
            query.unsqueeze(1), key_cache.flatten(2), value_cache.flatten(2), block_table=table, block_size=PAGE,
            actual_seq_lengths_kv=kv_lens, num_heads=heads, num_key_value_heads=heads_kv, scale=scale,
            input_layout="BSND")[0][:, 0]

    def pytorch():
        rows = []
        for b, n in enumerate(kv_lens):
            ids = table[b, : needed[b]].long()
            k = key_cache[ids].flatten(0, 1)[:n].transpose(0, 1)  # [KVN, n, D]
            v = value_cache[ids].flatten(0, 1)[:n].transpose(0, 1)
            rows.append(F.scaled_dot_product_attention(query[b].unsqueeze(1), k, v, scale=scale,
                                                       enable_gqa=True)[:, 0])
        return torch.stack(rows)

    flops = 4 * heads * sum(kv_lens) * d
    shape = f"B={batch} N={heads}/{heads_kv} D={d} Skv={kv_lens[0]}..{kv_lens[-1]} page={PAGE}"
    return {"atb": atb, "fia": fia, "pytorch": pytorch, "flops": flops, "shape": shape}


def _best_of_interleaved(fns: dict[str, Any], repeats: int) -> dict[str, dict[str, Any]]:
    """Each function `repeats` times, round-robin (the same load for all), after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: {"min_s": min(t), "median_s": sorted(t)[len(t) // 2], "times_s": t} for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = common.cli_parser(__doc__, "smaller shapes (a smoke run)", devices=DEVICES, threads=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 5 if args.quick else 15
    rows, failures = [], []
    for dtype in ("float16", "bfloat16"):
        built = decode_case(dtype, args.quick)
        a, f, p = built["atb"]().clone(), built["fia"](), built["pytorch"]()
        if not torch.equal(a, f):
            failures.append(f"{dtype}: _npu_paged_attention differs from FIA decode")
        t = _best_of_interleaved({k: built[k] for k in ("atb", "fia", "pytorch")}, repeats)
        row = {"case": f"paged decode {dtype}", "shape": built["shape"],
               **{f"{k}_ms": 1e3 * t[k]["min_s"] for k in t},
               "atb_over_fia": t["atb"]["min_s"] / t["fia"]["min_s"],
               "pytorch_over_atb": t["pytorch"]["min_s"] / t["atb"]["min_s"],
               "atb_gflops": common.gflops(built["flops"], t["atb"]["min_s"]),
               "atb_equals_fia": torch.equal(a, f),
               "max_abs_diff_vs_pytorch": float((a.float() - p.float()).abs().max()), "times": t}
        rows.append(row)
        print(f"{row['case']:22s} {row['shape']:50s} ATB {row['atb_ms']:7.2f} ms  FIA {row['fia_ms']:7.2f} ms  "
              f"PyTorch {row['pytorch_ms']:7.2f} ms  ATB/FIA {row['atb_over_fia']:.3f}", flush=True)
    out = Path(args.out)
    payload = {"benchmark": "_npu_paged_attention vs FIA decode on the same paged cache (CPU reference)",
               "quick": args.quick, "timing": f"interleaved, best of {repeats}", "target_atb_over_fia": TARGET,
               "machine": common.machine_info("cpu"), "threads": torch.get_num_threads(),
               "busy": common.busy_warning(), "rows": rows, "failures": failures}
    common.write_json(out / "atb_cpu.json", payload)
    common.bar_plot(out / "atb_cpu.png", [r["case"] for r in rows],
                    {name: [r[f"{name}_ms"] for r in rows] for name in ("atb", "fia", "pytorch")},
                    title="_npu_paged_attention vs FIA decode (same cache), CPU reference", ylabel="ms per call",
                    ratios=[1 / r["atb_over_fia"] for r in rows], targets=[1 / TARGET] * len(rows),
                    ratio_label="FIA time / ATB time (dashed: 1/1.1)")
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    missed = [r["case"] for r in rows if r["atb_over_fia"] > TARGET]
    return 1 if failures or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
