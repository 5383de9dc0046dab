"""Attention sinks: FlashAttentionScore forward and forward + backward with a `sink` vs the same call without one,
and vs PyTorch SDPA (which has no sink), measured in the same run.

B=1, N=8, S=2048, D=128, fp32 and bf16, layout BNSD, on the CPU reference backend:
  (a) no mask;
  (b) gpt-oss sliding window: sparse_mode 4 with compressed_mask(4), pre_tokens=128, next_tokens=0.
Each is timed as the forward alone (cann_attn.flash_attention_score) and as forward + `.backward(dy)` of the
differentiable cann_attn.flash_attention (the sink a leaf that gets its gradient), with and without the sink,
interleaved (common.time_pair). cost = time with sink / time without, target <= 1.05 (docs/semantics/sinks.md: the
sink is merged into the row statistics, no kernel's key loop changes). The verdict takes the ratio of the fastest
calls (cost), which other processes on a shared machine inflate least; the ratio of the medians (cost_median) is
reported too. sink_work_ms times the sink's own work in isolation (the merge into [B, N, S] row statistics and the
[B*N, S, Dv] accumulator; with the backward, dsink's terms from the row sums): the part of the cost no noise hides.
SDPA (no sink; for (b) with the materialised float mask) is timed in the same run for scale: sdpa_ratio = SDPA
time / ours with the sink. FLOPs as the other benchmarks count them (the sink adds none): forward
2*B*N*visible_pairs*(Dqk+Dv), forward + backward 3.5 x that.

Before timing, the outputs with the sink and dq, dk, dv, dsink are checked against torch.autograd through the
dense formula (softmax over [scale Q K^T, sink], the sink column dropped) in float64 on the same inputs; a mismatch
makes the exit status 1 (with --strict, so does a missed target). Peak RSS of forward + backward with and without
the sink is measured in fresh processes (skip with --no-rss).

    python benchmarks/bench_sinks.py [--quick] [--out DIR] [--strict] [--no-rss]

Writes DIR/sinks_cpu.json and DIR/sinks_cpu.png (default DIR: benchmarks/results).
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

B, N, S, D = 1, 8, 2048, 128
WINDOW = 128
TARGET = 1.05  # time with a sink / time without
FWD_BWD_FACTOR = 3.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Our results vs the float64 formula on the same (rounded) inputs: fp32 accumulation everywhere; bf16 rounds the
# output and the gradients to bf16.
TOLERANCES = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2)}
CASES = {
    "a_dense": ("(a) no mask", {}),
    "b_window": (f"(b) sliding window mode 4 pre={WINDOW} next=0",
                 {"sparse_mode": 4, "pre_tokens": WINDOW, "next_tokens": 0}),
}


def make_inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dy = (torch.randn(B, N, S, D, generator=gen).to(dtype) for _ in range(4))
    sink = torch.randn(N, generator=gen) * 2.0
    return q, k, v, dy, sink


def mask_kwargs(case: str) -> dict[str, Any]:
    kw = dict(CASES[case][1])
    if kw:
        kw["atten_mask"] = cann_attn.compressed_mask(4)
    return kw


def visible(case: str) -> torch.Tensor:
    """[S, S] bool: the keys each query row sees (for the dense golden and SDPA's mask)."""
    i = torch.arange(S).view(-1, 1)
    j = torch.arange(S).view(1, -1)
    if case == "a_dense":
        return torch.ones(S, S, dtype=torch.bool)
    return (j <= i) & (j >= i - WINDOW)


def pairs_of(case: str) -> int:
    return S * S if case == "a_dense" else common.visible_pairs(S, S, pre=WINDOW, nxt=0)


def golden(case: str, q, k, v, dy, sink):
    """out, dq, dk, dv, dsink in float64 by autograd through softmax([scale Q K^T masked, sink])[..., :-1] V."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    qd, kd, vd, sd = leaves
    scores = (qd @ kd.transpose(-1, -2)) * D**-0.5
    scores = scores.masked_fill(~visible(case), float("-inf"))
    column = sd.view(1, N, 1, 1).expand(B, N, S, 1)
    probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    out = probs @ vd
    grads = torch.autograd.grad(out, leaves, dy.double())
    return out.detach(), grads


def check(case: str, dtype: torch.dtype) -> tuple[bool, float]:
    """Our forward with the sink and forward + backward (dq, dk, dv, dsink) vs the float64 formula."""
    q, k, v, dy, sink = make_inputs(dtype)
    kw = mask_kwargs(case)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out = cann_attn.flash_attention(*leaves[:3], N, "BNSD", scale_value=D**-0.5, sink=leaves[3], **kw)
    out.backward(dy)
    gold_out, gold_grads = golden(case, q, k, v, dy, sink)
    atol, rtol = TOLERANCES[dtype]
    ok, diff = True, 0.0
    for ours, ref in zip((out, *(t.grad for t in leaves)), (gold_out, *gold_grads), strict=True):
        ours = ours.detach().double()
        # dsink sums S * B rows: compare it relative to its largest term's scale
        scale = max(1.0, float(ref.abs().max())) if ours.shape == (N,) else 1.0
        ok &= bool(torch.allclose(ours, ref, atol=atol * scale, rtol=rtol))
        diff = max(diff, float((ours - ref).abs().max()) / scale)
    return ok, diff


def calls(case: str, dtype: torch.dtype) -> dict[str, Any]:
    """The timed callables: forward and forward + backward, with and without the sink, and SDPA."""
    q, k, v, dy, sink = make_inputs(dtype)
    kw = mask_kwargs(case)
    scale = D**-0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.clone().requires_grad_()
    sdpa_mask = None if case == "a_dense" else torch.zeros(S, S, dtype=dtype).masked_fill_(~visible(case),
                                                                                          float("-inf"))

    def fwd(with_sink: bool):
        extra = {"sink": sink} if with_sink else {}
        return lambda: cann_attn.flash_attention_score(q, k, v, N, "BNSD", scale_value=scale, **kw, **extra)

    def step(with_sink: bool):
        def run() -> None:
            for t in (*leaves, sink_leaf):
                t.grad = None
            extra = {"sink": sink_leaf} if with_sink else {}
            cann_attn.flash_attention(*leaves, N, "BNSD", scale_value=scale, **kw, **extra).backward(dy)

        return run

    def sdpa_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, scale=scale, attn_mask=sdpa_mask)

    def sdpa_step():
        for t in leaves:
            t.grad = None
        F.scaled_dot_product_attention(*leaves, scale=scale, attn_mask=sdpa_mask).backward(dy)

    return {"fwd": (fwd(True), fwd(False), sdpa_fwd), "fwd_bwd": (step(True), step(False), sdpa_step)}


def sink_work(dtype: torch.dtype, backward: bool, repeats: int = 20) -> float:
    """Seconds (fastest of `repeats`) of the sink's own work at this shape, as the reference backend does it: the
    merge into the row statistics and the scaling of the fp32 accumulator; with `backward`, dsink's terms from the
    row sums rowsum(dY * O) the backward forms anyway."""
    from cann_attn.problem import sink as rule

    gen = torch.Generator().manual_seed(2)
    row_max, row_sum = torch.randn(1, N, S, generator=gen), torch.rand(1, N, S, generator=gen) + 1
    acc = torch.randn(N, S, D, generator=gen)
    d_sum, sink = torch.randn(1, N, S, generator=gen), torch.randn(N, generator=gen)
    heads = rule.head_values(sink, torch.float32, "cpu")

    def work() -> None:
        m, l = row_max.clone(), row_sum.clone()
        acc.mul_(rule.merge_into_rows_(m, l, heads).view(N, S, 1))
        if backward:
            rule.sink_grad_terms_from_rowsum(d_sum, m, l, heads).sum(dim=(0, 2))

    return common.time_fn(work, 2, repeats)["min_s"]


# Child side of the peak-RSS measurement (run in a fresh interpreter by common.peak_rss).
def rss_case(with_sink: bool, dtype: str = "fp32", case: str = "a_dense"):
    run = calls(case, DTYPES[dtype])["fwd_bwd"][0 if with_sink else 1]
    return run, {"with_sink": with_sink, "dtype": dtype, "case": case}


def run_all(args, warmup: int, repeats: int, progress, task) -> list[dict[str, Any]]:
    rows = []
    for dtype_name, dtype in DTYPES.items():
        for case, (label, _) in CASES.items():
            progress.update(task, description=f"{dtype_name} {label}: check vs float64")
            ok, diff = check(case, dtype)
            timed = calls(case, dtype)
            fwd_flops = common.attention_flops(B, N, pairs_of(case), D)
            for kind, flops in (("fwd", fwd_flops), ("fwd_bwd", FWD_BWD_FACTOR * fwd_flops)):
                progress.update(task, description=f"{dtype_name} {label}: {kind}")
                with_sink, without, sdpa = timed[kind]
                t_with, t_without = common.time_pair(with_sink, without, warmup, repeats)
                t_sdpa = common.time_fn(sdpa, warmup, max(1, repeats // 3))
                cost = t_with["min_s"] / t_without["min_s"]
                work = sink_work(dtype, backward=kind == "fwd_bwd")
                rows.append({
                    "key": f"{case}_{kind}", "case": label, "kind": kind, "dtype": dtype_name,
                    "shape": f"B{B} N{N} S{S} D{D}", "visible_pairs": pairs_of(case), "flops": flops,
                    "with_sink_ms": t_with["median_s"] * 1e3, "without_sink_ms": t_without["median_s"] * 1e3,
                    "sdpa_ms": t_sdpa["median_s"] * 1e3,
                    "with_sink_times_s": t_with["times_s"], "without_sink_times_s": t_without["times_s"],
                    "with_sink_gflops": common.gflops(flops, t_with["median_s"]),
                    "without_sink_gflops": common.gflops(flops, t_without["median_s"]),
                    "sdpa_gflops": common.gflops(flops, t_sdpa["median_s"]),
                    "with_sink_min_ms": t_with["min_s"] * 1e3, "without_sink_min_ms": t_without["min_s"] * 1e3,
                    "cost": cost, "cost_median": t_with["median_s"] / t_without["median_s"],
                    "sink_work_ms": work * 1e3, "sink_work_share": work / t_without["min_s"],
                    "target": TARGET, "passed": cost <= TARGET,
                    "sdpa_ratio": t_sdpa["median_s"] / t_with["median_s"],
                    "allclose_float64": ok, "max_abs_diff": diff,
                })
                progress.advance(task)
    return rows


def run_rss(progress, task) -> dict[str, Any]:
    script = Path(__file__).resolve()
    out = {}
    for with_sink in (True, False):
        progress.update(task, description=f"peak RSS fwd+bwd fp32 (sink={with_sink}, fresh process)")
        mem = common.peak_rss(script, "rss_case", {"with_sink": with_sink})
        out["with_sink" if with_sink else "without_sink"] = {k: mem[k] for k in ("peak_mb", "before_mb", "delta_mb")}
    progress.advance(task)
    return out


def print_table(rows, rss, console) -> None:
    from rich.table import Table

    table = Table(title=f"flash_attention with a sink vs without ({rows[0]['shape']}, BNSD, CPU; fastest calls)",
                  header_style="bold")
    for col in ("case", "kind", "dtype", "with sink ms", "without ms", "cost", "target", "pass", "median cost",
                "sink work ms", "SDPA ms (no sink)", "GFLOP/s (sink)", "vs float64 (max diff)"):
        table.add_column(col, justify="left" if col in ("case", "kind", "dtype") else "right")
    for r in rows:
        table.add_row(r["case"], r["kind"], r["dtype"], f"{r['with_sink_min_ms']:.1f}",
                      f"{r['without_sink_min_ms']:.1f}", f"{r['cost']:.3f}", f"<= {r['target']}",
                      "[green]pass[/]" if r["passed"] else "[bold red]FAIL[/]", f"{r['cost_median']:.3f}",
                      f"{r['sink_work_ms']:.2f}", f"{r['sdpa_ms']:.1f}", f"{r['with_sink_gflops']:.1f}",
                      ("[green]yes[/]" if r["allclose_float64"] else "[bold red]NO[/]") + f" ({r['max_abs_diff']:.1e})")
    console.print(table)
    if rss:
        w, wo = rss["with_sink"], rss["without_sink"]
        console.print(f"peak RSS, fp32 (a) forward+backward in a fresh process: with sink {w['peak_mb']:.0f} MB "
                      f"(+{w['delta_mb']:.0f} MB in the call), without {wo['peak_mb']:.0f} MB "
                      f"(+{wo['delta_mb']:.0f} MB)", highlight=False)


def main(argv=None) -> int:
    parser = common.cli_parser(__doc__, "fewer repeats (1 warm-up, 3 timed)", devices=DEVICES, no_rss=True)
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = common.console(170)
    busy_before = common.busy_warning()
    if busy_before:
        console.print(f"[yellow]warning[/]: {busy_before}", highlight=False)
    warmup, repeats = (1, 3) if args.quick else (1, 11)
    total = len(DTYPES) * len(CASES) * 2 + (0 if args.no_rss else 1)
    progress = Progress(TextColumn("[bold]bench sinks"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
    with progress:
        task = progress.add_task("", total=total)
        rows = run_all(args, warmup, repeats, progress, task)
        rss = None if args.no_rss else run_rss(progress, task)
    print_table(rows, rss, console)
    busy_after = common.busy_warning()
    if busy_after:
        console.print(f"[yellow]warning[/] (after the run, which itself loads the CPUs): {busy_after}", highlight=False)
    payload = {
        "benchmark": "sinks",
        "device": "cpu",
        "machine": common.machine_info("cpu"),
        "settings": {"warmup": warmup, "repeats": repeats, "quick": args.quick, "B": B, "N": N, "S": S, "D": D,
                     "window": WINDOW, "layout": "BNSD", "target_cost": TARGET,
                     "cost": "fastest call with the sink / fastest call without (interleaved)"},
        "flop_convention": "forward 2*B*N*visible_pairs*(Dqk+Dv); forward+backward 3.5 x; the sink adds "
                           "none",
        "warnings": {"before": busy_before, "after": busy_after},
        "results": rows,
        "peak_rss": rss,
    }
    out_dir = Path(args.out)
    json_path = common.write_json(out_dir / "sinks_cpu.json", payload)
    png_path = plot(payload, out_dir / "sinks_cpu.png")
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""), highlight=False)
    if not all(r["allclose_float64"] for r in rows):
        console.print("[bold red]mismatch vs the float64 formula[/]")
        return 1
    return 1 if args.strict and not all(r["passed"] for r in rows) else 0


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """Times (fastest calls; SDPA's median) and, below, without / with (at or above the dashed 1/1.05: passed)."""
    rows = payload["results"]
    return common.bar_plot(
        path,
        [f"{r['dtype']} {r['kind']} {r['case'][:3]}" for r in rows],
        {"with sink": [r["with_sink_min_ms"] for r in rows], "without sink": [r["without_sink_min_ms"] for r in rows],
         "SDPA (no sink)": [r["sdpa_ms"] for r in rows]},
        title=f"flash_attention with / without a sink on the CPU ({payload['machine']['cpu']}, "
        f"{payload['machine']['torch_threads']} threads)",
        ylabel="ms (fastest call; SDPA: median)",
        ratios=[1.0 / r["cost"] for r in rows],
        targets=[1.0 / TARGET for _ in rows],
        ratio_label="time without / with the sink (dashed: 1/1.05)",
    )


if __name__ == "__main__":
    sys.exit(main())
