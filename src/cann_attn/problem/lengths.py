"""Actual sequence lengths (docs/semantics/layouts.md).

TND lengths are cumulative ends without a leading 0 ([2, 4, 6] for three sequences of 2); BSND/BNSD
per-batch lengths (PFA, DSA) are plain lengths. Both Python int sequences and integer tensors are accepted.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from itertools import accumulate, pairwise

import torch

from ..errors import ParamInvalidError, ParamNullptrError, caller_stacklevel, describe

IntList = Sequence[int] | torch.Tensor


def to_int_list(value: IntList | int | None, param: str) -> list[int] | None:
    """Normalise an int, int sequence or integer tensor (0-d or 1-d) to a list of Python ints (None stays None).
    Items are Python or NumPy integers or 0-d integer tensors: `True` and `7.0` are refused rather than converted,
    and so is a tensor of two or more dimensions rather than flattened (docs/semantics/errors.md)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or value.dim() > 1:
            raise ParamInvalidError(f"{param}: expected an integer list or a 1-d integer tensor, got {describe(value)}")
        return [int(x) for x in value.reshape(-1).tolist()]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return [int(value)]
    if isinstance(value, (str, bytes)):
        raise ParamInvalidError(f"{param}: expected a list of ints, got {value!r}")
    try:
        items = list(value)
    except TypeError:
        raise ParamInvalidError(f"{param}: expected a list of ints, got {value!r}") from None
    out = []
    for item in items:
        integer_tensor = isinstance(item, torch.Tensor) and item.dim() == 0 and not (
            item.is_floating_point() or item.is_complex() or item.dtype == torch.bool)
        if integer_tensor or (isinstance(item, numbers.Integral) and not isinstance(item, bool)):
            out.append(int(item))
        else:
            raise ParamInvalidError(f"{param}: expected a list of ints, got {value!r} (item {item!r})")
    return out


def ends_without_trailing_zeros(value: IntList | None, param: str) -> list[int] | None:
    """Cumulative TND ends with torch_npu's form for batches left out at the end: "TND格式下，支持尾部部分Batch不参与
    计算，此时actual_seq_qlen和actual_seq_kvlen尾部传入对应个数个0即可" (npu_fusion_attention constraints; real lengths
    [2, 3, 4, 5, 6] with the last two left out are passed as [2, 5, 9, 0, 0]). Those trailing zeros become empty
    sequences, [2, 5, 9, 9, 9]: the batch count keeps them (docs/semantics/layouts.md)."""
    ends = to_int_list(value, param)
    if not ends:
        return ends
    kept = len(ends)
    while kept > 0 and ends[kept - 1] == 0:
        kept -= 1
    if kept in (0, len(ends)):
        return ends
    return ends[:kept] + [ends[kept - 1]] * (len(ends) - kept)


def cumulative_lengths(value: IntList | None, total: int, param: str, *, eod_padding: bool = False) -> list[int]:
    """Per-sequence lengths from TND cumulative ends; the last end must be the token count `total`.

    With `eod_padding` (the FlashAttentionScore family) the end-of-document padded form is accepted: trailing zero
    ends are empty sequences (:func:`ends_without_trailing_zeros`) and the last end may be smaller than `total`;
    the tokens past it are padding that no sequence owns (docs/semantics/layouts.md, "End-of-document padding";
    the kernel's tiling checks only T >= the sum of the lengths).
    """
    ends = ends_without_trailing_zeros(value, param) if eod_padding else to_int_list(value, param)
    if ends is None:
        raise ParamNullptrError(f"{param}: required for the TND layout (cumulative sequence ends), got None")
    if len(ends) == 0:
        raise ParamInvalidError(f"{param}: expected at least one cumulative length, got []")
    lengths = _differences(ends, param, total)
    previous = ends[-1]
    if eod_padding and previous > total:
        raise ParamInvalidError(
            f"{param}: the last cumulative length must be at most the tensor's T={total}, got {ends}"
            f"{_prefix_sums_hint(ends, total)}"
        )
    if not eod_padding and previous != total:
        raise ParamInvalidError(
            f"{param}: the last cumulative length must equal the tensor's T={total}, got {ends}"
            f"{_prefix_sums_hint(ends, total)}"
        )
    hint = _prefix_sums_hint(ends, total) if previous < total else ""
    if hint:
        # Valid (the tokens past the last end are end-of-document padding), but the usual slip: lengths per sequence.
        warnings.warn(f"{param}: {ends} leaves {total - previous} of T={total} tokens to no sequence (their output "
                      f"is 0){hint}", UserWarning, stacklevel=caller_stacklevel())
    return lengths


def _prefix_sums_hint(ends: list[int], total: int) -> str:
    """When `ends` read as lengths per sequence would fill the T tokens exactly, the sentence that says so: TND
    lengths are prefix sums (docs/semantics/layouts.md), and per-sequence lengths are the common mistake."""
    if len(ends) < 2 or min(ends) < 0 or sum(ends) != total:
        return ""
    return (f"; they are cumulative ends (prefix sums): if {ends} are the lengths of the sequences, pass "
            f"{list(accumulate(ends))}")


