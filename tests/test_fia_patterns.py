"""Call patterns of public Ascend inference code, replayed (written from what those callers pass, not copied):

* context/sequence-parallel prefill (vllm-ascend, cann-recipes-infer): dense BNSD with ``softmax_lse_flag=True``
  per key block, blocks merged with the log-sum-exp rule, equals attention over all keys;
* decode over a padded KV cache with per-batch ``actual_seq_lengths_kv`` (vllm-ascend, MindSpeed-LLM inference);
* BSH prefill with GQA (``num_key_value_heads``) and the causal compressed mask (sparse_mode 3);
* vllm-ascend PrefillNoCache (TND causal prefill passing ``block_size`` without a block table), ChunkedPrefill (new
  tokens against the paged context), gpt-oss prefill with ``learnable_sink`` (v2, TND, D 64, sliding window; also
  cann-recipes-infer's gpt-oss), and MLA decode context parallelism (per-rank FIA lse merged by
  ``npu_attention_update``). vLLM's C8 NZ decode is in test_fia_inference.py.

References are PyTorch's scaled_dot_product_attention in float64 on the sliced tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import cann_attn.torch_npu as torch_npu
from cann_attn import compressed_mask
from paged_utils import paginate

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


# ---------------------------------------------------------------------------------------------- vllm-ascend, gpt-oss
def _sdpa_tnd(q, k, v, q_ends, kv_ends, scale, *, window=None):
    """Per-sequence float64 SDPA of TND tensors, causal aligned to the bottom right (sparse_mode 3), or a band of
    `window` keys ending at the diagonal (sparse_mode 4 with pre_tokens=window, next_tokens=0)."""
    outs = []
    for qs, qe, ks, ke in zip([0, *q_ends[:-1]], q_ends, [0, *kv_ends[:-1]], kv_ends, strict=True):
        sq, skv = qe - qs, ke - ks
        qi = q[qs:qe].double().permute(1, 0, 2)
        ki, vi = (x[ks:ke].double().permute(1, 0, 2).repeat_interleave(q.shape[1] // k.shape[1], 0)
                  for x in (k, v))
        rows = torch.arange(sq).view(-1, 1) + (skv - sq)
        cols = torch.arange(skv).view(1, -1)
        visible = cols <= rows
        if window is not None:
            visible &= cols >= rows - window
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=visible, scale=scale).permute(1, 0, 2))
    return torch.cat(outs)


def test_vllm_prefill_no_cache_passes_its_block_size():
    """vllm-ascend PrefillNoCache: TND causal prefill over the new tokens' own keys, with block_size (its cache's
    block size) and no block_table: the block size has no effect."""
    n, nkv, d, ends = 8, 2, 128, [5, 21, 40]
    q = torch.randn(40, n, d, generator=G).bfloat16()
    k, v = (torch.randn(40, nkv, d, generator=G).bfloat16() for _ in range(2))
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout="TND", scale=d**-0.5, sparse_mode=3,
        atten_mask=compressed_mask(3), actual_seq_lengths=ends, actual_seq_lengths_kv=ends, block_size=128)
    torch.testing.assert_close(out.double(), _sdpa_tnd(q, k, v, ends, ends, d**-0.5), atol=2e-2, rtol=2e-2)


def test_vllm_chunked_prefill_over_the_paged_cache():
    """vllm-ascend ChunkedPrefill: the new tokens of each request (TND) attend to its whole context in the paged
    cache (BnBsH, block_table, per-request kv lengths), causal from the bottom right (sparse_mode 3)."""
    n, nkv, d, page = 4, 2, 128, 128
    new, context = [3, 1, 6], [130, 40, 6]  # a request's kv length counts its new tokens
    q_ends = [3, 4, 10]
    q = torch.randn(10, n, d, generator=G).half()
    seqs = {name: [torch.randn(c, nkv * d, generator=G).half() for c in context] for name in ("key", "value")}
    caches, table = paginate(seqs, page, G)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, caches["key"], caches["value"], block_table=table, block_size=page, num_heads=n, num_key_value_heads=nkv,
        input_layout="TND", scale=d**-0.5, sparse_mode=3, atten_mask=compressed_mask(3), actual_seq_lengths=q_ends,
        actual_seq_lengths_kv=context)
    k = torch.cat(seqs["key"]).view(-1, nkv, d)
    v = torch.cat(seqs["value"]).view(-1, nkv, d)
    kv_ends = [sum(context[: i + 1]) for i in range(len(context))]
    assert new == [e - s for s, e in zip([0, *q_ends[:-1]], q_ends, strict=True)]
    torch.testing.assert_close(out.double(), _sdpa_tnd(q, k, v, q_ends, kv_ends, d**-0.5), atol=2e-3, rtol=2e-3)


def test_gpt_oss_sinks_prefill_sliding_window():
    """gpt-oss prefill (vllm-ascend attention_v1.py, cann-recipes-infer): v2, TND, head dim 64, GQA, learnable_sink,
    sliding-window layers sparse_mode 4 (pre_tokens = window, next_tokens = 0), the others sparse_mode 3."""
    n, nkv, d, ends, window = 8, 2, 64, [9, 30], 6
    q = torch.randn(30, n, d, generator=G).bfloat16()
    k, v = (torch.randn(30, nkv, d, generator=G).bfloat16() for _ in range(2))
    sinks = torch.randn(n, generator=G).bfloat16()
    for mode, kw in ((4, {"pre_tokens": window, "next_tokens": 0}), (3, {"next_tokens": 0})):
        out, _ = torch_npu.npu_fused_infer_attention_score_v2(
            q, k, v, num_query_heads=n, num_key_value_heads=nkv, input_layout="TND", softmax_scale=d**-0.5,
            sparse_mode=mode, atten_mask=compressed_mask(mode), actual_seq_qlen=ends, actual_seq_kvlen=ends,
            learnable_sink=sinks, **kw)
        # The sink as one more softmax column without a value: exp(sink) joins each row's denominator.
        ref = []
        for qs, qe in zip([0, *ends[:-1]], ends, strict=True):
            s = qe - qs
            qi = q[qs:qe].double().permute(1, 0, 2)
            ki, vi = (x[qs:qe].double().permute(1, 0, 2).repeat_interleave(n // nkv, 0) for x in (k, v))
            logits = (qi @ ki.transpose(1, 2)) * d**-0.5
            rows, cols = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
            visible = (cols <= rows) & ((cols >= rows - window) if mode == 4 else True)
            logits = logits.masked_fill(~visible, float("-inf"))
            column = sinks.double().view(n, 1, 1).expand(n, s, 1)
            p = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]
            ref.append((p @ vi).permute(1, 0, 2))
        torch.testing.assert_close(out.double(), torch.cat(ref), atol=2e-2, rtol=2e-2)


def test_dcp_mla_decode_merged_with_attention_update():
    """vllm-ascend decode context parallelism for MLA (mla_cp.py): each rank holds every other token of the
    latent cache (paged, BnNBsD), runs FIA with softmax_lse_flag=True (MLA D=512, beyond the documentation), and
    npu_attention_update merges the ranks. A request of one token has no keys on rank 1: its lse there is
    -3.40e38 and the merge gives it weight 0."""
    n, d, dr, page, ranks = 4, 512, 64, 16, 2
    lengths = [37, 1, 20]
    b = len(lengths)
    q, q_rope = torch.randn(b, n, 1, d, generator=G), torch.randn(b, n, 1, dr, generator=G)
    latent = [torch.randn(length, 1, d, generator=G) for length in lengths]
    rope = [torch.randn(length, 1, dr, generator=G) for length in lengths]
    outs, lses = [], []
    for r in range(ranks):
        shard = {"key": [x[r::ranks] for x in latent], "key_rope": [x[r::ranks] for x in rope]}
        caches, table = paginate(shard, page, G)
        caches = {name: c.permute(0, 2, 1, 3).contiguous() for name, c in caches.items()}  # BnNBsD
        out, lse = torch_npu.npu_fused_infer_attention_score(
            q, caches["key"], caches["key"], query_rope=q_rope, key_rope=caches["key_rope"], num_heads=n,
            num_key_value_heads=1, input_layout="BNSD", scale=(d + dr) ** -0.5, block_table=table, block_size=page,
            actual_seq_lengths_kv=[len(x) for x in shard["key"]], softmax_lse_flag=True)
        outs.append(out.permute(0, 2, 1, 3).reshape(-1, d))
        lses.append(lse.permute(0, 2, 1, 3).reshape(-1))
    assert (lses[1].view(b, n)[1] == -3.40e38).all()
    merged, _ = torch_npu.npu_attention_update(lses, outs, 0)
    for i in range(b):
        keys = torch.cat([latent[i], rope[i]], -1)[:, 0].double()
        logits = torch.cat([q[i, :, 0], q_rope[i, :, 0]], -1).double() @ keys.T * (d + dr) ** -0.5
        ref = torch.softmax(logits, -1) @ latent[i][:, 0].double()
        torch.testing.assert_close(merged.view(b, n, d)[i].double(), ref, atol=1e-4, rtol=1e-4)
