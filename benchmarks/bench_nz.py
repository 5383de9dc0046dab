"""MLA decode over bf16 NZ paged caches against the same call over ND caches, on the CPU reference backend.

Cases (docs/semantics/paged-kv.md, "NZ caches"; the shapes of cann-recipes-infer's deepseek_r1 decode and
vLLM-Ascend's mla_v1 with enable_kv_nz): npu_fused_infer_attention_score_v2 with the 512-wide latent as key and value,
rope 64, one key-value head, N = 32 query heads, 128-token blocks shuffled in the pool, bf16:
  r1_decode:      TND_NTD, one token for each of B=8 sequences of 4096..1024 keys, sparse_mode 0;
  r1_mtp:         TND_NTD, two tokens per sequence (speculative decoding), sparse_mode 3 with the mask;
  vllm_bsnd_nbsd: BSND_NBSD, one token per sequence (vLLM-Ascend's enable_kv_nz decode).
The ND call reads [block_num, block_size, 512] / [block_num, block_size, 64] caches (BnBsH), the NZ call their NZ
copies [block_num, 1, D/16, block_size, 16] holding the same tokens; every NZ output is checked equal to the ND one
bit for bit. Times: one thread, CPU time of the calling thread (time.thread_time), NZ and ND calls alternated and
the median of each kept, so a loaded machine slows both alike. "nz_over_nd" = NZ time / ND time, target <= 1.1.

    python benchmarks/bench_nz.py [--quick] [--out DIR] [--strict]

Writes DIR/nz_cpu.json and DIR/nz_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from bench_paged import _pool

import cann_attn
from cann_attn.problem.nz import to_nz

DEVICES = ("cpu",)
TARGET = 1.1
PAGE, LATENT, ROPE = 128, 512, 64


def _thread_times(fn_a, fn_b, repeats: int) -> tuple[list[float], list[float]]:
    """CPU seconds of the calling thread per call, a and b alternated after one warm-up call of each."""
    fn_a()
    fn_b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((fn_a, times[0]), (fn_b, times[1])):
            start = time.thread_time()
            fn()
            out.append(time.thread_time() - start)
    return times


def mla_case(layout: str, q_len: int, quick: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    batch, heads = (4, 16) if quick else (8, 32)
    top = 1024 if quick else 4096
    kv_lens = [top - (top * 3 // 4) * b // max(batch - 1, 1) for b in range(batch)]
    latent = [torch.randn(n, 1, LATENT, generator=gen).bfloat16() for n in kv_lens]
    rope = [torch.randn(n, 1, ROPE, generator=gen).bfloat16() for n in kv_lens]
    pool_gen = torch.Generator().manual_seed(1)
    k_nd, table = _pool(latent, PAGE, pool_gen)  # [block_num, block_size, 1, D]
    r_nd, table_r = _pool(rope, PAGE, torch.Generator().manual_seed(1))
    assert torch.equal(table, table_r)
    k_nz, r_nz = to_nz(k_nd), to_nz(r_nd)
    k_bnbsh, r_bnbsh = k_nd.flatten(2), r_nd.flatten(2)
    if layout.startswith("TND"):
        q = torch.randn(batch * q_len, heads, LATENT, generator=gen).bfloat16()
        qr = torch.randn(batch * q_len, heads, ROPE, generator=gen).bfloat16()
        extra = {"actual_seq_qlen": [q_len * (b + 1) for b in range(batch)]}
    else:
        q = torch.randn(batch, q_len, heads, LATENT, generator=gen).bfloat16()
        qr = torch.randn(batch, q_len, heads, ROPE, generator=gen).bfloat16()
        extra = {}
    if q_len > 1:
        extra |= {"sparse_mode": 3, "atten_mask": torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)}
    kw = dict(query_rope=qr, num_query_heads=heads, num_key_value_heads=1, input_layout=layout,
              softmax_scale=(128 + ROPE) ** -0.5, block_table=table, block_size=PAGE, actual_seq_kvlen=kv_lens,
              backend="reference", **extra)

    def nd():
        return cann_attn.fused_infer_attention_score_v2(q, k_bnbsh, k_bnbsh, key_rope=r_bnbsh, **kw)[0]

    def nz():
        return cann_attn.fused_infer_attention_score_v2(q, k_nz, k_nz, key_rope=r_nz, **kw)[0]

    shape = f"B={batch} N={heads}/1 D={LATENT}+{ROPE} Sq={q_len} Skv={kv_lens[0]}..{kv_lens[-1]} page={PAGE}"
    return {"nd": nd, "nz": nz, "shape": shape, "kw": kw, "q": q, "k_nd": k_nd, "r_nz": r_nz, "r_bnbsh": r_bnbsh}


def write_pair(stem: Path, payload: dict[str, Any], base: tuple[str, str], other: tuple[str, str], target: float,
               title: str) -> list[str]:
    """stem.json and stem.png of rows timing `base` against `other` (keys `<key>_ms`, `<other>_over_<base>`);
    returns the cases over `target`."""
    rows = payload["rows"]
    (b_key, b_label), (o_key, o_label) = base, other
    common.write_json(stem.with_suffix(".json"), payload)
    common.bar_plot(stem.with_suffix(".png"), [r["case"] for r in rows],
                    {f"{b_label} ms": [r[f"{b_key}_ms"] for r in rows],
                     f"{o_label} ms": [r[f"{o_key}_ms"] for r in rows]},
                    title=title, ylabel="ms per call", ratios=[r[f"{b_key}_ms"] / r[f"{o_key}_ms"] for r in rows],
                    targets=[1 / target] * len(rows),
                    ratio_label=f"{b_label} time / {o_label} time (dashed: 1/{target})")
    return [r["case"] for r in rows if r[f"{o_key}_over_{b_key}"] > target]


CASES = {
    "r1_decode bf16": ("TND_NTD", 1),
    "r1_mtp bf16": ("TND_NTD", 2),
    "vllm_bsnd_nbsd bf16": ("BSND_NBSD", 1),
}


def main(argv: list[str] | None = None) -> int:
    parser = common.cli_parser(__doc__, "smaller shapes (a smoke run)", devices=DEVICES)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 3 if args.quick else 7
    rows, failures = [], []
    for label, (layout, q_len) in CASES.items():
        built = mla_case(layout, q_len, args.quick)
        a, b = built["nd"](), built["nz"]()
        if not torch.equal(a, b):
            failures.append(f"{label}: the NZ output differs from the ND one")
        t_nd, t_nz = _thread_times(built["nd"], built["nz"], repeats)
        nd_s, nz_s = statistics.median(t_nd), statistics.median(t_nz)
        row = {"case": label, "shape": built["shape"], "nd_ms": 1e3 * nd_s, "nz_ms": 1e3 * nz_s,
               "nz_over_nd": nz_s / nd_s, "bitwise_equal": torch.equal(a, b),
               "thread_times_s": {"nd": t_nd, "nz": t_nz}}
        rows.append(row)
        print(f"{label:22s} {row['shape']:62s} ND {row['nd_ms']:8.1f} ms  NZ {row['nz_ms']:8.1f} ms  "
              f"NZ/ND {row['nz_over_nd']:.3f}", flush=True)
    out = Path(args.out)
    payload = {"benchmark": "MLA decode over bf16 NZ vs ND paged caches (CPU reference, one thread, thread CPU time)",
               "quick": args.quick, "target_nz_over_nd": TARGET, "machine": common.machine_info("cpu"),
               "threads": torch.get_num_threads(), "busy": common.busy_warning(), "rows": rows,
               "failures": failures}
    missed = write_pair(out / "nz_cpu", payload, ("nd", "ND"), ("nz", "NZ"), TARGET,
                        "MLA decode, bf16 NZ vs ND paged caches, CPU reference (1 thread, CPU time)")
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    return 1 if failures or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
