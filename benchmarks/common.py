"""Shared benchmark helpers: timing, peak memory in a fresh process, FLOPs, JSON, plots, machine info.

- `time_fn(fn, warmup, repeats, device)`: median (and all) wall times of `fn()` after warm-up calls; `time_pair`
  times two implementations alternately (the fair way to take their ratio on a shared machine);
  `timed_once(fn, device)`: result and time of a single call.
- `peak_rss(script, func, kwargs)`: run ``func(**kwargs)`` from `script` in a fresh interpreter and return its
  peak resident set (VmHWM of /proc/self/status, falling back to getrusage ru_maxrss), together with the peak
  before the measured call (imports + inputs) so the call's own overhead is visible. On CUDA the child reports
  torch.cuda.max_memory_allocated as well.
- `attention_flops(...)`: the FLOP convention of every suite: 2 * B * N * visible_pairs * (Dqk + Dv) (dense:
  4 * B * N * Sq * Skv * D); `visible_pairs` counts the (i, j) a window lets through.
- `write_json`, `bar_plot` (matplotlib, Agg backend), `machine_info`.

Run as ``python common.py --child SCRIPT FUNC JSON_KWARGS`` it is the child side of `peak_rss`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


# ----------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------
def sync(device: str | torch.device = "cpu") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], Any], warmup: int = 1, repeats: int = 5, device: str = "cpu") -> dict[str, Any]:
    """Call `fn` `warmup` times, then time `repeats` calls; returns median_s, min_s and times_s."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def time_pair(fn_a: Callable[[], Any], fn_b: Callable[[], Any], warmup: int = 1, repeats: int = 5,
              device: str = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """Time two implementations alternately (a, b, a, b, ...), as `time_fn` does each. On a shared machine whose
    speed drifts over seconds, interleaving exposes both to the same conditions, so their ratio is not skewed
    by which one happened to run during a slow spell."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    sync(device)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(max(1, repeats)):
        for fn, out in ((fn_a, times[0]), (fn_b, times[1])):
            start = time.perf_counter()
            fn()
            sync(device)
            out.append(time.perf_counter() - start)
    return tuple({"median_s": statistics.median(t), "min_s": min(t), "times_s": t} for t in times)


def timed_once(fn: Callable[[], Any], device: str = "cpu") -> tuple[Any, float]:
    """(result, seconds) of one call (for calls too long to repeat)."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


# ----------------------------------------------------------------------------------------------------------
# Memory: peak RSS of one call in a fresh interpreter
# ----------------------------------------------------------------------------------------------------------
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def current_peak_kb() -> int:
    """Peak resident set of this process so far, in KiB (VmHWM; else ru_maxrss, KiB on Linux)."""
    hwm = _status_kb("VmHWM")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss // 1024 if sys.platform == "darwin" else maxrss


