"""Real-size bf16 DSA kernels on a CUDA GPU against the reference backend (docs/operators/sparse_flash_attention.md,
docs/operators/lightning_indexer.md, docs/semantics/precision.md). Run with
`pytest -m gpu tests/test_gpu_dsa.py`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn.testing.precision import assert_close_to_oracle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BF16 = torch.bfloat16


def _topk_indices(gen, s1: int, s2: int, k: int, device) -> torch.Tensor:
    """[1, S1, 1, K] int32: row t a random top-k of its causally allowed keys [0, S2 - S1 + t], then -1."""
    idx = torch.full((1, s1, 1, k), -1, dtype=torch.int32)
    for t in range(s1):
        allowed = s2 - s1 + t + 1
        n = min(k, allowed)
        idx[0, t, 0, :n] = torch.randperm(allowed, generator=gen)[:n].to(torch.int32)
    return idx.to(device)


@pytest.mark.parametrize("deterministic", [False, True])
def test_sparse_attention_real_size_bf16(deterministic):
    """N1 = 128, D = 512 + 64, value = the 512 latent (same tensor as key), top-2048 of S2 = 4096 keys."""
    gen = torch.Generator().manual_seed(0)
    s1, s2, n1, k = 128, 4096, 128, 2048
    dev = torch.device("cuda")
    q = torch.randn(1, s1, n1, 512, generator=gen).to(dev, BF16)
    qr = torch.randn(1, s1, n1, 64, generator=gen).to(dev, BF16)
    kv = torch.randn(1, s2, 1, 512, generator=gen).to(dev, BF16)
    kr = torch.randn(1, s2, 1, 64, generator=gen).to(dev, BF16)
    idx = _topk_indices(gen, s1, s2, k, dev)
    d_out = torch.randn(1, s1, n1, 512, generator=gen).to(dev, BF16)
    kw = dict(query_rope=qr, key_rope=kr, sparse_mode=3)
    scale = 576 ** -0.5
    fwd = cann_attn.sparse_flash_attention(q, kv, kv, idx, scale, backend="triton", **kw)
    ref = cann_attn.sparse_flash_attention(q, kv, kv, idx, scale, backend="reference", **kw)
    assert_close_to_oracle(fwd.attention_out, ref.attention_out.double(), dtype=BF16, name="attention_out")
    torch.testing.assert_close(fwd.softmax_max, ref.softmax_max, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fwd.softmax_sum, ref.softmax_sum, rtol=2e-3, atol=1e-3)
    grads = cann_attn.sparse_flash_attention_grad(q, kv, kv, idx, d_out, ref.attention_out, ref.softmax_max,
                                                  ref.softmax_sum, scale, deterministic=deterministic,
                                                  backend="triton", **kw)
    golden = cann_attn.sparse_flash_attention_grad(q, kv, kv, idx, d_out, ref.attention_out, ref.softmax_max,
                                                   ref.softmax_sum, scale, backend="reference", **kw)
    for name in ("d_query", "d_key", "d_value", "d_query_rope", "d_key_rope"):
        assert_close_to_oracle(getattr(grads, name), getattr(golden, name).double(), dtype=BF16, name=name)
    if deterministic:
        again = cann_attn.sparse_flash_attention_grad(q, kv, kv, idx, d_out, ref.attention_out, ref.softmax_max,
                                                      ref.softmax_sum, scale, deterministic=True, backend="triton",
                                                      **kw)
        for a, b in zip(again, grads, strict=True):
            assert torch.equal(a, b)


def test_indexer_and_kl_real_size_bf16():
    """Indexer N = 64, D = 128 over S2 = 8192 keys, top-2048; KL backward with N1 = 128 main heads."""
    gen = torch.Generator().manual_seed(1)
    s1, s2, k = 64, 8192, 2048
    dev = torch.device("cuda")
    qi = torch.randn(1, s1, 64, 128, generator=gen).to(dev, BF16)
    ki = torch.randn(1, s2, 1, 128, generator=gen).to(dev, BF16)
    w = (torch.randn(1, s1, 64, generator=gen) * 64 ** -0.5 * 128 ** -0.5).to(dev, BF16)
    got = cann_attn.lightning_indexer(qi, ki, w, sparse_count=k, return_value=True, backend="triton")
    ref = cann_attn.lightning_indexer(qi, ki, w, sparse_count=k, return_value=True, backend="reference")
    # Same fp32 scores up to summation order: the selected sets agree almost everywhere.
    same = (got.sparse_indices == ref.sparse_indices).float().mean().item()
    assert same > 0.95, same
    q = torch.randn(1, s1, 128, 512, generator=gen).to(dev, BF16)
    qr = torch.randn(1, s1, 128, 64, generator=gen).to(dev, BF16)
    kv = torch.randn(1, s2, 1, 512, generator=gen).to(dev, BF16)
    kr = torch.randn(1, s2, 1, 64, generator=gen).to(dev, BF16)
    idx = ref.sparse_indices
    scale = 576 ** -0.5
    fwd = cann_attn.sparse_flash_attention(q, kv, kv, idx, scale, query_rope=qr, key_rope=kr, backend="reference")
    args = (q, kv, qi, ki, w, idx, fwd.softmax_max, fwd.softmax_sum, scale)
    res = cann_attn.sparse_lightning_indexer_grad_kl_loss(*args, query_rope=qr, key_rope=kr, backend="triton")
    gold = cann_attn.sparse_lightning_indexer_grad_kl_loss(*args, query_rope=qr, key_rope=kr, backend="reference")
    for name in ("d_query_index", "d_key_index", "d_weights"):
        assert_close_to_oracle(getattr(res, name), getattr(gold, name).double(), dtype=BF16, name=name)
    torch.testing.assert_close(res.loss, gold.loss, rtol=1e-3, atol=1e-3)
