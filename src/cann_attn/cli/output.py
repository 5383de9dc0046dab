"""How the commands print: rich tables on a terminal, plain aligned text elsewhere, and strict JSON for machines.

On a terminal a table is a rich ``Table`` when it fits the window; in a narrower window each row is printed as
"column value" fields packed into lines of the window's width, so that 80 columns still show every digit (rich
would shorten cells to "0.00e+..."). Anywhere else (a pipe, a file, a CI log) the same rows are printed as plain
text: one line per row, columns padded to their widest cell, no colours, no box drawing, nothing cut
(docs/guides/golden.md).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import UsageError
from .tensorio import check_output

STDOUT = "-"  # `--json -`: the JSON report on standard output, instead of the table


@dataclass(frozen=True)
class Column:
    name: str
    justify: str = "left"  # "left", "right" or "center"
    no_wrap: bool = False  # terminal tables only: keep the cell on one line


def console() -> Console:
    """The console of a command's standard output; off a terminal, lines are never wrapped."""
    out = Console()
    return out if out.is_terminal else Console(soft_wrap=True)


def print_table(out: Console, title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    """`rows` of rich-markup cells under `columns`: a rich table on a terminal, plain aligned text elsewhere."""
    if out.is_terminal and _natural_width(columns, rows) > out.width:
        _print_records(out, title, columns, rows)
        return
    if out.is_terminal:
        table = Table(title=title, header_style="bold")
        for column in columns:
            table.add_column(column.name, justify=column.justify, no_wrap=column.no_wrap)
        for row in rows:
            table.add_row(*row)
        out.print(table)
        return
    for line in plain_table(title, columns, rows):
        out.print(line, markup=False, highlight=False, soft_wrap=True)


def _natural_width(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> int:
    """The width of the rich table with no cell shortened: the widest cell of each column, its padding and
    borders (one space each side, one rule between columns)."""
    widths = [len(c.name) for c in columns]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], *(len(line) for line in Text.from_markup(cell).plain.split("\n")))
    return sum(widths) + 3 * len(columns) + 1


def _print_records(out: Console, title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    """A terminal narrower than the table: each row as "column value" fields packed into lines of the terminal's
    width (continuation lines indented), empty cells left out; nothing is shortened."""
    out.print(Text(title, style="bold"))
    for row in rows:
        fields = [Text.assemble((f"{c.name} ", "dim"), Text.from_markup(cell)) for c, cell in zip(columns, row,
                                                                                                  strict=True)
                  if Text.from_markup(cell).plain.strip()]
        line, lines = Text(), []
        for field_ in fields:
            if line.plain and len(line.plain) + 2 + len(field_.plain) > out.width:
                lines.append(line)
                line = Text("    ")
            elif line.plain.strip():
                line.append("  ")
            line.append_text(field_)
        lines.append(line)
        for text in lines:
            out.print(text, soft_wrap=False, overflow="fold", no_wrap=False)


def plain_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a table as plain text: the title, the header, a rule of dashes, one line per row; cells are
    the markup's plain text, separated by two spaces, padded to each column's widest cell."""
    cells = [[column.name for column in columns]]
    cells += [[Text.from_markup(cell).plain.replace("\n", " ") for cell in row] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    pad = {"left": str.ljust, "right": str.rjust, "center": str.center}

    def join(line: Sequence[str]) -> str:
        return "  ".join(pad[c.justify](cell, w) for c, cell, w in zip(columns, line, widths, strict=True)).rstrip()

    header, *body = cells
    return [title, join(header), "  ".join("-" * w for w in widths), *(join(line) for line in body)]


def finite_json(value: Any) -> Any:
    """`value` with NaN / infinite floats as the strings "NaN", "Infinity", "-Infinity": strict JSON (RFC 8259)
    has no such numbers, and parsers other than Python's reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def check_json_target(path: str) -> None:
    """--json FILE: refuse, before any work, a directory or a file that cannot be written (`-` is stdout)."""
    if path == STDOUT:
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--json: {target} is a directory")
    if not target.parent.is_dir():
        raise UsageError(f"--json: cannot write {target} ({target.parent} is not an existing directory)")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"--json: cannot write {target} (permission denied)")
    check_output(target.parent, "--json", shown=target)


def write_json(path: str, report: dict) -> None:
    """The report as strict, indented JSON in `path`, or on standard output for `-`."""
    text = json.dumps(finite_json(report), indent=2, allow_nan=False) + "\n"
    if path == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise UsageError(f"--json: cannot write {path} ({exc.strerror or exc})") from exc
