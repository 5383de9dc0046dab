"""The merge operators' Triton kernels on a CUDA GPU at real sizes (docs/operators/ring_attention_update.md,
docs/operators/attention_update.md): against the reference backend on the same device (the rule of
cann_attn.problem.merge in fp32), with invalid rows / empty shards mixed in, and a ring of real FlashAttentionScore
blocks against full attention. Run with `pytest -m gpu tests/test_gpu_merge.py`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn.backends import dispatch_counts
from cann_attn.problem.stats import FLT_MAX
from cann_attn.testing.precision import assert_close_to_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _stats(gen, shape, p_invalid=0.1):
    mx = torch.randn(shape, generator=gen, device=DEV) * 4
    sm = torch.rand(shape, generator=gen, device=DEV) * 50 + 1
    invalid = torch.rand(shape, generator=gen, device=DEV) < p_invalid
    mx, sm = mx.masked_fill(invalid, -FLT_MAX), sm.masked_fill(invalid, FLT_MAX)
    return mx.unsqueeze(-1).expand(*shape, 8).contiguous(), sm.unsqueeze(-1).expand(*shape, 8).contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout,softmax_layout", [("SBH", ""), ("TND", ""), ("TND", "TND")])
def test_ring_update_triton_matches_reference(layout, softmax_layout, dtype):
    gen = torch.Generator(device=DEV).manual_seed(0)
    heads, d = 16, 128
    if layout == "SBH":
        s, b = 4096, 2
        attn_shape, stat_shape, kw = (s, b, heads * d), (b, heads, s), {}
    else:
        lengths = [3000, 1, 0, 5191]
        t = sum(lengths) + 7  # end-of-document padding
        attn_shape, stat_shape = (t, heads, d), (t, heads)
        ends = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        kw = dict(input_layout="TND", input_softmax_layout=softmax_layout, actual_seq_qlen=ends)
    prev = (torch.randn(attn_shape, generator=gen, device=DEV).to(dtype), *_stats(gen, stat_shape))
    cur = (torch.randn(attn_shape, generator=gen, device=DEV).to(dtype), *_stats(gen, stat_shape))
    before = dispatch_counts[("ring_attention_update", "triton")]
    tri = cann_attn.ring_attention_update(*prev, *cur, backend="triton", **kw)
    assert dispatch_counts[("ring_attention_update", "triton")] == before + 1
    ref = cann_attn.ring_attention_update(*prev, *cur, backend="reference", **kw)
    assert_close_to_oracle(tri.attn_out, ref.attn_out.double(), name="attn_out")
    torch.testing.assert_close(tri.softmax_max, ref.softmax_max, rtol=0, atol=0)
    torch.testing.assert_close(tri.softmax_sum, ref.softmax_sum, rtol=2e-6, atol=0)
    both = (prev[1] <= -FLT_MAX) & (cur[1] <= -FLT_MAX)
    assert torch.all(tri.softmax_sum[both] == FLT_MAX)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("parts", [2, 8, 16])
def test_attention_update_triton_matches_reference(parts, dtype):
    gen = torch.Generator(device=DEV).manual_seed(1)
    rows, d = 32 * 1024, 512
    lse = [torch.randn(rows, generator=gen, device=DEV) * 3 for _ in range(parts)]
    lse[0][::5] = -torch.inf
    outs = [torch.randn(rows, d, generator=gen, device=DEV).to(dtype) for _ in range(parts)]
    tri = cann_attn.attention_update(lse, outs, 1, backend="triton")
    ref = cann_attn.attention_update(lse, outs, 1, backend="reference")
    assert_close_to_oracle(tri.out, ref.out.double(), name="out")
    torch.testing.assert_close(tri.lse_out, ref.lse_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_two_block_ring_of_flash_attention_equals_full_attention(dtype):
    """Causal split of the keys in two blocks (top-left causal, then bottom-right causal: the rows before the
    second block see none of it), merged on the GPU, against full causal attention in fp32."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    b, n, s, d = 2, 8, 2048, 128
    q, k, v = (torch.randn(s, b, n * d, generator=gen, device=DEV).to(dtype) for _ in range(3))
    half = s // 2
    mask2, mask3 = cann_attn.compressed_mask(2, DEV), cann_attn.compressed_mask(3, DEV)
    first = cann_attn.flash_attention_score(q, k[:half], v[:half], n, "SBH", atten_mask=mask2, sparse_mode=2,
                                            scale_value=d ** -0.5)
    second = cann_attn.flash_attention_score(q, k[half:], v[half:], n, "SBH", atten_mask=mask3, sparse_mode=3,
                                             scale_value=d ** -0.5)
    merged = cann_attn.ring_attention_update(first.attention_out, first.softmax_max, first.softmax_sum,
                                             second.attention_out, second.softmax_max, second.softmax_sum)
    full = cann_attn.flash_attention_score(q.float(), k.float(), v.float(), n, "SBH", atten_mask=mask3,
                                           sparse_mode=3, scale_value=d ** -0.5, backend="reference")
    assert_close_to_oracle(merged.attn_out, full.attention_out.double(), name="attn_out")
    torch.testing.assert_close(merged.softmax_max, full.softmax_max, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged.softmax_sum, full.softmax_sum, rtol=1e-4, atol=1e-4)
