"""Running ``cann-attn`` in-process from tests: the exit status and what it printed."""

from __future__ import annotations

import json
from pathlib import Path

from cann_attn.cli import main as cli_main

# A FlashAttentionScore case small enough for many CLI runs per test.
SMALL_FP16_FA = {
    "op": "flash_attention_score",
    "seed": 2,
    "inputs": {"query": {"shape": [1, 16, 2, 16], "dtype": "float16"},
               "key": {"shape": [1, 16, 2, 16], "dtype": "float16"},
               "value": {"shape": [1, 16, 2, 16], "dtype": "float16"}},
    "params": {"head_num": 2, "input_layout": "BSND", "scale_value": 0.25},
}


def write_case(directory: Path, case: dict, name: str = "case.json") -> Path:
    """`case` written as the JSON case file `directory/name`; its path."""
    path = directory / name
    path.write_text(json.dumps(case))
    return path


def run_main(capsys, *args) -> tuple[int, str, str]:
    """Run the CLI in-process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = cli_main.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def refused(capsys, *args, match: str) -> str:
    """Run the CLI, expecting bad usage: exit status 2 and one line on stderr containing `match` (returned)."""
    rc, out, err = run_main(capsys, *args)
    assert rc == 2, out + err
    assert len(err.strip().splitlines()) == 1 and match in err, err
    return err
