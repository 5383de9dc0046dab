"""The documentation: the site builds with warnings as errors, and every Python example in it runs.

Examples are the fenced ```python blocks of README.md and docs/**/*.md. The blocks of one page run in order in
one namespace (a page reads like one interpreter run), in a temporary working directory. A block that cannot run here
(it
needs an NPU or a GPU, or shows code written for Ascend) opts out with the line ``<!-- no-run -->`` right before
its fence; the marker is described in docs/contributing-docs.md, and this file checks that it stays rare.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from patience import HANG_SECONDS

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


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The site, built once per module (and per xdist worker) with `mkdocs build --strict`."""
    site = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run(
        # Not --quiet: it drops the warnings before --strict counts them (a docstring warning would pass).
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_SECONDS,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    return proc, site


def test_site_builds_strictly(built_site):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav or a nav entry without a page,
    and any mkdocstrings warning about a docstring fail the build. mkdocs is installed by `make test` (the `docs`
    extra), so its absence is a failure, not a skip."""
    proc, site = built_site
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert (site / "operators" / "flash_attention_score.html").is_file()
    # Opened from file:// (use_directory_urls: false): every local link names a file, never a folder, and nothing
    # is fetched from the network (fonts off, KaTeX bundled).
    for page in (site / "index.html", site / "semantics" / "masks.html", site / "api.html"):
        html = page.read_text(encoding="utf-8")
        links = re.findall(r'(?:href|src)="([^"#?]*)[^"]*"', html)
        local = [link for link in links if link and "://" not in link and not link.startswith(("mailto:", "data:"))]
        assert local and all(not link.endswith("/") for link in local), [lk for lk in local if lk.endswith("/")]
        missing = [link for link in local if not (page.parent / link).exists()]
        assert not missing, f"{page.name} links to missing files: {missing}"
        assert not re.findall(r'<(?:script|link)[^>]+(?:src|href)="https?://', html), f"{page.name} loads from the web"
    assert (site / "assets" / "katex" / "katex.min.js").is_file()
    assert 'class="arithmatex"' in (site / "operators" / "attention_update.html").read_text(encoding="utf-8")
    # Every page loads the bundled KaTeX and the CJK font's stylesheet: math and quoted Chinese render anywhere.
    pages = [p for p in site.rglob("*.html") if "assets" not in p.parts]
    for page in pages:
        html = page.read_text(encoding="utf-8")
        assert "katex.min.js" in html and "auto-render.min.js" in html and "extra.css" in html, page.name
    assert (site / "assets" / "fonts" / "cjk-subset.woff").is_file()


def test_site_layout_at_1280_px(built_site):
    """docs/layout_check.py in headless chromium, every page in a 1280 x 900 window: every formula rendered by
    KaTeX, no formula or table wider than its column, no contents entry cut short, the CJK font loaded where a page
    quotes Chinese. It needs chromium (Debian: apt-get install chromium)."""
    proc, site = built_site
    assert proc.returncode == 0, "the site did not build (test_site_builds_strictly says why)"
    check = _docs_module("layout_check")
    if check.chromium() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                   if p.name != "404.html" and "assets" not in p.parts)
    problems = {page: found for page, found in check.check_pages(check.chromium(), site, pages).items() if found}
    assert not problems, problems


def test_cjk_font_holds_every_chinese_character_of_the_pages():
    """The bundled font (docs/cjk_font.py) has a glyph for every CJK character README.md, docs/ and the docstrings
    use; a page that quotes a character outside it needs `python docs/cjk_font.py` run again."""
    ttfont = pytest.importorskip("fontTools.ttLib", reason="fontTools comes with matplotlib")
    font = _docs_module("cjk_font")
    cmap = {chr(code) for code in ttfont.TTFont(font.FONT).getBestCmap()}
    missing = sorted(font.page_characters() - cmap)
    assert not missing, f"not in {font.FONT.name}: {''.join(missing)} (run python docs/cjk_font.py)"


def _docs_module(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_operator_index_lists_every_operator_page():
    """The home page and the semantics index carry the generated operator table (docs/hooks.py): every page of
    the nav's Operators section, with its functions and torch_npu spellings."""
    hooks = _docs_module("hooks")
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = re.findall(r"^      - [^:]+: (operators/\S+\.md)$", config, flags=re.MULTILINE)
    assert "operators/fused_infer_attention_score.md" in pages and "operators/incre_flash_attention.md" in pages
    nav = [{"Operators": [{Path(p).stem: p} for p in pages]}]
    table = hooks.operator_table(nav, ROOT / "docs", "semantics/index.md")
    assert all(f"(../{p})" in table for p in pages)
    assert "`fused_infer_attention_score`" in table and "`npu_incre_flash_attention`" in table
    assert "`npu_sparse_flash_attention_grad`" in table  # the `npu_x(_grad)` form names both
    for index in ("index.md", "semantics/index.md"):
        assert hooks.MARKER in (ROOT / "docs" / index).read_text(encoding="utf-8"), index


def test_performance_page_covers_every_benchmark_suite_and_plot():
    """docs/performance.md's generated section: one per benchmarks/bench_*.py, and every recorded plot embedded
    once (a result belongs to the longest suite name that prefixes it)."""
    sections = _docs_module("hooks").benchmark_sections(ROOT / "docs", "performance.md")
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    assert len(scripts) >= 11
    for script in scripts:
        assert f"`python benchmarks/{script.name}`" in sections
    for plot in (ROOT / "benchmarks" / "results").glob("*.png"):
        assert sections.count(f"(benchmarks/results/{plot.name})") == 1, plot.name
    assert "paged_gpu_h200.jsonl" in sections and "NVIDIA H200" in sections
    assert "<!-- benchmark-suites -->" in (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")


def test_figures_script_reproduces_the_committed_figures(tmp_path):
    """docs/figures.py draws every figure from the library's rules; the committed PNGs are what it draws now."""
    matplotlib_image = pytest.importorskip("matplotlib.image")
    written = _docs_module("figures").main(["--out", str(tmp_path)])
    assert written
    for path in written:
        committed = ROOT / "docs" / "images" / path.name
        assert committed.is_file(), f"{committed} is not committed: run `python docs/figures.py`"
        new, old = matplotlib_image.imread(path), matplotlib_image.imread(committed)
        assert new.shape == old.shape and (new == old).all(), f"{path.name} changed: run `python docs/figures.py`"
        assert f"images/{path.name}" in "".join(p.read_text(encoding="utf-8") for p in PAGES[1:]), path.name


def test_readme_links_resolve():
    """README.md is read on the repository host, outside the site: its relative links must name existing files."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README should link into docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


TABLE_RULE = re.compile(r"^\|[\s:|-]+\|\s*$")


def table_cell_counts(text: str) -> list[tuple[int, int, int]]:
    """(line, header cells, row cells) of every table row outside code fences whose cell count is not its header's:
    such a row is usually a paragraph that lost the blank line before it and now renders as a broken table cell."""
    lines, wrong, in_code = text.split("\n"), [], False

    def cells(row: str) -> int:
        return len(re.sub(r"`[^`]*`", "C", row).replace("\\|", "").strip().strip("|").split("|"))

    for n, line in enumerate(lines):
        if FENCE.match(line):
            in_code = not in_code
        starts_table = line.startswith("|") and n + 1 < len(lines) and TABLE_RULE.match(lines[n + 1])
        if in_code or not starts_table or (n and lines[n - 1].startswith("|")):
            continue
        header, m = cells(line), n + 2
        while m < len(lines) and lines[m].startswith("|"):
            if cells(lines[m]) != header:
                wrong.append((m + 1, header, cells(lines[m])))
            m += 1
    return wrong


def test_table_rows_match_their_header():
    broken = {page.name: rows for page in PAGES if (rows := table_cell_counts(page.read_text(encoding="utf-8")))}
    assert not broken, f"table rows whose cell count differs from the header's (line, header, row): {broken}"


def test_table_check_sees_a_paragraph_glued_to_a_row():
    glued = ("| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 | and a sentence\nthat goes on\n\n"
             "```\n| x |\n|---|\n| 1 | 2 |\n```\n")
    assert table_cell_counts(glued) == [(4, 2, 3)]


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
