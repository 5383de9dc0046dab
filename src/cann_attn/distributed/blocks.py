"""The FlashAttentionScore calls of context-parallel attention: which (query chunk, key chunk) pairs of which
sequences one call computes, with which mask, ALiBi start indices and dropout bits (docs/guides/context_parallel.md).

Everything works on the packed form [T, N, D] (dense layouts are B sequences of equal length), so one call serves
every sequence whose block has the same mask and ALiBi offsets: all B sequences of a dense layout, and in TND every
document alike for no mask and the causal modes (their blocks are full, diagonal or skipped alike); band and ALiBi
blocks of documents of different lengths get a call per distinct offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from ..ops.flash_attention_score import flash_attention_score
from ..ops.flash_attention_score_grad import flash_attention_score_grad
from ..problem.context_blocks import BlockMask, Window, block_mask
from ..problem.dropout import block_elements, pack_bits, positional_keep, sequence_bases
from ..problem.stats import STAT_WIDTH, accumulation_dtype
from .plan import SequencePlan

ALIBI_TYPES = (2, 3)


@dataclass(frozen=True)
class AttentionSetup:
    """What every block call of one context-parallel attention shares."""

    q_plan: SequencePlan
    kv_plan: SequencePlan
    windows: tuple[Window, ...]  # per sequence
    head_num: int  # query heads this rank computes
    head_offset: int  # global index of its first head (Ulysses); the dropout bits are keyed by global heads
    total_heads: int
    pse: torch.Tensor | None  # ALiBi slopes ([B, N] or [N]) of this rank's heads, or None
    pse_type: int
    q_start: int
    kv_start: int
    scale_value: float
    keep_prob: float
    seed: int
    inner_precise: int
    backend: str
    atten_mask: torch.Tensor | None  # the compressed mask band blocks pass
    # The start of each sequence's [N, Sq_b, Skv_b] run in the logical drop mask (docs/semantics/dropout.md).
    drop_bases: tuple[int, ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "drop_bases", sequence_bases(self.total_heads, self.q_plan.lengths,
                                                              self.kv_plan.lengths))


@dataclass(frozen=True)
class BlockCall:
    """One FlashAttentionScore call over (query chunk, key chunk) blocks of several sequences."""

    mask: BlockMask
    seqs: tuple[int, ...]
    q_rows: torch.Tensor  # int64 rows of this rank's packed queries
    kv_rows: torch.Tensor  # int64 rows of the packed keys of the rank the keys came from
    q_offsets: tuple[int, ...]  # per sequence, global position of the block's first query row / key column
    kv_offsets: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    q_start: int
    kv_start: int
    q_slot: int
    q_span: tuple[int, int] | None  # (start, length) when q_rows are one contiguous range: views, no copies
    kv_span: tuple[int, int] | None


def _span(rows: list[torch.Tensor]) -> tuple[int, int] | None:
    """(start, length) when the ranges follow one another without a gap."""
    start, total = int(rows[0][0]) if rows[0].numel() else 0, 0
    for r in rows:
        if r.numel() and int(r[0]) != start + total:
            return None
        total += r.numel()
    return start, total


def take(x: torch.Tensor, rows: torch.Tensor, span: tuple[int, int] | None, dim: int = 0) -> torch.Tensor:
    """The rows of x along dim: a view when they are contiguous, else a copy."""
    return x.narrow(dim, span[0], span[1]) if span is not None else x.index_select(dim, rows)


def plan_calls(setup: AttentionSetup, q_rank: int, kv_rank: int, device) -> list[BlockCall]:
    """The calls that compute rank `q_rank`'s queries against the keys rank `kv_rank` holds (in shard order)."""
    alibi = setup.pse is not None and setup.pse_type in ALIBI_TYPES
    groups: dict[tuple, list] = {}
    for b in range(len(setup.q_plan.lengths)):
        for q_slot, cq in enumerate(setup.q_plan.ids(q_rank)):
            for kv_slot, ck in enumerate(setup.kv_plan.ids(kv_rank)):
                rows, cols = setup.q_plan.chunk_len(b), setup.kv_plan.chunk_len(b)
                qo, ko = cq * rows, ck * cols
                mask = block_mask(setup.windows[b], qo, ko, rows, cols)
                if mask.kind == "skip":
                    continue
                # One call never holds a query row twice (its merge would overwrite itself): slots are part of the key.
                key = (q_slot, kv_slot, mask, qo if alibi else 0, ko if alibi else 0)
                groups.setdefault(key, []).append((b, q_slot, kv_slot, qo, ko, rows, cols))
    calls = []
    for (q_slot, _, mask, qo_key, ko_key), members in groups.items():
        q_rows, kv_rows = [], []
        for b, q_slot_b, kv_slot, _, _, _, _ in members:
            start, n = setup.q_plan.local_chunk(b, q_slot_b)
            q_rows.append(torch.arange(start, start + n, dtype=torch.int64, device=device))
            start, n = setup.kv_plan.local_chunk(b, kv_slot)
            kv_rows.append(torch.arange(start, start + n, dtype=torch.int64, device=device))
        calls.append(BlockCall(
            mask, tuple(m[0] for m in members), torch.cat(q_rows), torch.cat(kv_rows), tuple(m[3] for m in members),
            tuple(m[4] for m in members), tuple(m[5] for m in members), tuple(m[6] for m in members),
            setup.q_start + qo_key, setup.kv_start + ko_key, q_slot, _span(q_rows), _span(kv_rows)))
    return calls


