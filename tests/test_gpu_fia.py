"""FusedInferAttentionScore / IncreFlashAttention on a CUDA GPU: the Triton kernels (backend "auto" on CUDA tensors)
against the float64 oracle at realistic sizes, and the log-sum-exp merge of two key blocks. Run with
`pytest -m gpu tests/test_gpu_fia.py`; skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

import cann_attn
from cann_attn.testing.fia_oracle import fia_oracle
from cann_attn.testing.precision import assert_close_to_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _check(q, k, v, **kw):
    counts = cann_attn.backends.dispatch_counts
    before = counts[("fused_infer_attention_score", "triton")]
    out, lse = cann_attn.fused_infer_attention_score(q.cuda(), k.cuda(), v.cuda(), **{
        key: (val.cuda() if isinstance(val, torch.Tensor) and key != "atten_mask" else val) for key, val in kw.items()})
    assert counts[("fused_infer_attention_score", "triton")] > before, "did not run on Triton"
    golden, golden_lse = fia_oracle(q, k, v, **kw)
    assert_close_to_oracle(out.cpu(), golden, dtype=q.dtype, name="attention_out")
    if kw.get("softmax_lse_flag"):
        finite = torch.isfinite(golden_lse)
        assert torch.equal(torch.isneginf(lse.cpu()), ~finite)
        torch.testing.assert_close(lse.cpu().double()[finite], golden_lse[finite], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_causal_gqa_lse(dtype):
    g = torch.Generator().manual_seed(0)
    b, n, nkv, s, d = 2, 16, 4, 1024, 128
    q = torch.randn(b, n, s, d, generator=g).to(dtype)
    k, v = (torch.randn(b, nkv, s, d, generator=g).to(dtype) for _ in range(2))
    _check(q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale=1 / math.sqrt(d),
           sparse_mode=3, atten_mask=cann_attn.compressed_mask(3), actual_seq_lengths=[1024, 700],
           actual_seq_lengths_kv=[1024, 900], softmax_lse_flag=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_per_batch_lengths(dtype):
    g = torch.Generator().manual_seed(1)
    b, n, nkv, s, d = 8, 32, 8, 4096, 128
    q = torch.randn(b, 1, n * d, generator=g).to(dtype)
    k, v = (torch.randn(b, s, nkv * d, generator=g).to(dtype) for _ in range(2))
    _check(q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout="BSH", scale=1 / math.sqrt(d),
           actual_seq_lengths_kv=[4096, 1, 2000, 3333, 0, 17, 4095, 512], softmax_lse_flag=True)


def test_decode_antiquant_int8_cache():
    g = torch.Generator().manual_seed(2)
    b, n, nkv, s, d = 4, 32, 8, 2048, 128
    q = torch.randn(b, n, 1, d, generator=g).half()
    k, v = (torch.randint(-127, 128, (b, nkv, s, d), generator=g).to(torch.int8) for _ in range(2))
    scale = (0.01 + 0.02 * torch.rand(2, nkv, 1, d, generator=g)).half()
    _check(q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale=1 / math.sqrt(d),
           antiquant_scale=scale)
