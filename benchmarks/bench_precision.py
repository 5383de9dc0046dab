"""The cost of the "npu" precision mode (docs/semantics/precision.md): each operator in "exact" and in "npu" mode on
the same inputs, timed alternately in one run, with PyTorch SDPA (no rounding points, fp32 math in the input dtype)
for scale where the operator is dense attention.

Cases (CPU reference backend; B=1, N=8, S=512 (--seq), D=128 unless said; --quick: S=256):
  PromptFlashAttention fp16 (torch_npu's inner_precise=1: the fp16 pipeline), FusedInferAttentionScore prefill bf16
  (inner_precise=0), FlashAttentionScore bf16 forward (causal), FlashAttentionScoreGrad bf16 (causal),
  SparseFlashAttention bf16 (T=S tokens, top-k 256 of 2S keys, N1=16, D=512+64 rope, Dv=512) and
  SparseLightningIndexerGradKLLoss bf16 (the same selection, 16 index heads of 128).
cost = "npu" time / "exact" time (medians of interleaved calls; --cpu-time: CPU time of this process, which a busy
machine disturbs less than wall time); sdpa_ratio = SDPA time / "exact" time. Target: a cost of at most 2 for the
dense cases (PFA, FIA, FA forward and grad), measured at S=2048 on one thread (--seq 2048 --threads 1 --cpu-time);
--strict exits 1 when one misses it.

    python benchmarks/bench_precision.py [--quick] [--seq S] [--threads T] [--cpu-time] [--only NAME ...] [--out DIR]

Writes DIR/precision_cpu.json and DIR/precision_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

import cann_attn

DEVICES = ("cpu",)
N, D = 8, 128
COST_TARGET = 2.0
DENSE = ("PFA fp16 (inner_precise 1)", "FIA prefill bf16 (inner_precise 0)", "FA forward bf16", "FA grad bf16")


def _dense(seq: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, N, seq, D, generator=g).to(dtype) for _ in range(4)]


def cases(seq: int) -> dict[str, tuple[Any, Any]]:
    """name -> (the operator call, the SDPA call or None)."""
    q16, k16, v16, _ = _dense(seq, torch.float16)
    qb, kb, vb, dy = _dense(seq, torch.bfloat16)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    fwd = cann_attn.flash_attention_score(qb, kb, vb, N, "BNSD", scale_value=D**-0.5, atten_mask=causal)

    def sdpa(q, k, v):
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=D**-0.5)

    g = torch.Generator().manual_seed(1)
    heads, k_top, d_main, d_rope = 16, 256, 512, 64
    q_s = torch.randn(1, seq, heads, d_main, generator=g).bfloat16()
    qr_s = torch.randn(1, seq, heads, d_rope, generator=g).bfloat16()
    kv_s = torch.randn(1, 2 * seq, 1, d_main, generator=g).bfloat16()
    kr_s = torch.randn(1, 2 * seq, 1, d_rope, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(seq + t + 1, generator=g)[:k_top] for t in range(seq)])
    idx = idx.view(1, seq, 1, k_top).to(torch.int32)
    sfa = cann_attn.sparse_flash_attention(q_s, kv_s, kv_s, idx, d_main**-0.5, query_rope=qr_s, key_rope=kr_s)
    q_idx = torch.randn(1, seq, 16, 128, generator=g).bfloat16()
    k_idx = torch.randn(1, 2 * seq, 1, 128, generator=g).bfloat16()
    w = torch.randn(1, seq, 16, generator=g).bfloat16()
    return {
        "PFA fp16 (inner_precise 1)": (
            lambda: cann_attn.prompt_flash_attention(q16, k16, v16, num_heads=N, input_layout="BNSD",
                                                     scale_value=D**-0.5),
            sdpa(q16, k16, v16)),
        "FIA prefill bf16 (inner_precise 0)": (
            lambda: cann_attn.fused_infer_attention_score(qb, kb, vb, num_heads=N, input_layout="BNSD",
                                                          scale=D**-0.5),
            sdpa(qb, kb, vb)),
        "FA forward bf16": (lambda: cann_attn.flash_attention_score(qb, kb, vb, N, "BNSD", scale_value=D**-0.5,
                                                                    atten_mask=causal),
                            lambda: F.scaled_dot_product_attention(qb, kb, vb, scale=D**-0.5, is_causal=True)),
        "FA grad bf16": (
            lambda: cann_attn.flash_attention_score_grad(qb, kb, vb, dy, N, "BNSD", attention_in=fwd.attention_out,
                                                         softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
                                                         scale_value=D**-0.5, atten_mask=causal),
            None),
        "SFA forward bf16": (
            lambda: cann_attn.sparse_flash_attention(q_s, kv_s, kv_s, idx, d_main**-0.5, query_rope=qr_s,
                                                     key_rope=kr_s),
            None),
        "SFA grad bf16": (
            lambda: cann_attn.sparse_flash_attention_grad(q_s, kv_s, kv_s, idx, sfa.attention_out, sfa.attention_out,
                                                          sfa.softmax_max, sfa.softmax_sum, d_main**-0.5,
                                                          query_rope=qr_s, key_rope=kr_s),
            None),
        "KL loss bf16": (
            lambda: cann_attn.sparse_lightning_indexer_grad_kl_loss(q_s, kv_s, q_idx, k_idx, w, idx, sfa.softmax_max,
                                                                    sfa.softmax_sum, d_main**-0.5, query_rope=qr_s,
                                                                    key_rope=kr_s),
            None),
    }


def _npu(fn):
    def run():
        with cann_attn.precision("npu"):
            return fn()
    return run


def _cpu_pair(fn_a, fn_b, warmup: int, repeats: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """`common.time_pair` in CPU time of this process (time.process_time): alternated calls, medians."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(max(1, repeats)):
        for fn, out in ((fn_a, times[0]), (fn_b, times[1])):
            start = time.process_time()
            fn()
            out.append(time.process_time() - start)
    return tuple({"median_s": statistics.median(t), "min_s": min(t), "times_s": t} for t in times)


