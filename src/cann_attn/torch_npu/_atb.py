"""torch_npu's ATB attention spellings (op-plugin op_plugin/ops/atb/, exposed as ``torch_npu.<name>`` and, after
install(), ``torch.ops.atb.<name>``): ``_npu_paged_attention`` (+ ``_get_workspace``),
``_npu_paged_attention_splitfuse``, ``_npu_flash_attention``, ``_npu_flash_attention_unpad``
(docs/operators/atb_attention.md). Their schemas return ``()``: the result is written into ``out``, after every
argument has been validated."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import atb_attention
from ._registry import npu_op

_PAGED_ARGS = ("Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, int num_heads, "
               "float scale_value, Tensor block_table, Tensor context_lens, Tensor(a!) out")
ALL = ("7.1", "7.2", "7.3", "26.0", "current")
WITH_WORKSPACE = ("7.2", "7.3", "26.0", "current")  # 7.1's op has no workspace (nor get_workspace)

NPU_PAGED_ATTENTION_SCHEMAS = {
    ("7.1",): f"_npu_paged_attention({_PAGED_ARGS}) -> ()",
    WITH_WORKSPACE: f"_npu_paged_attention({_PAGED_ARGS}, *, Tensor? workspace=None) -> ()",
}
NPU_PAGED_ATTENTION_GET_WORKSPACE_SCHEMAS = {
    WITH_WORKSPACE: f"_npu_paged_attention_get_workspace({_PAGED_ARGS}) -> Tensor",
}
NPU_PAGED_ATTENTION_SPLITFUSE_SCHEMAS = {
    ALL: ("_npu_paged_attention_splitfuse(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
          "Tensor context_lens, Tensor mask, Tensor seq_len, int num_kv_heads, int num_heads, float scale_value, "
          "Tensor(a!) out) -> ()"),
}
NPU_FLASH_ATTENTION_SCHEMAS = {
    ALL: ("_npu_flash_attention(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor seq_len, "
          "float scale_value, int num_heads, int num_kv_heads, Tensor(a!) out) -> ()"),
}
NPU_FLASH_ATTENTION_UNPAD_SCHEMAS = {
    ALL: ("_npu_flash_attention_unpad(Tensor query, Tensor key, Tensor value, Tensor seq_len, float scale_value, "
          "int num_heads, int num_kv_heads, Tensor(a!) out) -> ()"),
}


@npu_op(NPU_PAGED_ATTENTION_SCHEMAS, namespace="atb")
def _npu_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_kv_heads: int, num_heads: int,
                         scale_value: float, block_table: Tensor, context_lens: Tensor, out: Tensor, *,
                         workspace: Tensor | None = None) -> None:
    """Paged decode into `out`; `workspace` (from ``_npu_paged_attention_get_workspace``) is accepted and unused."""
    atb_attention.atb_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                                  context_lens, out)


@npu_op(NPU_PAGED_ATTENTION_GET_WORKSPACE_SCHEMAS, namespace="atb")
def _npu_paged_attention_get_workspace(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_kv_heads: int,
                                       num_heads: int, scale_value: float, block_table: Tensor, context_lens: Tensor,
                                       out: Tensor) -> Tensor:
    """The workspace ``_npu_paged_attention`` takes for graph capture: an empty uint8 tensor on the query's device
    (the computation here needs none)."""
    return torch.empty(0, dtype=torch.uint8, device=query.device)


@npu_op(NPU_PAGED_ATTENTION_SPLITFUSE_SCHEMAS, namespace="atb")
def _npu_paged_attention_splitfuse(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                                   context_lens: Tensor, mask: Tensor, seq_len: Tensor, num_kv_heads: int,
                                   num_heads: int, scale_value: float, out: Tensor) -> None:
    atb_attention.atb_paged_attention_splitfuse(query, key_cache, value_cache, block_table, context_lens, mask, seq_len,
                                            num_kv_heads, num_heads, scale_value, out)


@npu_op(NPU_FLASH_ATTENTION_SCHEMAS, namespace="atb")
def _npu_flash_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, seq_len: Tensor,
                         scale_value: float, num_heads: int, num_kv_heads: int, out: Tensor) -> None:
    atb_attention.atb_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out)


@npu_op(NPU_FLASH_ATTENTION_UNPAD_SCHEMAS, namespace="atb")
def _npu_flash_attention_unpad(query: Tensor, key: Tensor, value: Tensor, seq_len: Tensor, scale_value: float,
                               num_heads: int, num_kv_heads: int, out: Tensor) -> None:
    atb_attention.atb_flash_attention_unpad(query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out)
