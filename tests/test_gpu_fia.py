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
    cuda = {key: (val.cuda() if isinstance(val, torch.Tensor) and key != "atten_mask" else val)
            for key, val in kw.items()}
    if "learnable_sink" in kw:  # a v2 parameter
        out, lse = cann_attn.fused_infer_attention_score_v2(
            q.cuda(), k.cuda(), v.cuda(), **{{"num_heads": "num_query_heads", "scale": "softmax_scale",
                                             "softmax_lse_flag": "return_softmax_lse", "actual_seq_lengths":
                                             "actual_seq_qlen", "actual_seq_lengths_kv": "actual_seq_kvlen"}
                                            .get(key, key): val for key, val in cuda.items()})
    else:
        out, lse = cann_attn.fused_infer_attention_score(q.cuda(), k.cuda(), v.cuda(), **cuda)
    assert counts[("fused_infer_attention_score", "triton")] > before, "did not run on Triton"
    golden, golden_lse = fia_oracle(q, k, v, **kw)
    assert_close_to_oracle(out.cpu(), golden, dtype=q.dtype, name="attention_out")
    if kw.get("softmax_lse_flag"):
        finite = torch.isfinite(golden_lse)  # rows without keys: +inf (docs/semantics/invalid-rows.md)
        assert torch.equal(lse.cpu()[~finite], golden_lse[~finite].float())
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


def test_learnable_sink_tnd_sliding_window():
    """gpt-oss prefill: v2 learnable_sink, TND, D=64 GQA, sparse_mode 4 with a window (Triton's sink merge)."""
    g = torch.Generator().manual_seed(3)
    t, n, nkv, d = 1536, 16, 4, 64
    q = torch.randn(t, n, d, generator=g).bfloat16()
    k, v = (torch.randn(t, nkv, d, generator=g).bfloat16() for _ in range(2))
    _check(q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout="TND", scale=1 / math.sqrt(d), sparse_mode=4,
           atten_mask=cann_attn.compressed_mask(4), pre_tokens=128, next_tokens=0, actual_seq_lengths=[500, 1536],
           actual_seq_lengths_kv=[500, 1536], learnable_sink=torch.randn(n, generator=g).bfloat16(),
           softmax_lse_flag=True)


def test_decode_int4_cache():
    """int4 key/value packed in int32 (unpacked, then the Triton decode)."""
    g = torch.Generator().manual_seed(4)
    b, n, nkv, s, d = 4, 32, 8, 2048, 128
    q = torch.randn(b, n, 1, d, generator=g).half()
    k, v = (torch.randint(-2**31, 2**31 - 1, (b, nkv, s, d // 8), generator=g, dtype=torch.int64).to(torch.int32)
            for _ in range(2))
    scale = (0.01 + 0.02 * torch.rand(1, nkv * d, generator=g)).half()
    _check(q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale=1 / math.sqrt(d),
           key_antiquant_scale=scale, value_antiquant_scale=scale, actual_seq_lengths_kv=[2048, 0, 77, 1500],
           softmax_lse_flag=True)