def lengths_of_ends(value: IntList | None, param: str) -> list[int]:
    """Per-sequence lengths from cumulative ends without a leading 0 when no tensor fixes the total (context-parallel
    plans, where the ends describe the whole sequence and every rank holds a part; docs/semantics/layouts.md)."""
    ends = to_int_list(value, param)
    if ends is None:
        raise ParamInvalidError(f"{param}: expected cumulative sequence ends (ints), got None")
    return _differences(ends, param)


def _differences(ends: list[int], param: str, total: int | None = None) -> list[int]:
    previous = 0
    lengths = []
    for end in ends:
        if end < previous:
            hint = _prefix_sums_hint(ends, total) if total is not None else ""
            raise ParamInvalidError(
                f"{param}: cumulative lengths (no leading 0) must be non-decreasing and >= 0, got {ends}{hint}"
            )
        lengths.append(end - previous)
        previous = end
    return lengths


def require_same_sequence_count(q_lengths: Sequence[int], kv_lengths: Sequence[int], q_param: str,
                                kv_param: str) -> None:
    """Query and key/value lengths describe the same sequences, one entry each (docs/semantics/layouts.md)."""
    if len(kv_lengths) != len(q_lengths):
        raise ParamInvalidError(f"{kv_param}: expected as many sequences as {q_param} ({len(q_lengths)}), "
                                f"got {len(kv_lengths)}")


def padding_tokens(lengths: Sequence[int], total: int) -> int:
    """Tokens of a TND tensor past its last sequence (end-of-document padding): they produce 0 output, invalid-row
    statistics and zero gradients, and are never read as keys (docs/semantics/layouts.md)."""
    return total - sum(lengths)


def starts_of(lengths: Sequence[int]) -> list[int]:
    """Token offset of each sequence in a packed (TND) tensor."""
    starts, acc = [], 0
    for length in lengths:
        starts.append(acc)
        acc += length
    return starts


def per_batch_lengths(value: IntList | int | None, param: str, batch: int, seq: int | None, *,
                      broadcast: bool = True) -> list[int]:
    """Per-batch actual lengths of a BSND/BNSD tensor (PFA and DSA ops): None -> S for every batch; one value ->
    used for every batch (unless not `broadcast`); >= B values -> the first B; anything else is an error. Each must
    be in [0, S] (`seq` None: no upper bound, the paged caches' case)."""
    lengths = to_int_list(value, param)
    if lengths is None:
        return [seq] * batch
    if len(lengths) == 1 and (broadcast or batch == 1):
        lengths = lengths * batch
    elif len(lengths) >= batch:
        lengths = lengths[:batch]
    else:
        expected = f"None, one value or at least B={batch} values" if broadcast else \
            f"one value per sequence (B={batch})"
        raise ParamInvalidError(f"{param}: expected {expected}, got {lengths}")
    for b, length in enumerate(lengths):
        if seq is None and length < 0:
            raise ParamInvalidError(f"{param}: batch {b} length must be >= 0, got {length}")
        if seq is not None and not 0 <= length <= seq:
            raise ParamInvalidError(f"{param}: batch {b} length must be in [0, {seq}] (the tensor's S), got {length}")
    return lengths


def zero_based_cumulative_lengths(value: IntList | None, total: int, param: str) -> list[int]:
    """Per-sequence lengths from cumulative ends WITH a leading 0 ([0, 2, 5] for lengths 2 and 3), the form of
    RingAttentionUpdate's actual_seq_qlen (docs/operators/ring_attention_update.md): non-decreasing from 0, the
    last end at most the token count `total` (tokens past it are end-of-document padding). A tensor must be int64
    (the documented dtype)."""
    if value is None:
        raise ParamNullptrError(f"{param}: required for the TND layout (cumulative lengths from 0), got None")
    if isinstance(value, torch.Tensor) and value.dtype != torch.int64:
        raise ParamInvalidError(f"{param}: expected an int64 tensor, got {describe(value)}")
    if isinstance(value, torch.Tensor) and value.dim() > 1:
        raise ParamInvalidError(f"{param}: expected a 1-D tensor, got {describe(value)}")
    ends = to_int_list(value, param)
    if not ends or ends[0] != 0:
        raise ParamInvalidError(f"{param}: expected cumulative lengths starting at 0 ([0, S_1, S_1 + S_2, ...]), "
                                f"got {ends}")
    if any(b < a for a, b in pairwise(ends)):
        raise ParamInvalidError(f"{param}: cumulative lengths must be non-decreasing, got {ends}")
    if ends[-1] > total:
        raise ParamInvalidError(f"{param}: the last cumulative length must be at most the tensor's T={total}, "
                                f"got {ends}")
    return [b - a for a, b in pairwise(ends)]
