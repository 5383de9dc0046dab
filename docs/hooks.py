"""mkdocs build hook: the operator index, generated from the navigation.

A page that holds the line ``<!-- operator-index -->`` gets, in its place, a table of every page under the
*Operators* section of ``mkdocs.yml`` (its nav title as a link, the ``cann_attn`` functions and torch_npu
spellings its opening paragraph names). A new operator page therefore appears on the home page and in the semantics
index as soon as it is in the nav; nothing else is edited by hand.

The line ``<!-- benchmark-suites -->`` becomes one section per benchmark script (``benchmarks/bench_*.py``): what
its docstring says it measures, its command, and its recorded results in ``benchmarks/results/`` (the files named
after the suite: plots embedded, JSON linked, JSON-lines rows as a table). The results are copied into the site
under ``benchmarks/results/``; a new suite or result appears without editing the page.

Every page then loads the offline search's iframe-worker shim from the bundled copy, not from the web.
"""

from __future__ import annotations

import ast
import json
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

MARKER = "<!-- operator-index -->"
# The offline plugin makes search work from file:// with this script, which it names on the web; a copy is bundled.
IFRAME_WORKER_URL = "https://unpkg.com/iframe-worker/shim"
IFRAME_WORKER_COPY = "assets/iframe-worker/shim.js"
_FUNCTION = re.compile(r"`cann_attn\.(\w+)`")
_TORCH_NPU = re.compile(r"`(npu_\w+?)(\(_\w+\))?`")  # `npu_x(_grad)` names npu_x and npu_x_grad


def _operator_pages(nav: list) -> list[tuple[str, str]]:
    for section in nav:
        if isinstance(section, dict) and "Operators" in section:
            return [next(iter(entry.items())) for entry in section["Operators"] if isinstance(entry, dict)]
    return []


def _opening(source: str) -> str:
    """The text between the title and the first subheading or code block."""
    body = source.split("\n", 1)[1] if source.startswith("# ") else source
    return re.split(r"\n(?:#|```)", body, maxsplit=1)[0]


def _unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def operator_table(nav: list, docs_dir: Path, from_page: str) -> str:
    """The index table, its links relative to ``from_page`` (a path under docs_dir)."""
    rows = ["| operator | `cann_attn` functions | torch_npu |", "|---|---|---|"]
    for title, path in _operator_pages(nav):
        opening = _opening((docs_dir / path).read_text(encoding="utf-8"))
        functions = ", ".join(f"`{name}`" for name in _unique(_FUNCTION.findall(opening)))
        spellings = [name for base, suffix in _TORCH_NPU.findall(opening)
                     for name in (base, base + suffix[1:-1] if suffix else None) if name]
        torch_npu = ", ".join(f"`{name}`" for name in _unique(spellings))
        link = posixpath.relpath(path, posixpath.dirname(from_page) or ".")
        rows.append(f"| [{title}]({link}) | {functions} | {torch_npu} |")
    return "\n".join(rows)


BENCHMARK_MARKER = "<!-- benchmark-suites -->"
RESULTS_URI = "benchmarks/results"


def _benchmarks(docs_dir: Path) -> Path:
    return docs_dir.parent / "benchmarks"


def on_files(files, config):
    """The recorded results (plots, JSON) become files of the site, so that pages can embed and link them."""
    for result in sorted((_benchmarks(Path(config["docs_dir"])) / "results").glob("*")):
        if result.suffix in (".png", ".json", ".jsonl"):
            files.append(File.generated(config, f"{RESULTS_URI}/{result.name}", abs_src_path=str(result)))
    return files


def _summary(script: Path) -> str:
    docstring = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
    return " ".join(docstring.split("\n\n")[0].split())


def _jsonl_table(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cell = lambda value: f"{value:.3g}" if isinstance(value, float) else str(value)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(column, "")) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def benchmark_sections(docs_dir: Path, from_page: str) -> str:
    """One section per benchmarks/bench_*.py, with its recorded results."""
    root, results = _benchmarks(docs_dir), _benchmarks(docs_dir) / "results"
    up = posixpath.relpath(RESULTS_URI, posixpath.dirname(from_page) or ".")
    scripts = sorted(root.glob("bench_*.py"))
    suites = [script.stem.removeprefix("bench_") for script in scripts]

    def owner(result: Path) -> str | None:  # the longest suite name that prefixes it: fia_quant_cpu is fia_quant's
        return max((s for s in suites if result.name.startswith(f"{s}_")), key=len, default=None)

    sections = []
    for script, suite in zip(scripts, suites, strict=True):
        parts = [f"### `{suite}`", "", _summary(script), "", f"`python benchmarks/{script.name}`", ""]
        recorded = [r for r in sorted(results.glob(f"{suite}_*")) if owner(r) == suite]
        for result in recorded:
            if result.suffix == ".png":
                parts += [f"![{suite}: {result.stem}]({up}/{result.name})", ""]
        links = [f"[{r.name}]({up}/{r.name})" for r in recorded if r.suffix in (".json", ".jsonl")]
        parts += [f"Recorded: {', '.join(links)}." if links else "No recorded result yet.", ""]
        for result in recorded:
            if result.suffix == ".jsonl":
                parts += [_jsonl_table(result), ""]
        sections.append("\n".join(parts))
    return "\n".join(sections)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, operator_table(config["nav"], Path(config["docs_dir"]),
                                                          page.file.src_uri))
    if BENCHMARK_MARKER in markdown:
        markdown = markdown.replace(BENCHMARK_MARKER, benchmark_sections(Path(config["docs_dir"]),
                                                                         page.file.src_uri))
    return markdown


def on_post_page(output: str, page, config) -> str:
    relative = posixpath.relpath(IFRAME_WORKER_COPY, posixpath.dirname(page.file.dest_uri) or ".")
    return output.replace(IFRAME_WORKER_URL, relative)


def on_post_template(output: str, template_name: str, config) -> str:
    """404.html and the other root-level templates."""
    return output.replace(IFRAME_WORKER_URL, IFRAME_WORKER_COPY)
