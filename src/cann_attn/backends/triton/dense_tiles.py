"""Per-tile building blocks shared by the dense forward and backward kernels (docs/semantics/masks.md,
docs/semantics/pse.md, docs/semantics/dropout.md).

Each helper takes broadcastable row / column index tensors `i2`, `j2` (a [M, 1] x [1, N] pair, or transposed
for the backward's key-major tiles), so the same code serves both orientations. They implement the canonical
description that `dense_plan` lowered; none of them looks at sparse_mode or pse shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch
import triton.language as tl

from .dense_plan import COL, NUM_COLUMNS
from .jit import INTERPRET, device_function

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
FLT_MAX = 3.4028234663852886e38
COMPRESSED_PSE_ROWS = tl.constexpr(1024)  # a constexpr global: kernels may only read those



@contextlib.contextmanager
def interpreter_speed() -> Iterator[None]:
    """Around the dense kernel launches: under the interpreter, skip its int32 overflow sanitizer, which
    re-does every 32-bit integer add/mul in int64 plus an assert (~40% of interpreted run time). The plan
    bounds the in-sequence offsets of every tensor the caller passes (q, k, v, and dy / o for the grad) below 2^31
    (`dense_unsupported`), mask and pse offsets are formed in int64, and test shapes are tiny. Set
    CANN_ATTN_TRITON_SANITIZE=1 to keep the sanitizer. No effect on a GPU."""
    if not INTERPRET or os.environ.get("CANN_ATTN_TRITON_SANITIZE") == "1":
        yield
        return
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not hasattr(options, "sanitize_overflow"):
        yield
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    try:
        yield
    finally:
        builder.options = options


@contextlib.contextmanager
def rounded_bf16_outputs(*outputs: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Kernel-facing stand-ins for `outputs`. The interpreter has no bf16 type (NumPy) and converts fp32 to bf16
    by truncation, one ulp off half the time, where GPUs round to nearest; under the interpreter each bf16
    output is computed into an fp32 tensor of the same strides (so the plan's offsets still hold) and copied
    back with torch's round-to-nearest. Anything else is handed through unchanged."""
    if not INTERPRET:
        yield outputs
        return
    standins = tuple(
        torch.empty_strided(t.shape, t.stride(), dtype=torch.float32, device=t.device).copy_(t)
        if t.dtype == torch.bfloat16 else t
        for t in outputs
    )
    yield standins
    for target, standin in zip(outputs, standins, strict=True):
        if standin is not target:
            target.copy_(standin)


# Table columns as kernel-visible constants.
C_SEQ_Q = tl.constexpr(COL["seq_q"])
C_SEQ_KV = tl.constexpr(COL["seq_kv"])
C_LOWER = tl.constexpr(COL["lower"])
C_UPPER = tl.constexpr(COL["upper"])
C_PREFIX = tl.constexpr(COL["prefix"])
C_Q = tl.constexpr(COL["q"])
C_K = tl.constexpr(COL["k"])
C_V = tl.constexpr(COL["v"])
C_O = tl.constexpr(COL["o"])
C_DY = tl.constexpr(COL["dy"])
C_DQ = tl.constexpr(COL["dq"])
C_DK = tl.constexpr(COL["dk"])
C_DV = tl.constexpr(COL["dv"])
C_STAT = tl.constexpr(COL["stat"])
C_STAT_HS = tl.constexpr(COL["stat_hs"])
C_DELTA = tl.constexpr(COL["delta"])
C_MASK = tl.constexpr(COL["mask"])
C_PSE = tl.constexpr(COL["pse"])
C_DPSE = tl.constexpr(COL["dpse"])
C_PSE_COMP = tl.constexpr(COL["pse_compressed"])
C_SLOPE = tl.constexpr(COL["slope"])
C_DROP = tl.constexpr(COL["drop"])
NCOL = tl.constexpr(NUM_COLUMNS)


@device_function
def tensor_offset(row, col, OFF_ALIGN: tl.constexpr):
    """A q/k/v/o/dy/dq/dk/dv offset of a table row with its host-checked alignment (`DensePlan.offset_align`):
    with an unknown divisor the compiler loads tiles one element at a time (a 64-bit address per element, the
    registers then spill) and cannot pipeline them."""
    return tl.multiple_of(tl.load(row + col), OFF_ALIGN)


@device_function
def band_bounds(row):
    """(lower, upper, prefix) of a table row: the band of j - i every kernel clips its tiles to (int32)."""
    lower = tl.load(row + C_LOWER).to(tl.int32)
    upper = tl.load(row + C_UPPER).to(tl.int32)
    prefix = tl.load(row + C_PREFIX).to(tl.int32)
    return lower, upper, prefix


