"""PromptFlashAttentionV2 (prompt_flash_attention) forward vs PyTorch SDPA, measured in the same run.

B=1, N=8 query heads with GQA 8:2 (num_key_value_heads=2), S=2048, D=128, layout BNSD, causal:
  (a) fp16 and bf16: sparse_mode=3 with the compressed mask vs SDPA(is_causal=True, enable_gqa=True)   target 0.8
  (b) int8 inputs (deq_scale1/quant_scale1/deq_scale2) with fp16 output, and with int8 output
      (quant_scale2 + quant_offset2): time and throughput reported beside SDPA fp16 (ratio shown, no target).
GFLOP/s use the convention 2*B*N*visible_pairs*(Dqk+Dv) with the causal triangle's visible pairs, for
ours and SDPA alike. Times are medians of repeats. The fp16/bf16 outputs are checked against SDPA's (allclose);
the int8 -> fp16 output against SDPA on the dequantized inputs (loose: p is quantized to int8). A mismatch makes
the exit status 1 (with --strict, so does a missed target).

    python benchmarks/bench_pfa.py [--quick] [--out DIR] [--device cpu] [--strict] [--threads N]

Writes DIR/pfa_cpu.json and DIR/pfa_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

import cann_attn

# --device choices (the first is the default); cann-attn bench reads this line to pass --device only where it
# applies.
DEVICES = ("cpu",)

B, N, NKV, S, D = 1, 8, 2, 2048, 128
SCALE = D**-0.5
MODE = 3  # rightDownCausal; Sq == Skv, so the same triangle as SDPA's top-left is_causal
TARGET = 0.8
# allclose tolerances of our output vs SDPA's (bf16 outputs carry 8 mantissa bits)
TOLERANCES = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
INT8_TOL = (6e-2, 6e-2)  # int8 inputs, fp16 output vs SDPA on the dequantized inputs: p quantized to 1/127 steps


@dataclass
class Bench:
    key: str
    label: str
    dtype: str
    target: float | None
    ours: Any
    sdpa: Any
    check: Any  # () -> (allclose, max_abs_diff) or None


def make_inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, S, D, generator=gen)
    k = torch.randn(B, NKV, S, D, generator=gen)
    v = torch.randn(B, NKV, S, D, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sdpa_fn(q, k, v):
    def call():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)

    return call


def float_bench(dtype_name: str, dtype: torch.dtype) -> Bench:
    q, k, v = make_inputs(dtype)
    mask = cann_attn.compressed_mask(MODE)

    def ours():
        return cann_attn.prompt_flash_attention(
            q,
            k,
            v,
            atten_mask=mask,
            sparse_mode=MODE,
            num_heads=N,
            num_key_value_heads=NKV,
            input_layout="BNSD",
            scale_value=SCALE,
        )

    sdpa = sdpa_fn(q, k, v)

    def check():
        a, b = ours().float(), sdpa().float()
        atol, rtol = TOLERANCES[dtype]
        return bool(torch.allclose(a, b, atol=atol, rtol=rtol)), float((a - b).abs().max())

    return Bench(f"causal_{dtype_name}", f"causal mode {MODE}", dtype_name, TARGET, ours, sdpa, check)


def int8_benches() -> list[Bench]:
    """int8 Q/K/V quantized per tensor from the fp32 inputs; scales chosen as a quantizing model would."""
    qf, kf, vf = make_inputs(torch.float32)
    sq, sk, sv = (float(t.abs().max()) / 127.0 for t in (qf, kf, vf))
    q8, k8, v8 = (torch.round(t / s).clamp(-128, 127).to(torch.int8) for t, s in ((qf, sq), (kf, sk), (vf, sv)))
    mask = cann_attn.compressed_mask(MODE)
    quant1 = 127.0
    scales = {
        "deq_scale1": cann_attn.trans_quant_param(torch.tensor([sq * sk], dtype=torch.float32)),
        "quant_scale1": torch.tensor([quant1], dtype=torch.float32),
        "deq_scale2": cann_attn.trans_quant_param(torch.tensor([sv / quant1], dtype=torch.float32)),
    }
    common_kw = {
        "atten_mask": mask,
        "sparse_mode": MODE,
        "num_heads": N,
        "num_key_value_heads": NKV,
        "input_layout": "BNSD",
        "scale_value": SCALE,
        **scales,
    }
    # SDPA fp16 on the dequantized inputs: the float computation the int8 path approximates
    qd, kd, vd = ((t.float() * s).half() for t, s in ((q8, sq), (k8, sk), (v8, sv)))
    sdpa = sdpa_fn(qd, kd, vd)

    def ours_fp16():
        return cann_attn.prompt_flash_attention(q8, k8, v8, **common_kw)

    def ours_int8():
        return cann_attn.prompt_flash_attention(
            q8, k8, v8, quant_scale2=torch.tensor([40.0]), quant_offset2=torch.tensor([1.0]), **common_kw
        )

    def check_fp16():
        a, b = ours_fp16().float(), sdpa().float()
        return bool(torch.allclose(a, b, atol=INT8_TOL[0], rtol=INT8_TOL[1])), float((a - b).abs().max())

    def check_int8():
        a = ours_int8().float()
        b = torch.round(sdpa().float() * 40.0 + 1.0).clamp(-128, 127)
        diff = float((a - b).abs().max())
        return diff <= 4.0, diff  # within a few int8 steps of the quantized float result

    return [
        Bench("int8_fp16out", "int8 in, fp16 out", "int8", None, ours_fp16, sdpa, check_fp16),
        Bench("int8_int8out", "int8 in, int8 out", "int8", None, ours_int8, sdpa, check_int8),
    ]


def run_benches(warmup: int, repeats: int, progress, task) -> list[dict[str, Any]]:
    pairs = common.visible_pairs(S, S, pre=None, nxt=0)
    flops = common.attention_flops(B, N, pairs, D)
    benches = [float_bench("fp16", torch.float16), float_bench("bf16", torch.bfloat16), *int8_benches()]
    results = []
    sdpa_cache: dict[str, dict[str, Any]] = {}
    for bench in benches:
        progress.update(task, description=f"{bench.dtype} {bench.label}")
        match, diff = bench.check()
        sdpa_key = "fp16" if bench.dtype == "int8" else bench.dtype
        if bench.dtype == "int8" and sdpa_key in sdpa_cache:
            t_ours = common.time_fn(bench.ours, warmup, repeats)
        else:
            t_ours, sdpa_cache[sdpa_key] = common.time_pair(bench.ours, bench.sdpa, warmup, repeats)
        t_sdpa = sdpa_cache[sdpa_key]
        ratio = t_sdpa["median_s"] / t_ours["median_s"]
        results.append(
            {
                "key": bench.key,
                "case": bench.label,
                "dtype": bench.dtype,
                "sdpa_reference": f"SDPA {sdpa_key} is_causal enable_gqa",
                "shape": f"B{B} N{N} Nkv{NKV} S{S} D{D}",
                "visible_pairs": pairs,
                "flops": flops,
                "ours_ms": t_ours["median_s"] * 1e3,
                "sdpa_ms": t_sdpa["median_s"] * 1e3,
                "ours_times_s": t_ours["times_s"],
                "sdpa_times_s": t_sdpa["times_s"],
                "ours_gflops": flops / t_ours["median_s"] / 1e9,
                "sdpa_gflops": flops / t_sdpa["median_s"] / 1e9,
                "ratio": ratio,
                "target": bench.target,
                "passed": None if bench.target is None else ratio >= bench.target,
                "allclose": match,
                "max_abs_diff": diff,
            }
        )
        progress.advance(task)
    return results


def print_table(results, console) -> None:
    from rich.table import Table

    table = Table(
        title=f"prompt_flash_attention vs SDPA on CPU ({results[0]['shape']}, BNSD, causal)", header_style="bold"
    )
    for col in (
        "case",
        "dtype",
        "ours ms",
        "SDPA ms",
        "ours GFLOP/s",
        "SDPA GFLOP/s",
        "ratio",
        "target",
        "pass",
        "check (max diff)",
    ):
        table.add_column(col, justify="left" if col in ("case", "dtype") else "right")
    for r in results:
        if r["passed"] is None:
            verdict, target = "-", "(reported)"
        else:
            verdict = "[green]pass[/]" if r["passed"] else "[bold red]FAIL[/]"
            target = f">= {r['target']}"
        close = ("[green]yes[/]" if r["allclose"] else "[bold red]NO[/]") + f" ({r['max_abs_diff']:.1e})"
        table.add_row(
            r["case"],
            r["dtype"],
            f"{r['ours_ms']:.1f}",
            f"{r['sdpa_ms']:.1f}",
            f"{r['ours_gflops']:.1f}",
            f"{r['sdpa_gflops']:.1f}",
            f"{r['ratio']:.2f}",
            target,
            verdict,
            close,
        )
    console.print(table)
    console.print(
        "int8 rows: ratio = SDPA fp16 (dequantized inputs) time / ours; GFLOP/s count the same causal "
        "FLOPs as the float rows.",
        highlight=False,
    )


def main(argv=None) -> int:
    parser = common.cli_parser(__doc__, "fewer repeats (1 warm-up, 2 timed)", devices=DEVICES, threads=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = common.console(150)
    warmup, repeats = (1, 2) if args.quick else (1, 5)
    progress = Progress(
        TextColumn("[bold]bench pfa"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task("", total=4)
        results = run_benches(warmup, repeats, progress, task)
    print_table(results, console)

    out_dir = Path(args.out)
    payload = {
        "benchmark": "pfa",
        "device": "cpu",
        "machine": common.machine_info("cpu"),
        "settings": {
            "warmup": warmup,
            "repeats": repeats,
            "quick": args.quick,
            "B": B,
            "N": N,
            "num_key_value_heads": NKV,
            "S": S,
            "D": D,
            "sparse_mode": MODE,
            "scale": SCALE,
            "target_ratio": TARGET,
        },
        "flop_convention": "2*B*N*visible_pairs*(Dqk+Dv), causal visible pairs",
        "results": results,
    }
    json_path = common.write_json(out_dir / "pfa_cpu.json", payload)
    png_path = common.bar_plot(
        out_dir / "pfa_cpu.png",
        [r["case"] if r["dtype"] == "int8" else f"{r['dtype']} {r['case']}" for r in results],
        {"cann_attn": [r["ours_gflops"] for r in results], "PyTorch SDPA": [r["sdpa_gflops"] for r in results]},
        title=f"prompt_flash_attention vs SDPA, causal GQA 8:2 S={S} D={D} ({payload['machine']['cpu']}, "
        f"{payload['machine']['torch_threads']} threads)",
        ylabel="GFLOP/s (causal visible pairs)",
        ratios=[r["ratio"] for r in results],
        targets=[r["target"] for r in results],
    )
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""), highlight=False)
    if any(not r["allclose"] for r in results):
        console.print("[bold red]output mismatch[/]: " + ", ".join(r["key"] for r in results if not r["allclose"]))
        return 1
    missed = [r for r in results if r["passed"] is False]
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
