"""``cann-attn verify``: run every implemented operator on the built-in cases and judge it against the oracle.

For each case (``cases.py``) and each output tensor the table shows the max absolute error, the max relative
error (Ascend's rel = |a - g| / max(|a|, |g|)), the verdict of the Ascend "double thousandth" rule of
docs/semantics/precision.md (threshold of the output's dtype) and the operator's wall time; integer outputs (int8
quantized results, top-k indices) are judged as ``compare`` judges them (metrics.py). As in the test suite,
an output the Ascend rule rejects still passes when its case has a same-dtype naive reference and the
flash-attn rule (max error <= 2 x the naive computation's max error + 1e-5) accepts it; the "fa rule" column
says so. The "backend" column names the backend that computed the case (``--backend triton`` prefers the Triton
kernels and falls back per case where they do not apply; on CPU they run in Triton's interpreter). Exit status 1
if any output fails or any case raises.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
import zlib
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..backends import PREFERENCE_ENV, dispatch_counts
from ..backends.reference import native
from . import UsageError
from . import cases as registry
from .metrics import SECOND_RULE_NOTE
from .output import STDOUT, Column, check_json_target, console, print_table, write_json

_DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int8: "int8",
}


@dataclass
class Row:
    """One output of one case (output "-": the case raised before any output could be judged)."""

    op: str
    case: str
    dtype: str
    shape: str
    output: str
    ascend: bool = False
    fa_rule: bool | None = None  # None: not evaluated (Ascend rule passed, or no naive reference)
    max_abs: float | None = None
    max_rel: float | None = None
    time_ms: float | None = None
    backend: str = ""
    note: str = ""
    reason: str = ""  # why the flash-attn rule accepts or refuses the output (when judged)
    traceback: str = ""

    @property
    def passed(self) -> bool:
        return self.ascend or bool(self.fa_rule)


def add_parser(subparsers) -> None:
    # `demo` (docs/design.md's CLI list) is the main job under its own name: what `make demo` runs.
    p = subparsers.add_parser(
        "verify",
        aliases=["demo"],
        help="check every implemented operator against its float64 oracle (Ascend precision rule); alias: demo",
        description="Run every implemented operator on the built-in cases and judge each output against "
        "the float64 oracle with the Ascend precision rule (docs/semantics/precision.md). Exit status 1 on any "
        "failure.",
    )
    p.add_argument("--op", help="only this operator (cann_attn or torch_npu name; default: every operator with cases)")
    p.add_argument("--quick", action="store_true",
                   help="the small cases only: about 5 s of CPU time (more wall-clock time on a busy machine)")
    p.add_argument("--device", default="cpu", help="device of the operator's inputs, e.g. cpu, cuda, cuda:1")
    p.add_argument("--seed", type=_seed, default=0,
                   help="base seed of the input generators, a 64-bit signed integer (default 0)")
    p.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto",
                   help="backend preference: triton runs every case the Triton kernels support on them (on CPU "
                   "in Triton's interpreter) and the rest on the reference backend (default auto)")
    p.add_argument("--case", metavar="SUBSTR", help="only cases whose name contains SUBSTR")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--traceback", action="store_true", help="print the traceback of cases that raised")
    p.add_argument("--json", metavar="FILE",
                   help="also write every output's verdict and metrics to FILE as strict JSON; '-': the JSON on "
                   "standard output instead of the table")
    p.set_defaults(func=run)


SEED_RANGE = (-(2**63), 2**63 - 1)  # seed + crc32 (< 2**32) stays within what torch.Generator.manual_seed takes


def _seed(text: str) -> int:
    """--seed: an integer in SEED_RANGE (argparse turns the ValueError into a usage error)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"expected an integer in [-2**63, 2**63 - 1], got {text}")
    return seed


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device: not a device name: {name!r}") from exc
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu or cuda[:N], got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available (PyTorch build or machine)")
    return device


def _select(args: argparse.Namespace) -> list[registry.Case]:
    known = sorted({c.op for c in registry.cases_for()})
    if args.op is not None:
        args.op = registry.canonical_op(args.op)
    if args.op is not None and args.op not in known:
        raise UsageError(f"--op: unknown or unimplemented operator {args.op!r} (known: {', '.join(known)})")
    selected = registry.cases_for(args.op, quick=args.quick)
    if args.case:
        selected = [c for c in selected if args.case in c.name]
    if not selected:
        raise UsageError("no case matches the given filters")
    return selected


def _documented_dtypes(case: registry.Case, call: registry.Call) -> dict[str, torch.dtype]:
    """The documented dtype of each output of the case's call (empty for an operator without that record)."""
    op = registry.OPERATORS.get(case.op)
    return {} if op is None else op.output_dtypes(registry.by_name(case.op, call))


