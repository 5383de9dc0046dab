"""Context parallelism on the CPU (gloo, spawned ranks on this machine; docs/guides/context_parallel.md):

1. per-rank peak memory of causal FlashAttention forward + backward at S = 8k, 16k, 32k for P = 1, 2, 4 (ring,
   head_tail): the growth of each rank's resident set over the call (VmHWM after resetting it, minus the resident
   set before; the leaf copies of q/k/v the call makes are inside it) and the rank's shard sizes, next to the
   single-process `cann_attn.flash_attention` at the same S; then, in a second call under torch.profiler's memory
   tracking, where it goes: the saved activations (what autograd keeps for the backward, counted by
   saved_tensors_hooks once per storage, split into the caller's inputs (q/k/v, the
   compressed mask) and the new tensors), the ring's
   communication buffers (every tensor received into, while alive: peak), the reference backend's score-tile
   workspace (peak transient of one FlashAttentionScore(Grad) call above its inputs and outputs: bounded by a fixed
   tile budget, not by S) and the peak of all torch-allocated bytes above what was live before the call; saved
   activations must scale as ~1/P;
2. ring with overlap vs without, timed alternately in the same process group;
3. bytes sent per rank per layer (forward + backward, counted by cann_attn.distributed) against the analytic
   volume: ring (P-1)(|K|+|V|) forward, (P-1)(|K|+|V|) + P(|dK|+|dV|) backward (dK/dV travel in fp32);
   Ulysses (P-1)/P of (|Q|+|K|+|V|+|O|) forward and of (|dO|+|dQ|+|dK|+|dV|) backward.

Small N and D keep it to minutes on 2 cores; P ranks share this machine's cores, so times are not speed-ups.
Writes results/context_parallel_cpu.json and .png.

    PYTHONPATH=src python benchmarks/bench_context_parallel.py [--quick]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cli_parser, machine_info, time_pair, write_json

# cann-attn bench passes --device only where it applies: gloo process groups on the CPU.
DEVICES = ("cpu",)

HEADS, DIM = 4, 16


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> int:
    """Resets VmHWM to the current resident set (Linux clear_refs 5); returns the resident set in KiB."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return _status_kb("VmRSS")


def _shards(rank: int, world: int, seq: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(rank)
    local = seq // world
    q, k, v, dy = (torch.randn(1, local, HEADS, DIM, generator=gen, dtype=dtype) for _ in range(4))
    return q, k, v, dy


def _layer(q, k, v, dy, method="ring", overlap=True, plain=False):
    """Causal forward + backward through cann_attn.distributed (or, `plain`, the single-process
    cann_attn.flash_attention on the same tensors)."""
    import cann_attn
    import cann_attn.distributed as cp

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    kwargs = dict(sparse_mode=2, atten_mask=cann_attn.compressed_mask(2), scale_value=DIM**-0.5)
    if plain:
        out = cann_attn.flash_attention(q, k, v, HEADS, "BSND", **kwargs)
    else:
        out = cp.flash_attention(q, k, v, HEADS, "BSND", method=method, overlap=overlap, **kwargs)
    out.backward(dy)
    return out


def memory_worker(rank: int, world: int, device, seq: int, plain: bool = False) -> dict:
    q, k, v, dy = _shards(rank, world, seq)
    _layer(*(t[:, : 4 * world] for t in (q, k, v, dy)), plain=plain)  # warm-up: lazy imports, allocator pools
    before = _reset_peak()
    start = time.perf_counter()
    _layer(q, k, v, dy, plain=plain)
    seconds = time.perf_counter() - start
    peak = _status_kb("VmHWM")
    shard_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, dy))
    return {"rank": rank, "growth_mib": (peak - before) / 1024, "peak_mib": peak / 1024,
            "shard_inputs_mib": shard_bytes / 2**20, "seconds": seconds}


class _Breakdown:
    """Where one forward + backward's memory goes (torch-allocated bytes; see the module docstring)."""

    def __init__(self, inputs):
        import weakref

        self._weakref = weakref
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.saved: dict[int, tuple[int, bool]] = {}  # storage -> (bytes, is a caller input)
        self.buffers_live = self.buffers_peak = 0
        self.op_ranges: list[tuple[int, int]] = []  # profiler ns ranges of the FlashAttentionScore(Grad) calls

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        self.saved.setdefault(ptr, (t.untyped_storage().nbytes(), ptr in self.inputs))
        return t

    def received(self, tensors) -> None:
        for t in tensors:
            size = t.numel() * t.element_size()
            self.buffers_live += size
            self.buffers_peak = max(self.buffers_peak, self.buffers_live)
            self._weakref.finalize(t, self._released, size)

    def _released(self, size: int) -> None:
        self.buffers_live -= size


