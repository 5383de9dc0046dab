"""Attention sinks on a CUDA GPU (docs/semantics/sinks.md): the compiled Triton kernels with a sink (FA forward +
grad, SFA forward + grad) against the reference backend on the same GPU in fp32 (relative L2 errors)."""

from __future__ import annotations

import pytest
import torch

import cann_attn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _rel(a: torch.Tensor, g: torch.Tensor) -> float:
    return float((a.float() - g.float()).norm() / g.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa_sink_sliding_window_gqa(dtype):
    gen = torch.Generator().manual_seed(3)
    b, n1, n2, s, d = 2, 8, 2, 512, 64
    q = torch.randn(b, n1, s, d, generator=gen).to(DEV, dtype)
    k, v = (torch.randn(b, n2, s, d, generator=gen).to(DEV, dtype) for _ in range(2))
    dy = torch.randn(b, n1, s, d, generator=gen).to(DEV, dtype)
    sink = (torch.randn(n1, generator=gen) * 2).to(DEV)
    kw = {"scale_value": d**-0.5, "atten_mask": cann_attn.compressed_mask(4, DEV), "sparse_mode": 4,
          "pre_tokens": 128, "next_tokens": 0, "sink": sink}
    fwd = cann_attn.flash_attention_score(q, k, v, n1, "BNSD", backend="triton", **kw)
    grads = cann_attn.flash_attention_score_grad(q, k, v, dy, n1, "BNSD", backend="triton", softmax_max=fwd.softmax_max,
                                                 softmax_sum=fwd.softmax_sum, attention_in=fwd.attention_out, **kw)
    f32 = [t.float() for t in (q, k, v, dy)]
    gold = cann_attn.flash_attention_score(*f32[:3], n1, "BNSD", backend="reference", **kw)
    gold_g = cann_attn.flash_attention_score_grad(*f32, n1, "BNSD", backend="reference", softmax_max=gold.softmax_max,
                                                  softmax_sum=gold.softmax_sum, attention_in=gold.attention_out, **kw)
    assert _rel(fwd.attention_out, gold.attention_out) < 1e-2
    torch.testing.assert_close(fwd.softmax_max, gold.softmax_max, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fwd.softmax_sum, gold.softmax_sum, rtol=1e-2, atol=1e-2)
    for name in ("dq", "dk", "dv", "dsink"):
        assert _rel(getattr(grads, name), getattr(gold_g, name)) < 2e-2, name


def test_sfa_sinks():
    gen = torch.Generator().manual_seed(4)
    s1, s2, n1, d, dr, k = 64, 256, 16, 128, 32, 32
    q = torch.randn(1, s1, n1, d, generator=gen).to(DEV, torch.bfloat16)
    kv = torch.randn(1, s2, 1, d, generator=gen).to(DEV, torch.bfloat16)
    qr = torch.randn(1, s1, n1, dr, generator=gen).to(DEV, torch.bfloat16)
    kr = torch.randn(1, s2, 1, dr, generator=gen).to(DEV, torch.bfloat16)
    allowed = torch.arange(s1) + (s2 - s1 + 1)
    idx = torch.stack([torch.randperm(int(a), generator=gen)[:k] for a in allowed]).to(torch.int32)
    idx = idx.view(1, s1, 1, k).to(DEV)
    sinks = torch.randn(n1, generator=gen).to(DEV)
    kw = {"query_rope": qr, "key_rope": kr, "sinks": sinks}
    ours = cann_attn.sparse_flash_attention(q, kv, kv, idx, 0.1, backend="triton", **kw)
    gold = cann_attn.sparse_flash_attention(q.float(), kv.float(), kv.float(), idx, 0.1, backend="reference",
                                            query_rope=qr.float(), key_rope=kr.float(), sinks=sinks)
    assert _rel(ours.attention_out, gold.attention_out) < 1e-2
    torch.testing.assert_close(ours.softmax_sum, gold.softmax_sum, rtol=1e-2, atol=1e-2)
    d_out = torch.randn(ours.attention_out.shape, generator=gen).to(DEV, torch.bfloat16)
    g = cann_attn.sparse_flash_attention_grad(q, kv, kv, idx, d_out, ours.attention_out, ours.softmax_max,
                                              ours.softmax_sum, 0.1, backend="triton", **kw)
    gg = cann_attn.sparse_flash_attention_grad(q.float(), kv.float(), kv.float(), idx, d_out.float(),
                                               gold.attention_out, gold.softmax_max, gold.softmax_sum, 0.1,
                                               backend="reference", query_rope=qr.float(), key_rope=kr.float(),
                                               sinks=sinks)
    for name in ("d_query", "d_key", "d_sinks"):
        assert _rel(getattr(g, name), getattr(gg, name)) < 2e-2, name
