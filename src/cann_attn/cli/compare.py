"""``cann-attn compare ACTUAL GOLDEN``: actual outputs against a golden, with the metrics of
docs/semantics/precision.md.

ACTUAL and GOLDEN are both files or both directories:

- directories: GOLDEN is a ``cann-attn golden`` directory; each of its output tensors (``--all``: also the
  inputs) is matched by name in ACTUAL. When ACTUAL has a manifest.json, it is the source of truth: a tensor it
  does not list, or a listed file that is absent, is missing (files it does not list are ignored), and every
  file it lists is read (in the manifest's dtype and shape) and measured: the tensor passes when each of them
  does; when a ``.npy`` and a ``.bin`` of one tensor hold different values, its row is that of the file that
  fares worse, with a note. Without a manifest: ``NAME.npy``, else ``NAME.bin`` (of ``--dtype``, default the
  golden's dtype, and the golden's shape);
- files: ``.npy`` or ``.bin``; a ``.bin`` takes its dtype from ``--dtype`` (default: the golden's) and its shape
  from the golden (a ``.bin`` golden needs the manifest.json of its directory).

Per tensor (``metrics.py``): max abs / max rel error, the Ascend double-thousandth verdict with its counts (the
gate), MERE / MARE (a gate only with ``--strict``); integer tensors: int8 within one step, others exact. The
thresholds are those of the golden's dtype (its manifest; bfloat16 ``.npy`` files hold float32 values).

A golden written with ``--precision npu`` also holds, per output NAME, the NPU-pipeline golden ``NAME.npu`` (role
``npu_output``, docs/semantics/precision.md). Each output is then measured against both, one row each: a tensor
passes when it passes against either, and the notes say which: passing only the npu-pipeline golden means the
difference from the float64 golden is the kernel's documented rounding; failing both means it is not.
Exit status 0 when every tensor passes, 1 when one fails or is missing, 2 for bad usage or unreadable input.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from ..testing.npu_recipes import ulp_verdict
from . import UsageError
from .metrics import SECOND_RULE_NOTE, TensorMetrics, dtype_name, dtype_problem, measure, second_rule
from .output import STDOUT, Column, check_json_target, console, print_table, write_json
from .tensorio import (
    MANIFEST,
    NAIVE_ROLE,
    NAIVE_SUFFIX,
    NPU_ROLE,
    NPU_SUFFIX,
    entry_files,
    find_entry,
    inside,
    parse_dtype,
    read_bin,
    read_entry,
    read_file_of_entry,
    read_manifest,
    read_npy,
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        help="compare actual outputs with a golden (max abs/rel, Ascend double-thousandth, MERE/MARE)",
        description="Compare actual tensors with golden ones (files, or directories matched by the golden's "
        "manifest) using the precision metrics of docs/semantics/precision.md. Exit status 0: every tensor "
        "passes; 1: a tensor fails or is missing; 2: bad usage or unreadable input.",
    )
    p.add_argument("actual", metavar="ACTUAL", help="a .npy / .bin file, or a directory of them")
    p.add_argument("golden", metavar="GOLDEN", help="a golden file, or a directory written by cann-attn golden")
    p.add_argument(
        "--dtype",
        help="element type of .bin files (default: the golden's dtype); also the threshold dtype of a golden "
        "without manifest",
    )
    p.add_argument(
        "--strict", action="store_true", help="MERE/MARE gate too; int8: at most 0.1%% of elements one step off"
    )
    p.add_argument("--all", action="store_true", help="directories: compare the input tensors too")
    p.add_argument("--json", metavar="FILE",
                   help="also write the metrics to FILE as strict JSON; '-': the JSON on standard output instead of "
                   "the table")
    p.set_defaults(func=run)


def _dtype_option(args: argparse.Namespace) -> torch.dtype | None:
    if args.dtype is None:
        return None
    dtype = parse_dtype(args.dtype)
    if dtype is None:
        raise UsageError(f"--dtype: unknown dtype {args.dtype!r} (e.g. float16, bfloat16, float32, int8)")
    return dtype


def _load_actual(path: Path, golden: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """An actual tensor: .npy (float32 values of a bfloat16 golden are cast to bfloat16) or .bin (dtype `dtype`
    or the golden's, the golden's shape)."""
    if path.suffix == ".npy":
        t = read_npy(path)
        if golden.dtype == torch.bfloat16 and t.dtype == torch.float32:
            t = t.to(torch.bfloat16)
        return t
    if path.suffix == ".bin":
        return read_bin(path, dtype or golden.dtype, list(golden.shape))
    raise UsageError(f"{path}: expected a .npy or .bin file")


def _measure(name: str, actual: torch.Tensor, golden: torch.Tensor,
             naive: torch.Tensor | None = None) -> TensorMetrics:
    """`measure` with the golden's dtype's thresholds, after checking that the actual has that dtype: a golden
    rounded to a lower-precision actual's dtype would hide the rounding (torch_npu's assertRtolEqual also fails on
    differing dtypes). An output the Ascend rule rejects is judged by the flash-attn rule when the golden
    directory holds its naive reference (docs/semantics/precision.md: the same two rules as verify)."""
    problem = dtype_problem(actual, golden.dtype)
    if problem:
        return _problem(name, golden, f"{problem} (the golden's)")
    m = measure(name, actual, golden, golden.dtype)
    if (m.kind == "float" and not m.ascend_pass and not m.n_nonfinite and naive is not None
            and naive.shape == golden.shape):
        second_rule(m, actual, naive, golden)
    return m


def _naive(directory: Path, manifest: dict[str, Any] | None, name: str) -> torch.Tensor | None:
    """The naive reference `golden` wrote beside output `name` (None if none)."""
    entry = find_entry(manifest, name=f"{name}{NAIVE_SUFFIX}")
    if entry is None or entry.get("role") != NAIVE_ROLE:
        return None
    return read_entry(directory, entry)


def _golden_file(path: Path, dtype_option: torch.dtype | None) -> tuple[str, torch.Tensor]:
    entry = find_entry(read_manifest(path.parent), file=path.name)
    if path.suffix == ".bin":
        if entry is None:
            raise UsageError(f"{path}: a .bin golden needs the manifest.json of its directory (for its shape)")
        return entry["name"], read_bin(path, parse_dtype(entry["dtype"]) or dtype_option, entry["shape"])
    if path.suffix != ".npy":
        raise UsageError(f"{path}: expected a .npy or .bin file")
    dtype = parse_dtype(entry["dtype"]) if entry else dtype_option
    return (entry["name"] if entry else path.stem), read_npy(path, dtype)


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ between two tensors of one dtype (every element if the shapes differ; NaN equals
    NaN)."""
    if a.shape != b.shape:
        return max(a.numel(), b.numel())
    differ = a != b
    if a.dtype.is_floating_point:
        differ &= ~(a.isnan() & b.isnan())
    return int(differ.sum())


