"""Paged KV caches on a CUDA GPU at DeepSeek-V3.2 sizes (docs/semantics/paged-kv.md): the Triton sparse attention
and indexer kernels read the pages in place and give exactly what they give for the same keys laid out contiguously
(and what the reference gives, to its precision rule); FIA decode through a cache equals the contiguous call.
Run with `pytest -m gpu tests/test_gpu_paged.py`; skipped without CUDA."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import cann_attn
from cann_attn.testing.precision import assert_close_to_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BF16 = torch.bfloat16
PAGE = 128


def _pool(per_seq: list[torch.Tensor], gen: torch.Generator, table: torch.Tensor | None = None):
    """Shuffled block pool [block_num, PAGE, ...] (NaN where unused) and its int32 table (-1 where unused)."""
    needed = [-(-t.shape[0] // PAGE) for t in per_seq]
    blocks = sum(needed) + 3
    if table is None:
        perm = torch.randperm(blocks, generator=gen).tolist()
        table = torch.full((len(per_seq), max(needed) + 1), -1, dtype=torch.int32)
        k = 0
        for b, n in enumerate(needed):
            for j in range(n):
                table[b, j] = perm[k]
                k += 1
    cache = torch.full((blocks, PAGE, *per_seq[0].shape[1:]), float("nan"), dtype=per_seq[0].dtype)
    for b, t in enumerate(per_seq):
        for j in range(needed[b]):
            chunk = t[j * PAGE : (j + 1) * PAGE]
            cache[int(table[b, j]), : chunk.shape[0]] = chunk
    return cache.cuda(), table


def _sfa_inputs(q_lens, kv_lens, gen, heads=128, k=2048):
    latent = [torch.randn(n, 1, 512, generator=gen).to(BF16) for n in kv_lens]
    rope = [torch.randn(n, 1, 64, generator=gen).to(BF16) for n in kv_lens]
    cache, table = _pool(latent, gen)
    rope_cache, _ = _pool(rope, gen, table)
    rows = []
    for sq, skv in zip(q_lens, kv_lens, strict=True):
        for t in range(sq):
            allowed = skv - sq + t + 1
            chosen = torch.randperm(allowed, generator=gen)[:k]
            rows.append(torch.cat([chosen, torch.full((k - chosen.numel(),), -1)]))
    tokens = sum(q_lens)
    return dict(
        query=torch.randn(tokens, heads, 512, generator=gen).to(BF16).cuda(),
        query_rope=torch.randn(tokens, heads, 64, generator=gen).to(BF16).cuda(),
        indices=torch.stack(rows).to(torch.int32).unsqueeze(1).cuda(),
        key=torch.cat(latent).cuda(), key_rope=torch.cat(rope).cuda(), cache=cache, rope_cache=rope_cache,
        table=table.cuda(), q_cum=torch.tensor(q_lens).cumsum(0).tolist(), kv_lens=kv_lens,
    )


def _sfa(i, paged: bool, backend: str):
    common = dict(query_rope=i["query_rope"], actual_seq_lengths_query=i["q_cum"], layout="TND", sparse_mode=3,
                  backend=backend)
    if paged:
        return cann_attn.sparse_flash_attention(i["query"], i["cache"], i["cache"], i["indices"], 576 ** -0.5,
                                                key_rope=i["rope_cache"], block_table=i["table"],
                                                actual_seq_lengths_kv=i["kv_lens"], **common)
    return cann_attn.sparse_flash_attention(i["query"], i["key"], i["key"], i["indices"], 576 ** -0.5,
                                            key_rope=i["key_rope"],
                                            actual_seq_lengths_kv=torch.tensor(i["kv_lens"]).cumsum(0).tolist(),
                                            **common)


def _median_ms(fn, repeats=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1, 1], [8192, 6144, 4608, 3072]), ([64, 64], [4096, 3000])])
def test_sfa_paged_real_size_bf16(q_lens, kv_lens):
    i = _sfa_inputs(q_lens, kv_lens, torch.Generator().manual_seed(0))
    paged, contiguous = _sfa(i, True, "triton"), _sfa(i, False, "triton")
    for name, a, b in zip(paged._fields, paged, contiguous, strict=True):
        assert torch.equal(a, b), name
    reference = _sfa(i, False, "reference")
    assert_close_to_oracle(paged.attention_out, reference.attention_out.float(), None, dtype=BF16,
                           name="attention_out")
    t_paged = _median_ms(lambda: _sfa(i, True, "triton"))
    t_contiguous = _median_ms(lambda: _sfa(i, False, "triton"))
    record = {"case": f"sfa q={q_lens} kv={kv_lens}", "paged_ms": t_paged, "contiguous_ms": t_contiguous,
              "paged_over_contiguous": t_paged / t_contiguous, "gpu": torch.cuda.get_device_name()}
    print(json.dumps(record))
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "paged_gpu.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def test_indexer_paged_real_size_bf16():
    gen = torch.Generator().manual_seed(1)
    kv_lens, q_lens = [8192, 5000], [2, 3]
    keys = [torch.randn(n, 1, 128, generator=gen).to(BF16) for n in kv_lens]
    cache, table = _pool(keys, gen)
    q = torch.randn(sum(q_lens), 64, 128, generator=gen).to(BF16).cuda()
    w = torch.randn(sum(q_lens), 64, generator=gen).to(BF16).cuda()
    common = dict(layout="TND", actual_seq_lengths_query=torch.tensor(q_lens).cumsum(0).tolist(), sparse_count=2048,
                  backend="triton")
    paged = cann_attn.lightning_indexer(q, cache, w, block_table=table.cuda(), actual_seq_lengths_key=kv_lens,
                                        **common)
    contiguous = cann_attn.lightning_indexer(q, torch.cat(keys).cuda(), w,
                                             actual_seq_lengths_key=torch.tensor(kv_lens).cumsum(0).tolist(), **common)
    assert torch.equal(paged.sparse_indices, contiguous.sparse_indices)


def test_fia_decode_paged_bf16():
    gen = torch.Generator().manual_seed(2)
    kv_lens = [4096, 3000, 2048, 1000]
    k = torch.randn(4, 4096, 8, 128, generator=gen).to(BF16)
    v = torch.randn(4, 4096, 8, 128, generator=gen).to(BF16)
    q = torch.randn(4, 1, 32, 128, generator=gen).to(BF16).cuda()
    k_cache, table = _pool([k[b, :n].flatten(1) for b, n in enumerate(kv_lens)], gen)
    v_cache, _ = _pool([v[b, :n].flatten(1) for b, n in enumerate(kv_lens)], gen, table)
    common = dict(num_heads=32, num_key_value_heads=8, input_layout="BSND", actual_seq_lengths_kv=kv_lens,
                  scale=128 ** -0.5)
    paged = cann_attn.fused_infer_attention_score(q, k_cache, v_cache, block_table=table.cuda(), block_size=PAGE,
                                                  **common)[0]
    contiguous = cann_attn.fused_infer_attention_score(q, k.cuda(), v.cuda(), **common)[0]
    torch.testing.assert_close(paged, contiguous, rtol=0, atol=0)
