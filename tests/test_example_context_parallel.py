"""examples/context_parallel.py: a few training steps on 2 spawned ranks give the single-process losses."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")


def test_context_parallel_example_matches_single_process(tmp_path):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # also the spawned ranks' path: they import the example by name
    import context_parallel

    assert context_parallel.main(["--steps", "3", "--seq", "32", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "context_parallel.json").exists()
