"""The ATB attention operators torch_npu exposes (op-plugin op_plugin/ops/atb/): PagedAttentionOperation (paged
decode, and its splitfuse form for chunked prefill) and SelfAttentionOperation PA_ENCODER (packed prompts with or
without an additive mask) (docs/operators/atb_attention.md).

They compute softmax(scale * Q K^T + mask) V per sequence on packed tokens [tokens, heads, head_size], with GQA
(num_heads a multiple of num_kv_heads; 0 = num_heads) and a value head size that may differ from the key's (MLA
style), in float16 / bfloat16, into the caller's `out` [tokens, num_heads, head_size_v], which is written once every
argument has been validated. The additive mask is a pse (problem/pse.py, type 0: added after the scale); paged caches
follow the page-table rule (problem/page_table.py) and the attention runs on `infer_attention.attend` /
`attend_pages`, the kernels of FusedInferAttentionScore.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ParamInvalidError, ParamNullptrError, require, require_finite, require_int
from ..problem.page_table import BlockSizeRule, page_table
from ..traceable import traced_as_custom_op
from .flash_attention_score import INT_MAX
from .infer_attention import QuantPlan, attend, attend_pages
from .out_tensors import check_out_tensor
from .paged_infer import CacheShape, PagedKv, length_groups

__all__ = ["atb_flash_attention", "atb_flash_attention_unpad", "atb_paged_attention", "atb_paged_attention_splitfuse"]

ATB_DTYPES = (torch.float16, torch.bfloat16)
# PagedAttentionOperation: "block_size % 16 == 0, recommended 128" (ATB docs, constraints); no upper bound is
# documented for the Atlas A2 / A3 products.
ATB_BLOCK_SIZES = BlockSizeRule(multiple=16, maximum=INT_MAX)


def _heads(num_heads, num_kv_heads) -> tuple[int, int]:
    """(num_heads, KV heads): num_kv_heads = 0 means num_heads; num_heads must be a multiple of it (GQA)."""
    num_heads = require_int(num_heads, "num_heads")
    require(num_heads > 0, "num_heads", "a positive int", num_heads)
    kv = require_int(num_kv_heads, "num_kv_heads")
    require(kv >= 0, "num_kv_heads", "an int >= 0 (0: num_heads)", kv)
    kv = kv or num_heads
    require(num_heads % kv == 0, "num_kv_heads", f"a divisor of num_heads={num_heads}", num_kv_heads)
    return num_heads, kv


def _tokens(tensor, param: str, heads: int, like: Tensor | None = None, dim: int | None = None, *,
            cache: bool = False) -> Tensor:
    """A [tokens, heads, head_size] (a `cache`: [num_blocks, block_size, heads, head_size]) float16 / bfloat16
    tensor, of `like`'s dtype and device when given."""
    if tensor is None:
        raise ParamNullptrError(f"{param}: required, got None")
    require(isinstance(tensor, Tensor), param, "a torch.Tensor", tensor)
    rank = 4 if cache else 3
    shape = "[num_blocks, block_size, num_kv_heads, head_size]" if cache else "[tokens, heads, head_size]"
    require(tensor.dim() == rank and tensor.shape[-2] == heads and tensor.shape[-1] > 0, param,
            f"{shape} with {heads} heads", tensor)
    if like is None:
        require(tensor.dtype in ATB_DTYPES, param, "dtype float16 or bfloat16", tensor)
    else:
        require(tensor.dtype == like.dtype, param, f"the query's dtype {like.dtype}", tensor)
        require(tensor.device == like.device, param, f"the query's device {like.device}", tensor)
    if dim is not None:
        require(tensor.shape[-1] == dim, param, f"head_size {dim} (the query's)", tensor)
    return tensor


def _lengths(lengths, param: str, count: int | None = None) -> list[int]:
    """A 1-D int32 tensor of non-negative lengths (host or device; read once on the host)."""
    if lengths is None:
        raise ParamNullptrError(f"{param}: required, got None")
    require(isinstance(lengths, Tensor) and lengths.dtype == torch.int32 and lengths.dim() == 1, param,
            "a 1-D int32 tensor", lengths)
    if count is not None:
        require(lengths.numel() == count, param, f"{count} entries, one per sequence", lengths)
    values = lengths.tolist()
    if any(v < 0 for v in values):
        raise ParamInvalidError(f"{param}: expected lengths >= 0, got {values}")
    return values


def _scale(scale_value) -> float:
    return require_finite(scale_value, "scale_value")


def _check_out(out, shape: tuple[int, ...], query: Tensor, inputs: dict) -> Tensor:
    """`out` must be the [tokens, num_heads, head_size_v] tensor of the query's dtype and device, sharing no memory
    with `inputs` (ops/out_tensors.py); it is checked before anything is computed and written only at the end."""
    return check_out_tensor(out, "out", shape=shape, dtype=query.dtype, device=query.device, inputs=inputs)