def _patched(breakdown: _Breakdown):
    """Wraps the ring's send/receive and its block operator calls (module attributes) for the breakdown."""
    import contextlib

    from cann_attn.distributed import blocks, comm

    @contextlib.contextmanager
    def patch():
        send_recv, fwd, bwd = comm.send_recv, blocks.flash_attention_score, blocks.flash_attention_score_grad

        def counted_send_recv(group, send, recv, *args):
            breakdown.received(recv)
            return send_recv(group, send, recv, *args)

        def marked(fn, name):
            def call(*args, **kwargs):
                with torch.profiler.record_function(name):
                    return fn(*args, **kwargs)
            return call

        comm.send_recv = counted_send_recv
        blocks.flash_attention_score = marked(fwd, "cp_block_forward")
        blocks.flash_attention_score_grad = marked(bwd, "cp_block_backward")
        try:
            yield
        finally:
            comm.send_recv, blocks.flash_attention_score, blocks.flash_attention_score_grad = send_recv, fwd, bwd
    return patch()


def _timeline(prof) -> tuple[list[tuple[int, int]], dict[str, list[tuple[int, int]]]]:
    """(memory events (ns, bytes +alloc / -free) in time order, {range name: [(start, end)]}) of a profile."""
    memory, ranges = [], {}
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]":
            memory.append((event.start_ns(), event.nbytes()))
        elif event.name().startswith("cp_"):
            ranges.setdefault(event.name(), []).append((event.start_ns(), event.start_ns() + event.duration_ns()))
    memory.sort()
    return memory, ranges


def _live_curve(memory):
    times, live, total = [], [], 0
    for ns, nbytes in memory:
        total += nbytes
        times.append(ns)
        live.append(total)
    return times, live


def _workspace(times, live, ranges) -> int:
    """Max over the ranges of (peak live bytes inside) - max(live at entry, live at exit): what a call needs beyond
    its inputs and results while it runs."""
    import bisect

    worst = 0
    for start, end in ranges:
        i0, i1 = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        entry = live[i0 - 1] if i0 > 0 else 0
        leave = live[i1 - 1] if i1 > 0 else 0
        inside = max(live[i0:i1], default=entry)
        worst = max(worst, inside - max(entry, leave))
    return worst