def case_generator(case: registry.Case, seed: int) -> torch.Generator:
    """The case's own CPU generator: the same inputs whatever other cases run (seed + crc32 of op/name)."""
    return torch.Generator().manual_seed(seed + zlib.crc32(f"{case.op}/{case.name}".encode()))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: registry.Case, device: torch.device, seed: int) -> list[Row]:
    """Build, run (timed), compute the oracle and judge every output of one case."""
    from ..testing.precision import ascend_rule
    from .metrics import dtype_problem, judge_flash_attn, measure, nonfinite_mismatches

    dtype = _DTYPE_NAMES.get(case.dtype, str(case.dtype))
    base = {"op": case.op, "case": case.name, "dtype": dtype, "shape": case.shape}
    try:
        call = case.build(case_generator(case, seed))
        dev_call = call.map_tensors(lambda t: t.to(device))
        _sync(device)
        before = dispatch_counts.copy()
        start = time.perf_counter()
        outputs = case.run(dev_call)
        _sync(device)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        base["backend"] = _backends_used(before)
        golden = case.oracle(call)
        documented = _documented_dtypes(case, call)
        rows, naive = [], None
        for name, expected in golden.items():
            actual = outputs.get(name)
            if actual is None:
                rows.append(Row(**base, output=name, time_ms=elapsed_ms, note="missing output"))
                continue
            if tuple(actual.shape) != tuple(expected.shape):
                note = f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
                rows.append(Row(**base, output=name, time_ms=elapsed_ms, note=note))
                continue
            # The documented output dtype first: the rule casts the golden to the actual's dtype, so a lower
            # precision than documented would otherwise go unnoticed.
            problem = dtype_problem(actual, documented[name]) if name in documented else ""
            if problem:
                rows.append(Row(**base, output=name, time_ms=elapsed_ms, note=problem))
                continue
            if not actual.dtype.is_floating_point:  # int8 outputs, indices: see metrics.py
                m = measure(name, actual, expected)
                note = "; ".join(m.failures()) or (f"{m.n_mismatch} one step off" if m.n_mismatch else "exact")
                rows.append(
                    Row(**base, output=name, ascend=m.passed(), max_abs=m.max_abs, time_ms=elapsed_ms, note=note)
                )
                continue
            ok, details = ascend_rule(actual, expected)
            # NaN / inf where the golden has other values fail outright (metrics.py), whatever the counts.
            n_nonfinite = nonfinite_mismatches(actual, expected)
            row = Row(
                **base,
                output=name,
                ascend=ok and not n_nonfinite,
                max_abs=details["max_abs_err"],
                max_rel=details["max_rel_err"],
                time_ms=elapsed_ms,
            )
            if n_nonfinite:
                row.note = f"{n_nonfinite} NaN/inf values where the golden holds other values"
            elif not ok:
                row.note = f"{details['n_rel_fail']} rel / {details['n_abs_fail']} abs > t"
                if case.naive is not None:
                    naive = case.naive(call) if naive is None else naive
                    if naive.get(name) is not None:
                        row.fa_rule, row.reason = judge_flash_attn(actual, naive[name], expected)
            rows.append(row)
        return rows
    except Exception as exc:
        note = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return [Row(**base, output="-", note=note, traceback=traceback.format_exc())]


def _backends_used(before) -> str:
    """Which backends the calls since `before` ran on ("triton", "reference" or both, "+"-joined)."""
    used = sorted({backend for _op, backend in dispatch_counts - before})
    return "+".join(used) or "-"


def _use_backend(preference: str, device: torch.device) -> None:
    """Make `preference` the default of every op call in this process (see cann_attn.backends)."""
    if preference == "auto":
        return
    os.environ[PREFERENCE_ENV] = preference
    if preference == "triton" and device.type == "cpu":
        # Read when the kernel modules are first imported, which happens lazily on the first Triton call.
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


COLUMNS = (
    Column("op", no_wrap=True), Column("case", no_wrap=True), Column("dtype"), Column("shape"),
    Column("output", no_wrap=True), Column("max abs", "right"), Column("max rel", "right"), Column("ascend", "center"),
    Column("result"), Column("backend"), Column("time ms", "right"),
)


def _verdicts(r: Row) -> tuple[str, str]:
    """The Ascend cell and the result cell of a row: a row that passes by the flash-attn rule says so, and why."""
    if r.ascend:
        ascend = "[green]pass[/]" + (f" [dim]({escape(r.note)})[/]" if r.note else "")
        return ascend, "[green]pass[/]"
    ascend = f"[{'yellow' if r.passed else 'bold red'}]over t[/]" if r.max_abs is not None else "[bold red]FAIL[/]"
    if r.note:
        ascend += f" [{'yellow' if r.passed else 'red'}]({escape(r.note)})[/]"
    if r.passed:
        return ascend, f"[yellow]pass[/] ({escape(r.reason)})"
    return ascend, "[bold red]FAIL[/]" + (f" [red]({escape(r.reason)})[/]" if r.reason else "")


