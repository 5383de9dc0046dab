"""Call patterns of public Ascend inference code, replayed (written from what those callers pass, not copied):

* context/sequence-parallel prefill (vllm-ascend, cann-recipes-infer): dense BNSD with ``softmax_lse_flag=True``
  per key block, blocks merged with the log-sum-exp rule, equals attention over all keys;
* decode over a padded KV cache with per-batch ``actual_seq_lengths_kv`` (vllm-ascend, MindSpeed-LLM inference);
* BSH prefill with GQA (``num_key_value_heads``) and the causal compressed mask (sparse_mode 3).

References are PyTorch's scaled_dot_product_attention in float64 on the sliced tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import cann_attn.torch_npu as torch_npu
from cann_attn import compressed_mask

G = torch.Generator().manual_seed(7)


def merge_two(o1, lse1, o2, lse2):
    """The ring-attention merge of the FIA documentation: weights exp(lse_i - max). FIA marks rows without keys
    with lse = +inf ("数据为inf的代表无效数据"), so a caller first turns those into log 0."""
    lse1, lse2 = (torch.where(torch.isposinf(x), -torch.inf, x) for x in (lse1, lse2))
    lse_max = torch.maximum(lse1, lse2)
    lse_max = torch.where(torch.isneginf(lse_max), torch.zeros_like(lse_max), lse_max)
    w1, w2 = torch.exp(lse1 - lse_max), torch.exp(lse2 - lse_max)
    total = w1 + w2
    out = (w1 * o1 + w2 * o2) / torch.where(total > 0, total, torch.ones_like(total))
    return out, lse_max + torch.log(total)


def test_lse_blocks_merge_to_full_attention():
    b, n, s, d = 2, 4, 24, 32
    q, k, v = (torch.randn(b, n, s, d, generator=G, dtype=torch.float32) for _ in range(3))
    scale = 1 / math.sqrt(d)
    kw = {"num_heads": n, "input_layout": "BNSD", "scale": scale, "softmax_lse_flag": True}
    full, full_lse = torch_npu.npu_fused_infer_attention_score(q, k, v, **kw)
    half = s // 2
    o1, l1 = torch_npu.npu_fused_infer_attention_score(q, k[:, :, :half], v[:, :, :half], **kw)
    o2, l2 = torch_npu.npu_fused_infer_attention_score(q, k[:, :, half:], v[:, :, half:], **kw)
    merged, merged_lse = merge_two(o1.double(), l1.double(), o2.double(), l2.double())
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
    torch.testing.assert_close(merged, reference, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(full.double(), reference, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(merged_lse, full_lse.double(), atol=2e-5, rtol=2e-5)


def test_causal_lse_blocks_merge_with_empty_rows():
    """Causal ring step: the second key block is invisible to the first half of the queries (empty rows give
    lse = +inf, the documented invalid-row mark, and output 0, and contribute nothing to the merge)."""
    b, n, s, d = 1, 2, 16, 16
    q, k, v = (torch.randn(b, n, s, d, generator=G, dtype=torch.float32) for _ in range(3))
    scale = 0.3
    half = s // 2
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)  # True = masked
    kw = {"num_heads": n, "input_layout": "BNSD", "scale": scale, "softmax_lse_flag": True, "sparse_mode": 0,
          "next_tokens": 2147483647}
    o1, l1 = torch_npu.npu_fused_infer_attention_score(q, k[:, :, :half], v[:, :, :half],
                                                       atten_mask=causal[:, :half].contiguous(), **kw)
    o2, l2 = torch_npu.npu_fused_infer_attention_score(q, k[:, :, half:], v[:, :, half:],
                                                       atten_mask=causal[:, half:].contiguous(), **kw)
    assert torch.isposinf(l2[:, :, : half - 1]).all() and (o2[:, :, : half - 1] == 0).all()
    merged, _ = merge_two(o1.double(), l1.double(), o2.double(), l2.double())
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=~causal, scale=scale)
    torch.testing.assert_close(merged, reference, atol=2e-5, rtol=2e-5)


def test_decode_with_per_batch_kv_lengths():
    b, n, nkv, s_max, d = 4, 8, 2, 40, 32
    q = torch.randn(b, 1, n * d, generator=G).half()  # BSH, one new token per sequence
    cache_k = torch.randn(b, s_max, nkv * d, generator=G).half()
    cache_v = torch.randn(b, s_max, nkv * d, generator=G).half()
    lengths = [40, 1, 17, 29]
    scale = 1 / math.sqrt(d)
    out, _ = torch_npu.npu_fused_infer_attention_score(q, cache_k, cache_v, num_heads=n, num_key_value_heads=nkv,
                                                       input_layout="BSH", scale=scale,
                                                       actual_seq_lengths_kv=lengths)
    ifa = torch_npu.npu_incre_flash_attention(q, cache_k, cache_v, num_heads=n, num_key_value_heads=nkv,
                                              input_layout="BSH", scale_value=scale, actual_seq_lengths=lengths)
    assert torch.equal(out, ifa)
    for i, length in enumerate(lengths):
        qi = q[i].double().view(1, n, d).transpose(0, 1).unsqueeze(0)  # [1, N, 1, D]
        ki = cache_k[i, :length].double().view(length, nkv, d).permute(1, 0, 2).unsqueeze(0)
        vi = cache_v[i, :length].double().view(length, nkv, d).permute(1, 0, 2).unsqueeze(0)
        ref = F.scaled_dot_product_attention(qi, ki.repeat_interleave(n // nkv, 1), vi.repeat_interleave(n // nkv, 1),
                                             scale=scale)
        torch.testing.assert_close(out[i].double().view(1, n, d), ref[0].transpose(0, 1), atol=2e-3, rtol=2e-3)


def test_bsh_gqa_causal_prefill():
    b, n, nkv, s, d = 2, 8, 2, 20, 16
    q = torch.randn(b, s, n * d, generator=G).bfloat16()
    k = torch.randn(b, s, nkv * d, generator=G).bfloat16()
    v = torch.randn(b, s, nkv * d, generator=G).bfloat16()
    scale = 1 / math.sqrt(d)
    out, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=n, num_key_value_heads=nkv,
                                                       input_layout="BSH", scale=scale, sparse_mode=3,
                                                       atten_mask=compressed_mask(3),
                                                       actual_seq_lengths=[s] * b, actual_seq_lengths_kv=[s] * b)
    qd = q.double().view(b, s, n, d).transpose(1, 2)
    kd = k.double().view(b, s, nkv, d).transpose(1, 2).repeat_interleave(n // nkv, 1)
    vd = v.double().view(b, s, nkv, d).transpose(1, 2).repeat_interleave(n // nkv, 1)
    ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(1, 2).reshape(b, s, -1)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
