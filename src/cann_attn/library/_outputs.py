"""Placeholders for absent optional outputs (custom ops cannot return None) and length-list conversion,
shared by the custom-op modules of :mod:`cann_attn.library`."""

import torch
from torch import Tensor

from ..problem.lengths import to_int_list


def _empty_like_none(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The ``(0,)`` placeholder for an absent optional output."""
    return like.new_empty((0,), dtype=dtype or like.dtype)


def _none_if_placeholder(t: Tensor, present: bool) -> Tensor | None:
    return t if present else None


def _ints(value, name: str) -> list[int] | None:
    """Length lists and start indices as Python int lists (tensors converted; one int becomes a list)."""
    return to_int_list(value, name)
