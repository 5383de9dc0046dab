"""The "npu" precision mode on a CUDA GPU (docs/semantics/precision.md): the Triton kernels do not compute it, so
backend="auto" falls back to the reference backend with a BackendFallbackWarning and gives the CPU's values (up to
the float64 GEMMs' summation order), and backend="triton" is refused. Values near FLT_MAX stay finite on the GPU's
Triton kernels (FA, paged FIA decode, SparseFlashAttention with rows that select nothing)."""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn import BackendFallbackWarning, ParamInvalidError
from cann_attn.backends import dispatch_counts
from cann_attn.testing.dsa_oracle import INVALID_MAX
from paged_utils import paginate
from test_float_max_range import SCALE, B, N, S, assert_matches_golden, golden, inputs_near_max

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_attention_near_the_float_maximum_on_triton(dtype):
    """tests/test_float_max_range.py's SparseFlashAttention case (every key selected, values near FLT_MAX) on the
    GPU's Triton SFA kernel, with every fifth query row selecting nothing (indices all -1): the selecting rows give
    the float64 answer, not inf (the call reruns with exactly scaled value columns); the empty rows stay invalid rows
    through the rerun: output 0, softmax_max -2e38, softmax_sum 0 (docs/operators/sparse_flash_attention.md)."""
    q, k, v = inputs_near_max(dtype)
    q, k, v = q.transpose(1, 2), k[:, :1].transpose(1, 2), v[:, :1].transpose(1, 2)  # BSND, one kv head
    empty = torch.arange(S) % 5 == 0
    indices = torch.arange(S, dtype=torch.int32).expand(B, S, 1, S).clone()
    indices[:, empty] = -1
    before = dispatch_counts[("sparse_flash_attention", "triton")]
    res = cann_attn.sparse_flash_attention(q.cuda(), k.cuda(), v.cuda(), indices.cuda(), SCALE, sparse_mode=0,
                                           backend="triton")
    assert dispatch_counts[("sparse_flash_attention", "triton")] > before
    out, row_max, row_sum = (t.cpu() for t in res)
    dense = (t.transpose(1, 2).expand(B, N, S, -1) for t in (k, v))
    want = golden(q.transpose(1, 2), *dense).transpose(1, 2)
    assert_matches_golden(out[:, ~empty], want[:, ~empty], v.transpose(1, 2))  # column scales over the keys
    assert bool((out[:, empty] == 0).all())
    assert bool((row_max[:, :, empty] == torch.tensor(INVALID_MAX, dtype=torch.float32)).all())
    assert bool((row_sum[:, :, empty] == 0).all())
