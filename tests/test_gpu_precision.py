"""The "npu" precision mode on a CUDA GPU (docs/semantics/precision.md): the Triton kernels do not compute it, so
backend="auto" falls back to the reference backend with a BackendFallbackWarning and gives the CPU's values (up to
the float64 GEMMs' summation order), and backend="triton" is refused."""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn import BackendFallbackWarning, ParamInvalidError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_npu_mode_falls_back_on_cuda_and_matches_the_cpu():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 64, generator=g).half() for _ in range(3))
    with cann_attn.precision("npu"):
        cpu = cann_attn.prompt_flash_attention(q, k, v, num_heads=4, input_layout="BNSD", scale_value=0.125)
        with pytest.warns(BackendFallbackWarning, match="npu"):
            cuda = cann_attn.prompt_flash_attention(q.cuda(), k.cuda(), v.cuda(), num_heads=4, input_layout="BNSD",
                                                    scale_value=0.125)
        with pytest.raises(ParamInvalidError, match="npu"):
            cann_attn.prompt_flash_attention(q.cuda(), k.cuda(), v.cuda(), num_heads=4, input_layout="BNSD",
                                             scale_value=0.125, backend="triton")
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=0, atol=2e-3)
