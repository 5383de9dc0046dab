"""Check the built site as a 1280 x 900 browser window shows it (headless chromium, pages opened from file://).

For every page of the site: every formula is rendered by the bundled KaTeX (no `.arithmatex` left without
`.katex`, no `.katex-error`), no display formula and no table is wider than its column (scrollWidth > clientWidth:
cut, or hidden behind a scroll bar), no entry of the right-hand contents is cut short, and where the page holds
Chinese text the bundled CJK font (docs/cjk_font.py) has loaded. Run after `mkdocs build`:

    python docs/layout_check.py [SITE_DIR] [PAGE ...]     # exit status 1 and one line per problem

`bash docs/screenshots.sh` runs it before taking the screenshots; tests/test_docs_layout.py runs it on the site
tests/test_docs.py builds. Chromium: Debian `apt-get install chromium`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTH, HEIGHT = 1280, 900
REPORT = re.compile(r"LAYOUT-REPORT(\{.*?\})LAYOUT-END", re.S)

# The problems of one loaded page, found in its own window `w` (KaTeX has rendered by then).
PROBE = """
async function problemsOf(w) {
  const document = w.document;
  await document.fonts.ready;
  const wide = (el) => el.scrollWidth > el.clientWidth + 1;
  const label = (el) => {
    const heading = [...document.querySelectorAll("h1, h2, h3, h4, .doc-heading")]
      .filter((h) => h.compareDocumentPosition(el) & w.Node.DOCUMENT_POSITION_FOLLOWING).pop();
    return (heading ? heading.textContent.trim().slice(0, 60) + ": " : "") +
      el.textContent.trim().replace(/\\s+/g, " ").slice(0, 60);
  };
  const problems = [];
  for (const el of document.querySelectorAll(".md-content .katex-display"))
    if (wide(el))
      problems.push(`formula wider than the column (${el.scrollWidth} > ${el.clientWidth} px): ${label(el)}`);
  for (const el of document.querySelectorAll(".md-content .md-typeset__scrollwrap, .md-content table"))
    if (wide(el)) problems.push(`table wider than the column (${el.scrollWidth} > ${el.clientWidth} px): ${label(el)}`);
  for (const el of document.querySelectorAll(".md-sidebar--secondary .md-nav__link .md-ellipsis"))
    if (wide(el)) problems.push(`contents entry cut: ${el.textContent.trim()}`);
  const content = document.querySelector(".md-content");
  if (content && wide(content)) problems.push(`content wider than its column (${content.scrollWidth} px)`);
  for (const el of document.querySelectorAll(".md-content .arithmatex"))
    if (!el.querySelector(".katex")) problems.push(`formula not rendered: ${label(el)}`);
  for (const el of document.querySelectorAll(".md-content .katex-error"))
    problems.push(`KaTeX error: ${el.getAttribute("title") || label(el)}`);
  if (/[\\u3400-\\u9fff]/.test(content ? content.textContent : "")) {
    const faces = [...document.fonts].filter((f) => f.family.replace(/"/g, "") === "Docs CJK");
    if (!faces.some((f) => f.status === "loaded")) problems.push("Chinese text, but the bundled CJK font did not load");
  }
  return problems;
}
"""

# One browser for every page: a driver page in the site's root opens each page in a 1280 x 900 frame (the frame's
# width is what the page's layout sees), probes it, and writes the reports into its own DOM.
DRIVER = """<!doctype html><html><body style="margin:0">
<iframe id="frame" style="width:%(width)dpx;height:%(height)dpx;border:0"></iframe>
<script>%(probe)s
const pages = %(pages)s, reports = {};
const frame = document.getElementById("frame");
(async () => {
  for (const page of pages) {
    await new Promise((done) => { frame.onload = done; frame.src = page; });
    await new Promise((done) => setTimeout(done, 300));
    try { reports[page] = await problemsOf(frame.contentWindow); }
    catch (error) { reports[page] = ["could not be probed: " + error]; }
  }
  const out = document.createElement("pre");
  out.textContent = "LAYOUT-REPORT" + JSON.stringify(reports) + "LAYOUT-END";
  document.body.appendChild(out);
})();
</script></body></html>"""


def chromium() -> str | None:
    return next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)


def check_pages(browser: str, site: Path, pages: list[str]) -> dict[str, list[str]]:
    """Each page's problems (page paths relative to the site)."""
    driver = site / "_layout_check.html"
    driver.write_text(DRIVER % {"width": WIDTH, "height": HEIGHT, "probe": PROBE, "pages": json.dumps(pages)},
                      encoding="utf-8")
    try:
        with tempfile.TemporaryDirectory() as profile:
            dom = subprocess.run(
                [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--allow-file-access-from-files", f"--user-data-dir={profile}",
                 f"--window-size={WIDTH + 40},{HEIGHT + 40}", f"--virtual-time-budget={20000 + 5000 * len(pages)}",
                 "--dump-dom", driver.as_uri()],
                capture_output=True, text=True, timeout=600).stdout
    finally:
        driver.unlink()
    found = REPORT.search(dom)
    if not found:
        return {"(all pages)": ["no report: the pages did not finish loading"]}
    text = found.group(1).replace("&gt;", ">").replace("&lt;", "<").replace("&quot;", '"').replace("&amp;", "&")
    return json.loads(text)


def main(argv: list[str]) -> int:
    site = Path(argv[0] if argv else "site").resolve()
    browser = chromium()
    if browser is None:
        print("chromium not found (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    pages = argv[1:] or sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                               if p.name != "404.html" and "assets" not in p.parts)
    failed = 0
    for page, problems in check_pages(browser, site, pages).items():
        for problem in problems:
            print(f"{page}: {problem}")
            failed += 1
    print(f"{len(pages)} pages at {WIDTH} px: {failed} problems", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
