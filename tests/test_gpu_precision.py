"""The "npu" precision mode on a CUDA GPU (docs/semantics/precision.md): the Triton kernels do not compute it, so
backend="auto" falls back to the reference backend with a BackendFallbackWarning and gives the CPU's values (up to
the float64 GEMMs' summation order), and backend="triton" is refused."""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn import BackendFallbackWarning, ParamInvalidError
from paged_utils import paginate
from test_float_max_range import SCALE, N, S, assert_matches_golden, golden, inputs_near_max

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


@pytest.mark.parametrize("paged", [False, True], ids=["fa", "fia_paged_decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_values_near_the_float_maximum_stay_finite_on_triton(dtype, paged):
    """tests/test_float_max_range.py's cases on the GPU's Triton kernel (its real tiles and configs): FA, and FIA
    decode over a paged cache, with value tensors near FLT_MAX give the float64 answer, not inf."""
    q, k, v = inputs_near_max(dtype)
    if not paged:
        out = cann_attn.flash_attention_score(q.cuda(), k.cuda(), v.cuda(), N, "BNSD", scale_value=SCALE,
                                              backend="triton")[0]
        assert_matches_golden(out.cpu(), golden(q, k, v), v)
        return
    caches, table = paginate({"key": list(k.transpose(1, 2)), "value": list(v.transpose(1, 2))}, 16,
                             torch.Generator().manual_seed(6), garbage=0.0)
    key, value = (caches[name].permute(0, 2, 1, 3).contiguous().cuda() for name in ("key", "value"))
    out = cann_attn.fused_infer_attention_score(q[:, :, :1].cuda(), key, value, num_heads=N, input_layout="BNSD",
                                                scale=SCALE, block_table=table.cuda(), block_size=16,
                                                actual_seq_lengths_kv=[S] * q.shape[0], backend="triton")[0]
    assert_matches_golden(out.cpu(), golden(q[:, :, :1], k, v), v)
