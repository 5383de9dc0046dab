"""Masks and ALiBi positions of one (query block, key block) pair of a sequence split across ranks
(docs/guides/context_parallel.md).

A context-parallel attention computes a sequence's attention as blocks: a contiguous run of query rows
[q_offset, q_offset + rows) against a contiguous run of key columns [kv_offset, kv_offset + cols), both in the
sequence's own (global) positions. The masks context parallelism supports are diagonal windows of the whole
sequence, `i + lower <= j <= i + upper` (docs/semantics/masks.md): no mask (full attention), sparse_mode 2
(`j <= i`), 3 (`j <= i + delta`) and 4 (the band `i + delta - pre <= j <= i + delta + next`), delta = Skv - Sq.

A block sees the same window shifted by its offsets: with local i', j' (i = q_offset + i', j = kv_offset + j') it is
`i' + lower + q_offset - kv_offset <= j' <= i' + upper + q_offset - kv_offset`. Each block is then either skipped
(no visible element), computed without a mask (every element visible), or computed as a sparse_mode 4 band of its
own with pre/next chosen so that the operator's right-down band (delta' = cols - rows) is that shifted window.
Generated ALiBi (pse_type 2/3) reads positions `i + q_start` and `j + kv_start`: a block adds its offsets to the
sequence's start indices (docs/semantics/pse.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ParamInvalidError

INT_MAX = 2147483647
# sparse_mode values whose mask is a diagonal window of the whole sequence (with the compressed atten_mask).
WINDOW_MODES = (2, 3, 4)


@dataclass(frozen=True)
class Window:
    """Visible iff `i + lower <= j <= i + upper`; None = unbounded on that side."""

    lower: int | None
    upper: int | None


@dataclass(frozen=True)
class BlockMask:
    """How one block is computed: kind "skip" (nothing visible), "full" (no mask) or "band" (sparse_mode 4 with
    the compressed mask and these pre/next tokens)."""

    kind: str
    pre_tokens: int = INT_MAX
    next_tokens: int = INT_MAX


def sequence_window(has_mask: bool, sparse_mode: int, pre_tokens: int, next_tokens: int, seq_q: int,
                    seq_kv: int) -> Window:
    """The window of one sequence of Sq x Skv. Without atten_mask the FA family ignores sparse_mode and the
    band (full attention); with it, modes 2, 3 and 4 are windows. Any other mode needs a mask tensor that a rank
    would have to slice per block: not supported under context parallelism."""
    if not has_mask:
        return Window(None, None)
    delta = seq_kv - seq_q
    if sparse_mode == 2:
        return Window(None, 0)
    if sparse_mode == 3:
        return Window(None, delta)
    if sparse_mode == 4:
        return Window(delta - pre_tokens, delta + next_tokens)
    raise ParamInvalidError(
        f"sparse_mode: context parallelism supports no mask or sparse_mode 2, 3 or 4 with the compressed "
        f"atten_mask, got sparse_mode={sparse_mode!r} with an atten_mask")


def block_mask(window: Window, q_offset: int, kv_offset: int, rows: int, cols: int) -> BlockMask:
    """The computation of rows [q_offset, q_offset + rows) against columns [kv_offset, kv_offset + cols)."""
    if rows == 0 or cols == 0:
        return BlockMask("skip")
    shift = q_offset - kv_offset
    lower = None if window.lower is None else window.lower + shift
    upper = None if window.upper is None else window.upper + shift
    # Rows that see something: i' + upper >= 0 and i' + lower <= cols - 1 (and lower <= upper).
    first = 0 if upper is None else max(0, -upper)
    last = rows - 1 if lower is None else min(rows - 1, cols - 1 - lower)
    if (lower is not None and upper is not None and lower > upper) or first > last:
        return BlockMask("skip")
    every_lower = lower is None or (rows - 1) + lower <= 0
    every_upper = upper is None or upper >= cols - 1
    if every_lower and every_upper:
        return BlockMask("full")
    delta = cols - rows  # the operator's band is right-down aligned: i' + delta - pre <= j' <= i' + delta + next
    pre = INT_MAX if every_lower else delta - lower
    nxt = INT_MAX if every_upper else upper - delta
    return BlockMask("band", _clamp(pre), _clamp(nxt))


def _clamp(value: int) -> int:
    return max(-INT_MAX, min(INT_MAX, value))
