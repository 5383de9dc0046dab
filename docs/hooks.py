"""mkdocs build hook: the operator index, generated from the navigation.

A page that holds the line ``<!-- operator-index -->`` gets, in its place, a table of every page under the
*Operators* section of ``mkdocs.yml`` (its nav title as a link, the ``cann_attn`` functions and torch_npu
spellings its opening paragraph names). A new operator page therefore appears on the home page and in the semantics
index as soon as it is in the nav; nothing else is edited by hand.

Every page then loads the offline search's iframe-worker shim from the bundled copy, not from the web.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

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


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    table = operator_table(config["nav"], Path(config["docs_dir"]), page.file.src_uri)
    return markdown.replace(MARKER, table)


def on_post_page(output: str, page, config) -> str:
    relative = posixpath.relpath(IFRAME_WORKER_COPY, posixpath.dirname(page.file.dest_uri) or ".")
    return output.replace(IFRAME_WORKER_URL, relative)


def on_post_template(output: str, template_name: str, config) -> str:
    """404.html and the other root-level templates."""
    return output.replace(IFRAME_WORKER_URL, IFRAME_WORKER_COPY)
