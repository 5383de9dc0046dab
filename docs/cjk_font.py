"""Build docs/assets/fonts/cjk-subset.woff: the Chinese characters the pages quote, readable without a CJK font.

The pages quote the Chinese Ascend documentation verbatim. A browser without a CJK font draws those characters as
empty boxes, so the site ships its own: a subset of Droid Sans Fallback (Apache License 2.0, Debian package
fonts-droid-fallback) holding the 3755 characters of GB2312 level 1 (the common ones), CJK punctuation, and every
other CJK character found in README.md, docs/ and the docstrings of src/ (which the API pages render). The CSS
(docs/stylesheets/extra.css) loads it for those code points only (unicode-range), so Latin text keeps the theme's
fonts. tests/test_docs_layout.py checks that every CJK character of the pages is in the font; when a page gains one
outside it, rebuild:

    apt-get install fonts-droid-fallback     # or pass the .ttf of any Droid Sans Fallback Full
    python docs/cjk_font.py [/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf]

Needs fontTools (installed with matplotlib). WOFF (zlib) rather than WOFF2, which would need brotli.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FONT = ROOT / "docs" / "assets" / "fonts" / "cjk-subset.woff"
SOURCE = Path("/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf")
# CJK punctuation, ideographs and full-width forms: what the pages quote.
CJK = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")
# The same ranges, for the CSS unicode-range of the @font-face that loads the font.
UNICODE_RANGE = "U+3000-303F, U+3400-4DBF, U+4E00-9FFF, U+FF00-FFEF"


def common_characters() -> set[str]:
    """GB2312 level 1: rows 16-55 of the table, the 3755 most common Chinese characters."""
    found = set()
    for high in range(0xB0, 0xD8):
        for low in range(0xA1, 0xFF):
            try:
                found.add(bytes([high, low]).decode("gb2312"))
            except UnicodeDecodeError:
                continue
    return found


def page_characters() -> set[str]:
    """Every CJK character of README.md, docs/**/*.md and src/**/*.py (docstrings reach the API pages)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "src").rglob("*.py"))]
    return {c for f in files for c in CJK.findall(f.read_text(encoding="utf-8"))}


def build(source: Path) -> int:
    from fontTools import subset
    from fontTools.ttLib import TTFont

    options = subset.Options()
    options.flavor = "woff"
    options.layout_features = []
    options.hinting = False
    options.name_IDs = ["*"]  # keep the copyright and licence records
    font = TTFont(source)
    subsetter = subset.Subsetter(options)
    wanted = common_characters() | page_characters() | {chr(c) for c in range(0x3000, 0x3040)}
    subsetter.populate(text="".join(sorted(wanted)))
    subsetter.subset(font)
    FONT.parent.mkdir(parents=True, exist_ok=True)
    font.flavor = "woff"
    font.save(FONT)
    missing = page_characters() - {chr(c) for c in font.getBestCmap()}
    print(f"{FONT.relative_to(ROOT)}: {len(font.getBestCmap())} characters, {FONT.stat().st_size} bytes")
    if missing:
        print(f"not in {source.name}: {''.join(sorted(missing))}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(build(Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE))
