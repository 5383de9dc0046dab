"""The ATB attention operators (torch_npu ``_npu_paged_attention``, ``_npu_paged_attention_splitfuse``,
``_npu_flash_attention``, ``_npu_flash_attention_unpad``): cases and goldens (``cann_attn.testing.atb_oracle``,
docs/operators/atb_attention.md).

Inputs as vllm-ascend builds them: lengths int32, block tables whose unused entries are -1, caches in shuffled blocks,
causal additive masks with -inf above the diagonal (the splitfuse mask: the causal row of each query token's
position)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...testing.atb_oracle import paged_attention_oracle, self_attention_oracle, splitfuse_oracle
from ._common import (
    BF16,
    F16,
    Call,
    Case,
    Operator,
    Outputs,
    bind,
    by_name,
    outputs_of,
    randn,
    register,
    register_operator,
    same_dtype,
    without,
)

OUT_NO_EFFECT = {"out": "the tensor the operator writes; its contents are not read"}


def _int32(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def _paged_cache(gen: torch.Generator, kv_lens: Sequence[int], heads_kv: int, dim: int, dim_v: int,
                 block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches [blocks, block_size, KVN, D(v)] holding each sequence in shuffled blocks, and the int32 table (-1
    past a sequence's blocks)."""
    needed = [-(-n // block_size) for n in kv_lens]
    blocks = sum(needed) + 1
    key = randn(gen, (blocks, block_size, heads_kv, dim), dtype)
    value = randn(gen, (blocks, block_size, heads_kv, dim_v), dtype)
    order = torch.randperm(blocks, generator=gen).tolist()
    table = torch.full((len(kv_lens), max(needed, default=0) + 1), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(needed):
        table[b, :n] = torch.tensor(order[k : k + n], dtype=torch.int32)
        k += n
    return key, value, table


def causal_additive_mask(size: int, dtype: torch.dtype) -> torch.Tensor:
    """vllm-ascend's causal additive mask: 0 on and below the diagonal, -inf above."""
    upper = ~torch.ones(size, size, dtype=torch.bool).tril_()
    return torch.zeros(size, size, dtype=dtype).masked_fill_(upper, float("-inf"))


def _golden(op: str, oracle):
    def golden(call: Call) -> Outputs:
        return {"attention_out": oracle(**without(by_name(op, call), "out"))}

    return golden


def paged_case(name: str, dtype: torch.dtype, kv_lens: Sequence[int], heads: int, heads_kv: int, dim: int,
               dim_v: int, block_size: int = 16, quick: bool = True) -> Case:
    def build(gen: torch.Generator) -> Call:
        key, value, table = _paged_cache(gen, kv_lens, heads_kv, dim, dim_v, block_size, dtype)
        return bind("atb_paged_attention", dict(
            query=randn(gen, (len(kv_lens), heads, dim), dtype), key_cache=key, value_cache=value,
            num_kv_heads=heads_kv, num_heads=heads, scale_value=dim ** -0.5, block_table=table,
            context_lens=_int32(kv_lens), out=torch.empty(len(kv_lens), heads, dim_v, dtype=dtype)))

    return Case(op="atb_paged_attention", name=name, dtype=dtype, quick=quick,
                shape=f"T={len(kv_lens)} N={heads}/{heads_kv} D={dim}/{dim_v} Skv={list(kv_lens)} page={block_size}",
                build=build, run=outputs_of("atb_paged_attention", ("attention_out",)),
                oracle=_golden("atb_paged_attention", paged_attention_oracle))


def splitfuse_case(name: str, dtype: torch.dtype, q_lens: Sequence[int], kv_lens: Sequence[int], heads: int,
                   heads_kv: int, dim: int, block_size: int = 16) -> Case:
    def build(gen: torch.Generator) -> Call:
        key, value, table = _paged_cache(gen, kv_lens, heads_kv, dim, dim, block_size, dtype)
        positions = [p for ql, cl in zip(q_lens, kv_lens, strict=True) for p in range(cl - ql, cl)]
        mask = causal_additive_mask(max(kv_lens), dtype).index_select(0, torch.tensor(positions))
        tokens = sum(q_lens)
        return bind("atb_paged_attention_splitfuse", dict(
            query=randn(gen, (tokens, heads, dim), dtype), key_cache=key, value_cache=value, block_table=table,
            context_lens=_int32(kv_lens), mask=mask, seq_len=_int32(q_lens), num_kv_heads=heads_kv,
            num_heads=heads, scale_value=dim ** -0.5, out=torch.empty(tokens, heads, dim, dtype=dtype)))

    return Case(op="atb_paged_attention_splitfuse", name=name, dtype=dtype,
                shape=f"seq_len={list(q_lens)} context_lens={list(kv_lens)} N={heads}/{heads_kv} D={dim}",
                build=build, run=outputs_of("atb_paged_attention_splitfuse", ("attention_out",)),
                oracle=_golden("atb_paged_attention_splitfuse", splitfuse_oracle))


def self_attention_case(op: str, name: str, dtype: torch.dtype, seq: Sequence[int], heads: int, heads_kv: int,
                        dim: int, dim_v: int) -> Case:
    def build(gen: torch.Generator) -> Call:
        tokens = sum(seq)
        named: dict[str, Any] = dict(
            query=randn(gen, (tokens, heads, dim), dtype), key=randn(gen, (tokens, heads_kv, dim), dtype),
            value=randn(gen, (tokens, heads_kv, dim_v), dtype), seq_len=_int32(seq), scale_value=dim ** -0.5,
            num_heads=heads, num_kv_heads=heads_kv, out=torch.empty(tokens, heads, dim_v, dtype=dtype))
        if op == "atb_flash_attention":
            named["mask"] = causal_additive_mask(max(seq), dtype)
        return bind(op, named)

    return Case(op=op, name=name, dtype=dtype, shape=f"seq_len={list(seq)} N={heads}/{heads_kv} D={dim}/{dim_v}",
                build=build, run=outputs_of(op, ("attention_out",)), oracle=_golden(op, self_attention_oracle))


register(
    paged_case("decode_gqa", F16, kv_lens=(37, 1, 64, 0), heads=8, heads_kv=2, dim=64, dim_v=64),
    paged_case("decode_narrow_value", BF16, kv_lens=(130, 17), heads=4, heads_kv=1, dim=128, dim_v=64,
               block_size=32, quick=False),
    splitfuse_case("chunk_prompt_decodes", F16, q_lens=(8, 12, 1, 1), kv_lens=(28, 12, 33, 5), heads=4, heads_kv=2,
                   dim=64),
    self_attention_case("atb_flash_attention", "causal_gqa_narrow_value", BF16, seq=(5, 9, 9, 3), heads=4,
                        heads_kv=2, dim=64, dim_v=48),
    self_attention_case("atb_flash_attention_unpad", "encoder", F16, seq=(7, 1, 12), heads=4, heads_kv=1, dim=64,
                        dim_v=64),
)

for _op, _oracle in (("atb_paged_attention", paged_attention_oracle),
                     ("atb_paged_attention_splitfuse", splitfuse_oracle),
                     ("atb_flash_attention", self_attention_oracle),
                     ("atb_flash_attention_unpad", self_attention_oracle)):
    register_operator(Operator(_op, ("attention_out",), _golden(_op, _oracle), same_dtype(attention_out="query"),
                               oracle=_oracle,
                               no_effect=OUT_NO_EFFECT))