def _problem(name: str, golden: torch.Tensor, problem: str) -> TensorMetrics:
    """A tensor that could not be compared (a failure)."""
    kind = "float" if golden.dtype.is_floating_point else "exact"
    return TensorMetrics(name, dtype_name(golden.dtype), tuple(golden.shape), kind, problem=problem)


def _from_actual_manifest(actual_path: Path, entry, name: str, golden: torch.Tensor, strict: bool,
                          naive: torch.Tensor | None) -> tuple[TensorMetrics, torch.Tensor | None]:
    """The metrics of tensor `name` as ACTUAL's manifest lists it: every listed file is measured; when they hold
    different values, the row is that of the file that fares worst (a failing one first), with a note. Also the
    tensor of the first listed file (None when missing)."""
    where = actual_path / MANIFEST
    if entry is None:
        return _problem(name, golden, f"missing: {where} does not list {name}"), None
    files = entry_files(actual_path, entry)
    absent = [p.name for p in files.values() if not os.path.lexists(p)]
    if absent:
        return _problem(name, golden, f"missing: {', '.join(absent)} (listed in {where}) not found"), None
    tensors = {kind: read_file_of_entry(path, kind, entry) for kind, path in files.items()}
    measured = {kind: _measure(name, t, golden, naive) for kind, t in tensors.items()}
    first, *others = tensors
    differ = {kind: _differ(tensors[first], tensors[kind]) for kind in others}
    if not any(differ.values()):
        return measured[first], tensors[first]
    worst = min(measured, key=lambda k: (measured[k].passed(strict), -(measured[k].max_abs or 0.0)))
    row = measured[worst]
    for kind, n in differ.items():
        if n:
            verdicts = ", ".join(
                f"{files[k].name} {'passes' if measured[k].passed(strict) else 'fails'}" for k in (first, kind)
            )
            row.notes.append(
                f"{files[first].name} and {files[kind].name} (both listed in {where}) differ in {n} of "
                f"{tensors[first].numel()} elements ({verdicts}); the row is {files[worst].name}'s"
            )
    return row, tensors[first]