def load_module(path: str | Path, name: str | None = None):
    """Import a Python file by path (benchmark scripts are not a package)."""
    path = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(name or f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def peak_rss(script: str | Path, func: str, kwargs: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Run ``script.func(**kwargs)`` in a fresh interpreter and measure its peak memory.

    ``func`` must return a callable (the measured call, with its inputs already built) or a (callable, info)
    pair. Returns peak_mb, before_mb (peak after imports and input building), delta_mb, seconds (of the call),
    children_maxrss_mb (getrusage(RUSAGE_CHILDREN) of this process after the child ended, a cross-check that
    is a maximum over every child so far) and, on CUDA, cuda_peak_mb.
    """
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        str(Path(script).resolve()),
        func,
        json.dumps(kwargs),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"peak_rss child failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["children_maxrss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return result


def _child(script: str, func: str, kwargs_json: str) -> None:
    module = load_module(script)
    made = getattr(module, func)(**json.loads(kwargs_json))
    call, info = made if isinstance(made, tuple) else (made, {})
    cuda = torch.cuda.is_available() and info.get("device", "cpu") == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = current_peak_kb()
    start = time.perf_counter()
    call()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = current_peak_kb()
    out = {
        "peak_mb": peak / 1024,
        "before_mb": before / 1024,
        "delta_mb": (peak - before) / 1024,
        "seconds": seconds,
        **info,
    }
    if cuda:
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(out))


# ----------------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------------
def visible_pairs(
    seq_q: int, seq_kv: int, pre: int | None = None, nxt: int | None = None, delta: int = 0
) -> int:
    """Number of (i, j) with i - pre + delta <= j <= i + nxt + delta (None = unbounded), 0 <= j < seq_kv."""
    i = torch.arange(seq_q, dtype=torch.int64)
    hi = torch.full_like(i, seq_kv - 1) if nxt is None else (i + delta + nxt).clamp(max=seq_kv - 1)
    lo = torch.zeros_like(i) if pre is None else (i + delta - pre).clamp(min=0)
    return int((hi - lo + 1).clamp(min=0).sum())


def attention_flops(batch: int, heads: int, pairs: int, d_qk: int, d_v: int | None = None) -> float:
    """Forward FLOPs: 2 * B * N * visible_pairs * (Dqk + Dv) (= 4 B N Sq Skv D when dense and Dv = Dqk)."""
    return 2.0 * batch * heads * pairs * (d_qk + (d_qk if d_v is None else d_v))


# ----------------------------------------------------------------------------------------------------------
# Machine, JSON, plots
# ----------------------------------------------------------------------------------------------------------
def gflops(flops: float, seconds: float | None) -> float | None:
    return None if not seconds else flops / seconds / 1e9


def ratio_record(*, key: str, case: str, dtype: str, shape: str, pairs: int, flops: float, flops_name: str,
                 t_ours: dict[str, Any], t_ref: dict[str, Any], target: float, allclose: bool,
                 max_abs_diff: float) -> dict[str, Any]:
    """One row of a ours-vs-SDPA benchmark: medians, GFLOP/s, ratio = SDPA time / ours, and the target check."""
    ratio = t_ref["median_s"] / t_ours["median_s"]
    return {
        "key": key,
        "case": case,
        "dtype": dtype,
        "shape": shape,
        "visible_pairs": pairs,
        flops_name: flops,
        "ours_ms": t_ours["median_s"] * 1e3,
        "sdpa_ms": t_ref["median_s"] * 1e3,
        "ours_times_s": t_ours["times_s"],
        "sdpa_times_s": t_ref["times_s"],
        "ours_gflops": gflops(flops, t_ours["median_s"]),
        "sdpa_gflops": gflops(flops, t_ref["median_s"]),
        "ratio": ratio,
        "target": target,
        "passed": ratio >= target,
        "allclose": allclose,
        "max_abs_diff": max_abs_diff,
    }


def cli_parser(doc: str, quick_help: str, *, devices: tuple[str, ...], threads: bool = False, no_rss: bool = False):
    """The options every benchmark script shares: --quick, --out, --strict, --device (one of `devices`, the
    script's module-level DEVICES, which ``cann-attn bench`` reads to pass --device only where it applies; the
    first is the default) and --threads / --no-rss."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--device", default=devices[0], choices=devices, help=f"device to measure on (default {devices[0]})"
    )
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a performance target is missed")
    if threads:
        parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    if no_rss:
        parser.add_argument("--no-rss", action="store_true", help="skip the peak-memory subprocesses")
    return parser


def gpu_args(doc: str, quick_help: str, argv: list[str] | None, script: str, devices: tuple[str, ...] = ("cuda",)):
    """The shared options of a GPU benchmark, parsed (`out` as a Path); None, after saying so on stderr, when
    there is no CUDA GPU (the caller exits with status 2)."""
    args = cli_parser(doc, quick_help, devices=devices).parse_args(argv)
    args.out = Path(args.out)
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.", file=sys.stderr)
        return None
    return args


def console(min_width: int):
    """A rich console; when output is not a terminal (logs, CI), wide enough for the result tables."""
    from rich.console import Console

    con = Console()
    return con if con.is_terminal else Console(width=max(con.width, min_width))


def print_ratio_table(console, title: str, rows: list[dict[str, Any]], long: dict[str, Any] | None,
                      close_label: str, long_label: str) -> None:
    """The ours-vs-SDPA table of `ratio_record` rows (+ the optional long-sequence memory row) and its RSS line."""
    from rich.table import Table

    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    table = Table(title=title, header_style="bold")
    columns = ("case", "dtype", "ours ms", "SDPA ms", "ours GFLOP/s", "SDPA GFLOP/s", "ratio", "target", "pass",
               close_label)
    for col in columns:
        table.add_column(col, justify="left" if col in ("case", "dtype") else "right")
    for r in [*rows, long] if long else rows:
        verdict = "[green]pass[/]" if r["passed"] else "[bold red]FAIL[/]"
        target = f">= {r['target']}" if r.get("target") is not None else f"RSS < {r['rss_target_gb']} GB"
        close = ("[green]yes[/]" if r["allclose"] else "[bold red]NO[/]") + f" ({r['max_abs_diff']:.1e})"
        table.add_row(r["case"], r["dtype"], f(r["ours_ms"]), f(r["sdpa_ms"]), f(r["ours_gflops"]),
                      f(r["sdpa_gflops"]), f(r["ratio"], ".2f"), target, verdict, close)
    console.print(table)
    if long:
        verdict = "pass" if long["passed"] else "FAIL"
        console.print(
            f"(e) {long['shape']} {long_label}: our peak RSS {long['ours_peak_rss_mb']:.0f} MB "
            f"({long['ours_rss_before_call_mb']:.0f} MB before the call, +{long['ours_rss_call_delta_mb']:.0f} MB "
            f"during it; target < {long['rss_target_gb']} GB: {verdict}); SDPA peak RSS "
            f"{long['sdpa_peak_rss_mb']:.0f} MB (+{long['sdpa_rss_call_delta_mb']:.0f} MB)",
            highlight=False,
        )


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# CPU features that change what PyTorch's own kernels can do: with AVX512-BF16 (or AMX) SDPA's reduced-precision
# path multiplies in bf16 (P and dS rounded to bf16) and runs several times faster than without, so bf16 ratios
# against SDPA are only comparable between machines that agree here.
MATMUL_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_features() -> list[str]:
    """Which of MATMUL_FEATURES /proc/cpuinfo lists (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [name for name in MATMUL_FEATURES if name in flags]
    except OSError:
        pass
    return []


def load_average() -> list[float] | None:
    """1/5/15-minute load averages (None where unavailable)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _own_running_threads() -> int:
    """Threads of this process in state R (the sampling thread itself included)."""
    count = 0
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "R":
                count += 1
        except (OSError, IndexError):
            pass
    return max(count, 1)


def other_runnable(samples: int = 20, interval: float = 0.05) -> float | None:
    """Mean number of runnable tasks outside this process (/proc/loadavg minus our own running threads,
    sampled `samples` times); None where /proc is unavailable. Unlike load averages it does not lag."""
    counts = []
    for _ in range(samples):
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, IndexError, ValueError):
            return None
        counts.append(max(0, running - _own_running_threads()))
        time.sleep(interval)
    return sum(counts) / len(counts)


