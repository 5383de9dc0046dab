"""Decode (one query token per sequence) on the CPU reference backend against the memory's streaming rate.

A decode step reads each sequence's K and V once and does little arithmetic on them, so on a CPU its yardstick is
memory bandwidth: the K/V bytes a call reads per second, divided by the rate of a streaming read measured in the
same run (a memory-bound sum over STREAM_MIB MiB of fp32, timed alternately with the cases).

Cases: fused_infer_attention_score bf16 decode, B 8, N 32 query / 8 kv heads, Skv 8192, D 128 (all sequences full):
  contiguous BNSD, contiguous BSH, paged BSH (blocks of 128 keys, shuffled in the pool);
  long: B 1 with Skv 65536 (one sequence: its chunks are split across the threads);
  torch GQA: the same contiguous BNSD step in four lines of PyTorch (grouped query heads as GEMM rows, bf16),
  a reference point, not a golden.
The clock (`--clock`): `cpu`, this process's CPU time on one thread (default; on a shared machine wall-clock times
move with the neighbours' load), or `wall` with torch's threads. Every case and the streaming read are timed
alternately; the best of `--repeats` is kept. ratio = case GB/s / streaming GB/s. The paged output is checked equal
(bit for bit) to the contiguous one.

    python benchmarks/bench_decode.py [--clock cpu|wall] [--repeats N] [--quick] [--out DIR] [--strict]

--strict: exit 1 where a cann_attn case reads K/V at less than TARGET (0.5) of the streaming rate.

Writes DIR/decode_cpu.json and DIR/decode_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

import cann_attn

# --device choices (cann-attn bench reads this line).
DEVICES = ("cpu",)
B, N, NKV, S, D, PAGE = 8, 32, 8, 8192, 128, 128
# --strict: the K/V rate of every cann_attn case at least this fraction of the streaming read's.
TARGET = 0.5
LONG_S = 65536
STREAM_MIB = 512
DTYPE = torch.bfloat16


def stream_call() -> tuple[Callable[[], Any], int]:
    """A memory-bound sum over STREAM_MIB MiB of fp32 (read once per call) and the bytes it reads."""
    x = torch.ones(STREAM_MIB << 18)
    return (lambda: x.sum()), x.numel() * x.element_size()


def _caches(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, N, 1, D, generator=gen).to(DTYPE)
    k = torch.randn(batch, NKV, seq, D, generator=gen).to(DTYPE)
    v = torch.randn(batch, NKV, seq, D, generator=gen).to(DTYPE)
    return q, k, v


def kv_bytes(batch: int, seq: int) -> int:
    return 2 * batch * NKV * seq * D * torch.finfo(DTYPE).bits // 8


def _fia(q, k, v, layout: str, **kw) -> Callable[[], Any]:
    options = dict(num_heads=N, num_key_value_heads=NKV, scale=D**-0.5, input_layout=layout, **kw)
    return lambda: cann_attn.fused_infer_attention_score(q, k, v, **options)[0]


def _to_bsh(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1).contiguous()


def paged_case(seed: int = 0) -> dict[str, Any]:
    """The paged BSH case alone (perf_guard's decode figure): call, bytes."""
    q, k, v = _caches(B, S, seed)
    return {"call": _paged(q, k, v), "bytes": kv_bytes(B, S)}


def _paged(q, k, v) -> Callable[[], Any]:
    batch, seq = k.shape[0], k.shape[2]
    blocks = batch * seq // PAGE
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
    kb, vb = _to_bsh(k), _to_bsh(v)
    pool_k = torch.empty(blocks, PAGE, kb.shape[-1], dtype=DTYPE)
    pool_v = torch.empty_like(pool_k)
    pool_k[order] = kb.view(blocks, PAGE, -1)
    pool_v[order] = vb.view(blocks, PAGE, -1)
    table = order.view(batch, seq // PAGE).to(torch.int32)
    return _fia(_to_bsh(q), pool_k, pool_v, "BSH", block_table=table, block_size=PAGE,
                actual_seq_lengths_kv=[seq] * batch)


def torch_gqa(q, k, v) -> Callable[[], Any]:
    """Grouped query heads as GEMM rows over a contiguous BNSD cache, in bf16 (PyTorch's own kernels)."""
    batch, group = q.shape[0], N // NKV

    def call():
        qg = q.view(batch, NKV, group, D)
        p = torch.softmax((qg @ k.transpose(-1, -2)).float() * D**-0.5, dim=-1).to(DTYPE)
        return (p @ v).view(batch, N, 1, D)

    return call


def cases(quick: bool) -> dict[str, dict[str, Any]]:
    q, k, v = _caches(B, S)
    long_q, long_k, long_v = _caches(1, LONG_S if not quick else 4 * S, seed=2)
    built = {
        "BNSD": {"call": _fia(q, k, v, "BNSD"), "bytes": kv_bytes(B, S)},
        "BSH": {"call": _fia(_to_bsh(q), _to_bsh(k), _to_bsh(v), "BSH"), "bytes": kv_bytes(B, S)},
        "paged BSH": {"call": _paged(q, k, v), "bytes": kv_bytes(B, S)},
        "long BNSD": {"call": _fia(long_q, long_k, long_v, "BNSD"), "bytes": kv_bytes(1, long_k.shape[2])},
        "torch GQA": {"call": torch_gqa(q, k, v), "bytes": kv_bytes(B, S)},
    }
    contiguous = built["BSH"]["call"]()
    paged = built["paged BSH"]["call"]()
    built["paged BSH"]["bitwise_equal_to_contiguous"] = bool(torch.equal(contiguous, paged))
    return built


def measure(built: dict[str, dict[str, Any]], repeats: int, clock: Callable[[], float]) -> dict[str, Any]:
    stream, stream_bytes = stream_call()
    best: dict[str, float] = {}
    calls = {**{name: c["call"] for name, c in built.items()}, "stream": stream}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():  # the streaming read between every pair of cases
            for key, fn in ((name, call), ("stream", stream)):
                start = clock()
                fn()
                best[key] = min(best.get(key, float("inf")), clock() - start)
    stream_gbps = stream_bytes / best["stream"] / 1e9
    rows = []
    for name, c in built.items():
        gbps = c["bytes"] / best[name] / 1e9
        rows.append({"case": name, "ms": best[name] * 1e3, "kv_bytes": c["bytes"], "gbps": gbps,
                     "ratio_to_stream": gbps / stream_gbps,
                     **({k: v for k, v in c.items() if k.startswith("bitwise")})})
    return {"stream_gbps": stream_gbps, "stream_ms": best["stream"] * 1e3, "rows": rows}


def plot(path: Path, result: dict[str, Any], title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(rows))
    ax.bar(x, [r["ratio_to_stream"] for r in rows],
           color=["tab:gray" if r["case"] == "torch GQA" else "tab:blue" for r in rows])
    for i, r in enumerate(rows):
        ax.text(i, r["ratio_to_stream"], f"{r['ratio_to_stream']:.2f}\n{r['ms']:.0f} ms", ha="center", va="bottom",
                fontsize=8)
    ax.axhline(TARGET, color="tab:red", linestyle="--", label=f"target {TARGET}")
    ax.set_xticks(list(x), [r["case"] for r in rows])
    ax.set_ylabel(f"K/V GB/s / streaming read GB/s ({result['stream_gbps']:.1f})")
    ax.set_title(title, fontsize=9)
    ax.legend()
    return common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = common.cli_parser(__doc__, "1 repeat, a shorter long sequence", devices=DEVICES)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: process CPU time on one thread (default); wall: wall clock, torch's threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each case (best kept)")
    args = parser.parse_args(argv)
    args.out = Path(args.out)
    if args.clock == "cpu":
        torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    built = cases(args.quick)
    result = measure(built, 1 if args.quick else args.repeats, clock)
    for r in result["rows"]:
        print(f"  {r['case']:<10} {r['ms']:8.1f} ms  {r['gbps']:6.2f} GB/s  {r['ratio_to_stream']:.3f} of the "
              f"streaming read ({result['stream_gbps']:.1f} GB/s)")
    threads = torch.get_num_threads()
    payload = {"benchmark": "decode", "device": "cpu", "machine": common.machine_info("cpu"),
               "busy_warning": common.busy_warning(),
               "settings": {"clock": args.clock, "threads": threads, "repeats": args.repeats, "quick": args.quick,
                            "B": B, "N": N, "NKV": NKV, "S": S, "D": D, "page": PAGE, "long_S": LONG_S,
                            "dtype": "bf16", "stream_mib": STREAM_MIB},
               **result}
    json_path = common.write_json(args.out / "decode_cpu.json", payload)
    png = plot(args.out / "decode_cpu.png", result,
               f"FIA bf16 decode B{B} N{N}/{NKV} Skv {S} D{D} ({args.clock} clock, {threads} thread(s), "
               f"{payload['machine']['cpu']})")
    print(f"wrote {json_path}" + (f" and {png}" if png else ""))
    failed = [r["case"] for r in result["rows"] if r.get("bitwise_equal_to_contiguous") is False]
    if failed:
        print(f"paged output differs from the contiguous one: {failed}")
        return 1
    missed = [r["case"] for r in result["rows"] if r["case"] != "torch GQA" and r["ratio_to_stream"] < TARGET]
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