def run_all(seq: int, warmup: int, repeats: int, progress, task, cpu_time: bool = False,
            only: list[str] | None = None) -> list[dict[str, Any]]:
    rows = []
    pair = _cpu_pair if cpu_time else common.time_pair
    for name, (call, sdpa) in cases(seq).items():
        if only and not any(word.lower() in name.lower() for word in only):
            continue
        progress.update(task, description=name)
        exact, npu = pair(call, _npu(call), warmup, repeats)
        sdpa_t = common.time_fn(sdpa, warmup, repeats) if sdpa is not None else None
        rows.append({
            "case": name, "seq": seq,
            "exact_ms": exact["median_s"] * 1e3, "npu_ms": npu["median_s"] * 1e3,
            "exact_times_s": exact["times_s"], "npu_times_s": npu["times_s"],
            "sdpa_ms": None if sdpa_t is None else sdpa_t["median_s"] * 1e3,
            "cost": npu["median_s"] / exact["median_s"],
            "sdpa_ratio": None if sdpa_t is None else sdpa_t["median_s"] / exact["median_s"],
        })
        progress.advance(task)
    return rows


def main(argv=None) -> int:
    parser = common.cli_parser(__doc__, "S=256, 1 warm-up, 3 timed calls", devices=DEVICES, threads=True)
    parser.add_argument("--seq", type=int, default=None, help="sequence length S (default 512; --quick: 256)")
    parser.add_argument("--cpu-time", action="store_true", help="time CPU time of this process, not wall time")
    parser.add_argument("--only", nargs="+", default=None, help="cases whose name contains one of these words")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from rich.progress import Progress
    from rich.table import Table

    console = common.console(120)
    busy = common.busy_warning()
    if busy:
        console.print(f"[yellow]warning[/]: {busy}", highlight=False)
    seq, warmup, repeats = (256, 1, 3) if args.quick else (512, 1, 5)
    seq = args.seq or seq
    clock = "CPU time" if args.cpu_time else "wall time"
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("", total=len(cases(seq)))
        rows = run_all(seq, warmup, repeats, progress, task, args.cpu_time, args.only)
    for r in rows:
        r["target"] = COST_TARGET if r["case"] in DENSE else None
    table = Table(title=f'"npu" precision mode vs "exact" (CPU reference backend, S={seq}, {torch.get_num_threads()} '
                        f'thread(s), {clock}; medians)')
    for col in ("case", "exact ms", "npu ms", "cost (npu / exact)", "SDPA ms", "SDPA / exact"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        table.add_row(r["case"], f"{r['exact_ms']:.1f}", f"{r['npu_ms']:.1f}", f"{r['cost']:.1f}x",
                      "-" if r["sdpa_ms"] is None else f"{r['sdpa_ms']:.1f}",
                      "-" if r["sdpa_ratio"] is None else f"{r['sdpa_ratio']:.2f}")
    console.print(table)
    out = Path(args.out)
    payload = {"benchmark": "precision", "quick": args.quick, "seq": seq, "threads": torch.get_num_threads(),
               "clock": clock, "machine": common.machine_info(), "busy": busy, "rows": rows}
    path = common.write_json(out / "precision_cpu.json", payload)
    labels = [r["case"] for r in rows]
    common.bar_plot(out / "precision_cpu.png", labels,
                    {"exact": [r["exact_ms"] for r in rows], "npu": [r["npu_ms"] for r in rows],
                     "SDPA": [r["sdpa_ms"] for r in rows]},
                    title=f'"npu" precision mode vs "exact", CPU, S={seq}', ylabel="ms (median)",
                    ratios=[r["cost"] for r in rows], targets=[r["target"] for r in rows],
                    ratio_label='cost: "npu" time / "exact" time', lower_is_better=True)
    console.print(f"wrote {path} and {out / 'precision_cpu.png'}", highlight=False)
    missed = [r["case"] for r in rows if r["target"] is not None and r["cost"] > r["target"]]
    if missed:
        console.print(f"cost above {COST_TARGET:g} for: {', '.join(missed)}", highlight=False)
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
