"""GPU check of torch.npu graph capture (run by benchmarks/gpu_checks.sh; skipped without CUDA): the Ascend capture
programs of tests/graph_capture_cases.py in fresh interpreters after install("cuda"), each replay bitwise equal to
the eager calls on the GPU (docs/guides/torch_npu.md, "Graph capture")."""

from __future__ import annotations

import pytest
import torch

from graph_capture_cases import CASES, run_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_ascend_capture_programs_run_unedited_on_the_gpu(case):
    result = run_case(case, "cuda")
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]
