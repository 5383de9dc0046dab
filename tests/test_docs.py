"""The documentation: the site builds with warnings as errors, and every Python example in it runs.

Examples are the fenced ```python blocks of README.md and docs/**/*.md. The blocks of one page run in order in
one namespace (a page reads like a session), in a temporary working directory. A block that cannot run here (it
needs an NPU or a GPU, or shows code written for Ascend) opts out with the line ``<!-- no-run -->`` right before
its fence; the marker is described in docs/contributing-docs.md, and this file checks that it stays rare.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NO_RUN = "<!-- no-run -->"
# An opening fence of any language (``` or ~~~, optionally indented), and its closing fence.
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^\n]*$")


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(first line number, code, opted out) of each ```python block, in page order."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if opening["lang"] in ("python", "py"):
            previous = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
            code = "\n".join(line[indent:] for line in lines[i + 1 : end])
            blocks.append((i + 2, code, previous == NO_RUN))
        i = end + 1
    return blocks


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav or a nav entry without a page,
    and any mkdocstrings warning about a docstring fail the build. mkdocs is installed by `make test` (the `docs`
    extra), so its absence is a failure, not a skip."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    operator_page = tmp_path / "site" / "operators" / "flash_attention_score" / "index.html"
    assert operator_page.is_file()


def test_readme_links_resolve():
    """README.md is read on the repository host, outside the site: its relative links must name existing files."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README should link into docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_pages_have_examples_and_few_opt_outs():
    blocks = [block for page in PAGES for block in python_blocks(page.read_text(encoding="utf-8"))]
    runnable = [b for b in blocks if not b[2]]
    assert len(runnable) >= 10, "the documentation should show runnable examples"
    assert len(blocks) - len(runnable) <= max(3, len(blocks) // 5), "`<!-- no-run -->` is for NPU/GPU-only code"


def test_block_parser_sees_markers_and_indentation():
    text = "x\n```python\na = 1\n```\n\n<!-- no-run -->\n```python\nimport torch_npu\n```\n" \
           "- item\n\n    ```python\n    b = 2\n    ```\n```console\n$ ls\n```\n"
    assert python_blocks(text) == [(3, "a = 1", False), (8, "import torch_npu", True), (13, "b = 2", False)]


@pytest.mark.parametrize(
    "page", [p for p in PAGES if any(not skip for _, _, skip in python_blocks(p.read_text(encoding="utf-8")))],
    ids=_page_id,
)
def test_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # Examples draw random inputs: the same ones every run (DOCS_EXAMPLE_SEED tries others when writing a page).
    torch.manual_seed(int(os.environ.get("DOCS_EXAMPLE_SEED", "0")))
    # A page may install the torch_npu module alias; give the next page the interpreter as it was.
    modules_before = set(sys.modules)
    namespace: dict = {"__name__": "__docs_example__"}
    try:
        for line, code, skip in python_blocks(page.read_text(encoding="utf-8")):
            if skip:
                continue
            source = f"{_page_id(page)}:{line}"
            try:
                exec(compile(code, source, "exec"), namespace)
            except Exception as error:
                frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == source]
                where = line + frames[-1].lineno - 1 if frames else line
                raise AssertionError(f"the example at {_page_id(page)} line {where} raised {error!r}") from error
    finally:
        for name in set(sys.modules) - modules_before:
            if name == "torch_npu" or name.startswith("torch_npu."):
                del sys.modules[name]
