"""Paged KV caches (PageAttention) against the same keys laid out contiguously, on the CPU reference backend.

Cases (docs/semantics/paged-kv.md; shapes of the DeepSeek-V3.2 inference recipes and op-plugin's examples):
  sfa_decode:  sparse_flash_attention, TND query of one token for each of B=4 sequences with 8192/6144/4608/3072
               keys, N1=128 heads, D=512 latent (key = value) + rope 64, K=2048 selected tokens per row
               (sparse_block_size 1, distinct allowed tokens, as lightning_indexer gives), cache blocks of 128
               tokens (PA_BSND) shuffled in the pool, fp32 and bf16;
  sfa_prefill: the same layer over a chunk of 32 query tokens at the end of sequences of 4096 and 3072 keys;
  fia_decode:  fused_infer_attention_score decode (Q_S = 1), B=8 sequences of 1024..4096 keys, GQA 32/8 heads,
               D=128, BSND query, BnBsH cache of 128-token blocks against a contiguous BSND cache, fp32 and bf16.
Times: median of alternating calls (common.time_pair); "speed" = contiguous time / paged time, target >= 1/1.15
(paged at most 1.15x the contiguous time). Every paged output is checked equal (bit for bit) to the contiguous one.
Peak memory: VmHWM of a fresh interpreter running one call (common.peak_rss): "delta" is the call's own working
memory, to compare with the size of the cache (a whole-cache copy would add at least that much).

    python benchmarks/bench_paged.py [--quick] [--out DIR] [--threads N] [--no-rss] [--strict]

Writes DIR/paged_cpu.json and DIR/paged_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from bench_sparse_attention import reset_peak_rss

import cann_attn

DEVICES = ("cpu",)
SPEED_TARGET = 1 / 1.15
PAGE = 128


def _pool(per_seq: list[torch.Tensor], page: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A block pool holding the sequences' [L_b, ...] tokens in shuffled blocks (two spare blocks), and the int32
    block table (-1 in unused entries)."""
    needed = [-(-t.shape[0] // page) for t in per_seq]
    blocks = sum(needed) + 2
    perm = torch.randperm(blocks, generator=gen).tolist()
    cache = torch.zeros((blocks, page, *per_seq[0].shape[1:]), dtype=per_seq[0].dtype)
    table = torch.full((len(per_seq), max(needed)), -1, dtype=torch.int32)
    k = 0
    for b, t in enumerate(per_seq):
        for j in range(needed[b]):
            chunk = t[j * page : (j + 1) * page]
            cache[perm[k], : chunk.shape[0]] = chunk
            table[b, j] = perm[k]
            k += 1
    return cache, table


def _top_k(q_lens: list[int], kv_lens: list[int], k: int, gen: torch.Generator) -> torch.Tensor:
    """[T, 1, K] distinct allowed tokens per row (mode 3: row t of a sequence sees Skv - Sq + t + 1 keys)."""
    rows = []
    for sq, skv in zip(q_lens, kv_lens, strict=True):
        for t in range(sq):
            allowed = skv - sq + t + 1
            chosen = torch.randperm(allowed, generator=gen)[:k]
            rows.append(torch.cat([chosen, torch.full((k - chosen.numel(),), -1)]))
    return torch.stack(rows).to(torch.int32).unsqueeze(1)


def sfa_case(name: str, dtype: str = "float32", quick: bool = False) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    if name == "sfa_prefill":
        q_lens, kv_lens = ([8, 8], [2048, 1536]) if quick else ([32, 32], [4096, 3072])
    else:
        q_lens, kv_lens = ([1, 1], [4096, 2500]) if quick else ([1, 1, 1, 1], [8192, 6144, 4608, 3072])
    heads, k = (32, 1024) if quick else (128, 2048)
    latent = [torch.randn(n, 1, 512, generator=gen).to(dt) for n in kv_lens]
    rope = [torch.randn(n, 1, 64, generator=gen).to(dt) for n in kv_lens]
    cache, table = _pool(latent, PAGE, gen)
    # One table serves both caches: the rope pool takes the latent pool's block numbers.
    rope_cache = torch.zeros((cache.shape[0], PAGE, 1, 64), dtype=dt)
    for b, n in enumerate(kv_lens):
        for j in range(-(-n // PAGE)):
            chunk = rope[b][j * PAGE : (j + 1) * PAGE]
            rope_cache[int(table[b, j]), : chunk.shape[0]] = chunk
    tokens = sum(q_lens)
    query = torch.randn(tokens, heads, 512, generator=gen).to(dt)
    query_rope = torch.randn(tokens, heads, 64, generator=gen).to(dt)
    indices = _top_k(q_lens, kv_lens, k, gen)
    q_cum = torch.tensor(q_lens).cumsum(0).tolist()
    key_t, rope_t = torch.cat(latent), torch.cat(rope)
    common_kw = dict(query_rope=query_rope, actual_seq_lengths_query=q_cum, layout="TND", sparse_mode=3,
                     backend="reference")

    def contiguous():
        return cann_attn.sparse_flash_attention(query, key_t, key_t, indices, 512 ** -0.5, key_rope=rope_t,
                                                actual_seq_lengths_kv=torch.tensor(kv_lens).cumsum(0).tolist(),
                                                **common_kw).attention_out

    def paged():
        return cann_attn.sparse_flash_attention(query, cache, cache, indices, 512 ** -0.5, key_rope=rope_cache,
                                                block_table=table, actual_seq_lengths_kv=kv_lens,
                                                **common_kw).attention_out

    flops = 2 * tokens * k * heads * (576 + 512)
    cache_mb = (cache.numel() + rope_cache.numel()) * cache.element_size() / 2**20
    shape = f"T={tokens} N1={heads} D=512+64 K={k} Skv={kv_lens} page={PAGE}"
    return {"contiguous": contiguous, "paged": paged, "flops": flops, "cache_mb": cache_mb, "shape": shape}


def fia_case(name: str, dtype: str = "float32", quick: bool = False) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    batch, heads, heads_kv, d = (4, 16, 4, 128) if quick else (8, 32, 8, 128)
    top = 2048 if quick else 4096
    kv_lens = [top - (top * 3 // 4) * b // max(batch - 1, 1) for b in range(batch)]
    s = max(kv_lens)
    k = torch.randn(batch, s, heads_kv, d, generator=gen).to(dt)
    v = torch.randn(batch, s, heads_kv, d, generator=gen).to(dt)
    q = torch.randn(batch, 1, heads, d, generator=gen).to(dt)
    k_cache, table = _pool([k[b, :n].flatten(1) for b, n in enumerate(kv_lens)], PAGE, gen)
    v_cache = torch.zeros_like(k_cache)
    for b, n in enumerate(kv_lens):
        for j in range(-(-n // PAGE)):
            chunk = v[b, j * PAGE : (j + 1) * PAGE].flatten(1)[: n - j * PAGE]
            v_cache[int(table[b, j]), : chunk.shape[0]] = chunk
    common_kw = dict(num_heads=heads, num_key_value_heads=heads_kv, input_layout="BSND", scale=d ** -0.5,
                     actual_seq_lengths_kv=kv_lens, backend="reference")

    def contiguous():
        return cann_attn.fused_infer_attention_score(q, k, v, **common_kw)[0]

    def paged():
        return cann_attn.fused_infer_attention_score(q, k_cache, v_cache, block_table=table, block_size=PAGE,
                                                     **common_kw)[0]

    flops = 4 * heads * sum(kv_lens) * d
    cache_mb = (k_cache.numel() + v_cache.numel()) * k_cache.element_size() / 2**20
    shape = f"B={batch} N={heads}/{heads_kv} D={d} Skv={kv_lens[0]}..{kv_lens[-1]} page={PAGE}"
    return {"contiguous": contiguous, "paged": paged, "flops": flops, "cache_mb": cache_mb, "shape": shape}


CASES = {
    "sfa_decode fp32": (sfa_case, "sfa_decode", "float32"),
    "sfa_decode bf16": (sfa_case, "sfa_decode", "bfloat16"),
    "sfa_prefill fp32": (sfa_case, "sfa_prefill", "float32"),
    "fia_decode fp32": (fia_case, "fia_decode", "float32"),
    "fia_decode bf16": (fia_case, "fia_decode", "bfloat16"),
}


def rss_call(case: str, kind: str, quick: bool = False, threads: int | None = None):
    """peak_rss child: the inputs of `case` built, returns its `kind` call."""
    if threads:
        torch.set_num_threads(threads)
    make, name, dtype = CASES[case]
    built = make(name, dtype, quick)
    call, cache_mb = built[kind], built["cache_mb"]
    del built
    # The peak around the call is then its own, not that of building the inputs.
    return call, {"cache_mb": cache_mb, "peak_reset": reset_peak_rss()}


def main(argv: list[str] | None = None) -> int:
    parser = common.cli_parser(__doc__, "smaller shapes (a smoke run)", devices=DEVICES, threads=True, no_rss=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else 5
    rows, failures = [], []
    for label, (make, name, dtype) in CASES.items():
        built = make(name, dtype, args.quick)
        a, b = built["contiguous"](), built["paged"]()
        if not torch.equal(a, b):
            failures.append(f"{label}: paged output differs from the contiguous one")
        t_contig, t_paged = common.time_pair(built["contiguous"], built["paged"], warmup=1, repeats=repeats)
        row = {"case": label, "shape": built["shape"], "contiguous_ms": 1e3 * t_contig["median_s"],
               "paged_ms": 1e3 * t_paged["median_s"], "speed": t_contig["median_s"] / t_paged["median_s"],
               "paged_over_contiguous": t_paged["median_s"] / t_contig["median_s"],
               "paged_gflops": common.gflops(built["flops"], t_paged["median_s"]), "cache_mb": built["cache_mb"],
               "bitwise_equal": torch.equal(a, b), "times": {"contiguous": t_contig, "paged": t_paged}}
        if not args.no_rss:
            for kind in ("contiguous", "paged"):
                rss = common.peak_rss(__file__, "rss_call", {"case": label, "kind": kind, "quick": args.quick,
                                                             "threads": args.threads})
                row[f"{kind}_delta_mb"] = rss["delta_mb"]
            # A whole-cache copy would add at least the cache's size to the call's working memory.
            row["no_cache_copy"] = row["paged_delta_mb"] < row["contiguous_delta_mb"] + 0.5 * row["cache_mb"]
        rows.append(row)
        print(f"{label:18s} {row['shape']:58s} contiguous {row['contiguous_ms']:8.1f} ms  paged "
              f"{row['paged_ms']:8.1f} ms  paged/contiguous {row['paged_over_contiguous']:.3f}"
              + (f"  RSS delta {row['contiguous_delta_mb']:.0f} / {row['paged_delta_mb']:.0f} MB (cache "
                 f"{row['cache_mb']:.0f} MB)" if not args.no_rss else ""), flush=True)
    out = Path(args.out)
    payload = {"benchmark": "paged KV caches vs contiguous (CPU reference)", "quick": args.quick,
               "target_paged_over_contiguous": 1.15, "machine": common.machine_info("cpu"),
               "threads": torch.get_num_threads(), "busy": common.busy_warning(), "rows": rows,
               "failures": failures}
    common.write_json(out / "paged_cpu.json", payload)
    common.bar_plot(out / "paged_cpu.png", [r["case"] for r in rows],
                    {"contiguous ms": [r["contiguous_ms"] for r in rows], "paged ms": [r["paged_ms"] for r in rows]},
                    title="Paged (PA) vs contiguous KV, CPU reference", ylabel="ms per call",
                    ratios=[r["speed"] for r in rows], targets=[SPEED_TARGET] * len(rows),
                    ratio_label="contiguous time / paged time (dashed: 1/1.15)")
    missed = [r["case"] for r in rows if r["paged_over_contiguous"] > 1.15]
    missed += [r["case"] for r in rows if r.get("no_cache_copy") is False]
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    return 1 if failures or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
