"""MLA decode with an int8 query (FIA v2 query_quant_mode 3) against the same decode in bf16, on the CPU reference
backend.

Cases: the shapes of benchmarks/bench_nz.py (cann-recipes-infer deepseek_r1 TND_NTD decode and MTP, vLLM-Ascend
mla_v1 fa_quant BSND_NBSD decode; N = 32 query heads, one 512-wide latent KV head, rope 64, 128-token blocks
shuffled in the pool). The quantised call takes the int8 query with float32 per-token-per-head scales and the int8
latent cache (NZ [block_num, 1, 16, block_size, 32] for deepseek_r1, ND for vLLM) with a per-tensor scale, bf16
rope; the bf16 call takes the bf16 query and the bf16 cache (NZ / ND alike) of the same shapes.
docs/operators/fused_infer_attention_score.md, "Quantised queries and fp8 caches". Times: one thread, CPU time of
the calling thread, the two calls alternated and the median of each kept. "quant_over_bf16" = quantised time /
bf16 time, target <= 1.2.

    python benchmarks/bench_quant_query.py [--quick] [--out DIR] [--strict]

Writes DIR/quant_query_cpu.json and DIR/quant_query_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from bench_nz import CASES, LATENT, ROPE, _thread_times, mla_case, write_pair

import cann_attn
from cann_attn.problem.nz import to_nz

DEVICES = ("cpu",)
TARGET = 1.2


def _int8(t: torch.Tensor, scale: float) -> torch.Tensor:
    return (t.float() / scale).round().clamp(-127, 127).to(torch.int8)


def quant_case(layout: str, q_len: int, quick: bool) -> dict[str, Any]:
    """bench_nz's MLA decode, once in bf16 (its NZ or ND call) and once with the int8 query and latent."""
    built = mla_case(layout, q_len, quick)
    kw, q, k_nd = built["kw"], built["q"], built["k_nd"]
    nz = layout.startswith("TND")
    gen = torch.Generator().manual_seed(2)
    scale_q = torch.rand(q.shape[:-1], generator=gen) * 0.02 + 0.01
    q_int8 = _int8(q, 1.0).clamp(-127, 127)
    latent_scale = torch.tensor([0.03])
    k_int8 = _int8(k_nd, 0.03)
    key = to_nz(k_int8) if nz else k_int8.flatten(2)
    key_rope = built["r_nz"] if nz else built["r_bnbsh"]
    quant_kw = dict(kw, dequant_scale_query=scale_q, dequant_scale_key=latent_scale,
                    dequant_scale_value=latent_scale, query_quant_mode=3)

    def quantised():
        return cann_attn.fused_infer_attention_score_v2(q_int8, key, key, key_rope=key_rope, **quant_kw)[0]

    return {"bf16": built["nz" if nz else "nd"], "quant": quantised, "shape": built["shape"],
            "cache": "NZ" if nz else "ND"}


def main(argv: list[str] | None = None) -> int:
    parser = common.cli_parser(__doc__, "smaller shapes (a smoke run)", devices=DEVICES)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 3 if args.quick else 7
    rows = []
    for label, (layout, q_len) in CASES.items():
        built = quant_case(layout, q_len, args.quick)
        t_bf16, t_quant = _thread_times(built["bf16"], built["quant"], repeats)
        bf16_s, quant_s = statistics.median(t_bf16), statistics.median(t_quant)
        case = label.replace(" bf16", f" {built['cache']}")
        row = {"case": case, "shape": built["shape"], "bf16_ms": 1e3 * bf16_s, "quant_ms": 1e3 * quant_s,
               "quant_over_bf16": quant_s / bf16_s, "thread_times_s": {"bf16": t_bf16, "quant": t_quant}}
        rows.append(row)
        print(f"{case:22s} {row['shape']:62s} bf16 {row['bf16_ms']:8.1f} ms  int8 query {row['quant_ms']:8.1f} ms  "
              f"ratio {row['quant_over_bf16']:.3f}", flush=True)
    out = Path(args.out)
    payload = {"benchmark": "MLA decode, int8 query (query_quant_mode 3) vs bf16 (CPU reference, one thread, "
                            "thread CPU time)",
               "quick": args.quick, "target_quant_over_bf16": TARGET, "machine": common.machine_info("cpu"),
               "threads": torch.get_num_threads(), "busy": common.busy_warning(), "rows": rows,
               "dims": {"latent": LATENT, "rope": ROPE}}
    missed = write_pair(out / "quant_query_cpu", payload, ("bf16", "bf16"), ("quant", "int8 query"), TARGET,
                        "MLA decode, int8 query vs bf16, CPU reference (1 thread, CPU time)")
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
