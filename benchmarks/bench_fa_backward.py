"""FlashAttentionScore forward + backward (cann_attn.flash_attention, autograd through FlashAttentionScoreGradV2)
vs PyTorch SDPA + autograd, measured in the same run (FLOPs as in
benchmarks/common.py).

B=1, N=8, S=2048, D=128, fp32 and bf16, layout BNSD; each timed call is forward + `.backward(dy)` on leaf inputs
with requires_grad (their .grad reset before every call):
  (a) no mask                                                              vs SDPA                target >= 0.8
  (b) causal: atten_mask=compressed_mask(3), sparse_mode=3                 vs SDPA is_causal=True target >= 0.8
  (c) band mode 4, pre=next=256       vs SDPA with the materialised float [S, S] mask (-inf outside) target >= 1.5
  (d) ALiBi pse_type=2 (slopes 2**(-8(h+1)/N), fp32 [N]) vs SDPA with the float bias [1, N, S, S]  target >= 1.5
  (e) S=16384, N=1, D=128, fp32, no mask: our peak RSS during forward + backward in a fresh process (target
      < 2 GB), SDPA's for comparison, and both times.
ratio = SDPA time / our time (median of repeats). FLOPs: forward = 2*B*N*visible_pairs*(Dqk+Dv),
backward = 2.5 x forward, so forward + backward = 3.5 x forward; (a)/(d) count every pair, (b) the causal
triangle, (c) the band, for both implementations. Our dq/dk/dv are checked against SDPA's (allclose) in the same
run; a mismatch makes the exit status 1 (with --strict, so does a missed target).

    python benchmarks/bench_fa_backward.py [--quick] [--out DIR] [--device cpu|cuda] [--strict] [--skip-long]

Writes DIR/fa_backward_<device>.json and DIR/fa_backward_<device>.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
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
LONG_S, LONG_N = 16384, 1
RSS_TARGET_GB = 2.0
FWD_BWD_FACTOR = 3.5  # forward + backward FLOPs = (1 + 2.5) x forward
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# allclose tolerances of our gradients vs SDPA's: both accumulate in fp32, but bf16 rounds the inputs of each
# GEMM (SDPA also rounds P and dS to bf16) and SDPA adds the ALiBi bias / band mask rounded to bf16.
TOLERANCES = {torch.float32: (1e-3, 1e-3), torch.bfloat16: (6e-2, 6e-2)}


@dataclass
class Bench:
    key: str
    label: str
    dtype: str
    target: float | None
    pairs: int
    ours: Callable[[], Any]
    sdpa: Callable[[], Any]
    grads: Callable[[], tuple[torch.Tensor, ...]]


def alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32)


def make_inputs(seq: int, heads: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Leaf q, k, v with requires_grad, and the upstream gradient dy (all [B, heads, seq, D])."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dy = (torch.randn(B, heads, seq, D, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dy


def fwd_bwd(forward: Callable[[], torch.Tensor], leaves, dy: torch.Tensor) -> Callable[[], None]:
    """One training step of attention: forward, then .backward(dy) into freshly reset .grad."""

    def step() -> None:
        for t in leaves:
            t.grad = None
        forward().backward(dy)

    return step


def benches(dtype_name: str, device: str) -> list[Bench]:
    dtype = DTYPES[dtype_name]
    q, k, v, dy = make_inputs(S, N, dtype, device)
    leaves = (q, k, v)
    scale = D**-0.5
    dense = S * S

    def ours(**kw):
        return fwd_bwd(lambda: cann_attn.flash_attention(q, k, v, N, "BNSD", scale_value=scale, **kw), leaves, dy)

    def sdpa(**kw):
        return fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, **kw), leaves, dy)

    def grads():
        return tuple(t.grad.detach().clone() for t in leaves)

    out: list[Bench] = [Bench("a_dense", "(a) no mask", dtype_name, 0.8, dense, ours(), sdpa(), grads)]
    out.append(
        Bench(
            "b_causal_mode3",
            "(b) causal mode 3",
            dtype_name,
            0.8,
            common.visible_pairs(S, S, pre=None, nxt=0),
            ours(atten_mask=cann_attn.compressed_mask(3, device), sparse_mode=3),
            sdpa(is_causal=True),
            grads,
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
            ours(atten_mask=cann_attn.compressed_mask(4, device), sparse_mode=4, pre_tokens=BAND, next_tokens=BAND),
            sdpa(attn_mask=band_mask),
            grads,
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
            grads,
        )
    )
    return out


# Child side of the peak-RSS measurement (run in a fresh interpreter by common.peak_rss).
def long_case(impl: str, device: str = "cpu"):
    q, k, v, dy = make_inputs(LONG_S, LONG_N, torch.float32, device, seed=1)
    if impl == "ours":
        step = fwd_bwd(lambda: cann_attn.flash_attention(q, k, v, LONG_N, "BNSD", scale_value=D**-0.5), (q, k, v), dy)
    else:
        step = fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, scale=D**-0.5), (q, k, v), dy)
    return step, {"impl": impl, "device": device}


def _compare(ours: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> tuple[bool, float]:
    """allclose of every gradient (dq, dk, dv), and the largest absolute difference."""
    atol, rtol = TOLERANCES[ours[0].dtype]
    ok, diff = True, 0.0
    for a, b in zip(ours, ref, strict=True):
        a, b = a.float(), b.float()
        ok &= bool(torch.allclose(a, b, atol=atol, rtol=rtol))
        diff = max(diff, float((a - b).abs().max()))
    return ok, diff


def run_benches(args, warmup: int, repeats: int, progress, task) -> list[dict[str, Any]]:
    results = []
    for dtype_name in DTYPES:
        for bench in benches(dtype_name, args.device):
            progress.update(task, description=f"{dtype_name} {bench.label}")
            bench.ours()
            ours_grads = bench.grads()
            bench.sdpa()
            match, diff = _compare(ours_grads, bench.grads())
            del ours_grads
            t_ours, t_sdpa = common.time_pair(bench.ours, bench.sdpa, warmup, repeats, args.device)
            flops = FWD_BWD_FACTOR * common.attention_flops(B, N, bench.pairs, D)
            results.append(common.ratio_record(
                key=bench.key, case=bench.label, dtype=dtype_name, shape=f"B{B} N{N} S{S} D{D}",
                pairs=bench.pairs, flops=flops, flops_name="flops_fwd_bwd", t_ours=t_ours, t_ref=t_sdpa,
                target=bench.target, allclose=match, max_abs_diff=diff,
            ))
            progress.advance(task)
    return results


def run_long(args, progress, task) -> dict[str, Any]:
    """(e): peak memory of forward + backward (fresh process each), and the times of ours and SDPA."""
    script = Path(__file__).resolve()
    progress.update(task, description=f"(e) S={LONG_S}: peak RSS (ours, fresh process)")
    mem_ours = common.peak_rss(script, "long_case", {"impl": "ours", "device": args.device})
    progress.update(task, description=f"(e) S={LONG_S}: peak RSS (SDPA, fresh process)")
    mem_sdpa = common.peak_rss(script, "long_case", {"impl": "sdpa", "device": args.device})
    progress.update(task, description=f"(e) S={LONG_S}: times and gradients")
    q, k, v, dy = make_inputs(LONG_S, LONG_N, torch.float32, args.device, seed=1)
    ours = fwd_bwd(lambda: cann_attn.flash_attention(q, k, v, LONG_N, "BNSD", scale_value=D**-0.5), (q, k, v), dy)
    sdpa = fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, scale=D**-0.5), (q, k, v), dy)
    _, t_ours = common.timed_once(ours, args.device)  # one call each: several seconds per call on 2 cores
    ours_grads = tuple(t.grad.clone() for t in (q, k, v))
    _, t_sdpa = common.timed_once(sdpa, args.device)
    match, diff = _compare(ours_grads, tuple(t.grad for t in (q, k, v)))
    del ours_grads
    flops = FWD_BWD_FACTOR * common.attention_flops(B, LONG_N, LONG_S * LONG_S, D)
    peak_gb = mem_ours["peak_mb"] / 1024
    progress.advance(task)
    return {
        "key": "e_long",
        "case": f"(e) S={LONG_S} no mask",
        "dtype": "fp32",
        "shape": f"B{B} N{LONG_N} S{LONG_S} D{D}",
        "flops_fwd_bwd": flops,
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
    title = f"flash_attention forward+backward vs SDPA + autograd ({results[0]['shape']}, BNSD)"
    common.print_ratio_table(console, title, results, long, close_label="grads allclose (max diff)",
                             long_label="fp32 forward+backward")

def main(argv=None) -> int:
    parser = common.cli_parser(__doc__, "fewer repeats (1 warm-up, 3 timed)", devices=DEVICES)
    parser.add_argument("--skip-long", action="store_true", help=f"skip (e), the S={LONG_S} case")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = common.console(160)
    busy_before = common.busy_warning()
    if busy_before:
        console.print(f"[yellow]warning[/]: {busy_before}", highlight=False)
    warmup, repeats = (1, 3) if args.quick else (1, 5)
    total = len(DTYPES) * 4 + (0 if args.skip_long else 1)
    progress = Progress(
        TextColumn("[bold]bench fa_backward"),
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
        console.print(f"[yellow]warning[/] (after the run, which itself loads the CPUs): {busy_after}", highlight=False)
    payload = {
        "benchmark": "fa_backward",
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
            "layout": "BNSD",
            "long": {"S": LONG_S, "N": LONG_N, "repeats": 1},
        },
        "flop_convention": "forward+backward = 3.5 * 2*B*N*visible_pairs*(Dqk+Dv) (bwd = 2.5 x fwd)",
        "warnings": {"before": busy_before, "after": busy_after},
        "results": results,
        "long": long,
    }
    out_dir = Path(args.out)
    json_path = common.write_json(out_dir / f"fa_backward_{args.device}.json", payload)
    rows = [*results, long] if long else results
    png_path = common.bar_plot(
        out_dir / f"fa_backward_{args.device}.png",
        [f"{r['dtype']} {r['case']}" for r in rows],
        {"cann_attn": [r["ours_gflops"] for r in rows], "PyTorch SDPA": [r["sdpa_gflops"] for r in rows]},
        title=f"flash_attention forward+backward vs SDPA on {args.device} ({payload['machine']['cpu']}, "
        f"{payload['machine']['torch_threads']} threads)",
        ylabel="GFLOP/s (3.5 x forward, visible pairs)",
        ratios=[r["ratio"] for r in rows],
        targets=[r.get("target") for r in rows],
    )
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""), highlight=False)
    mismatched = [r for r in rows if not r["allclose"]]
    missed = [r for r in rows if not r["passed"]]
    if mismatched:
        names = ", ".join(f"{r['dtype']} {r['case']}" for r in mismatched)
        console.print(f"[bold red]gradient mismatch vs SDPA[/]: {names}")
        return 1
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
