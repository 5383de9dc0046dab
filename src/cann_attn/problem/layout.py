"""Tensor layouts (docs/semantics/layouts.md): BSH, SBH, BSND, BNSD, TND and PFA's BNSD_BSND.

Every layout is exposed to backends as [B, N, S, D] (or, for TND, runs of equal-length sequences as
[n, N, S, D]) strided views of the caller's tensor: no data is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ParamInvalidError, describe

FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
# The dimensions holding B and S in each batched FA layout (TND has no batch dimension).
BATCH_SEQ_DIMS = {"BSH": (0, 1), "SBH": (1, 0), "BSND": (0, 1), "BNSD": (0, 2)}


@dataclass(frozen=True)
class LayoutDims:
    """Sizes read off one tensor: batch (None for TND), sequence (total tokens T for TND), heads, head dim."""

    batch: int | None
    seq: int
    heads: int
    head_dim: int


def check_layout(input_layout: str, allowed: tuple[str, ...], param: str = "input_layout") -> str:
    if not isinstance(input_layout, str) or input_layout not in allowed:
        raise ParamInvalidError(f"{param}: expected one of {list(allowed)}, got {input_layout!r}")
    return input_layout


def read_dims(
    tensor: torch.Tensor, layout: str, heads: int | None, param: str, heads_param: str = "head_num"
) -> LayoutDims:
    """Read B, S, N, D of `tensor` in `layout`; 3-D layouts with H need `heads` (the argument `heads_param`) to
    split H = N * D."""
    expected_rank = {"BSH": 3, "SBH": 3, "BSND": 4, "BNSD": 4, "TND": 3, "BNSD_BSND": 4}[layout]
    if tensor.dim() != expected_rank:
        raise ParamInvalidError(
            f"{param}: layout {layout} expects a {expected_rank}-D tensor, got {describe(tensor)}"
        )
    shape = tuple(tensor.shape)
    if layout in ("BSH", "SBH"):
        b, s, h = shape if layout == "BSH" else (shape[1], shape[0], shape[2])
        if heads is None or heads <= 0 or h % heads != 0:
            raise ParamInvalidError(
                f"{param}: hidden size H={h} of layout {layout} must be divisible by the head count "
                f"({heads_param}={heads})"
            )
        return LayoutDims(b, s, heads, h // heads)
    if layout == "BSND":
        return LayoutDims(shape[0], shape[1], shape[2], shape[3])
    if layout in ("BNSD", "BNSD_BSND"):
        return LayoutDims(shape[0], shape[2], shape[1], shape[3])
    return LayoutDims(None, shape[0], shape[1], shape[2])


# Where the head count N sits in the layouts of one rank: a tensor whose N is elsewhere was laid out differently.
_HEAD_AXIS = {"BSND": 2, "BNSD": 1, "BNSD_BSND": 1, "TND": 1, "NTD": 0}
_LAYOUT_OF_HEAD_AXIS = {4: {1: "BNSD", 2: "BSND"}, 3: {0: "NTD", 1: "TND"}}


def require_head_count(tensor: torch.Tensor, layout: str, heads: int, expected: int, param: str,
                       heads_param: str, layout_param: str = "input_layout") -> None:
    """`heads` (read from `tensor` in `layout`) must be the `expected` count the caller passed as `heads_param`.
    When another dimension of the tensor holds that count where another layout keeps N, the layout is what is
    wrong (a BSND tensor passed as "BNSD"), and the error says so with the shape that contradicts it."""
    if heads == expected:
        return
    own = _HEAD_AXIS.get(layout, _HEAD_AXIS.get(layout.split("_")[0]))
    shape = list(tensor.shape)
    fitting = [(axis, name) for axis, name in _LAYOUT_OF_HEAD_AXIS.get(tensor.dim(), {}).items()
               if own is not None and axis != own and shape[axis] == expected]
    if fitting:
        axis, name = fitting[0]
        raise ParamInvalidError(
            f"{layout_param}: {param} {shape} read as {layout} has N={heads} heads (dimension {own}), but "
            f"{heads_param}={expected} is its dimension {axis}: the tensor looks laid out as {name}, not {layout} "
            f"(pass {layout_param}={name!r}, or permute the tensor)")
    raise ParamInvalidError(f"{heads_param}: expected the {param}'s head count N={heads}, got {expected}")


def head_dim_of(tensor: torch.Tensor, heads: int, layout: str) -> int:
    """D of an already validated tensor of `heads` heads: H / heads in BSH and SBH (whose last dimension packs
    H = N * D), else the last dimension (docs/semantics/layouts.md)."""
    return tensor.shape[-1] // heads if layout in ("BSH", "SBH") else tensor.shape[-1]


def head_count_of(tensor: torch.Tensor, head_dim: int, layout: str) -> int:
    """N of an already validated tensor whose heads have `head_dim`: H / head_dim in BSH and SBH, dimension 1 in BNSD,
    else dimension -2 (BSND, TND) (docs/semantics/layouts.md)."""
    if layout in ("BSH", "SBH"):
        return tensor.shape[-1] // head_dim
    return tensor.shape[1] if layout == "BNSD" else tensor.shape[-2]


def as_bnsd(tensor: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """[B, N, S, D] view of a BSH / SBH / BSND / BNSD(_BSND) tensor (no copy)."""
    if layout == "BSH":
        b, s, h = tensor.shape
        return tensor.view(b, s, heads, h // heads).permute(0, 2, 1, 3)
    if layout == "SBH":
        s, b, h = tensor.shape
        return tensor.view(s, b, heads, h // heads).permute(1, 2, 0, 3)
    if layout == "BSND":
        return tensor.permute(0, 2, 1, 3)
    if layout in ("BNSD", "BNSD_BSND"):
        return tensor
    raise ValueError(f"as_bnsd does not handle layout {layout}")


def tnd_run(tensor: torch.Tensor, start: int, count: int, seq: int) -> torch.Tensor:
    """[count, N, seq, D] view of `count` consecutive TND sequences of equal length starting at token `start`."""
    _, n, d = tensor.shape
    block = tensor[start : start + count * seq]
    return block.view(count, seq, n, d).permute(0, 2, 1, 3)


def output_shape(layout: str, batch: int | None, seq: int, heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of a tensor with these sizes in `layout` (the output layout for BNSD_BSND is BSND)."""
    if layout == "BSH":
        return (batch, seq, heads * head_dim)
    if layout == "SBH":
        return (seq, batch, heads * head_dim)
    if layout in ("BSND", "BNSD_BSND"):
        return (batch, seq, heads, head_dim)
    if layout == "BNSD":
        return (batch, heads, seq, head_dim)
    return (seq, heads, head_dim)