def busy_warning() -> str | None:
    """A warning when other processes compete for the CPUs: timings of many small parallel regions (our tiled
    reference) then degrade far more than those of one big kernel (SDPA), so ratios are not meaningful."""
    cpus = os.cpu_count() or 1
    others = other_runnable()
    if others is not None:
        if others > 0.25 * cpus:
            return f"machine busy: {others:.1f} other runnable tasks on {cpus} CPUs; timings are unreliable"
        return None
    load = load_average()
    if load is not None and load[0] > 0.75 * cpus:
        return f"machine busy: 1-min load average {load[0]} on {cpus} CPUs; timings are unreliable"
    return None


def memory_copy_bandwidth(megabytes: int = 256, repeats: int = 3) -> float:
    """Best-of GB/s (read + write) of copying a `megabytes` fp32 tensor: a probe of the memory bandwidth this
    process gets now. On a shared host it moves with the neighbours' traffic, which the load average does not
    show; the gather-bound DSA kernels slow down with it while a GEMM yardstick barely does."""
    n = megabytes * (1 << 20) // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best / 1e9


def machine_info(device: str = "cpu") -> dict[str, Any]:
    info = {
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_1_5_15": load_average(),
        "other_runnable_tasks": other_runnable(),
        "memory_copy_gbps": round(memory_copy_bandwidth(), 1),
    }
    try:
        import cann_attn

        info["cann_attn"] = cann_attn.__version__
    except ImportError:
        pass
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def bar_plot(
    path: str | Path,
    labels: Sequence[str],
    series: dict[str, Sequence[float | None]],
    *,
    title: str,
    ylabel: str,
    ratios: Sequence[float | None] | None = None,
    targets: Sequence[float | None] | None = None,
    ratio_label: str = "speed-up vs PyTorch (dashed: target)",
    lower_is_better: bool = False,
) -> Path | None:
    """Grouped bars (one group per label, one bar per series); with `ratios`, a second panel of ratio bars
    and their target marks, green where a ratio meets its target (at least it, or at most it with
    `lower_is_better`, for costs). Returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = 2 if ratios is not None else 1
    fig, axes = plt.subplots(
        panels, 1, figsize=(max(8.0, 0.9 * len(labels) + 3), 4.5 * panels), squeeze=False
    )
    ax = axes[0][0]
    x = list(range(len(labels)))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [xi + (k - (len(series) - 1) / 2) * width for xi in x]
        ax.bar(xs, [0.0 if v is None else v for v in values], width, label=name)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.15)  # room for the legend
    ax.legend(loc="upper center", ncol=len(series))
    ax.grid(axis="y", alpha=0.3)
    if ratios is not None:
        ax2 = axes[1][0]
        values = [0.0 if r is None else r for r in ratios]
        def meets(r: float, t: float) -> bool:
            return r <= t if lower_is_better else r >= t

        colors = [
            "tab:gray" if r is None or t is None else ("tab:green" if meets(r, t) else "tab:red")
            for r, t in zip(ratios, targets or [None] * len(ratios), strict=True)
        ]
        ax2.bar(x, values, 0.6, color=colors)
        for xi, t in zip(x, targets or [], strict=False):
            if t is not None:
                ax2.hlines(t, xi - 0.4, xi + 0.4, colors="black", linestyles="dashed")
        ax2.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
        ax2.set_ylabel(ratio_label)
        ax2.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """A finished matplotlib figure written to `path` (its folder created) and closed."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        print("usage: common.py --child SCRIPT FUNC JSON_KWARGS", file=sys.stderr)
        sys.exit(2)
