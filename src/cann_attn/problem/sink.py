"""Attention sinks: one learnable logit per query head (docs/semantics/sinks.md).

Every row of head h gets one more softmax column whose logit is sink[h] (not scaled, no pse, never masked, no
dropout) and which is dropped before P V (it has no value). So, with (m, l) the row's maximum and sum over its visible
keys, the documented statistics become

    m' = max(m, sink[h]),   l' = l exp(m - m') + exp(sink[h] - m'),   out' = out l exp(m - m') / l'

(a row without visible keys: m' = sink[h], l' = 1, output 0), and the gradient of a loss with respect to the sink is

    dsink[h] = -sum over the rows of head h (every batch, every sequence) of P_sink * rowsum(dY * O),
    P_sink = exp(sink[h] - m') / l'.

The backward of the keys needs nothing new: P = exp(S - m') / l' from the sink-inclusive statistics, and
rowsum(dY * O) is unchanged (the sink column has no value, so its dP is 0; with dropout O already carries the keep
bits). This module is the one place of that rule: validation, the merge of the sink into running row statistics
(`merge_into_rows_`), its application to finished outputs (`merge_into_output_`, `merge_into_finished`) and dsink
(`sink_grad_terms`, `sink_grad`).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..errors import ParamInvalidError, require
from .stats import FLT_MAX


def check_sink(sink, heads_q: int, param: str = "sink") -> torch.Tensor | None:
    """`sink` must be None or a float32 tensor of shape [N1] (torch_npu: "shape [head_num], float32 only"); float64
    is accepted as well, for float64 inputs (gradcheck, goldens). A -inf entry is no sink for that head; NaN and
    +inf are refused: they can only make every row of the head NaN (exp(inf - inf))."""
    if sink is None:
        return None
    require(isinstance(sink, torch.Tensor) and sink.dtype in (torch.float32, torch.float64)
            and tuple(sink.shape) == (heads_q,), param, f"a float32 tensor of shape [{heads_q}] (one per query head)",
            sink)
    if not _is_symbolic(sink):
        bad = sink.isnan() | (sink == float("inf"))
        if bool(bad.any()):
            head = int(bad.nonzero()[0, 0])
            raise ParamInvalidError(f"{param}: expected finite logits or -inf (no sink), got {sink[head].item()} for "
                                    f"head {head}")
    return sink


def _is_symbolic(t: torch.Tensor) -> bool:
    """A tensor without values to read (meta, or a fake tensor while torch.compile traces)."""
    return t.device.type == "meta" or is_fake(t)


def head_values(sink: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """The sinks as [1, N1, 1] in the statistics' dtype, to broadcast over [count, N1, rows] row statistics."""
    return sink.to(device=device, dtype=dtype).view(1, -1, 1)


def merge_into_rows_(row_max: torch.Tensor, row_sum: torch.Tensor, sink_heads: torch.Tensor) -> torch.Tensor:
    """In place: merge the sink column into running row statistics [count, N1, rows] (natural units; max -inf and
    sum 0 where no key was visible) and return the factor exp(m - m') [count, N1, rows] by which the accumulated
    sum of P V must be multiplied. A -inf sink changes nothing; a row with neither keys nor a finite sink keeps
    sum 0 (an invalid row, docs/semantics/invalid-rows.md)."""
    new_max = torch.maximum(row_max, sink_heads)
    shift = torch.where(new_max == float("-inf"), 0.0, new_max)  # no inf - inf where nothing is visible
    factor = torch.exp(row_max - shift)
    row_sum.mul_(factor).add_(torch.exp(sink_heads - shift))
    row_max.copy_(new_max)
    return factor


def merge_into_output_(out: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor,
                       sink_heads: torch.Tensor) -> torch.Tensor:
    """In place: turn a finished output [..., Dv] (fp32 or wider, not yet rounded to the input dtype) and its row
    statistics [...] computed without the sink into the sink-inclusive ones. Rows with sum 0 had no visible key
    (whatever their max); they get max = sink, sum = 1 and stay 0, unless the sink is -inf too (then they keep their
    statistics). Returns the mask of rows that have something in their softmax (sum != 0 afterwards)."""
    empty = row_sum == 0
    running_max = torch.where(empty, float("-inf"), row_max.to(sink_heads.dtype))
    running_sum = row_sum.to(sink_heads.dtype)
    old_sum = running_sum.clone()
    factor = merge_into_rows_(running_max, running_sum, sink_heads)
    valid = running_sum != 0
    weight = torch.where(valid, old_sum * factor / torch.where(valid, running_sum, 1.0), 0.0)
    out.mul_(weight.unsqueeze(-1).to(out.dtype))
    row_max.copy_(torch.where(valid, running_max, row_max.to(running_max.dtype)))
    row_sum.copy_(running_sum)
    return valid