def render(rows: list[Row], out: Console, title: str) -> None:
    cells = []
    previous = None
    for r in rows:
        # A terminal table names a case once; plain text repeats it on every line, so each line stands alone.
        first = (r.op, r.case) != previous or not out.is_terminal
        previous = (r.op, r.case)
        ascend, result = _verdicts(r)
        cells.append([
            r.op if first else "",
            r.case if first else "",
            r.dtype if first else "",
            escape(r.shape) if first else "",
            r.output,
            _fmt(r.max_abs),
            _fmt(r.max_rel),
            ascend,
            result,
            r.backend if first else "",
            "-" if r.time_ms is None else (f"{r.time_ms:.1f}" if first else ""),
        ])
    print_table(out, title, COLUMNS, cells)


def json_report(rows: list[Row], args: argparse.Namespace, device: torch.device, elapsed: float) -> dict:
    """Everything the table and the summary say, for machines: one entry per output (numbers in full)."""
    return {
        "device": str(device),
        "backend": args.backend,
        "seed": args.seed,
        "quick": args.quick,
        "passed": all(r.passed for r in rows),
        "cases": len({(r.op, r.case) for r in rows}),
        "failing_cases": [f"{op}/{case}" for op, case in sorted({(r.op, r.case) for r in rows if not r.passed})],
        "seconds": round(elapsed, 3),
        "outputs": [
            {
                "op": r.op, "case": r.case, "dtype": r.dtype, "shape": r.shape, "output": r.output,
                "passed": r.passed, "ascend": r.ascend, "fa_rule": r.fa_rule, "max_abs": r.max_abs,
                "max_rel": r.max_rel, "backend": r.backend, "time_ms": r.time_ms, "note": r.note,
                "by_second_rule": r.passed and not r.ascend, "reason": r.reason,
                **({"traceback": r.traceback} if r.traceback else {}),
            }
            for r in rows
        ],
    }


def run(args: argparse.Namespace) -> int:
    device = _device(args.device)
    selected = _select(args)
    if args.json:
        check_json_target(args.json)
    _use_backend(args.backend, device)
    out = console()
    if args.list:
        for c in selected:
            line = f"{c.op}  {c.name}  {_DTYPE_NAMES.get(c.dtype, c.dtype)}  {c.shape}"
            out.print(line + ("" if c.quick else "  (not in --quick)"), markup=False, highlight=False)
        return 0
    rows: list[Row] = []
    start = time.perf_counter()
    progress = Progress(
        TextColumn("[bold]verify"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task("", total=len(selected))
        for case in selected:
            progress.update(task, description=f"{case.op}/{case.name}")
            rows.extend(run_case(case, device, args.seed))
            progress.advance(task)
    failed_cases = sorted({(r.op, r.case) for r in rows if not r.passed})
    loops = ""
    if device.type == "cpu":
        loops = f", native CPU loops {'on' if native.library() is not None else 'off'}"
    title = (f"cann-attn verify ({device}, backend {args.backend}, seed {args.seed}{loops}"
             f"{', quick' if args.quick else ''})")
    elapsed = time.perf_counter() - start
    if args.json:
        write_json(args.json, json_report(rows, args, device, elapsed))
        if args.json == STDOUT:
            return 1 if failed_cases else 0
    render(rows, out, title)
    by_fa_rule = sum(1 for r in rows if r.passed and not r.ascend)
    summary = f"{len(selected)} cases, {len(rows)} outputs, {len(failed_cases)} failing case(s)"
    if by_fa_rule:
        summary += f", {by_fa_rule} output(s) passed by the flash-attn rule only"
    summary += f", {elapsed:.1f} s"
    if by_fa_rule:
        out.print(f"[yellow]note[/]: {SECOND_RULE_NOTE}", highlight=False)
    if not failed_cases:
        out.print(f"[bold green]OK[/]: {summary}")
        return 0
    out.print(f"[bold red]FAILED[/]: {summary}")
    tracebacks = [r for r in rows if r.traceback]
    if tracebacks and not args.traceback:
        out.print("[dim]--traceback shows where the failing cases raised[/]")
    for r in tracebacks if args.traceback else ():
        out.print(f"[bold]{r.op}/{r.case}[/]")
        out.print(r.traceback, markup=False, highlight=False)
    return 1
