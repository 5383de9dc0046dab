"""FusedInferAttentionScore decode over quantised KV caches against the same keys in bfloat16, CPU reference.

Cases (docs/operators/fused_infer_attention_score.md, "KV anti-quantisation"; the shapes of bench_paged.py's
fia_decode, B=8 sequences of 1024..4096 keys, GQA 32/8 heads, D=128, bf16 query):
  int8 paged BnBsH: [block_num, 128, H] int8 cache, per-channel bf16 key/value_antiquant_scale (KV_N, 1, D),
                    against the bf16 BnBsH cache of the same keys;
  int8 paged NZ:    vLLM's C8 decode, [block_num, KV_N, D/32, 128, 32] int8 against the bf16 BnNBsD cache;
  int4 contiguous:  BSND int4 packed in int32 ([B, S, KV_N, D/8]; int4 is refused with PageAttention) against
                    the bf16 BSND cache.
Both sides are anti-quantised outputs of the same values: every quantised output is also checked against the bf16
call on the dequantised keys (bit for bit, the one anti-quantisation rule). Times: interleaved calls
(common.time_pair, the machine is shared), best of N; "ratio" = quantised time / bf16 time, target <= 1.2.

    python benchmarks/bench_fia_quant.py [--quick] [--out DIR] [--threads N]

Writes DIR/fia_quant_cpu.json and DIR/fia_quant_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from bench_paged import PAGE, _pool

import cann_attn
from cann_attn.problem.antiquant import INT4_PER_INT32

DEVICES = ("cpu",)
RATIO_TARGET = 1.2


def _pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values eight to an int32, value j in bits 4j..4j+3 (docs/operators/fused_infer_attention_score.md)."""
    nibbles = (values.to(torch.int64) & 0xF).reshape(*values.shape[:-1], -1, INT4_PER_INT32)
    word = sum(nibbles[..., j] << (4 * j) for j in range(INT4_PER_INT32))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _dequantised(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the operator's rule makes of int8/int4 values [..., KV_N, D] with a (KV_N, 1, D) scale: bf16 of fp32."""
    return (x.float() * scale.float().squeeze(1)).to(torch.bfloat16)


def build(case: str, quick: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    batch, heads, heads_kv, d = (4, 16, 4, 128) if quick else (8, 32, 8, 128)
    top = 2048 if quick else 4096
    kv_lens = [top - (top * 3 // 4) * b // max(batch - 1, 1) for b in range(batch)]
    s = max(kv_lens)
    low, high = (-8, 8) if case.startswith("int4") else (-127, 128)
    k, v = (torch.randint(low, high, (batch, s, heads_kv, d), generator=gen).to(torch.int8) for _ in range(2))
    scale_k, scale_v = ((0.01 + 0.02 * torch.rand(heads_kv, 1, d, generator=gen)).bfloat16() for _ in range(2))
    kf, vf = _dequantised(k, scale_k), _dequantised(v, scale_v)
    q = torch.randn(batch, heads, 1, d, generator=gen).bfloat16()
    common_kw = dict(num_heads=heads, num_key_value_heads=heads_kv, scale=d ** -0.5, actual_seq_lengths_kv=kv_lens,
                     backend="reference")
    quant_kw = dict(key_antiquant_scale=scale_k, value_antiquant_scale=scale_v)
    if case.startswith("int4"):
        q_bsnd = q.transpose(1, 2).contiguous()
        k4, v4 = _pack_int4(k), _pack_int4(v)

        def base():
            return cann_attn.fused_infer_attention_score(q_bsnd, kf, vf, input_layout="BSND", **common_kw)[0]

        def quant():
            return cann_attn.fused_infer_attention_score(q_bsnd, k4, v4, input_layout="BSND", **common_kw,
                                                         **quant_kw)[0]

        cache_mb = (k4.numel() + v4.numel()) * 4 / 2**20
    else:
        pools = {name: _pool([x[b, :n].flatten(1) for b, n in enumerate(kv_lens)], PAGE, torch.Generator()
                             .manual_seed(1)) for name, x in (("k", k), ("v", v), ("kf", kf), ("vf", vf))}
        table = pools["k"][1]
        caches = {name: pool[0] for name, pool in pools.items()}  # [blocks, PAGE, H], one shared table
        layout = "BSH" if case == "int8 paged BnBsH" else "BNSD"
        query = q.transpose(1, 2).reshape(batch, 1, heads * d).contiguous() if layout == "BSH" else q
        if case == "int8 paged NZ":
            def nz(c):
                return c.view(c.shape[0], PAGE, heads_kv, d // 32, 32).permute(0, 2, 3, 1, 4).contiguous()

            def bnnbsd(c):
                return c.view(c.shape[0], PAGE, heads_kv, d).permute(0, 2, 1, 3).contiguous()

            caches = {"k": nz(caches["k"]), "v": nz(caches["v"]), "kf": bnnbsd(caches["kf"]),
                      "vf": bnnbsd(caches["vf"])}
        paged_kw = dict(block_table=table, block_size=PAGE, input_layout=layout, **common_kw)

        def base():
            return cann_attn.fused_infer_attention_score(query, caches["kf"], caches["vf"], **paged_kw)[0]

        def quant():
            return cann_attn.fused_infer_attention_score(query, caches["k"], caches["v"], **paged_kw, **quant_kw)[0]

        cache_mb = (caches["k"].numel() + caches["v"].numel()) / 2**20
    shape = f"B={batch} N={heads}/{heads_kv} D={d} Skv={kv_lens[0]}..{kv_lens[-1]}"
    return {"base": base, "quant": quant, "shape": shape, "cache_mb": cache_mb,
            "flops": 4 * heads * sum(kv_lens) * d}


CASES = ("int8 paged BnBsH", "int8 paged NZ", "int4 contiguous")


def main(argv: list[str] | None = None) -> int:
    parser = common.cli_parser(__doc__, "smaller shapes (a smoke run)", devices=DEVICES, threads=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    rows, failures = [], []
    for case in CASES:
        built = build(case, args.quick)
        a, b = built["base"](), built["quant"]()
        if not torch.equal(a, b):
            failures.append(f"{case}: the quantised output differs from the bf16 one on the dequantised keys")
        t_base, t_quant = common.time_pair(built["base"], built["quant"], warmup=1, repeats=repeats)
        row = {"case": case, "shape": built["shape"], "bf16_ms": 1e3 * t_base["min_s"],
               "quant_ms": 1e3 * t_quant["min_s"], "ratio": t_quant["min_s"] / t_base["min_s"],
               "ratio_median": t_quant["median_s"] / t_base["median_s"], "cache_mb": built["cache_mb"],
               "quant_gflops": common.gflops(built["flops"], t_quant["min_s"]), "bitwise_equal": torch.equal(a, b),
               "times": {"bf16": t_base, "quant": t_quant}}
        rows.append(row)
        print(f"{case:18s} {row['shape']:40s} bf16 {row['bf16_ms']:8.1f} ms  quantised {row['quant_ms']:8.1f} ms  "
              f"ratio {row['ratio']:.2f} (median {row['ratio_median']:.2f})", flush=True)
    out = Path(args.out)
    payload = {"benchmark": "FIA decode, quantised vs bf16 KV cache (CPU reference)", "quick": args.quick,
               "target_quant_over_bf16": RATIO_TARGET, "statistic": "best of interleaved repeats",
               "machine": common.machine_info("cpu"), "threads": torch.get_num_threads(),
               "busy": common.busy_warning(), "rows": rows, "failures": failures}
    common.write_json(out / "fia_quant_cpu.json", payload)
    common.bar_plot(out / "fia_quant_cpu.png", [r["case"] for r in rows],
                    {"bf16 cache ms": [r["bf16_ms"] for r in rows], "quantised ms": [r["quant_ms"] for r in rows]},
                    title="FIA decode: quantised vs bf16 KV cache, CPU reference", ylabel="ms per call (best)",
                    ratios=[1 / r["ratio"] for r in rows], targets=[1 / RATIO_TARGET] * len(rows),
                    ratio_label="bf16 time / quantised time (dashed: 1/1.2)")
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    return 1 if failures or (args.strict and any(r["ratio"] > RATIO_TARGET for r in rows)) else 0


if __name__ == "__main__":
    sys.exit(main())
