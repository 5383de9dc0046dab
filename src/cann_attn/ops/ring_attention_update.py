"""RingAttentionUpdate: fold one more FlashAttentionScore result into a running one (context-parallel rings;
docs/operators/ring_attention_update.md, the merge rule in cann_attn.problem.merge)."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from ..backends import select_backend
from ..backends.reference import merge as reference
from ..errors import ParamInvalidError, ParamNullptrError, describe, require
from ..problem.layout import head_dim_of
from ..problem.lengths import zero_based_cumulative_lengths
from ..problem.stats import STAT_WIDTH, tnd_stat_rows
from ..traceable import traced_as_custom_op

RING_LAYOUTS = ("SBH", "TND")
# "" and "SBH" both mean Ascend's per-sequence [N, S_b, 8] blocks in TND (aclnnRingAttentionUpdateV2).
RING_SOFTMAX_LAYOUTS = ("", "SBH", "TND")
ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# aclnnRingAttentionUpdateV2, TND on Atlas A2/A3: N <= 256, D <= 768 and a multiple of 64.
TND_MAX_HEADS = 256
TND_MAX_HEAD_DIM = 768
TND_HEAD_DIM_MULTIPLE = 64

_ATTN_NAMES = ("prev_attn_out", "cur_attn_out")
_STAT_NAMES = ("prev_softmax_max", "prev_softmax_sum", "cur_softmax_max", "cur_softmax_sum")


class RingAttentionUpdateResult(NamedTuple):
    attn_out: torch.Tensor
    softmax_max: torch.Tensor
    softmax_sum: torch.Tensor


def _present(t, name: str) -> torch.Tensor:
    if t is None:
        raise ParamNullptrError(f"{name}: a required input, got None")
    require(isinstance(t, torch.Tensor), name, "a torch.Tensor", t)
    return t


def _check_lanes(stats: torch.Tensor, name: str) -> None:
    """The 8 values of a row must be equal (the documented form; NaN lanes count as equal to NaN)."""
    first = stats[..., :1]
    same = (stats == first) | (torch.isnan(stats) & torch.isnan(first))
    if not bool(same.all()):
        raise ParamInvalidError(f"{name}: expected the last dimension to hold one value repeated 8 times, got "
                                f"differing lanes in {describe(stats)}")


def _validate(attn: list[torch.Tensor], stats: list[torch.Tensor], actual_seq_qlen, input_layout: str,
              input_softmax_layout: str) -> tuple[int, list[int]]:
    """Checks every documented constraint; returns (heads, per-sequence lengths for the "" TND layout)."""
    if input_layout not in RING_LAYOUTS:
        raise ParamInvalidError(f"input_layout: expected 'SBH' or 'TND', got {input_layout!r}")
    if input_softmax_layout not in RING_SOFTMAX_LAYOUTS:
        raise ParamInvalidError(f"input_softmax_layout: expected '', 'SBH' or 'TND', got {input_softmax_layout!r}")
    prev, cur = attn
    require(prev.dtype in ATTN_DTYPES, "prev_attn_out", "dtype float16, bfloat16 or float32", prev)
    require(prev.dim() == 3, "prev_attn_out", f"a 3-D tensor ({'[S, B, H]' if input_layout == 'SBH' else '[T, N, D]'})",
            prev)
    require(cur.dtype == prev.dtype, "cur_attn_out", f"prev_attn_out's dtype {prev.dtype}", cur)
    require(cur.shape == prev.shape, "cur_attn_out", f"prev_attn_out's shape {list(prev.shape)}", cur)
    stat_dtypes = (torch.float32, torch.float64) if prev.dtype == torch.float64 else (torch.float32,)
    first = stats[0]
    for name, t in zip(_STAT_NAMES, stats, strict=True):
        require(t.dtype in stat_dtypes, name, "dtype float32", t)
        require(t.shape == first.shape, name, f"prev_softmax_max's shape {list(first.shape)}", t)
    if input_layout == "SBH":
        s, b, h = prev.shape
        require(first.dim() == 4 and first.shape[3] == STAT_WIDTH and first.shape[0] == b and first.shape[2] == s,
                "prev_softmax_max", f"shape [B, N, S, 8] = [{b}, N, {s}, 8] for input_layout 'SBH'", first)
        heads = first.shape[1]
        require(heads >= 1 and h % heads == 0, "prev_softmax_max",
                f"a head count N >= 1 dividing prev_attn_out's H = {h}", first)
        if actual_seq_qlen is not None:
            warnings.warn("actual_seq_qlen: ignored with input_layout 'SBH' (only TND reads it)", UserWarning,
                          stacklevel=3)
        lengths: list[int] = []
    else:
        t_len, heads, d = prev.shape
        require(first.dim() == 3 and tuple(first.shape) == (t_len, heads, STAT_WIDTH), "prev_softmax_max",
                f"shape [T, N, 8] = [{t_len}, {heads}, 8] for input_layout 'TND'", first)
        require(heads <= TND_MAX_HEADS, "prev_attn_out", f"N <= {TND_MAX_HEADS} heads for input_layout 'TND'", prev)
        require(d % TND_HEAD_DIM_MULTIPLE == 0 and 0 < d <= TND_MAX_HEAD_DIM, "prev_attn_out",
                f"a head dim D that is a multiple of {TND_HEAD_DIM_MULTIPLE} and <= {TND_MAX_HEAD_DIM} for "
                "input_layout 'TND'", prev)
        if actual_seq_qlen is None:
            raise ParamNullptrError("actual_seq_qlen: required for input_layout 'TND', got None")
        if input_softmax_layout == "TND":
            # Rows pair up token by token: the lengths are not read, only their documented type is checked.
            if isinstance(actual_seq_qlen, torch.Tensor) and actual_seq_qlen.dtype != torch.int64:
                raise ParamInvalidError(f"actual_seq_qlen: expected an int64 tensor, got {describe(actual_seq_qlen)}")
            lengths = []
        else:
            lengths = zero_based_cumulative_lengths(actual_seq_qlen, t_len, "actual_seq_qlen")
    for name, t in zip(_STAT_NAMES, stats, strict=True):
        _check_lanes(t, name)
    return heads, lengths


def _stat_rows(stats: torch.Tensor, input_layout: str, index: torch.Tensor | None) -> torch.Tensor:
    """One value per (row of attn_out) in attn_out's row order: SBH [S, B, N], TND [T, N], flattened."""
    if input_layout == "SBH":
        return stats[..., 0].permute(2, 0, 1).reshape(-1)
    return stats.reshape(-1, STAT_WIDTH)[index, 0]


