"""GPU check of install(device="cuda") (run by benchmarks/gpu_checks.sh; skipped without CUDA): the Ascend-style
script of tests/npu_device_cases.py, its npu device mapped onto CUDA, equals the plain CUDA call."""

from __future__ import annotations

import pytest
import torch

from npu_device_cases import assert_same_as_plain_call, run_npu_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_npu_script_after_install_cuda_equals_the_plain_cuda_call(tmp_path):
    assert_same_as_plain_call(run_npu_script("cuda", tmp_path / "npu.pt"), "cuda")
