"""FusedInferAttentionScore (fused_infer_attention_score) prefill and decode vs PyTorch SDPA, measured in the same run.

  (a) prefill: B=1, N=32, S=2048, D=128, BNSD, causal (sparse_mode=3 with the compressed mask) vs
      SDPA(is_causal=True), fp16 and bf16                                                             target 0.8
  (b) decode: B=8, N=32 query heads, Nkv=8 (GQA), Q_S=1, KV_S=4096, D=128, BNSD vs
      SDPA(enable_gqa=True), fp16 and bf16                                                            target 1.0
  (c) peak memory of one call (fresh process, VmHWM): ours vs SDPA for the fp16 prefill and decode; the call's
      growth is reported beside the inputs' size (O(tile) for ours: no Sq x Skv matrix, no cache-sized copy in
      decode).
GFLOP/s use 2*B*N*visible_pairs*(Dqk+Dv) (causal triangle for (a)). Times are medians of repeats. Outputs are
checked against SDPA's (allclose); a mismatch makes the exit status 1 (with --strict, so does a missed target).

    python benchmarks/bench_fia.py [--quick] [--out DIR] [--strict] [--threads N] [--no-rss]

Writes DIR/fia_cpu.json and DIR/fia_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

import cann_attn

DEVICES = ("cpu",)

PREFILL = {"B": 1, "N": 32, "S": 2048, "D": 128}
DECODE = {"B": 8, "N": 32, "NKV": 8, "S": 4096, "D": 128}
TARGETS = {"prefill": 0.8, "decode": 1.0}
TOLERANCES = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def prefill_case(dtype_name: str = "fp16", impl: str = "ours"):
    """(call, info) of the causal prefill; also the child side of the peak-RSS measurement."""
    b, n, s, d = PREFILL["B"], PREFILL["N"], PREFILL["S"], PREFILL["D"]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen).to(DTYPES[dtype_name]) for _ in range(3))
    mask = cann_attn.compressed_mask(3)
    if impl == "ours":
        def call():
            return cann_attn.fused_infer_attention_score(q, k, v, atten_mask=mask, sparse_mode=3, num_heads=n,
                                                         input_layout="BNSD", scale=d**-0.5)[0]
    else:
        def call():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
    return call, {"impl": impl, "inputs_mb": 3 * q.numel() * q.element_size() / 2**20}


def decode_case(dtype_name: str = "fp16", impl: str = "ours"):
    b, n, nkv, s, d = DECODE["B"], DECODE["N"], DECODE["NKV"], DECODE["S"], DECODE["D"]
    gen = torch.Generator().manual_seed(1)
    dtype = DTYPES[dtype_name]
    q = torch.randn(b, n, 1, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, nkv, s, d, generator=gen).to(dtype) for _ in range(2))
    if impl == "ours":
        def call():
            return cann_attn.fused_infer_attention_score(q, k, v, num_heads=n, num_key_value_heads=nkv,
                                                         input_layout="BNSD", scale=d**-0.5)[0]
    else:
        def call():
            return F.scaled_dot_product_attention(q, k, v, scale=d**-0.5, enable_gqa=True)
    return call, {"impl": impl, "inputs_mb": 2 * k.numel() * k.element_size() / 2**20}


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    atol, rtol = TOLERANCES[a.dtype]
    return bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)), float((a.float() - b.float()).abs().max())


def run_benches(warmup: int, repeats: int, progress, task) -> list[dict[str, Any]]:
    results = []
    for kind, make in (("prefill", prefill_case), ("decode", decode_case)):
        cfg = PREFILL if kind == "prefill" else DECODE
        for dtype_name in DTYPES:
            progress.update(task, description=f"{kind} {dtype_name}")
            ours, _ = make(dtype_name, "ours")
            sdpa, _ = make(dtype_name, "sdpa")
            match, diff = _compare(ours(), sdpa())
            t_ours, t_sdpa = common.time_pair(ours, sdpa, warmup, repeats)
            if kind == "prefill":
                pairs = common.visible_pairs(cfg["S"], cfg["S"], pre=None, nxt=0)
                shape = f"B{cfg['B']} N{cfg['N']} S{cfg['S']} D{cfg['D']} causal"
            else:
                pairs = cfg["S"]
                shape = f"B{cfg['B']} N{cfg['N']}/{cfg['NKV']} Q_S1 KV_S{cfg['S']} D{cfg['D']}"
            flops = common.attention_flops(cfg["B"], cfg["N"], pairs, cfg["D"])
            results.append(common.ratio_record(
                key=f"{kind}_{dtype_name}", case=f"({'a' if kind == 'prefill' else 'b'}) {kind}", dtype=dtype_name,
                shape=shape, pairs=pairs, flops=flops, flops_name="flops", t_ours=t_ours, t_ref=t_sdpa,
                target=TARGETS[kind], allclose=match, max_abs_diff=diff,
            ))
            progress.advance(task)
    return results


def run_memory(progress, task) -> list[dict[str, Any]]:
    script = Path(__file__).resolve()
    rows = []
    for func in ("prefill_case", "decode_case"):
        entry: dict[str, Any] = {"case": func.replace("_case", ""), "dtype": "fp16"}
        for impl in ("ours", "sdpa"):
            progress.update(task, description=f"(c) peak RSS {func} {impl}")
            mem = common.peak_rss(script, func, {"dtype_name": "fp16", "impl": impl})
            entry[f"{impl}_peak_rss_mb"] = mem["peak_mb"]
            entry[f"{impl}_call_delta_mb"] = mem["delta_mb"]
            entry["inputs_mb"] = mem["inputs_mb"]
        progress.advance(task)
        rows.append(entry)
    return rows


def main(argv=None) -> int:
    parser = common.cli_parser(__doc__, "fewer repeats (1 warm-up, 2 timed)", devices=DEVICES, threads=True,
                               no_rss=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = common.console(150)
    busy = common.busy_warning()
    if busy:
        console.print(f"[yellow]warning[/]: {busy}", highlight=False)
    warmup, repeats = (1, 2) if args.quick else (1, 5)
    progress = Progress(TextColumn("[bold]bench fia"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
    with progress:
        task = progress.add_task("", total=4 + (0 if args.no_rss else 2))
        results = run_benches(warmup, repeats, progress, task)
        memory = [] if args.no_rss else run_memory(progress, task)
    common.print_ratio_table(console, "fused_infer_attention_score vs SDPA on CPU", results, None,
                             close_label="allclose (max diff)", long_label="")
    for m in memory:
        console.print(
            f"(c) {m['case']} fp16: call growth ours +{m['ours_call_delta_mb']:.0f} MB, SDPA "
            f"+{m['sdpa_call_delta_mb']:.0f} MB (inputs {m['inputs_mb']:.0f} MB; peak RSS ours "
            f"{m['ours_peak_rss_mb']:.0f} MB, SDPA {m['sdpa_peak_rss_mb']:.0f} MB)", highlight=False)

    payload = {
        "benchmark": "fia",
        "device": "cpu",
        "machine": common.machine_info("cpu"),
        "settings": {"warmup": warmup, "repeats": repeats, "quick": args.quick, "prefill": PREFILL, "decode": DECODE,
                     "targets": TARGETS},
        "flop_convention": "2*B*N*visible_pairs*(Dqk+Dv); decode: visible pairs = KV_S per row",
        "results": results,
        "memory": memory,
    }
    out_dir = Path(args.out)
    json_path = common.write_json(out_dir / "fia_cpu.json", payload)
    png_path = common.bar_plot(
        out_dir / "fia_cpu.png", [f"{r['dtype']} {r['case']}" for r in results],
        {"cann_attn": [r["ours_gflops"] for r in results], "PyTorch SDPA": [r["sdpa_gflops"] for r in results]},
        title=f"fused_infer_attention_score vs SDPA ({payload['machine']['cpu']}, "
        f"{payload['machine']['torch_threads']} threads)",
        ylabel="GFLOP/s", ratios=[r["ratio"] for r in results], targets=[r["target"] for r in results],
    )
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""), highlight=False)
    if any(not r["allclose"] for r in results):
        console.print("[bold red]output mismatch[/]: " + ", ".join(r["key"] for r in results if not r["allclose"]))
        return 1
    return 1 if args.strict and any(not r["passed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