def _additive_mask(mask, query: Tensor, rows: int, cols: int, batch: int | None) -> Tensor:
    """The additive mask (query dtype): [rows >= ..., cols >= ...] (shared), or [batch, rows, cols] when `batch`."""
    if mask is None:
        raise ParamNullptrError("mask: required, got None")
    require(isinstance(mask, Tensor), "mask", "a torch.Tensor", mask)
    require(mask.dtype == query.dtype, "mask", f"an additive mask of the query's dtype {query.dtype}", mask)
    shared = mask.dim() == 2 and mask.shape[0] >= rows and mask.shape[1] >= cols
    per_batch = (batch is not None and mask.dim() == 3 and mask.shape[0] == batch and mask.shape[1] >= rows
                 and mask.shape[2] >= cols)
    expected = f"[>= {rows}, >= {cols}]" + ("" if batch is None else f" or [{batch}, >= {rows}, >= {cols}]")
    require(shared or per_batch, "mask", expected, mask)
    return mask.to(query.device)


def _common(heads_kv: int, scale: float, query: Tensor, backend: str, op: str) -> dict:
    return {"heads_kv": heads_kv, "scale": scale, "sparse_mode": 0, "pre_tokens": INT_MAX, "next_tokens": INT_MAX,
            "plan": QuantPlan(query.dtype), "backend": backend, "op": op}


def _paged_caches(key_cache, value_cache, block_table, kv_lengths: list[int], query: Tensor, heads_kv: int) -> PagedKv:
    """The [num_blocks, block_size, num_kv_heads, head_size(_v)] caches with their block table
    (docs/semantics/paged-kv.md: only a sequence's first ceil(L / block_size) entries are read)."""
    key_cache = _tokens(key_cache, "key_cache", heads_kv, like=query, dim=query.shape[-1], cache=True)
    value_cache = _tokens(value_cache, "value_cache", heads_kv, like=query, cache=True)
    require(value_cache.shape[:2] == key_cache.shape[:2], "value_cache",
            f"the key cache's blocks and block size {list(key_cache.shape[:2])}", value_cache)
    num_blocks, block_size = key_cache.shape[:2]
    pages = page_table(block_table, block_size=block_size, block_count=num_blocks, kv_lengths=kv_lengths,
                       batch=len(kv_lengths), rule=ATB_BLOCK_SIZES, lengths_param="context_lens",
                       block_size_param="key_cache", cache_param="key_cache")
    shape = CacheShape(num_blocks, block_size, heads_kv, key_cache.shape[-1], token_dim=1)
    # As FIA's BnBsH caches [num_blocks, block_size, KVN * D] (views of vLLM's contiguous caches).
    return PagedKv(pages, key_cache.flatten(2), value_cache.flatten(2), None, shape)


def _rows(tensor: Tensor, start: int, count: int, length: int) -> Tensor:
    """[count, N, length, D] view of `count` consecutive packed sequences of `length` tokens from `start`."""
    return tensor[start : start + count * length].unflatten(0, (count, length)).transpose(1, 2)


@traced_as_custom_op
def atb_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_kv_heads: int, num_heads: int,
                        scale_value: float, block_table: Tensor, context_lens: Tensor, out: Tensor, *,
                        backend: str = "auto") -> Tensor:
    """PagedAttentionOperation (decode): query token t attends to the first context_lens[t] keys of sequence t,
    found through row t of block_table; out [T, num_heads, head_size_v] (docs/operators/atb_attention.md)."""
    num_heads, heads_kv = _heads(num_heads, num_kv_heads)
    query = _tokens(query, "query", num_heads)
    scale = _scale(scale_value)
    lengths = _lengths(context_lens, "context_lens", query.shape[0])
    pages = _paged_caches(key_cache, value_cache, block_table, lengths, query, heads_kv)
    result = torch.zeros(query.shape[0], num_heads, value_cache.shape[-1], dtype=query.dtype, device=query.device)
    _check_out(out, tuple(result.shape), query, {"query": query, "key_cache": key_cache, "value_cache": value_cache,
                                                 "block_table": block_table, "context_lens": context_lens})
    if query.shape[0]:
        attend_pages(pages, query.unsqueeze(2), result.unsqueeze(2), atten_mask=None, mask_views=None,
                     act_q=[1] * query.shape[0], act_kv=lengths, pse_shift=None,
                     **_common(heads_kv, scale, query, backend, "atb_paged_attention"))
    return out.copy_(result)


