"""Float64 oracle of the ATB attention operators (docs/operators/atb_attention.md), written from the ATB
PagedAttentionOperation / SelfAttentionOperation descriptions and op-plugin's test goldens, never from the kernels:
one query token at a time, keys looked up position by position through the block table, scores
q.k * scale + mask, a plain softmax, then the values."""

from __future__ import annotations

import torch


def _attend_token(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """q [N, D], keys [L, KVN, D], values [L, KVN, Dv], bias [L] or None -> [N, Dv] float64 (zeros for L = 0)."""
    heads, heads_kv = q.shape[0], keys.shape[1]
    if keys.shape[0] == 0:
        return torch.zeros(heads, values.shape[-1], dtype=torch.float64)
    group = heads // heads_kv
    k = keys.double().repeat_interleave(group, dim=1)  # [L, N, D]: query head h reads KV head h // group
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nd,lnd->nl", q.double(), k) * scale
    if bias is not None:
        scores = scores + bias.double()
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("nl,lnd->nd", probs, v)


def _paged_keys(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """[length, KVN, D]: logical key p of the sequence lives at block table_row[p // bs], slot p % bs."""
    block_size = cache.shape[1]
    return torch.stack([cache[int(table_row[p // block_size]), p % block_size] for p in range(length)]) \
        if length else cache.new_zeros((0, *cache.shape[2:]))


def paged_attention_oracle(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                           context_lens) -> torch.Tensor:
    """[T, N, Dv] float64 of _npu_paged_attention: token t attends to the first context_lens[t] keys of row t."""
    outs = []
    for t in range(query.shape[0]):
        length = int(context_lens[t])
        keys = _paged_keys(key_cache, block_table[t], length)
        values = _paged_keys(value_cache, block_table[t], length)
        outs.append(_attend_token(query[t], keys, values, scale_value, None))
    return torch.stack(outs) if outs else torch.zeros(0, num_heads, value_cache.shape[-1], dtype=torch.float64)


def splitfuse_oracle(query, key_cache, value_cache, block_table, context_lens, mask, seq_len, num_kv_heads,
                     num_heads, scale_value) -> torch.Tensor:
    """[T, N, Dv] float64 of _npu_paged_attention_splitfuse: packed row t (of sequence b) attends to all
    context_lens[b] keys of b with mask[t, :context_lens[b]] added to its scaled scores."""
    outs, t = [], 0
    for b in range(len(seq_len)):
        length = int(context_lens[b])
        keys = _paged_keys(key_cache, block_table[b], length)
        values = _paged_keys(value_cache, block_table[b], length)
        for _ in range(int(seq_len[b])):
            outs.append(_attend_token(query[t], keys, values, scale_value, mask[t, :length]))
            t += 1
    return torch.stack(outs)


def self_attention_oracle(query, key, value, seq_len, scale_value, num_heads=None, num_kv_heads=None,
                          mask=None) -> torch.Tensor:
    """[T, N, Dv] float64 of _npu_flash_attention(_unpad): packed sequence b's token i attends to the sequence's
    keys with mask[(b,) i, :len] (the top-left corner of a [maxS, maxS] or [B, maxS, maxS] mask) added. The head
    counts are the tensors' (num_heads / num_kv_heads, when given, must agree)."""
    assert num_heads in (None, query.shape[1]) and num_kv_heads in (None, 0, key.shape[1])
    outs, start = [], 0
    for b in range(len(seq_len)):
        length = int(seq_len[b])
        keys, values = key[start:start + length], value[start:start + length]
        for i in range(length):
            bias = None
            if mask is not None:
                bias = (mask if mask.dim() == 2 else mask[b])[i, :length]
            outs.append(_attend_token(query[start + i], keys, values, scale_value, bias))
        start += length
    return torch.stack(outs)
