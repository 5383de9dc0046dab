"""examples/context_parallel.py: a few training steps on 2 spawned ranks give the single-process losses;
examples/cp_torchrun.py under torchrun equals the single-process operator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cann_attn.testing.distributed import free_port, one_group_at_a_time
from patience import HANG_SECONDS

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")


def test_context_parallel_example_matches_single_process(tmp_path):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # also the spawned ranks' path: they import the example by name
    import context_parallel

    assert context_parallel.main(["--steps", "3", "--seq", "32", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "context_parallel.json").exists()


def test_torchrun_example_on_two_processes_matches_single_process():
    """examples/cp_torchrun.py under `torchrun --nproc-per-node 2` (the command of docs/guides/context_parallel.md),
    its code the same as the guide's."""
    root = Path(__file__).resolve().parents[1]
    script = root / "examples" / "cp_torchrun.py"
    guide = (root / "docs" / "guides" / "context_parallel.md").read_text()
    body = script.read_text().split('"""', 2)[2].strip()
    assert body in guide, "docs/guides/context_parallel.md shows another version of examples/cp_torchrun.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root / "src"), os.environ.get("PYTHONPATH"))
                                                       if p)}
    with one_group_at_a_time():  # a process group of its own: queue with the other tests' groups
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(free_port()), str(script)], env=env, cwd=root,
                                capture_output=True, text=True, timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr[-3000:]
    difference = float(result.stdout.split("=")[-1])
    assert difference < 1e-5, result.stdout
