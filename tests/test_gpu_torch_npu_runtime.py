"""GPU checks of the torch_npu runtime surface (run by benchmarks/gpu_checks.sh; skipped without CUDA): the cases of
tests/test_torch_npu_runtime.py with the npu device mapped onto CUDA, and the two unedited programs on one rank
per GPU (their install() line picks CUDA when a GPU is present)."""

from __future__ import annotations

import pytest
import torch

import torch_npu_runtime_cases as cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("case", ["SCRIPTING_AND_METADATA", "RUNTIME_NAMES", "AMP", "TRANSFER_TO_NPU"])
def test_runtime_case_on_cuda(case, tmp_path):
    cases.run_case(getattr(cases, case), "cuda", tmp_path)


@pytest.mark.parametrize(("program", "done"), [("ulysses_npu.py", "ulysses ok"),
                                               ("mindspeed_ring_attention.py", "ring attention ok")])
def test_unedited_program_on_cuda(program, done):
    ranks = min(2, torch.cuda.device_count())
    output = cases.run_program(program, ranks)
    assert done in output and "cuda" in output