def breakdown_worker(rank: int, world: int, device, seq: int, plain: bool = False) -> dict:
    """One causal forward + backward under torch.profiler's memory tracking (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import cann_attn
    import cann_attn.distributed as cp

    q, k, v, dy = _shards(rank, world, seq)
    _layer(*(t[:, : 4 * world] for t in (q, k, v, dy)), plain=plain)  # warm-up
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kwargs = dict(sparse_mode=2, atten_mask=cann_attn.compressed_mask(2), scale_value=DIM**-0.5)
    breakdown = _Breakdown([*leaves, kwargs["atten_mask"]])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, _patched(breakdown):
        with torch.autograd.graph.saved_tensors_hooks(breakdown.pack, lambda t: t), record_function("cp_forward"):
            if plain:
                out = cann_attn.flash_attention(*leaves, HEADS, "BSND", **kwargs)
            else:
                out = cp.flash_attention(*leaves, HEADS, "BSND", **kwargs)
        with record_function("cp_backward"):
            out.backward(dy)
        del out
    memory, ranges = _timeline(prof)
    times, live = _live_curve(memory)
    op_ranges = (ranges.get("cp_forward", []) + ranges.get("cp_backward", []) if plain
                 else ranges.get("cp_block_forward", []) + ranges.get("cp_block_backward", []))
    saved_inputs = sum(n for n, is_input in breakdown.saved.values() if is_input)
    saved_new = sum(n for n, is_input in breakdown.saved.values() if not is_input)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves)
    mib = 2**-20
    return {"rank": rank, "saved_new_mib": saved_new * mib, "saved_inputs_mib": saved_inputs * mib,
            "gradients_mib": grads * mib, "buffers_peak_mib": breakdown.buffers_peak * mib,
            "workspace_mib": _workspace(times, live, op_ranges) * mib,
            "torch_peak_mib": max(live, default=0) * mib, "shard_mib": q.numel() * q.element_size() * mib}


def overlap_worker(rank: int, world: int, device, seq: int, repeats: int) -> dict:
    import torch.distributed as dist

    q, k, v, dy = _shards(rank, world, seq)

    def run(overlap):
        def call():
            dist.barrier()
            _layer(q, k, v, dy, overlap=overlap)
        return call

    with_overlap, without = time_pair(run(True), run(False), warmup=1, repeats=repeats)
    return {"rank": rank, "overlap_s": with_overlap["median_s"], "no_overlap_s": without["median_s"]}


def volume_worker(rank: int, world: int, device, seq: int) -> dict:
    import cann_attn.distributed as cp

    q, k, v, dy = _shards(rank, world, seq)
    out = {}
    for method in ("ring", "ulysses"):
        cp.reset_comm_stats()
        _layer(q, k, v, dy, method=method)
        out[method] = cp.comm_stats()
    return {"rank": rank, **out}


def analytic_bytes(method: str, world: int, seq: int) -> int:
    shard = (seq // world) * HEADS * DIM * 4  # one fp32 [1, S/P, N, D] shard
    if world == 1:
        return 0
    if method == "ring":
        return (world - 1) * 2 * shard + (world - 1) * 2 * shard + world * 2 * shard
    return (world - 1) * (4 * shard + 4 * shard) // world


def main(argv=None) -> None:
    from cann_attn.testing.distributed import run_group

    parser = cli_parser(__doc__, "S = 1k, 2k only (a smoke run)", devices=DEVICES)
    args = parser.parse_args(argv)
    seqs = [1024, 2048] if args.quick else [8192, 16384, 32768]
    worlds = [1, 2, 4]
    memory = []
    for seq in seqs:
        for world in worlds:
            ranks = run_group(world, memory_worker, seq, deadline=1800)
            memory.append({"seq": seq, "world": world, "ranks": ranks,
                           "max_growth_mib": max(r["growth_mib"] for r in ranks),
                           "seconds": max(r["seconds"] for r in ranks)})
            print(f"memory S={seq} P={world}: per-rank growth {[round(r['growth_mib'], 1) for r in ranks]} MiB, "
                  f"{memory[-1]['seconds']:.1f} s", flush=True)
    single = []
    for seq in seqs:
        rank = run_group(1, memory_worker, seq, True, deadline=1800)[0]
        single.append({"seq": seq, "growth_mib": rank["growth_mib"], "seconds": rank["seconds"]})
        print(f"single-process cann_attn.flash_attention S={seq}: growth {rank['growth_mib']:.1f} MiB", flush=True)
    breakdown = []
    for seq in seqs:
        for world in [0, *worlds]:  # 0: the single-process operator
            ranks = run_group(max(world, 1), breakdown_worker, seq, world == 0, deadline=1800)
            entry = {"seq": seq, "world": world if world else 1, "single_process": world == 0, "ranks": ranks}
            entry.update({key: max(r[key] for r in ranks) for key in ranks[0] if key != "rank"})
            breakdown.append(entry)
            print(f"breakdown S={seq} {'single-process' if world == 0 else f'P={world}'}: saved new "
                  f"{entry['saved_new_mib']:.2f} + inputs {entry['saved_inputs_mib']:.2f}, gradients "
                  f"{entry['gradients_mib']:.2f}, buffers {entry['buffers_peak_mib']:.2f}, workspace "
                  f"{entry['workspace_mib']:.2f}, torch peak {entry['torch_peak_mib']:.2f} MiB", flush=True)
    overlap = []
    for world in (2, 4):
        seq = seqs[0]
        ranks = run_group(world, overlap_worker, seq, 3, deadline=1800)
        entry = {"seq": seq, "world": world, "overlap_s": max(r["overlap_s"] for r in ranks),
                 "no_overlap_s": max(r["no_overlap_s"] for r in ranks)}
        entry["ratio_no_overlap_over_overlap"] = entry["no_overlap_s"] / entry["overlap_s"]
        overlap.append(entry)
        print(f"overlap P={world} S={seq}: {entry['overlap_s']:.2f} s vs {entry['no_overlap_s']:.2f} s without",
              flush=True)
    volume = []
    for world in (2, 4):
        seq = seqs[0]
        ranks = run_group(world, volume_worker, seq, deadline=1800)
        for method in ("ring", "ulysses"):
            measured = [sum(r[method].values()) for r in ranks]
            volume.append({"seq": seq, "world": world, "method": method, "measured_bytes_per_rank": measured,
                           "by_kind": ranks[0][method], "analytic_bytes": analytic_bytes(method, world, seq)})
            print(f"volume {method} P={world}: measured {measured}, analytic {volume[-1]['analytic_bytes']}",
                  flush=True)
    payload = {"benchmark": "context_parallel", "machine": machine_info("cpu"), "heads": HEADS, "dim": DIM,
               "dtype": "float32", "mask": "causal (sparse_mode 2), ring, head_tail", "memory": memory,
               "single_process_memory": single, "memory_breakdown": breakdown,
               "overlap": overlap, "volume": volume}
    out_dir = Path(args.out)
    name = "context_parallel_cpu" + ("_quick" if args.quick else "")
    write_json(out_dir / f"{name}.json", payload)
    _plot(payload, out_dir / f"{name}.png")


def _plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    seqs = sorted({m["seq"] for m in payload["memory"]})
    for world in sorted({m["world"] for m in payload["memory"]}):
        growth = [next(m["max_growth_mib"] for m in payload["memory"] if m["seq"] == s and m["world"] == world)
                  for s in seqs]
        axes[0].plot(seqs, growth, marker="o", label=f"P = {world}")
    axes[0].plot(seqs, [m["growth_mib"] for m in payload["single_process_memory"]], "k--", marker="x",
                 label="single-process flash_attention")
    axes[0].set(xscale="log", yscale="log", xlabel="sequence length S", ylabel="per-rank peak growth (MiB)",
                title="FA fwd+bwd per-rank memory (causal ring)")
    axes[0].legend()
    labels = [f"P={o['world']}" for o in payload["overlap"]]
    xs = range(len(labels))
    axes[1].bar([x - 0.2 for x in xs], [o["overlap_s"] for o in payload["overlap"]], 0.4, label="overlap")
    axes[1].bar([x + 0.2 for x in xs], [o["no_overlap_s"] for o in payload["overlap"]], 0.4, label="no overlap")
    axes[1].set(xticks=list(xs), xticklabels=labels, ylabel="fwd+bwd seconds (slowest rank)",
                title=f"ring overlap, S = {payload['overlap'][0]['seq']}")
    axes[1].legend()
    labels = [f"{v['method']} P={v['world']}" for v in payload["volume"]]
    xs = range(len(labels))
    axes[2].bar([x - 0.2 for x in xs], [max(v["measured_bytes_per_rank"]) / 2**20 for v in payload["volume"]], 0.4,
                label="measured")
    axes[2].bar([x + 0.2 for x in xs], [v["analytic_bytes"] / 2**20 for v in payload["volume"]], 0.4,
                label="analytic")
    axes[2].set(xticks=list(xs), xticklabels=labels, ylabel="MiB sent per rank per layer",
                title="communication volume (fwd+bwd)")
    axes[2].legend()
    _plot_breakdown(axes[3], payload.get("memory_breakdown", []))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_breakdown(axis, breakdown: list[dict]) -> None:
    """Per-rank breakdown at the largest S: saved activations (new tensors), gradients, communication buffers,
    the operator's tile workspace and the torch-allocated peak, for the single-process operator and P = 1, 2, 4."""
    if not breakdown:
        return
    seq = max(b["seq"] for b in breakdown)
    rows = [b for b in breakdown if b["seq"] == seq]
    labels = ["single" if b["single_process"] else f"P={b['world']}" for b in rows]
    parts = (("saved_new_mib", "saved activations"), ("gradients_mib", "gradients dq/dk/dv"),
             ("buffers_peak_mib", "ring buffers (peak)"), ("workspace_mib", "tile workspace"),
             ("torch_peak_mib", "torch peak (total)"))
    width = 0.8 / len(parts)
    for i, (key, label) in enumerate(parts):
        axis.bar([x + (i - 2) * width for x in range(len(rows))], [b[key] for b in rows], width, label=label)
    axis.set(xticks=list(range(len(rows))), xticklabels=labels, ylabel="MiB per rank",
             title=f"where the memory goes, S = {seq}")
    axis.legend(fontsize=8)


if __name__ == "__main__":
    main()
