"""Every reference in a tracked file resolves inside the repository: no tracker numbers, no absolute paths of a
particular machine, no commit hashes told as history (the history lives in the git log).

Every file `git ls-files` lists is read (images, fonts and the bundled third-party assets excepted) and each line is
matched against the patterns below. A hit fails the test with file, line and the matched text. Legitimate text that
a pattern would catch is listed in ALLOWED, each entry a (path, exact line fragment) pair, so that an allowance never
covers more than the line it was made for."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TRACKER = "iss" + "ue"  # spelled in two pieces so that this file's own patterns do not catch it

PATTERNS: dict[str, re.Pattern[str]] = {
    # A tracker number, written out or as "#" and digits (not "#include", a markdown anchor, a CSS colour, "sm_90").
    "a tracker number": re.compile(rf"\b{TRACKER}s? ?#?\d+|(?<![\w&/#'\"=:.-])#\d{{1,4}}\b(?![\w;-])", re.I),
    # An absolute path of one machine's file system: a reader of the repository cannot open it.
    "a path outside the repository": re.compile(r"(?<![\w.~$}])/(?:home|work|root|mnt|Users)/\w"),
    # History told in the docs and comments: a before/after section, a commit hash as a point in the history.
    "history": re.compile(r"\bBefore and after\b|\bbefore_[0-9a-f]{7}|(?<![\w.+-])(?!0[bx])"
                          r"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}\b(?![.\w])"),
}

# Recorded data may hold the commit it measured (perf_guard's "commit" field): provenance, not history.
HISTORY_EXEMPT_SUFFIXES = (".json", ".jsonl")
SKIPPED_SUFFIXES = (".png", ".jpg", ".svg", ".woff", ".woff2", ".ttf", ".otf", ".ico", ".pdf")
SKIPPED_PREFIXES = ("docs/assets/",)  # third-party files bundled as they are (KaTeX)

# (path, fragment of the exact line): text a pattern catches that is not what the rule is about.
ALLOWED: tuple[tuple[str, str], ...] = (
    # The public upstream sources are pinned by their commit: provenance of a quoted source, not our history.
    ("docs/guides/torch_npu.md", "(op-plugin master as read on 2026-08-21, commit 517f2e7)"),
    ("src/cann_attn/torch_npu/_registry.py", "op-plugin master as read on 2026-08-21 (commit 517f2e7)"),
    ("tests/test_torch_npu_schema.py", "master as read on 2026-08-21 (commit 517f2e7)"),
    ("docs/semantics/precision.md", "hicann/ops-transformer at commit `c29bc1069d32`"),
    ("docs/semantics/precision.md", "repo-mirror-test/ops-transformer at commit `bfbbec839121`"),
    ("docs/semantics/precision.md", "and op-plugin at commit `517f2e7d0f20`"),
    # This file names the patterns it looks for.
    ("tests/test_repository_hygiene.py", ""),
)


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.split("\0") if p and not p.endswith(SKIPPED_SUFFIXES)
            and not p.startswith(SKIPPED_PREFIXES)]


def findings(path: str, text: str) -> list[str]:
    """Every (line, pattern) hit of one file's text, as 'path:line: [what] matched: line'."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        if any(path == where and fragment in line for where, fragment in ALLOWED):
            continue
        for what, pattern in PATTERNS.items():
            if what == "history" and path.endswith(HISTORY_EXEMPT_SUFFIXES):
                continue
            match = pattern.search(line)
            if match:
                hits.append(f"{path}:{number}: [{what}] {match.group(0)!r}: {line.strip()[:160]}")
    if re.search(rf"{TRACKER}s?[_ -]?\d", path, re.I):
        hits.append(f"{path}: [a tracker number] in the file's name")
    return hits


def test_no_tracked_file_cites_tracker_numbers_outside_paths_or_history():
    hits = []
    for path in tracked_files():
        file = ROOT / path
        if not file.is_file():  # deleted in the working tree, not yet committed
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits += findings(path, text)
    assert not hits, "\n".join(["these lines speak of something other than the project:", *hits])


# Planted lines, one or more per pattern.
PLANTED = [template.format(tracker=TRACKER) for template in (
    "Before and after {tracker} 37 (2026-11-28)",
    "see {tracker}s 9/10 for the targets",
    "fixed in #42",
    "results in /home/alice/runs/fa.json",
    "the regressions of 98224a7 measured -24%",
    "benchmarks/results/{tracker}37_cpu/before_24b9c48/",
)]


@pytest.mark.parametrize("line", PLANTED)
def test_each_pattern_catches_a_planted_line(line: str):
    assert findings("docs/planted.md", line), line


@pytest.mark.parametrize("line", [
    "Shell sessions belong in `console` blocks",
    "an interactive session of the CLI",
    "The issue of overflow: softmax_max = -3.4028235e38",
    "#include <immintrin.h>",
    "see [Design](../design.md#layers) and #every-suite",
    "color: #333;",
    "torch.manual_seed(seed)",
    "the dropout seed (default: drawn from `generator`)",
    "offset 3 -> 0b000000011 at bits 37..45",
    "the cache in ~/.cache/cann_attn or $XDG_CACHE_HOME/cann_attn",
    "python docs/figures.py --out /tmp/f",
])
def test_ordinary_text_passes(line: str):
    assert not findings("docs/ordinary.md", line), findings("docs/ordinary.md", line)
