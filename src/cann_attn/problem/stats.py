"""softmax_max / softmax_sum layouts of the FA family (docs/semantics/softmax-stats.md).

Non-TND: [B, N1, Sq, 8], the value repeated 8 times. TND: a [T, N1, 8] tensor whose memory holds per-sequence
[N1, Sq_b, 8] blocks one after another (softmax_layout "", what Ascend writes) or a true [T, N1, 8]
(softmax_layout "TND"). Invalid rows carry max = -FLT_MAX and sum = +FLT_MAX (docs/semantics/invalid-rows.md).
"""

from __future__ import annotations

import torch

from ..errors import ParamInvalidError

STAT_WIDTH = 8
FLT_MAX = 3.4028234663852886e38
SOFTMAX_LAYOUTS = ("", "TND")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation and statistics everywhere; float64 inputs (gradcheck, goldens) stay float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Bound on |P V| accumulations: with every p_j <= 1, |sum_j p_j v_j| <= Skv * max|v|; kept below 2^126 leaves room
# for the sink's and the correction's factors (<= 1) and for summation rounding.
ACCUMULATION_LIMIT = 2.0**126


def value_column_scales(column_max: torch.Tensor, seq_kv: int) -> torch.Tensor | None:
    """The overflow rule of P V (docs/semantics/precision.md, "Values near the float maximum"): the exact powers of
    two 2^-k, per value column (`column_max` = max |v| over the keys, any shape), by which V is scaled before the
    accumulation so that seq_kv * max|v| * 2^-k stays below ACCUMULATION_LIMIT; the output is then divided by
    row_sum * 2^-k. A power of two changes no bit of a normal number, so only inputs whose accumulation would
    overflow (a finite answer near FLT_MAX turned into inf) are affected. None where no column needs it (k = 0
    everywhere, and always for non-finite columns, whose NaN / inf stay as the formulas give them)."""
    bound = column_max.double() * max(seq_kv, 1)
    k = torch.where(bound.isfinite() & (bound >= ACCUMULATION_LIMIT),
                    torch.ceil(torch.log2(bound / ACCUMULATION_LIMIT)) + 1, 0.0)
    if not bool(k.any()):
        return None
    return torch.exp2(-k).to(torch.float32)


def check_softmax_layout(softmax_layout: str) -> str:
    if softmax_layout not in SOFTMAX_LAYOUTS:
        raise ParamInvalidError(f"softmax_layout: expected '' or 'TND', got {softmax_layout!r}")
    return softmax_layout


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device, *, keyless_rows: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_max / softmax_sum outputs. Kernels write the rows of every run that has keys; a run without keys (dense
    Skv = 0 with Sq > 0) has rows with no visible column that no kernel visits, so with `keyless_rows` they are
    prefilled with the invalid-row values (docs/semantics/invalid-rows.md: never garbage) for every backend alike."""
    if keyless_rows:
        return (torch.full(shape, -FLT_MAX, dtype=dtype, device=device),
                torch.full(shape, FLT_MAX, dtype=dtype, device=device))
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)


def stats_shape(tnd: bool, batch: int, heads: int, seq: int) -> tuple[int, ...]:
    """[B, N1, Sq, 8], or [T, N1, 8] for TND (`seq` is the query tensor's S or T)."""
    return (seq, heads, STAT_WIDTH) if tnd else (batch, heads, seq, STAT_WIDTH)


def run_view(stats: torch.Tensor, *, tnd: bool, softmax_layout: str, b0: int, count: int, token_start: int,
             seq_q: int) -> torch.Tensor:
    """[count, N1, Sq, 8] view of the statistics of `count` consecutive sequences of length Sq (no copy)."""
    if not tnd:
        return stats[b0 : b0 + count]
    heads = stats.shape[1]
    if softmax_layout == "TND":
        block = stats[token_start : token_start + count * seq_q]
        return block.view(count, seq_q, heads, STAT_WIDTH).permute(0, 2, 1, 3)
    flat = stats.view(-1)
    start = token_start * heads * STAT_WIDTH
    return flat[start : start + count * heads * seq_q * STAT_WIDTH].view(count, heads, seq_q, STAT_WIDTH)


def tnd_stat_rows(lengths: list[int], tokens: int, heads: int, softmax_layout: str,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, N1] int64: where the statistics of token t, head n sit in a TND softmax tensor viewed as [T * N1, 8].

    "TND": row t * N1 + n. "" (Ascend's default): sequence b (token offset t_b, length S_b) is an [N1, S_b] block
    at row t_b * N1, so row t_b * N1 + n * S_b + (t - t_b). Tokens past sum(lengths) (end-of-document padding)
    form one more block of that kind.
    """
    if softmax_layout == "TND":
        return torch.arange(tokens * heads, device=device).view(tokens, heads)
    spans = list(lengths)
    if sum(spans) < tokens:
        spans.append(tokens - sum(spans))
    blocks, start = [], 0
    for length in spans:
        if length:
            block = torch.arange(length * heads, device=device).view(heads, length).t()
            blocks.append(block + start * heads)
        start += length
    if not blocks:
        return torch.empty((0, heads), dtype=torch.int64, device=device)
    return torch.cat(blocks)
