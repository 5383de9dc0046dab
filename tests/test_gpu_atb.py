"""The ATB attention operators (docs/operators/atb_attention.md) on a CUDA GPU through the Triton kernels: paged
decode equal to FIA decode over the same cache, and every op against the float64 oracle, with vLLM's argument
construction (host int32 lengths, -1 table padding, NaN in every slot nothing may read).
Run with `pytest -m gpu tests/test_gpu_atb.py`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import cann_attn.torch_npu as torch_npu
from cann_attn.testing.atb_oracle import paged_attention_oracle, self_attention_oracle, splitfuse_oracle
from cann_attn.testing.precision import assert_close_to_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PAGE = 128


def _caches(kv_lens, heads_kv, dim, dtype, gen):
    """[blocks, PAGE, KVN, D] key / value caches (NaN where unused, shuffled blocks) and the int32 table."""
    needed = [-(-n // PAGE) for n in kv_lens]
    blocks = sum(needed) + 2
    perm = torch.randperm(blocks, generator=gen).tolist()
    table = torch.full((len(kv_lens), max(needed) + 1), -1, dtype=torch.int32)
    key = torch.full((blocks, PAGE, heads_kv, dim), float("nan"), dtype=dtype)
    value = torch.full_like(key, float("nan"))
    k = 0
    for b, n in enumerate(kv_lens):
        for j in range(needed[b]):
            table[b, j] = perm[k]
            rows = min(PAGE, n - j * PAGE)
            key[perm[k], :rows] = torch.randn(rows, heads_kv, dim, generator=gen).to(dtype)
            value[perm[k], :rows] = torch.randn(rows, heads_kv, dim, generator=gen).to(dtype)
            k += 1
    return key, value, table


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_decode_equals_fia_decode_and_the_oracle(dtype):
    gen = torch.Generator().manual_seed(1)
    kv_lens, heads, heads_kv, d = [1000, 1, 257, 640], 32, 8, 128
    key, value, table = _caches(kv_lens, heads_kv, d, dtype, gen)
    query = torch.randn(len(kv_lens), heads, d, generator=gen).to(dtype)
    lens = torch.tensor(kv_lens, dtype=torch.int32)  # on the host, as vllm-ascend passes them
    dev = {"key": key.cuda(), "value": value.cuda(), "table": table.cuda(), "query": query.cuda()}
    out = torch.empty(len(kv_lens), heads, d, dtype=dtype, device="cuda")
    torch_npu._npu_paged_attention(dev["query"], dev["key"], dev["value"], heads_kv, heads, d ** -0.5, dev["table"],
                                   lens, out)
    fia, _ = torch_npu.npu_fused_infer_attention_score(
        dev["query"].unsqueeze(1), dev["key"].flatten(2), dev["value"].flatten(2), block_table=dev["table"],
        block_size=PAGE, actual_seq_lengths_kv=kv_lens, num_heads=heads, num_key_value_heads=heads_kv,
        scale=d ** -0.5, input_layout="BSND")
    assert torch.equal(out, fia[:, 0])
    golden = paged_attention_oracle(query, key, value, heads_kv, heads, d ** -0.5, table, kv_lens)
    assert_close_to_oracle(out.cpu(), golden, name="out")


def test_splitfuse_and_flash_attention_against_the_oracle():
    gen = torch.Generator().manual_seed(2)
    dtype, heads, heads_kv, d = torch.float16, 8, 2, 128
    q_lens, kv_lens = [64, 100, 1, 1], [300, 100, 129, 7]
    key, value, table = _caches(kv_lens, heads_kv, d, dtype, gen)
    upper = ~torch.ones(512, 512, dtype=torch.bool).tril_()
    causal = torch.zeros(512, 512, dtype=dtype).masked_fill_(upper, float("-inf"))
    positions = [p for ql, cl in zip(q_lens, kv_lens, strict=True) for p in range(cl - ql, cl)]
    mask = causal.index_select(0, torch.tensor(positions))
    query = torch.randn(sum(q_lens), heads, d, generator=gen).to(dtype)
    out = torch.empty(sum(q_lens), heads, d, dtype=dtype, device="cuda")
    torch_npu._npu_paged_attention_splitfuse(
        query.cuda(), key.cuda(), value.cuda(), table.cuda(), torch.tensor(kv_lens, dtype=torch.int32), mask.cuda(),
        torch.tensor(q_lens, dtype=torch.int32), heads_kv, heads, d ** -0.5, out)
    golden = splitfuse_oracle(query, key, value, table, kv_lens, mask, q_lens, heads_kv, heads, d ** -0.5)
    assert_close_to_oracle(out.cpu(), golden, name="splitfuse out")

    seq = [200, 33, 256]
    q = torch.randn(sum(seq), heads, d, generator=gen).to(dtype)
    k, v = (torch.randn(sum(seq), heads_kv, d, generator=gen).to(dtype) for _ in range(2))
    seq_len = torch.tensor(seq, dtype=torch.int32)
    for masked in (True, False):
        out = torch.empty(sum(seq), heads, d, dtype=dtype, device="cuda")
        if masked:
            torch_npu._npu_flash_attention(q.cuda(), k.cuda(), v.cuda(), causal.cuda(), seq_len, d ** -0.5, heads,
                                           heads_kv, out)
        else:
            torch_npu._npu_flash_attention_unpad(q.cuda(), k.cuda(), v.cuda(), seq_len, d ** -0.5, heads, heads_kv,
                                                 out)
        golden = self_attention_oracle(q, k, v, seq, d ** -0.5, mask=causal if masked else None)
        assert_close_to_oracle(out.cpu(), golden, name=f"flash attention (mask: {masked})")
