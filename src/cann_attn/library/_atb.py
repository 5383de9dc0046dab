"""Custom ops (``torch.ops.cann_attn.atb_*``) of the ATB attention operators (docs/operators/atb_attention.md), in
the style of :mod:`cann_attn.library` (which re-exports the wrappers below, where ``traced_as_custom_op`` finds
them): each op writes the caller's ``out`` (``mutates_args``) by running the eager operator, which reads the length
tensors on the host, so a compiled region traces the call as one opaque node instead of breaking the graph."""

import torch
from torch import Tensor

from ..ops.atb_attention import atb_flash_attention as _eager_flash_attention
from ..ops.atb_attention import atb_flash_attention_unpad as _eager_flash_attention_unpad
from ..ops.atb_attention import atb_paged_attention as _eager_paged_attention
from ..ops.atb_attention import atb_paged_attention_splitfuse as _eager_splitfuse


@torch.library.custom_op("cann_attn::atb_paged_attention", mutates_args=("out",))
def _paged_op(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_kv_heads: int, num_heads: int,
              scale_value: float, block_table: Tensor, context_lens: Tensor, out: Tensor, backend: str = "auto"
              ) -> None:
    _eager_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                           context_lens, out, backend=backend)


@_paged_op.register_fake
def _(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, out,
      backend="auto"):
    return None


def atb_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_kv_heads: int, num_heads: int,
                        scale_value: float, block_table: Tensor, context_lens: Tensor, out: Tensor, *,
                        backend: str = "auto") -> Tensor:
    """``cann_attn.atb_paged_attention`` through the ``cann_attn::atb_paged_attention`` custom op."""
    torch.ops.cann_attn.atb_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                                            block_table, context_lens, out, backend)
    return out


@torch.library.custom_op("cann_attn::atb_paged_attention_splitfuse", mutates_args=("out",))
def _splitfuse_op(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor, context_lens: Tensor,
                  mask: Tensor, seq_len: Tensor, num_kv_heads: int, num_heads: int, scale_value: float, out: Tensor,
                  backend: str = "auto") -> None:
    _eager_splitfuse(query, key_cache, value_cache, block_table, context_lens, mask, seq_len, num_kv_heads, num_heads,
                     scale_value, out, backend=backend)


@_splitfuse_op.register_fake
def _(query, key_cache, value_cache, block_table, context_lens, mask, seq_len, num_kv_heads, num_heads, scale_value,
      out, backend="auto"):
    return None


def atb_paged_attention_splitfuse(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                                  context_lens: Tensor, mask: Tensor, seq_len: Tensor, num_kv_heads: int,
                                  num_heads: int, scale_value: float, out: Tensor, *, backend: str = "auto"
                                  ) -> Tensor:
    """``cann_attn.atb_paged_attention_splitfuse`` through its ``cann_attn::`` custom op."""
    torch.ops.cann_attn.atb_paged_attention_splitfuse(query, key_cache, value_cache, block_table, context_lens, mask,
                                                      seq_len, num_kv_heads, num_heads, scale_value, out, backend)
    return out


@torch.library.custom_op("cann_attn::atb_flash_attention", mutates_args=("out",))
def _flash_op(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, seq_len: Tensor, scale_value: float,
              num_heads: int, num_kv_heads: int, out: Tensor, backend: str = "auto") -> None:
    _eager_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out,
                           backend=backend)


@_flash_op.register_fake
def _(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out, backend="auto"):
    return None


def atb_flash_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, seq_len: Tensor,
                        scale_value: float, num_heads: int, num_kv_heads: int, out: Tensor, *,
                        backend: str = "auto") -> Tensor:
    """``cann_attn.atb_flash_attention`` through the ``cann_attn::atb_flash_attention`` custom op."""
    torch.ops.cann_attn.atb_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads,
                                            out, backend)
    return out


@torch.library.custom_op("cann_attn::atb_flash_attention_unpad", mutates_args=("out",))
def _unpad_op(query: Tensor, key: Tensor, value: Tensor, seq_len: Tensor, scale_value: float, num_heads: int,
              num_kv_heads: int, out: Tensor, backend: str = "auto") -> None:
    _eager_flash_attention_unpad(query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out,
                                 backend=backend)


@_unpad_op.register_fake
def _(query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out, backend="auto"):
    return None


def atb_flash_attention_unpad(query: Tensor, key: Tensor, value: Tensor, seq_len: Tensor, scale_value: float,
                              num_heads: int, num_kv_heads: int, out: Tensor, *, backend: str = "auto") -> Tensor:
    """``cann_attn.atb_flash_attention_unpad`` through the ``cann_attn::atb_flash_attention_unpad`` custom op."""
    torch.ops.cann_attn.atb_flash_attention_unpad(query, key, value, seq_len, scale_value, num_heads, num_kv_heads,
                                                  out, backend)
    return out
