"""Placeholders for absent optional outputs (custom ops cannot return None) and the fake outputs of the indexer
KL-loss grad ops, shared by the custom-op modules of :mod:`cann_attn.library`."""

import torch
from torch import Tensor

from ..problem.stats import accumulation_dtype


def _empty_like_none(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The ``(0,)`` placeholder for an absent optional output."""
    return like.new_empty((0,), dtype=dtype or like.dtype)


def _none_if_placeholder(t: Tensor, present: bool) -> Tensor | None:
    return t if present else None


def _kl_loss_grad_fake(query: Tensor, query_index: Tensor, key_index: Tensor,
                       weights: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_query_index, d_key_index, d_weights, loss) of the indexers' KL-loss grad ops, sparse and dense alike: the
    gradients shaped as their inputs, the loss a [1] tensor of the accumulation dtype
    (docs/operators/lightning_indexer.md, docs/operators/dense_lightning_indexer.md)."""
    loss = query.new_empty((1,), dtype=accumulation_dtype(query_index.dtype))
    return torch.empty_like(query_index), torch.empty_like(key_index), torch.empty_like(weights), loss
