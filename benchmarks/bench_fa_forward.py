"""FlashAttentionScore forward vs PyTorch SDPA, measured in the same run (FLOPs as in benchmarks/common.py).

B=1, N=8, S=2048, D=128, fp32 and bf16, layout BNSD (ratio = SDPA time / our time; target: ratio >= it):
  (a) no mask: flash_attention_score(..., scale_value=D**-0.5) vs SDPA                           target 0.8
  (b) causal modes 2/3: atten_mask=compressed_mask(m), sparse_mode=m vs SDPA is_causal=True        target 0.8
  (c) band mode 4, pre=next=256 vs SDPA given the materialised float [S, S] mask (-inf outside)   target 1.5
  (d) ALiBi pse_type=2 (slopes fp32 [N]) vs SDPA given the bias -slope*|j-i| [1, N, S, S] (input dtype)
                                                                                                  target 1.5
  (e) S=32768, N=1, D=128, fp32, no mask: our peak RSS in a fresh process (target < 1.5 GB), and both times.
Times are medians of repeats. GFLOP/s: 2*B*N*visible_pairs*(Dqk+Dv) for both (the work the mask leaves), so
a and d count every pair, b the causal triangle and c the band. Our outputs are checked against SDPA's
(allclose) in the same run; a mismatch makes the exit status 1 (with --strict, so does a missed target).

    python benchmarks/bench_fa_forward.py [--quick] [--out DIR] [--device cpu|cuda] [--strict]

Writes DIR/fa_forward_<device>.json and DIR/fa_forward_<device>.png (default DIR: benchmarks/results).
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
DEVICES = ("cpu", "cuda")

B, N, S, D = 1, 8, 2048, 128
BAND = 256
LONG_S, LONG_N = 32768, 1
RSS_TARGET_GB = 1.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# allclose tolerances of our output vs SDPA's. SDPA adds the ALiBi bias rounded to the input dtype (bf16 has 8
# bits of mantissa, so logits near -8 move by up to 0.03); ours adds it in fp32, hence the looser bf16 bound.
TOLERANCES = {torch.float32: (2e-4, 2e-3), torch.bfloat16: (4e-2, 4e-2)}


@dataclass
class Bench:
    key: str
    label: str
    dtype: str
    target: float | None
    pairs: int
    ours: Any
    sdpa: Any


def alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32)


def make_qkv(seq: int, heads: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, heads, seq, D, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]


def benches(dtype_name: str, device: str) -> list[Bench]:
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(S, N, dtype, device)
    scale = D**-0.5
    dense = S * S
    out: list[Bench] = []

    def ours(**kw):
        return lambda: (
            cann_attn.flash_attention_score(q, k, v, N, "BNSD", scale_value=scale, **kw).attention_out
        )

    def sdpa(**kw):
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, **kw)

    out.append(Bench("a_dense", "(a) no mask", dtype_name, 0.8, dense, ours(), sdpa()))
    causal = common.visible_pairs(S, S, pre=None, nxt=0)
    for mode in (2, 3):
        mask = cann_attn.compressed_mask(mode, device)
        out.append(
            Bench(
                f"b_causal_mode{mode}",
                f"(b) causal mode {mode}",
                dtype_name,
                0.8,
                causal,
                ours(atten_mask=mask, sparse_mode=mode),
                sdpa(is_causal=True),
            )
        )
    i = torch.arange(S, device=device).view(-1, 1)
    j = torch.arange(S, device=device).view(1, -1)
    outside = (j > i + BAND) | (j < i - BAND)
    band_mask = torch.zeros(S, S, dtype=dtype, device=device).masked_fill_(outside, float("-inf"))
    out.append(
        Bench(
            "c_band_mode4",
            f"(c) band mode 4 pre=next={BAND}",
            dtype_name,
            1.5,
            common.visible_pairs(S, S, pre=BAND, nxt=BAND),
            ours(
                atten_mask=cann_attn.compressed_mask(4, device),
                sparse_mode=4,
                pre_tokens=BAND,
                next_tokens=BAND,
            ),
            sdpa(attn_mask=band_mask),
        )
    )
    slopes = alibi_slopes(N).to(device)
    bias = (-slopes.view(1, N, 1, 1) * (j - i).abs().to(torch.float32)).to(dtype)  # [1, N, S, S]
    out.append(
        Bench(
            "d_alibi",
            "(d) ALiBi pse_type 2",
            dtype_name,
            1.5,
            dense,
            ours(pse=slopes, pse_type=2),
            sdpa(attn_mask=bias),
        )
    )
    return out


# Child side of the peak-RSS measurement (run in a fresh interpreter by common.peak_rss).
def long_case(impl: str, device: str = "cpu"):
    q, k, v = make_qkv(LONG_S, LONG_N, torch.float32, device, seed=1)
    if impl == "ours":

        def call():
            return cann_attn.flash_attention_score(q, k, v, LONG_N, "BNSD", scale_value=D**-0.5)
    else:

        def call():
            return F.scaled_dot_product_attention(q, k, v, scale=D**-0.5)

    return call, {"impl": impl, "device": device}


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    atol, rtol = TOLERANCES[a.dtype]
    diff = float((a.float() - b.float()).abs().max())
    return bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)), diff


def run_benches(args, warmup: int, repeats: int, progress, task) -> list[dict[str, Any]]:
    results = []
    for dtype_name in DTYPES:
        for bench in benches(dtype_name, args.device):
            progress.update(task, description=f"{dtype_name} {bench.label}")
            match, diff = _compare(bench.ours(), bench.sdpa())
            t_ours, t_sdpa = common.time_pair(bench.ours, bench.sdpa, warmup, repeats, args.device)
            flops = common.attention_flops(B, N, bench.pairs, D)
            results.append(common.ratio_record(
                key=bench.key, case=bench.label, dtype=dtype_name, shape=f"B{B} N{N} S{S} D{D}",
                pairs=bench.pairs, flops=flops, flops_name="flops", t_ours=t_ours, t_ref=t_sdpa,
                target=bench.target, allclose=match, max_abs_diff=diff,
            ))
            progress.advance(task)
    return results


def run_long(args, progress, task) -> dict[str, Any]:
    """(e): peak memory of our op (fresh process), and the times of ours and SDPA at S=32768."""
    script = Path(__file__).resolve()
    progress.update(task, description=f"(e) S={LONG_S}: peak RSS (ours, fresh process)")
    mem_ours = common.peak_rss(script, "long_case", {"impl": "ours", "device": args.device})
    progress.update(task, description=f"(e) S={LONG_S}: peak RSS (SDPA, fresh process)")
    mem_sdpa = common.peak_rss(script, "long_case", {"impl": "sdpa", "device": args.device})
    progress.update(task, description=f"(e) S={LONG_S}: times")
    ours, _ = long_case("ours", args.device)
    sdpa, _ = long_case("sdpa", args.device)
    result, t_ours = common.timed_once(ours, args.device)  # one call each: ~10 s per call on 2 cores
    out_ours = result.attention_out
    out_sdpa, t_sdpa = common.timed_once(sdpa, args.device)
    match, diff = _compare(out_ours, out_sdpa)
    del out_ours, out_sdpa
    flops = common.attention_flops(B, LONG_N, LONG_S * LONG_S, D)
    peak_gb = mem_ours["peak_mb"] / 1024
    progress.advance(task)
    return {
        "key": "e_long",
        "case": f"(e) S={LONG_S} no mask",
        "dtype": "fp32",
        "shape": f"B{B} N{LONG_N} S{LONG_S} D{D}",
        "flops": flops,
        "ours_ms": t_ours * 1e3,
        "sdpa_ms": t_sdpa * 1e3,
        "ours_gflops": common.gflops(flops, t_ours),
        "sdpa_gflops": common.gflops(flops, t_sdpa),
        "ratio": t_sdpa / t_ours,
        "ours_peak_rss_mb": mem_ours["peak_mb"],
        "ours_rss_before_call_mb": mem_ours["before_mb"],
        "ours_rss_call_delta_mb": mem_ours["delta_mb"],
        "ours_call_s_in_child": mem_ours["seconds"],
        "sdpa_peak_rss_mb": mem_sdpa["peak_mb"],
        "sdpa_rss_call_delta_mb": mem_sdpa["delta_mb"],
        "ours_cuda_peak_mb": mem_ours.get("cuda_peak_mb"),
        "sdpa_cuda_peak_mb": mem_sdpa.get("cuda_peak_mb"),
        "rss_target_gb": RSS_TARGET_GB,
        "passed": peak_gb < RSS_TARGET_GB,
        "allclose": match,
        "max_abs_diff": diff,
    }


def print_tables(results, long, console) -> None:
    title = f"FlashAttentionScore forward vs SDPA ({results[0]['shape']}, BNSD)"
    common.print_ratio_table(console, title, results, long, close_label="allclose (max diff)", long_label="fp32")

def main(argv=None) -> int:
    parser = common.cli_parser(__doc__, "fewer repeats (1 warm-up, 3 timed)", devices=DEVICES)
    parser.add_argument("--skip-long", action="store_true", help="skip (e), the S=32768 case")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = common.console(150)
    busy_before = common.busy_warning()
    if busy_before:
        console.print(f"[yellow]warning[/]: {busy_before}", highlight=False)
    warmup, repeats = (1, 3) if args.quick else (2, 7)
    total = 2 * 5 + (0 if args.skip_long else 1)
    progress = Progress(
        TextColumn("[bold]bench fa_forward"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task("", total=total)
        results = run_benches(args, warmup, repeats, progress, task)
        long = None if args.skip_long else run_long(args, progress, task)

    print_tables(results, long, console)
    busy_after = common.busy_warning()
    if busy_after:
        console.print(f"[yellow]warning[/] (after the run): {busy_after}", highlight=False)
    out_dir = Path(args.out)
    payload = {
        "benchmark": "fa_forward",
        "device": args.device,
        "machine": common.machine_info(args.device),
        "settings": {
            "warmup": warmup,
            "repeats": repeats,
            "quick": args.quick,
            "B": B,
            "N": N,
            "S": S,
            "D": D,
            "band": BAND,
            "long": {"S": LONG_S, "N": LONG_N, "repeats": 1},
        },
        "flop_convention": "2*B*N*visible_pairs*(Dqk+Dv)",
        "warnings": {"before": busy_before, "after": busy_after},
        "results": results,
        "long": long,
    }
    json_path = common.write_json(out_dir / f"fa_forward_{args.device}.json", payload)
    rows = [*results, long] if long else results
    png_path = common.bar_plot(
        out_dir / f"fa_forward_{args.device}.png",
        [f"{r['dtype']} {r['case']}" for r in rows],
        {"cann_attn": [r["ours_gflops"] for r in rows], "PyTorch SDPA": [r["sdpa_gflops"] for r in rows]},
        title=f"FlashAttentionScore forward vs SDPA on {args.device} ({payload['machine']['cpu']}, "
        f"{payload['machine']['torch_threads']} threads)",
        ylabel="GFLOP/s (visible pairs)",
        ratios=[r["ratio"] for r in rows],
        targets=[r.get("target") for r in rows],
    )
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""), highlight=False)
    mismatched = [r for r in rows if not r["allclose"]]
    missed = [r for r in rows if not r["passed"]]
    if mismatched:
        names = ", ".join(f"{r['dtype']} {r['case']}" for r in mismatched)
        console.print(f"[bold red]output mismatch vs SDPA[/]: {names}")
        return 1
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