@traced_as_custom_op
def atb_paged_attention_splitfuse(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                                  context_lens: Tensor, mask: Tensor, seq_len: Tensor, num_kv_heads: int,
                                  num_heads: int, scale_value: float, out: Tensor, *, backend: str = "auto") -> Tensor:
    """PagedAttentionOperation, splitfuse (chunked prefill): sequence b's seq_len[b] packed query tokens are the
    last of its context_lens[b] keys in the paged cache; the token at row t of the packed query adds
    mask[t, :context_lens[b]] to its scaled scores (docs/operators/atb_attention.md)."""
    num_heads, heads_kv = _heads(num_heads, num_kv_heads)
    query = _tokens(query, "query", num_heads)
    scale = _scale(scale_value)
    q_lens = _lengths(seq_len, "seq_len")
    kv_lens = _lengths(context_lens, "context_lens", len(q_lens))
    require(sum(q_lens) == query.shape[0], "seq_len", f"lengths summing to the query's {query.shape[0]} tokens",
            q_lens)
    for b, (sq, skv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if sq > skv:
            raise ParamInvalidError(f"seq_len: sequence {b} has {sq} query tokens but context_lens[{b}] = {skv} "
                                    "keys (its chunk is the last seq_len of them)")
    pages = _paged_caches(key_cache, value_cache, block_table, kv_lens, query, heads_kv)
    mask = _additive_mask(mask, query, query.shape[0], max(kv_lens, default=0), None)
    result = torch.zeros(query.shape[0], num_heads, value_cache.shape[-1], dtype=query.dtype, device=query.device)
    _check_out(out, tuple(result.shape), query, {"query": query, "key_cache": key_cache, "value_cache": value_cache,
                                                 "block_table": block_table, "context_lens": context_lens,
                                                 "mask": mask, "seq_len": seq_len})
    common = _common(heads_kv, scale, query, backend, "atb_paged_attention_splitfuse")
    start = 0
    # Consecutive sequences with equal query lengths (every decode of a batch) run as one batch of [c, N, s, D].
    for group in length_groups(q_lens, [0] * len(q_lens)):
        sq, count = q_lens[group.start], len(group)
        if sq:
            rows = mask[start : start + count * sq].unflatten(0, (count, 1, sq))
            attend_pages(pages.select(group), _rows(query, start, count, sq), _rows(result, start, count, sq),
                         atten_mask=None, mask_views=None, act_q=[sq] * count,
                         act_kv=kv_lens[group.start : group.stop], pse_shift=rows.expand(-1, num_heads, -1, -1),
                         **common)
        start += count * sq
    return out.copy_(result)


def _self_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out, *, backend: str,
                    op: str) -> Tensor:
    """SelfAttentionOperation PA_ENCODER: packed sequences attend to themselves (keys and values packed like the
    query), with an additive mask read from its top-left corner when given."""
    num_heads, heads_kv = _heads(num_heads, num_kv_heads)
    query = _tokens(query, "query", num_heads)
    key = _tokens(key, "key", heads_kv, like=query, dim=query.shape[-1])
    value = _tokens(value, "value", heads_kv, like=query)
    scale = _scale(scale_value)
    lengths = _lengths(seq_len, "seq_len")
    tokens = query.shape[0]
    require(sum(lengths) == tokens, "seq_len", f"lengths summing to the query's {tokens} tokens", lengths)
    for name, tensor in (("key", key), ("value", value)):
        require(tensor.shape[0] == tokens, name, f"{tokens} tokens (the query's)", tensor)
    longest = max(lengths, default=0)
    if mask is not None:
        mask = _additive_mask(mask, query, longest, longest, len(lengths))
    result = torch.zeros(tokens, num_heads, value.shape[-1], dtype=query.dtype, device=query.device)
    _check_out(out, tuple(result.shape), query, {"query": query, "key": key, "value": value, "mask": mask,
                                                 "seq_len": seq_len})
    common = _common(heads_kv, scale, query, backend, op)
    start = 0
    for group in length_groups(lengths, lengths):
        length, count = lengths[group.start], len(group)
        if length:
            pse = None
            if mask is not None:
                shared = mask.unsqueeze(0) if mask.dim() == 2 else mask[group.start : group.stop]
                pse = shared.unsqueeze(1).expand(-1, num_heads, -1, -1)
            attend(_rows(query, start, count, length), _rows(key, start, count, length),
                   _rows(value, start, count, length), _rows(result, start, count, length), atten_mask=None,
                   mask_views=None, act_q=[length] * count, act_kv=[length] * count, pse_shift=pse, **common)
        start += count * length
    return out.copy_(result)


@traced_as_custom_op
def atb_flash_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, seq_len: Tensor, scale_value: float,
                        num_heads: int, num_kv_heads: int, out: Tensor, *, backend: str = "auto") -> Tensor:
    """SelfAttentionOperation PA_ENCODER with an additive mask (MASK_TYPE_NORM): sequence b adds
    mask[:seq_len[b], :seq_len[b]] (a [maxS, maxS] mask shared by all, or [B, maxS, maxS]) to its scaled scores
    (docs/operators/atb_attention.md)."""
    if mask is None:
        raise ParamNullptrError("mask: required, got None (_npu_flash_attention_unpad takes none)")
    return _self_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out,
                           backend=backend, op="atb_flash_attention")


@traced_as_custom_op
def atb_flash_attention_unpad(query: Tensor, key: Tensor, value: Tensor, seq_len: Tensor, scale_value: float,
                              num_heads: int, num_kv_heads: int, out: Tensor, *, backend: str = "auto") -> Tensor:
    """SelfAttentionOperation PA_ENCODER without a mask: each packed sequence attends to all of itself
    (docs/operators/atb_attention.md)."""
    return _self_attention(query, key, value, None, seq_len, scale_value, num_heads, num_kv_heads, out,
                           backend=backend, op="atb_flash_attention_unpad")