def collect(args: argparse.Namespace) -> tuple[list[TensorMetrics], dict[str, Any]]:
    """The metrics of every compared tensor, and facts about the golden for the title."""
    actual_path, golden_path = Path(args.actual), Path(args.golden)
    dtype_option = _dtype_option(args)
    for option, p in (("ACTUAL", actual_path), ("GOLDEN", golden_path)):
        if not p.exists():
            raise UsageError(f"{option}: {p}: no such file or directory")
    if actual_path.is_dir() != golden_path.is_dir():
        raise UsageError("ACTUAL and GOLDEN must both be files or both be directories")

    if not golden_path.is_dir():
        name, golden = _golden_file(golden_path, dtype_option)
        actual = _load_actual(actual_path, golden, dtype_option)
        golden_manifest = read_manifest(golden_path.parent)
        info = {"op": (golden_manifest or {}).get("op")}
        return [_measure(name, actual, golden, _naive(golden_path.parent, golden_manifest, name))], info

    manifest = read_manifest(golden_path)
    if manifest is None:
        raise UsageError(f"GOLDEN: {golden_path} has no manifest.json (write it with cann-attn golden)")
    roles = ("output", "input") if args.all else ("output",)
    entries = [e for e in manifest["tensors"] if e.get("role") in roles]
    if not entries:
        raise UsageError(f"GOLDEN: {golden_path / 'manifest.json'} lists no output tensor")
    actual_manifest = read_manifest(actual_path)
    results, npu_rows = [], {}
    for entry in entries:
        name = entry["name"]
        golden = read_entry(golden_path, entry)
        naive = _naive(golden_path, manifest, name)
        row, actual = _actual_row(actual_path, actual_manifest, name, golden, naive, dtype_option, args.strict)
        results.append(row)
        npu_entry = find_entry(manifest, name=f"{name}{NPU_SUFFIX}")
        if npu_entry is not None and npu_entry.get("role") == NPU_ROLE and entry.get("role") == "output":
            npu_rows[name] = _npu_row(f"{name}{NPU_SUFFIX}", actual, read_entry(golden_path, npu_entry), row.problem)
    return results, {"op": manifest.get("op"), "seed": manifest.get("seed"), "npu": npu_rows}


def _actual_row(actual_path: Path, actual_manifest, name: str, golden: torch.Tensor, naive: torch.Tensor | None,
                dtype_option: torch.dtype | None, strict: bool) -> tuple[TensorMetrics, torch.Tensor | None]:
    """The row of tensor `name` against `golden`, and the actual tensor it measured (the first listed file with a
    manifest; None when missing)."""
    if actual_manifest is not None:  # the source of truth: what it lists, nothing else
        entry = find_entry(actual_manifest, name=name)
        row, actual = _from_actual_manifest(actual_path, entry, name, golden, strict, naive)
        return row, None if row.problem else actual
    candidates = [inside(actual_path, f"{name}{ext}", named_by=actual_path) for ext in (".npy", ".bin")]
    found = next((c for c in candidates if os.path.lexists(c)), None)
    if found is None:
        return _problem(name, golden, f"missing: no {name}.npy or {name}.bin in {actual_path}"), None
    actual = _load_actual(found, golden, dtype_option)
    return _measure(name, actual, golden, naive), actual


@dataclass
class NpuRow:
    """An output measured against its NPU-pipeline golden: the usual metrics, and the ulp rule of
    docs/semantics/precision.md (within 2 ulps, a 0.5% tail within 4 ulps of its row's largest value), which a
    correct kernel meets where the Ascend rule's 1e-3 is below one fp16 ulp (|x| >= 1)."""

    metrics: TensorMetrics
    ulp_pass: bool = False
    ulps: dict[str, float] = field(default_factory=dict)

    def passed(self, strict: bool) -> bool:
        return self.metrics.passed(strict) or (not self.metrics.problem and self.ulp_pass)


def _npu_row(name: str, actual: torch.Tensor | None, golden: torch.Tensor, problem: str) -> NpuRow:
    if actual is None:
        return NpuRow(_problem(name, golden, problem))
    row = NpuRow(_measure(name, actual, golden))
    if not row.metrics.problem and golden.dtype in (torch.float16, torch.bfloat16, torch.float32):
        row.ulp_pass, row.ulps = ulp_verdict(actual, golden.to(actual.dtype), golden.dtype)
    return row


