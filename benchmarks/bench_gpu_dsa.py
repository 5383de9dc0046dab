"""DSA Triton kernels on a CUDA GPU at DeepSeek-V3.2 shapes (FLOPs as in
benchmarks/common.py).

Sparse MLA: B=1, S1=4096 query tokens, S2 in {8k, 16k, 32k, 64k}, N1=128, D=512 latent + 64 rope, value = the
512 latent (the same tensor as key), topk=2048 single tokens per row (sparse_block_size 1, sparse_mode 3: a random
top-2048 of each row's causally allowed keys). Throughput:
  forward  = 2 * tokens * topk * N1 * (Dqk + Dv)          (Dqk = 576, Dv = 512)
  backward = 2 * tokens * N1 * topk * (2 * Dv + 3 * Dqk)
for the atomic backward and the deterministic one. Indexer: N=64 index heads, D=128: lightning_indexer (scores +
top-2048) and the KL-loss backward (sparse_lightning_indexer_grad_kl_loss), whose time is reported relative to
the sparse backward. Peak memory: torch.cuda.max_memory_allocated of each call. Targets: forward >= 300
TFLOPS, backward >= 150 TFLOPS on H100/H200.

    python benchmarks/bench_gpu_dsa.py [--quick] [--out DIR] [--device cuda] [--strict]

Writes DIR/gpu_dsa_<gpu-model>.json and .png (default DIR: benchmarks/results). Exits with status 2 and a message
without CUDA.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

import cann_attn

# --device choices (the first is the default); cann-attn bench reads this line to pass --device only where it
# applies.
DEVICES = ("cuda",)

N1, D, DR, DV, TOPK = 128, 512, 64, 512, 2048
N_IDX, D_IDX = 64, 128
S1 = 4096
S2_VALUES = (8192, 16384, 32768, 65536)
FWD_TARGET_TFLOPS, BWD_TARGET_TFLOPS = 300.0, 150.0


def sparse_forward_flops(tokens: int, topk: int, heads: int = N1, d_qk: int = D + DR, d_v: int = DV) -> float:
    return 2.0 * tokens * topk * heads * (d_qk + d_v)


def sparse_backward_flops(tokens: int, topk: int, heads: int = N1, d_qk: int = D + DR, d_v: int = DV) -> float:
    return 2.0 * tokens * heads * topk * (2 * d_v + 3 * d_qk)


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def gpu_slug(name: str) -> str:
    """File-name form of a GPU model ("NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3")."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def causal_topk_indices(s1: int, s2: int, topk: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """[1, S1, 1, topk] int32: row t a random top-k of its allowed keys [0, S2 - S1 + t] (no duplicates), built on
    the device from random scores (the indexer's output pattern)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty((s1, topk), dtype=torch.int32, device=device)
    for t0 in range(0, s1, 256):
        rows = torch.arange(t0, min(t0 + 256, s1), device=device)
        scores = torch.rand((rows.numel(), s2), generator=gen, device=device)
        allowed = torch.arange(s2, device=device).view(1, -1) <= (s2 - s1 + rows).view(-1, 1)
        out[t0 : t0 + rows.numel()] = scores.masked_fill(~allowed, -1.0).topk(topk, dim=-1).indices.to(torch.int32)
    return out.view(1, s1, 1, topk)


def _measure(fn, repeats: int) -> dict[str, Any]:
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    timing = common.time_fn(fn, warmup=1, repeats=repeats, device="cuda")
    timing["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
    return timing


def run_case(s2: int, repeats: int, dev: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device=dev).manual_seed(s2)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(torch.bfloat16)

    q, qr = rnd(1, S1, N1, D), rnd(1, S1, N1, DR)
    kv, kr = rnd(1, s2, 1, D), rnd(1, s2, 1, DR)
    idx = causal_topk_indices(S1, s2, TOPK, dev)
    d_out = rnd(1, S1, N1, DV)
    scale = (D + DR) ** -0.5
    kw = dict(query_rope=qr, key_rope=kr, sparse_mode=3, backend="triton")
    fwd = cann_attn.sparse_flash_attention(q, kv, kv, idx, scale, **kw)
    record: dict[str, Any] = {"s1": S1, "s2": s2, "n1": N1, "topk": TOPK}
    record["forward"] = _measure(lambda: cann_attn.sparse_flash_attention(q, kv, kv, idx, scale, **kw), repeats)
    for name, det in (("backward", False), ("backward_deterministic", True)):
        record[name] = _measure(lambda det=det: cann_attn.sparse_flash_attention_grad(
            q, kv, kv, idx, d_out, fwd.attention_out, fwd.softmax_max, fwd.softmax_sum, scale, deterministic=det,
            **kw), repeats)
    qi, ki = rnd(1, S1, N_IDX, D_IDX), rnd(1, s2, 1, D_IDX)
    w = rnd(1, S1, N_IDX, scale=(N_IDX * D_IDX) ** -0.5)
    record["indexer"] = _measure(lambda: cann_attn.lightning_indexer(qi, ki, w, sparse_count=TOPK,
                                                                     backend="triton"), repeats)
    args = (q, kv, qi, ki, w, idx, fwd.softmax_max, fwd.softmax_sum, scale)
    record["kl_grad"] = _measure(lambda: cann_attn.sparse_lightning_indexer_grad_kl_loss(
        *args, query_rope=qr, key_rope=kr, backend="triton"), repeats)
    record["forward"]["tflops"] = tflops(sparse_forward_flops(S1, TOPK), record["forward"]["median_s"])
    for name in ("backward", "backward_deterministic"):
        record[name]["tflops"] = tflops(sparse_backward_flops(S1, TOPK), record[name]["median_s"])
    record["kl_grad_vs_sparse_backward"] = record["kl_grad"]["median_s"] / record["backward"]["median_s"]
    return record


def main(argv: list[str] | None = None) -> int:
    args = common.gpu_args(__doc__, "S2 = 8k only, 3 repeats", argv, "bench_gpu_dsa.py", DEVICES)
    if args is None:
        return 2
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    s2_values = S2_VALUES[:1] if args.quick else S2_VALUES
    repeats = 3 if args.quick else 10
    records = []
    for s2 in s2_values:
        rec = run_case(s2, repeats, dev)
        records.append(rec)
        print(f"S2={s2:6d}  fwd {rec['forward']['tflops']:6.1f} TFLOPS  bwd {rec['backward']['tflops']:6.1f}  "
              f"bwd(det) {rec['backward_deterministic']['tflops']:6.1f}  indexer {rec['indexer']['median_s']*1e3:7.2f}"
              f" ms  kl-grad/bwd {rec['kl_grad_vs_sparse_backward']:.2f}  "
              f"peak(bwd) {rec['backward']['peak_extra_bytes'] / 2**30:.2f} GiB")
        torch.cuda.empty_cache()
    slug = gpu_slug(gpu)
    payload = {"gpu": gpu, "machine": common.machine_info("cuda"), "command": " ".join(sys.argv),
               "targets_tflops": {"forward": FWD_TARGET_TFLOPS, "backward": BWD_TARGET_TFLOPS}, "cases": records}
    path = common.write_json(args.out / f"gpu_dsa_{slug}.json", payload)
    labels = [f"S2={r['s2'] // 1024}k" for r in records]
    common.bar_plot(args.out / f"gpu_dsa_{slug}.png", labels,
                    {"forward": [r["forward"]["tflops"] for r in records],
                     "backward": [r["backward"]["tflops"] for r in records],
                     "backward (deterministic)": [r["backward_deterministic"]["tflops"] for r in records]},
                    title=f"DSA sparse MLA on {gpu} (N1=128, D=576/512, topk=2048, S1=4096)", ylabel="TFLOPS")
    print(f"wrote {path}")
    missed = [r for r in records if r["forward"]["tflops"] < FWD_TARGET_TFLOPS
              or r["backward"]["tflops"] < BWD_TARGET_TFLOPS]
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
