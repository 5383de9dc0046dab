"""How much of the ALiBi benchmark case could any faithful kernel skip? (case (d) of
bench_fa_forward.py, whose target is ALiBi >= 1.5x SDPA)

SDPA given the materialised ALiBi bias runs at the speed of unmasked SDPA on the CPU (its flash kernel reads the bias
tile by tile; benchmarks/results/fa_forward_cpu.json: (d) and (a) take the same time), so 1.5x SDPA means doing at most
1/1.5 of SDPA's work at SDPA's GEMM speed. Without changing a result bit, a kernel may skip only the terms exp(s - max)
that softmax_exp flushes to exactly 0 ((s - max) * log2(e) <= -126; docs/semantics/pse.md, docs/semantics/precision.md).
This script computes, in float64 on the benchmark's own inputs (B=1, N=8, S=2048, D=128, slopes 2^-1 .. 2^-8, the seed
of bench_fa_forward.make_qkv), the share of such terms per head, at element level (a bound no kernel can beat, with
every logit known in advance) and at tile granularities, and the speed-up over doing every tile that it allows.

    python benchmarks/alibi_skip_bound.py [--out DIR]

Writes DIR/alibi_skip_bound.json (default DIR: benchmarks/results).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fa_forward as bench
import common

FLUSH_LOG2 = -126.0
TILES = [(1, 1), (16, 64), (64, 128), (64, 512), (256, 512)]


def exactly_zero_terms(q: torch.Tensor, k: torch.Tensor, slope: float, scale: float) -> torch.Tensor:
    """[S, S] bool: the terms of one head that flush to exactly 0 (their logit against the row's final maximum)."""
    i = torch.arange(q.shape[0], dtype=torch.float64)
    logits = scale * (q.double() @ k.double().T) - slope * (i[None, :] - i[:, None]).abs()
    return (logits - logits.amax(dim=1, keepdim=True)) * math.log2(math.e) <= FLUSH_LOG2


def skippable_share(zero: torch.Tensor, rows: int, cols: int) -> float:
    """The share of the terms in [rows, cols] tiles all of whose terms are exactly 0."""
    s = zero.shape[0]
    tiles = zero.view(s // rows, rows, s // cols, cols).all(dim=3).all(dim=1)
    return tiles.double().mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    q, k, _ = bench.make_qkv(bench.S, bench.N, torch.float32, "cpu")
    slopes = bench.alibi_slopes(bench.N).tolist()
    scale = bench.D**-0.5
    per_head, shares = [], {f"{r}x{c}": 0.0 for r, c in TILES}
    for h, slope in enumerate(slopes):
        zero = exactly_zero_terms(q[0, h], k[0, h], slope, scale)
        per_head.append(round(zero.double().mean().item(), 4))
        for r, c in TILES:
            shares[f"{r}x{c}"] += skippable_share(zero, r, c) / bench.N
    rows = {name: {"skippable": round(share, 4), "max_speedup": round(1.0 / (1.0 - share), 3)}
            for name, share in shares.items()}
    payload = {"benchmark": "alibi_skip_bound", "shape": f"B1 N{bench.N} S{bench.S} D{bench.D}", "slopes": slopes,
               "exactly_zero_share_per_head": per_head, "tiles": rows, "machine": common.machine_info()}
    path = common.write_json(Path(args.out) / "alibi_skip_bound.json", payload)
    print("exactly-zero share per head:", per_head)
    for name, row in rows.items():
        print(f"tiles {name:>8}: {row['skippable']:.3f} of the work skippable -> at most {row['max_speedup']:.2f}x "
              "over computing every tile")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