def _ascend_counts(m: TensorMetrics) -> str:
    """Both counts of the double-thousandth rule against its allowance."""
    state = "pass" if m.ascend_pass else "over"
    return (f"Ascend rule {state}: {m.n_rel_fail} rel and {m.n_abs_fail} abs > t={m.threshold:g}, allowed "
            f"{m.allowed:.4g} (fails only when both exceed it)")


def _ulp_figures(npu_row: NpuRow) -> str:
    u = npu_row.ulps
    state = "within" if npu_row.ulp_pass else "not within"
    return (f"{state} 2 ulps of the npu-pipeline golden (max {u['max_ulps']:g} ulps, {100 * u['tail_fraction']:.3g}% "
            f"beyond 2, those within {u['tail_max_row_ulps']:g} ulps of their row's largest value)")


def _float64_evidence(m: TensorMetrics, strict: bool) -> list[str]:
    """What the float64 golden's rules found, each rule with its numbers."""
    if m.problem:
        return [m.problem]
    if m.kind != "float":
        failures = m.failures(strict)
        rule = "int8 within 1 step" if m.kind == "int8" else "exact match"
        return failures or [f"{rule} ({m.n_mismatch} elements differ)"]
    parts = []
    if m.n_nonfinite:
        parts.append(f"{m.n_nonfinite} NaN/inf values where the golden holds other values")
    parts.append(_ascend_counts(m))
    if m.flash_attn_pass is not None:
        parts.append(m.flash_attn_reason)
    parts += [f for f in m.failures(strict) if f.startswith(("MERE", "MARE"))]
    return parts


def verdict(m: TensorMetrics, npu_row: NpuRow | None, strict: bool) -> str:
    """One line a tester can act on: the verdict, the rule that decided it and that rule's numbers; a failing tensor
    lists every rule it failed (docs/guides/golden.md)."""
    if m.passed(strict):
        rule = "the flash-attn rule" if m.by_second_rule else (
            "the Ascend rule" if m.kind == "float" else "int8 within 1 step" if m.kind == "int8" else "exact match")
        return f"PASS by {rule} against the float64 golden ({'; '.join(_float64_evidence(m, strict))})"
    evidence = _float64_evidence(m, strict)
    if npu_row is not None and not m.problem and npu_row.passed(strict):
        npu = npu_row.metrics
        how = _ascend_counts(npu) if npu.passed(strict) else _ulp_figures(npu_row)
        return (f"PASS by the npu-pipeline golden {npu.name}: {how}; the float64 golden's miss is the NPU kernel's "
                f"rounding (float64 golden: {'; '.join(evidence)})")
    if npu_row is not None and not m.problem:
        npu = npu_row.metrics
        npu_evidence = npu.problem or f"{_ascend_counts(npu)}; {_ulp_figures(npu_row)}"
        evidence.append(f"npu-pipeline golden {npu.name}: {npu_evidence}: not explained by the kernel's rounding")
    return f"FAIL: {'; '.join(evidence)}"


def passes(m: TensorMetrics, npu_rows: dict[str, NpuRow], strict: bool) -> bool:
    """A tensor passes against the float64 golden, or, where the golden holds one, against its npu-pipeline golden."""
    npu_row = npu_rows.get(m.name)
    return m.passed(strict) or (not m.problem and npu_row is not None and npu_row.passed(strict))


def _num(x: float | None, fmt: str = ".2e") -> str:
    return "-" if x is None else format(x, fmt)


COLUMNS = (
    Column("tensor", no_wrap=True), Column("dtype"), Column("shape", no_wrap=True), Column("max abs", "right"),
    Column("max rel", "right"), Column("rel>t", "right"), Column("abs>t", "right"), Column("allowed", "right"),
    Column("Ascend"), Column("MERE", "right"), Column("MARE", "right"), Column("result"),
)