@device_function
def key_span(i0, seq_q, seq_kv, lower, upper, prefix, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key tiles query rows [i0, i0 + BLOCK_M) visit (forward and dQ kernels): (start, hi, rows_full,
    full_lo, full_hi). Keys [start, hi) cover the band [i0 + lower, i_last + upper] widened to the prefix (a
    superset, start aligned to BLOCK_N). A key tile with full_lo <= j0 and j0 + BLOCK_N <= full_hi is visible
    for every row of the block when rows_full (docs/semantics/masks.md: d_min >= lower and d_max <= upper or inside the
    prefix), so it skips the elementwise band mask."""
    i_last = tl.minimum(i0 + BLOCK_M, seq_q) - 1
    upper_c = tl.minimum(upper, seq_kv)  # keeps i + upper inside int32 with the "no bound" sentinel
    lo = tl.maximum(i0 + lower, 0)
    hi = tl.maximum(tl.minimum(seq_kv, i_last + upper_c + 1), tl.minimum(seq_kv, prefix))
    start = (lo // BLOCK_N) * BLOCK_N
    rows_full = i0 + BLOCK_M <= seq_q
    full_lo = i0 + BLOCK_M - 1 + lower
    full_hi = tl.minimum(seq_kv, tl.maximum(i0 + 1 + upper_c, prefix))
    return start, hi, rows_full, full_lo, full_hi


@device_function
def visible(i2, j2, seq_q, seq_kv, lower, upper, prefix):
    """docs/semantics/masks.md in canonical form: lower <= j - i and (j - i <= upper or j < prefix), inside the
    sequence (the explicit mask is separate)."""
    d = j2 - i2
    return (d >= lower) & ((d <= upper) | (j2 < prefix)) & (i2 < seq_q) & (j2 < seq_kv)


@device_function
def explicit_visible(MASK, mask_base, i2, j2, seq_q, seq_kv, mask_rs, mask_cs):
    """Not hidden by the explicit mask (True/nonzero = masked; outside the sequence counts as masked)."""
    inb = (i2 < seq_q) & (j2 < seq_kv)
    # int64: a full [Sq, Skv] mask passes 2**31 elements from S = 46341 on.
    m = tl.load(MASK + mask_base + i2.to(tl.int64) * mask_rs + j2.to(tl.int64) * mask_cs, mask=inb, other=1)
    return m == 0


@device_function
def pse_element_offsets(i2, j2, seq_q, seq_kv, compressed, pse_rs, pse_cs, COMPRESSED: tl.constexpr):
    """Offsets of the pse elements a tile reads (docs/semantics/pse.md); with the 1024-row compressed form,
    value(i, j) = C[r, j + (Sq - 1024) + r - i], r = i - (Sq - 1024) on the last 1024 rows, else i mod 1024.
    Columns it sends outside [0, Skv) only occur where the mask hides the element (j > i): clamped."""
    if COMPRESSED:
        tail = seq_q - COMPRESSED_PSE_ROWS
        r = tl.where(i2 >= tail, i2 - tail, i2 % COMPRESSED_PSE_ROWS)
        c = j2 + tail + r - i2
        c = tl.minimum(tl.maximum(c, 0), seq_kv - 1)
        row = tl.where(compressed != 0, r, i2)
        col = tl.where(compressed != 0, c, j2)
    else:
        row = i2
        col = j2
    # int64: a full pse (or PFA pse_shift) passes 2**31 elements from Sq * Skv = 2**31 on.
    return row.to(tl.int64) * pse_rs + col.to(tl.int64) * pse_cs


@device_function
def bias_log2(PSE, pse_base, SLOPES, slope_addr, i2, j2, seq_q, seq_kv, compressed, pse_rs, pse_cs,
              q_start, kv_start, pse_mul, PSE_KIND: tl.constexpr, COMPRESSED: tl.constexpr):
    """The additive bias of a tile in log2 units (`pse_mul` carries log2(e) and, for pse_type 1, the scale):
    tensor pse (kind 1) or ALiBi generated from the slope (kind 2: |d|, kind 3: sqrt|d|)."""
    if PSE_KIND == 1:
        inb = (i2 < seq_q) & (j2 < seq_kv)
        offs = pse_element_offsets(i2, j2, seq_q, seq_kv, compressed, pse_rs, pse_cs, COMPRESSED)
        b = tl.load(PSE + pse_base + offs, mask=inb, other=0.0).to(tl.float32) * pse_mul
    else:
        slope = tl.load(SLOPES + slope_addr).to(tl.float32)
        dist = tl.abs((j2 + kv_start) - (i2 + q_start)).to(tl.float32)
        if PSE_KIND == 3:
            dist = tl.sqrt(dist)
        b = dist * (-slope * pse_mul)
    return b


@device_function
def keep_bits(DROP, drop_base, h, i2, j2, seq_q, seq_kv):
    """Dropout keep bits (docs/semantics/dropout.md): element e = base + h*Sq*Skv + i*Skv + j, bit (e & 7) of byte e >>
    3, LSB first; 64-bit element indices (masks exceed 2^31 bits at long sequences)."""
    inb = (i2 < seq_q) & (j2 < seq_kv)
    e = drop_base + (h.to(tl.int64) * seq_q + i2.to(tl.int64)) * seq_kv + j2.to(tl.int64)
    byte = tl.load(DROP + (e >> 3), mask=inb, other=0).to(tl.int32)
    return ((byte >> (e & 7).to(tl.int32)) & 1) != 0
