"""Margins over PyTorch SDPA on the CPU: the ratios the dense kernels must hold, each measured in one process.

Figures (B1 N8 S2048 D128 unless noted; ratio = SDPA's best time / ours, the two timed alternately):
  forward            FA forward fp32, the lower of no mask and causal (sparse_mode 2)           goal >= 1.05
  forward_backward   FA forward + backward fp32 vs SDPA + autograd, the lower of no mask and causal (mode 3)
                                                                                                  goal >= 1.1
  band               FA forward fp32, sparse_mode 4 pre = next = 256, vs SDPA with the float mask  goal >= 3.0
  pfa_fp16           PromptFlashAttention fp16 causal, GQA 8/2, vs SDPA fp16 (enable_gqa)       goal >= 1.15
The cases are the ones `make bench-check` measures (benchmarks/perf_guard.py builds them from bench_fa_forward,
bench_fa_backward and bench_pfa), timed the same way: ours and SDPA alternately after a warm-up pair, the best of
`--repeats` of each. The whole set is measured `--rounds` times; a case's ratio is the median of its rounds (the
JSON keeps every round, so the spread shows), a figure's the lowest of its cases'.
The clock (`--clock`): `cpu`, this process's CPU time on one thread (default: on a shared machine wall-clock times
move with the neighbours' load), or `wall`, wall clock with torch's threads.

    python benchmarks/bench_margins.py [--clock cpu|wall] [--repeats N] [--rounds N] [--quick] [--out DIR] [--strict]
                                       [--config full|tiny]

--quick: 3 repeats, one round. --strict: exit 1 where a figure is below its goal. --config tiny: perf_guard's tiny
shapes (seconds in all; the tests use it, its ratios mean nothing).
Writes DIR/margins_cpu.json and DIR/margins_cpu.png (default DIR: benchmarks/results).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import perf_guard

# --device choices (cann-attn bench reads this line).
DEVICES = ("cpu",)


@dataclass(frozen=True)
class Figure:
    name: str
    cases: tuple[str, ...]  # perf_guard case names; the figure is the lowest of their ratios
    goal: float
    label: str


FIGURES = (
    Figure("forward", ("fa_forward.dense", "fa_forward.causal"), 1.05, "FA forward fp32, min(no mask, causal)"),
    Figure("forward_backward", ("fa_fwd_bwd.dense", "fa_fwd_bwd.causal"), 1.1,
           "FA forward + backward fp32, min(no mask, causal)"),
    Figure("band", ("fa_forward.band",), 3.0, "FA forward fp32, band 256 / 256 vs SDPA + float mask"),
    Figure("pfa_fp16", ("pfa.causal_fp16",), 1.15, "PFA fp16 causal GQA 8/2"),
)


def measure_rounds(rounds: int, repeats: int, clock_name: str, config: str = "full") -> dict[str, list[dict[str, Any]]]:
    """Every case of FIGURES measured `rounds` times (perf_guard.measure: alternated, best of `repeats`), the cases
    taken in turn within a round."""
    names = tuple(name for figure in FIGURES for name in figure.cases)
    cases = [case for case in perf_guard.build_cases(config, names) if case.name in names]
    clock = perf_guard.clock_of(clock_name)
    measured: dict[str, list[dict[str, Any]]] = {case.name: [] for case in cases}
    for r in range(rounds):
        for case in cases:
            m = perf_guard.measure(case, repeats, clock)
            measured[case.name].append(m)
            print(f"  round {r + 1}/{rounds}  {case.name:<20} ratio {m['ratio']:.3f}  ours {m['ours_best_ms']:7.1f} ms"
                  f"  SDPA {m['yardstick_best_ms']:7.1f} ms", flush=True)
    return measured


def summarise(measured: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Per case: the median, lowest and highest ratio over the rounds; per figure: the lowest case median, its goal."""
    cases = {}
    for name, rounds in measured.items():
        ratios = [m["ratio"] for m in rounds]
        cases[name] = {"ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                       "ours_best_ms": statistics.median(m["ours_best_ms"] for m in rounds),
                       "sdpa_best_ms": statistics.median(m["yardstick_best_ms"] for m in rounds),
                       "rounds": rounds}
    figures = []
    for figure in FIGURES:
        worst = min(figure.cases, key=lambda n: cases[n]["ratio"])
        ratio = cases[worst]["ratio"]
        figures.append({"figure": figure.name, "label": figure.label, "cases": list(figure.cases),
                        "lowest_case": worst, "ratio": ratio, "goal": figure.goal, "passed": ratio >= figure.goal})
    return cases, figures


def main(argv: list[str] | None = None) -> int:
    parser = common.cli_parser(__doc__, "3 repeats, one round", devices=DEVICES)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: process CPU time, 1 thread (default); wall: wall clock, torch's threads")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls of each side per round (best kept)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of every case (median kept)")
    parser.add_argument("--config", choices=("full", "tiny"), default="full", help="tiny: small shapes (tests)")
    args = parser.parse_args(argv)
    if args.clock == "cpu":
        torch.set_num_threads(1)
    repeats, rounds = (3, 1) if args.quick else (args.repeats, args.rounds)
    busy_before = common.busy_warning()
    cases, figures = summarise(measure_rounds(rounds, repeats, args.clock, args.config))
    for f in figures:
        print(f"{f['figure']:<17} {f['ratio']:.3f}  goal >= {f['goal']:<5} {'pass' if f['passed'] else 'MISSED'}"
              f"  ({f['lowest_case']}; {f['label']})")
    out = Path(args.out)
    payload = {"benchmark": "margins", "device": "cpu", "machine": common.machine_info("cpu"),
               "settings": {"clock": args.clock, "threads": torch.get_num_threads(), "repeats": repeats,
                            "rounds": rounds, "quick": args.quick, "config": args.config},
               "busy_warning": {"before": busy_before, "after": common.busy_warning()},
               "figures": figures, "cases": cases}
    json_path = common.write_json(out / "margins_cpu.json", payload)
    goal_of = {name: f.goal for f in FIGURES for name in f.cases}
    clock = "CPU time, 1 thread" if args.clock == "cpu" else f"wall clock, {torch.get_num_threads()} threads"
    png_path = common.bar_plot(
        out / "margins_cpu.png", list(cases),
        {"cann_attn": [c["ours_best_ms"] for c in cases.values()], "PyTorch SDPA": [c["sdpa_best_ms"] for c in
                                                                                     cases.values()]},
        title=f"Margins over SDPA ({payload['machine']['cpu']}, {clock}, {rounds} round(s), median)",
        ylabel="best time (ms)", ratios=[c["ratio"] for c in cases.values()], targets=[goal_of[n] for n in cases],
        ratio_label="SDPA time / ours (dashed: goal)")
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return 1 if args.strict and not all(f["passed"] for f in figures) else 0


if __name__ == "__main__":
    sys.exit(main())