def drop_mask(setup: AttentionSetup, call: BlockCall, device) -> torch.Tensor | None:
    """The packed keep bits of the call's blocks: each element's bit is its bit in the logical mask of the whole
    problem (positional_keep keyed by its global element index), so the bits do not depend on the world size."""
    if setup.keep_prob >= 1.0:
        return None
    heads = range(setup.head_offset, setup.head_offset + setup.head_num)
    parts = [block_elements(setup.drop_bases[b], setup.q_plan.lengths[b], setup.kv_plan.lengths[b], heads,
                            range(qo, qo + rows), range(ko, ko + cols), device)
             for b, qo, ko, rows, cols in zip(call.seqs, call.q_offsets, call.kv_offsets, call.rows, call.cols,
                                              strict=True)]
    return pack_bits(positional_keep(setup.seed, torch.cat(parts), setup.keep_prob))


def _options(setup: AttentionSetup, call: BlockCall) -> dict:
    band = call.mask.kind == "band"
    pse = setup.pse
    if pse is not None and pse.dim() == 2:
        pse = pse[list(call.seqs)]
    return dict(
        pse=pse, atten_mask=setup.atten_mask if band else None,
        actual_seq_qlen=list(accumulate(call.rows)), actual_seq_kvlen=list(accumulate(call.cols)),
        q_start_idx=[call.q_start], kv_start_idx=[call.kv_start], scale_value=setup.scale_value,
        keep_prob=setup.keep_prob, pre_tokens=call.mask.pre_tokens, next_tokens=call.mask.next_tokens,
        inner_precise=setup.inner_precise, sparse_mode=4 if band else 0,
        pse_type=setup.pse_type, softmax_layout="TND", backend=setup.backend)


def _rows(x: torch.Tensor, rows: torch.Tensor, span) -> torch.Tensor:
    """The rows, upcast to the accumulation dtype: fp16/bf16 blocks run on exact fp32 copies, so that the merged
    result is rounded to the input dtype once, as the single-process operator rounds its fp32 accumulators once
    (a per-block rounding before the merge would add one rounding per block)."""
    return take(x, rows, span).to(accumulation_dtype(x.dtype))


def block_forward(setup: AttentionSetup, call: BlockCall, query, key, value):
    """(out [N, rows, Dv], max [N, rows], sum [N, rows]) of the call, rows in `call.q_rows` order."""
    q, k, v = (_rows(query, call.q_rows, call.q_span), _rows(key, call.kv_rows, call.kv_span),
               _rows(value, call.kv_rows, call.kv_span))
    result = flash_attention_score(q, k, v, setup.head_num, "TND", drop_mask=drop_mask(setup, call, q.device),
                                   **_options(setup, call))
    return (result.attention_out.transpose(0, 1), result.softmax_max[..., 0].transpose(0, 1),
            result.softmax_sum[..., 0].transpose(0, 1))


def block_backward(setup: AttentionSetup, call: BlockCall, query, key, value, d_out, out, softmax_max, softmax_sum):
    """(dq, dk, dv) of the call's blocks given the merged output and statistics ([N, T] for this rank's rows)."""
    q, k, v = (_rows(query, call.q_rows, call.q_span), _rows(key, call.kv_rows, call.kv_span),
               _rows(value, call.kv_rows, call.kv_span))
    stats = [take(s, call.q_rows, call.q_span, 1).transpose(0, 1).unsqueeze(-1).expand(-1, -1, STAT_WIDTH)
             .contiguous() for s in (softmax_max, softmax_sum)]
    grads = flash_attention_score_grad(
        q, k, v, _rows(d_out, call.q_rows, call.q_span), setup.head_num, "TND",
        drop_mask=drop_mask(setup, call, q.device), softmax_max=stats[0], softmax_sum=stats[1],
        attention_in=_rows(out, call.q_rows, call.q_span), **_options(setup, call))
    return grads.dq, grads.dk, grads.dv