def _stats_back(rows: torch.Tensor, like: torch.Tensor, input_layout: str, index: torch.Tensor | None
                ) -> torch.Tensor:
    if input_layout == "SBH":
        b, n, s, _ = like.shape
        per_row = rows.view(s, b, n).permute(1, 2, 0)
        return per_row.unsqueeze(-1).expand(b, n, s, STAT_WIDTH).contiguous()
    out = torch.empty((like.numel() // STAT_WIDTH, STAT_WIDTH), dtype=rows.dtype, device=rows.device)
    out[index] = rows.unsqueeze(-1).expand(-1, STAT_WIDTH)
    return out.view(like.shape)


@traced_as_custom_op
def ring_attention_update(
    prev_attn_out: torch.Tensor,
    prev_softmax_max: torch.Tensor,
    prev_softmax_sum: torch.Tensor,
    cur_attn_out: torch.Tensor,
    cur_softmax_max: torch.Tensor,
    cur_softmax_sum: torch.Tensor,
    *,
    actual_seq_qlen=None,
    input_layout: str = "SBH",
    input_softmax_layout: str = "",
    backend: str = "auto",
) -> RingAttentionUpdateResult:
    """Merge two attention results over disjoint key sets of the same queries:
    m = max(m_p, m_c), s = s_p e^(m_p - m) + s_c e^(m_c - m), O = (O_p s_p e^(m_p - m) + O_c s_c e^(m_c - m)) / s.

    input_layout "SBH": attn_out [S, B, H], statistics [B, N, S, 8]; "TND": attn_out [T, N, D], statistics
    [T, N, 8] laid out per `input_softmax_layout` ("" / "SBH": per-sequence [N, S_b, 8] blocks as FlashAttentionScore
    writes them by default, "TND": token-major), `actual_seq_qlen` cumulative lengths from 0 ([0, S_1, ...]).
    A row that saw no key in one input (FlashAttentionScore's invalid row) leaves the other unchanged; in both, it
    stays invalid (docs/semantics/invalid-rows.md). Returns new tensors (attn_out in the input dtype, float32
    statistics); the inputs are never written.
    """
    attn = [_present(t, name) for t, name in zip((prev_attn_out, cur_attn_out), _ATTN_NAMES, strict=True)]
    stats = [_present(t, name) for t, name in zip(
        (prev_softmax_max, prev_softmax_sum, cur_softmax_max, cur_softmax_sum), _STAT_NAMES, strict=True)]
    heads, lengths = _validate(attn, stats, actual_seq_qlen, input_layout, input_softmax_layout)

    index = None
    if input_layout == "TND":
        layout = "TND" if input_softmax_layout == "TND" else ""
        index = tnd_stat_rows(lengths, prev_attn_out.shape[0], heads, layout, prev_attn_out.device).reshape(-1)
    head_dim = head_dim_of(prev_attn_out, heads, input_layout)
    out_rows = [t.reshape(-1, head_dim) for t in attn]
    max_p, sum_p, max_c, sum_c = (_stat_rows(t, input_layout, index) for t in stats)

    chosen = select_backend(backend, prev_attn_out.device, op="ring_attention_update",
                            unsupported=lambda: _triton_unsupported(prev_attn_out, prev_softmax_max))
    compute = reference.ring_update
    if chosen == "triton":
        from ..backends.triton import merge as triton_merge

        compute = triton_merge.ring_update
    out, new_max, new_sum = compute(out_rows[0], max_p, sum_p, out_rows[1], max_c, sum_c)
    return RingAttentionUpdateResult(
        out.view(prev_attn_out.shape),
        _stats_back(new_max, prev_softmax_max, input_layout, index),
        _stats_back(new_sum, prev_softmax_sum, input_layout, index),
    )


def _triton_unsupported(attn: torch.Tensor, stats: torch.Tensor) -> str | None:
    if attn.dtype == torch.float64 or stats.dtype == torch.float64:
        return "the kernels compute float16/bfloat16/float32 outputs with float32 statistics, got float64"
    return None