def merge_into_finished(out: torch.Tensor, softmax_max: torch.Tensor, softmax_sum: torch.Tensor,
                        sink_heads: torch.Tensor) -> None:
    """`merge_into_output_` for FlashAttentionScore's output [count, N1, rows, Dv] and 8-wide statistics
    [count, N1, rows, 8], whose rows without keys carry (-FLT_MAX, +FLT_MAX) (docs/semantics/invalid-rows.md)
    before and, where the sink is -inf, after."""
    row_max = softmax_max[..., 0].to(sink_heads.dtype)
    row_sum = softmax_sum[..., 0].to(sink_heads.dtype)
    invalid = (row_max == -FLT_MAX) & (row_sum == FLT_MAX)
    row_sum = torch.where(invalid, 0.0, row_sum)
    valid = merge_into_output_(out, row_max, row_sum, sink_heads)
    softmax_max.copy_(torch.where(valid, row_max, -FLT_MAX).unsqueeze(-1).expand_as(softmax_max))
    softmax_sum.copy_(torch.where(valid, row_sum, FLT_MAX).unsqueeze(-1).expand_as(softmax_sum))


def sink_probability(row_max: torch.Tensor, row_sum: torch.Tensor, sink_heads: torch.Tensor) -> torch.Tensor:
    """P_sink = exp(sink - m') / l' of rows from sink-inclusive statistics; 0 on rows whose statistics say nothing
    was in their softmax (FlashAttentionScore's (-FLT_MAX, +FLT_MAX), SparseFlashAttention's sum 0)."""
    valid = (row_sum != 0) & ((row_sum != FLT_MAX) | (row_max != -FLT_MAX))
    p = torch.exp(sink_heads - row_max) / torch.where(valid, row_sum, 1.0)
    return torch.where(valid, p, 0.0)


def sink_grad_terms(dy: torch.Tensor, out: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor,
                    sink_heads: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """-P_sink * rowsum(dY * O) of rows (dY, O [..., Dv], statistics [...]), in `acc_dtype`: summed over the rows of
    a head (every batch and sequence) they give dsink[h]."""
    d_sum = (dy.to(acc_dtype) * out.to(acc_dtype)).sum(-1)
    return sink_grad_terms_from_rowsum(d_sum, row_max, row_sum, sink_heads)


def sink_grad_terms_from_rowsum(d_sum: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor,
                                sink_heads: torch.Tensor) -> torch.Tensor:
    """`sink_grad_terms` from rowsum(dY * O) [...] already at hand (a backward kernel forms it anyway), in its
    dtype."""
    dtype = d_sum.dtype
    return -sink_probability(row_max.to(dtype), row_sum.to(dtype), sink_heads.to(dtype)) * d_sum


def sink_grad(rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], sink: torch.Tensor,
              acc_dtype: torch.dtype, total: torch.Tensor | None = None) -> torch.Tensor:
    """FlashAttentionScore's dsink [N1] in `acc_dtype` from runs of (dY [c, N1, rows, Dv], O [c, N1, rows, Dv],
    softmax_max [c, N1, rows, 8], softmax_sum [c, N1, rows, 8]), added to `total` when given."""
    total = torch.zeros(sink.shape[0], dtype=acc_dtype, device=sink.device) if total is None else total
    for dy, out, smax, ssum in rows:
        if dy.numel() == 0:
            continue
        heads = head_values(sink, acc_dtype, dy.device)
        terms = sink_grad_terms(dy, out, smax[..., 0], ssum[..., 0], heads, acc_dtype)
        total += terms.sum(dim=(0, 2)).to(total.device)
    return total


def finish_keyless_rows(problem, out: torch.Tensor, softmax_max: torch.Tensor, softmax_sum: torch.Tensor) -> None:
    """The rows of runs without any key (dense Skv = 0), which kernels skip and `stats.allocate` prefills as invalid:
    with a sink they have one column, so max = sink, sum = 1 and output 0."""
    for run in problem.runs:
        if run.seq_q > 0 and run.seq_kv == 0:
            smax, ssum = problem.stat_view(softmax_max, run), problem.stat_view(softmax_sum, run)
            merge_into_finished(problem.q_view(out, run), smax, ssum,
                                head_values(problem.sink, smax.dtype, smax.device))