def render(results: list[TensorMetrics], strict: bool, out: Console, title: str,
           npu_rows: dict[str, NpuRow] | None = None) -> None:
    rows = []
    gate = "red" if strict else "yellow"
    npu_rows = npu_rows or {}
    listed = []
    for m in results:
        listed.append((m, passes(m, npu_rows, strict)))
        if m.name in npu_rows:
            listed.append((npu_rows[m.name].metrics, npu_rows[m.name].passed(strict)))
    for m, ok in listed:
        result = "[bold green]PASS[/]" if ok else "[bold red]FAIL[/]"
        if m.problem:
            rows.append([m.name, m.dtype, str(list(m.shape)), *["-"] * 5, f"[red]{escape(m.problem)}[/]", "-", "-",
                         result])
            continue
        if m.by_second_rule and ok:
            result = "[bold yellow]PASS[/] (flash-attn rule)"
        if m.kind == "float":
            over = "[yellow]over t[/]" if m.by_second_rule else "[red]FAIL[/]"
            ascend = f"[green]pass[/] (t={m.threshold:g})" if m.ascend_pass else f"{over} (t={m.threshold:g})"
            mere = _num(m.mere) if m.mere_pass else f"[{gate}]{_num(m.mere)}[/]"
            mare = _num(m.mare) if m.mare_pass else f"[{gate}]{_num(m.mare)}[/]"
            counts = (str(m.n_rel_fail), str(m.n_abs_fail), f"{m.allowed:.4g}")
        else:
            rule = "int8 within 1 step" if m.kind == "int8" else "exact"
            ascend = f"[red]FAIL[/] ({rule})" if m.failures(strict) else f"[green]pass[/] ({rule})"
            mere = mare = "-"
            counts = (f"{m.n_mismatch} differ", "-", "-")
        rows.append([m.name, m.dtype, str(list(m.shape)), _num(m.max_abs), _num(m.max_rel), *counts, ascend, mere,
                     mare, result])
    print_table(out, title, COLUMNS, rows)


def run(args: argparse.Namespace) -> int:
    if args.json:
        check_json_target(args.json)
    results, info = collect(args)
    npu_rows = info.get("npu") or {}
    failed = [m for m in results if not passes(m, npu_rows, args.strict)]
    gates = "Ascend double-thousandth rule" + (" + MERE/MARE (--strict)" if args.strict else "")
    if any(m.flash_attn_pass is not None for m in results):
        gates += ", else the flash-attn rule"
    if any(m.kind != "float" for m in results):
        gates += "; integers: int8 within one step, others exact"
    if npu_rows:
        gates += "; against the float64 or the npu-pipeline golden"
    if args.json:
        report = {
            "actual": args.actual,
            "golden": args.golden,
            "op": info.get("op"),
            "strict": args.strict,
            "gates": gates,
            "passed": not failed,
            "tensors": [_tensor_json(m, npu_rows, args.strict) for m in results],
        }
        write_json(args.json, report)
        if args.json == STDOUT:
            return 1 if failed else 0
    out = console()
    what = f" ({info['op']})" if info.get("op") else ""
    render(results, args.strict, out, f"cann-attn compare{what}: {args.actual} vs golden {args.golden}", npu_rows)
    for m in results:
        for row in (m, *((npu_rows[m.name].metrics,) if m.name in npu_rows else ())):
            for note in row.notes:
                out.print(f"[yellow]note[/]: {row.name}: {escape(note)}", highlight=False, soft_wrap=True)
        line = verdict(m, npu_rows.get(m.name), args.strict)
        colour = "green" if line.startswith("PASS") else "red"
        out.print(f"[{colour}]verdict[/]: {m.name}: {escape(line)}", highlight=False, soft_wrap=True)
    if any(m.by_second_rule for m in results):
        out.print(f"[yellow]note[/]: {SECOND_RULE_NOTE}", highlight=False)
    if not failed:
        out.print(f"[bold green]PASS[/]: {len(results)}/{len(results)} tensors pass ({gates})")
        over = [m.name for m in results if m.kind == "float" and not (m.mere_pass and m.mare_pass)]
        if over and not args.strict:
            out.print(f"[yellow]note[/]: MERE/MARE over their limits for {', '.join(over)} (a gate with --strict)")
        return 0
    out.print(f"[bold red]FAIL[/]: {len(failed)} of {len(results)} tensors fail ({gates})")
    for m in failed:
        for failure in m.failures(args.strict):
            out.print(f"  {m.name}: {escape(failure)}", highlight=False)
    return 1


def _tensor_json(m: TensorMetrics, npu_rows: dict[str, NpuRow], strict: bool) -> dict[str, Any]:
    """A tensor's JSON record; with an npu-pipeline golden its metrics under "npu_golden" and the verdict of both."""
    record = m.to_json(strict)
    record["verdict"] = verdict(m, npu_rows.get(m.name), strict)
    if m.name in npu_rows:
        npu_row = npu_rows[m.name]
        record["npu_golden"] = {**npu_row.metrics.to_json(strict), "ulp_rule": npu_row.ulps,
                                "ulp_pass": npu_row.ulp_pass, "passed": npu_row.passed(strict)}
        record["passed"] = passes(m, npu_rows, strict)
    return record
