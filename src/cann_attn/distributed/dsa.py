"""DSA under context parallelism (docs/guides/context_parallel.md), as the DeepSeek-V3.2 recipes do it: every
sequence tensor (queries, query_index, weights, sparse_indices rows, softmax statistics rows) is sharded like the
queries; the N2 = 1 latent key/value, key_rope and the indexer keys are all-gathered once per call, so indices stay
in global positions; the gradients of the gathered tensors are reduce-scattered back to their shards.

A rank's query chunk [g0, g0 + n) of a sequence with Sq queries and Skv keys sees, under sparse_mode 3, the keys
s <= Skv - Sq + t (t global). Each chunk slot runs as its own call with the actual key length Skv - Sq + g0 + n: the
operators' causal threshold (Lk - Lq + t_local + 1) is then the global one, and keys past it are never read.
BSND (whole sequences) and TND (the global cumulative lengths on every rank, as for FlashAttention).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from .. import autograd as single
from ..errors import ParamInvalidError
from ..ops.lightning_indexer import LightningIndexerResult, count_tokens_with_keys
from ..ops.lightning_indexer import lightning_indexer as single_indexer
from ..problem.lengths import lengths_of_ends, require_same_sequence_count
from . import comm
from .plan import SequencePlan


@dataclass(frozen=True)
class Layout:
    """Where the sequence axis of each tensor kind is, and the split of the queries and keys."""

    tnd: bool
    plan: SequencePlan
    kv_plan: SequencePlan
    batch: int

    @property
    def seq(self) -> int:
        return 0 if self.tnd else 1

    @property
    def stat_seq(self) -> int:
        """Sequence axis of SFA statistics: [B, N2, S1, G] or [N2, T1, G]."""
        return 1 if self.tnd else 2


@dataclass(frozen=True)
class Slot:
    """One operator call: this rank's `slot`-th chunk of every sequence, with the keys its rows may see."""

    q_rows: torch.Tensor  # int64 local rows (sequence axis)
    kv_rows: torch.Tensor | None  # TND: int64 rows of the gathered packed keys; BSND: None (every key)
    kwargs: dict  # the call's actual lengths


def _slots(layout: Layout, rank: int, sparse_mode: int, kv_name: str, device) -> list[Slot]:
    plan, kv_plan = layout.plan, layout.kv_plan
    slots = []
    for slot, c in enumerate(plan.ids(rank)):
        q_rows, kv_rows, q_lengths, kv_lengths = [], [], [], []
        for b in range(len(plan.lengths)):
            n = plan.chunk_len(b)
            start, _ = plan.local_chunk(b, slot)
            q_rows.append(torch.arange(start, start + n, dtype=torch.int64, device=device))
            seen = kv_plan.lengths[b] - plan.lengths[b] + c * n + n if sparse_mode == 3 else kv_plan.lengths[b]
            seen = max(0, min(kv_plan.lengths[b], seen))
            kv_rows.append(torch.arange(kv_plan.global_starts[b], kv_plan.global_starts[b] + seen,
                                        dtype=torch.int64, device=device))
            q_lengths.append(n)
            kv_lengths.append(seen)
        if layout.tnd:
            kwargs = {"actual_seq_lengths_query": list(accumulate(q_lengths)),
                      f"actual_seq_lengths_{kv_name}": list(accumulate(kv_lengths))}
            slots.append(Slot(torch.cat(q_rows), torch.cat(kv_rows), kwargs))
        else:
            kwargs = {f"actual_seq_lengths_{kv_name}": kv_lengths * layout.batch}
            slots.append(Slot(q_rows[0], None, kwargs))
    return slots


def _rows(layout: Layout, x, slot: Slot, stat: bool = False):
    if x is None:
        return None
    return x.index_select(layout.stat_seq if stat else layout.seq, slot.q_rows)


def _keys(layout: Layout, x, slot: Slot):
    if x is None or slot.kv_rows is None:
        return x
    return x.index_select(0, slot.kv_rows)


def _assemble(layout: Layout, parts: list[torch.Tensor], slots: list[Slot]) -> torch.Tensor:
    """The slots' outputs back in shard order (a differentiable permutation)."""
    whole = torch.cat(parts, dim=layout.seq)
    order = torch.cat([s.q_rows for s in slots])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    return whole.index_select(layout.seq, inverse)


class GatherSequenceCopies(torch.autograd.Function):
    """`copies` separate whole tensors from one shard (one per slot call). Backward: the copies' gradients
    (the operator's dtype) are summed in fp32 and reduce-scattered in fp32, then cast once, so that the gathered
    tensor's gradient adds each call's partial gradient without rounding every partial sum to bf16."""

    @staticmethod
    def forward(ctx, x, group: comm.Group, plan: SequencePlan, copies: int, dim: int):
        ctx.group, ctx.plan, ctx.dtype, ctx.dim = group, plan, x.dtype, dim
        whole = gather_sequence(group, plan, x, dim)
        return tuple(whole if i == 0 else whole.clone() for i in range(copies))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        group, plan, dim = ctx.group, ctx.plan, ctx.dim
        present = [g for g in grads if g is not None]
        total = present[0].to(torch.float32)
        for g in present[1:]:
            total = total + g.to(torch.float32)
        rank_major = torch.cat([plan.global_index(r, total.device) for r in range(group.world)])
        moved = total.movedim(dim, 0).index_select(0, rank_major)
        grad = comm.reduce_scatter_rank_major(group, moved).movedim(0, dim).to(ctx.dtype)
        return grad, None, None, None, None


def gather_sequence(group: comm.Group, plan: SequencePlan, x: torch.Tensor, dim: int) -> torch.Tensor:
    gathered = comm.all_gather_rank_major(group, x.detach().movedim(dim, 0))
    return gathered.index_select(0, plan.gather_order(x.device)).movedim(0, dim).contiguous()


def _setup(name: str, tensors: dict, group, timeout, load_balance, layout: str, extra: dict):
    """Validates one rank's call and agrees with the others; returns (group, Layout)."""
    first = next(t for t in tensors.values() if isinstance(t, torch.Tensor))
    info = comm.resolve_group(group, timeout, first.device)
    error, signature, result = None, {}, None
    try:
        if layout not in ("BSND", "TND"):
            raise ParamInvalidError(f"layout: expected 'BSND' or 'TND', got {layout!r}")
        q_key, kv_key = "actual_seq_lengths_query", extra["kv_lengths_name"]
        q_ends, kv_ends = extra.get(q_key), extra.get(kv_key)
        query, keys = tensors[extra["q_name"]], tensors[extra["kv_name"]]
        if layout == "TND":
            if q_ends is None or kv_ends is None:
                raise ParamInvalidError(f"{q_key}/{kv_key}: TND under context parallelism needs the global "
                                        f"cumulative lengths of the whole packed sequences on every rank")
            q_lengths = lengths_of_ends(q_ends, q_key)
            kv_lengths = lengths_of_ends(kv_ends, kv_key)
            require_same_sequence_count(q_lengths, kv_lengths, q_key, kv_key)
            batch = len(q_lengths)
        else:
            if q_ends is not None or kv_ends is not None:
                raise ParamInvalidError(f"{q_key}/{kv_key}: BSND under context parallelism takes whole sequences "
                                        f"(no actual lengths)")
            batch = query.shape[0]
            q_lengths, kv_lengths = [query.shape[1] * info.world], [keys.shape[1] * info.world]
        plan = SequencePlan(tuple(q_lengths), info.world, load_balance)
        kv_plan = SequencePlan(tuple(kv_lengths), info.world, load_balance)
        seq = 0 if layout == "TND" else 1
        for label, t, p in ((extra["q_name"], query, plan), (extra["kv_name"], keys, kv_plan)):
            if t.dim() <= seq or t.shape[seq] != p.local_total:
                raise ParamInvalidError(f"{label}: expected a shard of {p.local_total} tokens on axis {seq} for "
                                        f"these lengths over {info.world} ranks, got shape {list(t.shape)}")
        result = Layout(layout == "TND", plan, kv_plan, batch)
        signature = {k: (list(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else t
                     for k, t in tensors.items()}
        signature.update({k: v for k, v in extra.items() if not k.startswith("actual")}, load_balance=load_balance,
                         q_lengths=list(q_lengths), kv_lengths=list(kv_lengths))
    except Exception as exc:
        error = exc
    comm.agree(info, signature, error)
    return info, result


def sparse_attention(query, key, value, sparse_indices, scale_value, *, query_rope=None, key_rope=None,
                     sparse_block_size: int = 1, layout: str = "BSND", sparse_mode: int = 3,
                     actual_seq_lengths_query=None, actual_seq_lengths_kv=None, deterministic: bool = False,
                     group=None, load_balance: str | None = "head_tail", timeout=None,
                     backend: str = "auto") -> torch.Tensor:
    """Context-parallel `cann_attn.sparse_attention`: this rank's query shard (and its sparse_indices rows, in
    global key positions) against the all-gathered latent key/value; returns this rank's output shard.
    Differentiable: d_key / d_value / d_key_rope are reduce-scattered to their shards. TND: the global cumulative
    `actual_seq_lengths_query` / `actual_seq_lengths_kv` on every rank."""
    group, lay = _setup(
        "sparse_attention", dict(query=query, key=key, value=value, sparse_indices=sparse_indices,
                                 query_rope=query_rope, key_rope=key_rope),
        group, timeout, load_balance, layout,
        dict(q_name="query", kv_name="key", kv_lengths_name="actual_seq_lengths_kv", scale=float(scale_value),
             block=sparse_block_size, mode=sparse_mode, value_is_key=value is key,
             actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv))
    slots = _slots(lay, group.rank, sparse_mode, "kv", query.device)
    copies = len(slots)
    keys = GatherSequenceCopies.apply(key, group, lay.kv_plan, copies, lay.seq)
    values = keys if value is key else GatherSequenceCopies.apply(value, group, lay.kv_plan, copies, lay.seq)
    ropes = [None] * copies if key_rope is None else GatherSequenceCopies.apply(key_rope, group, lay.kv_plan,
                                                                                 copies, lay.seq)
    outs = []
    for slot, key_all, value_all, rope_all in zip(slots, keys, values, ropes, strict=True):
        k = _keys(lay, key_all, slot)
        v = k if value is key else _keys(lay, value_all, slot)
        outs.append(single.sparse_attention(
            _rows(lay, query, slot), k, v, _rows(lay, sparse_indices, slot), scale_value,
            query_rope=_rows(lay, query_rope, slot), key_rope=_keys(lay, rope_all, slot),
            sparse_block_size=sparse_block_size, layout=layout, sparse_mode=sparse_mode,
            deterministic=deterministic, backend=backend, **slot.kwargs))
    return _assemble(lay, outs, slots)


def lightning_indexer(query_index, key_index, weights, *, sparse_count: int = 2048, sparse_mode: int = 3,
                      layout: str = "BSND", return_value: bool = False, actual_seq_lengths_query=None,
                      actual_seq_lengths_key=None, group=None, load_balance: str | None = "head_tail", timeout=None,
                      backend: str = "auto") -> LightningIndexerResult:
    """Context-parallel `lightning_indexer`: top-k keys (global positions; TND: positions in the sequence's own
    keys, as the operator) of this rank's query_index / weights rows against the all-gathered key_index."""
    group, lay = _setup(
        "lightning_indexer", dict(query_index=query_index, key_index=key_index, weights=weights), group, timeout,
        load_balance, layout,
        dict(q_name="query_index", kv_name="key_index", kv_lengths_name="actual_seq_lengths_key",
             count=sparse_count, mode=sparse_mode, values=return_value,
             actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_key=actual_seq_lengths_key))
    keys = gather_sequence(group, lay.kv_plan, key_index, lay.seq)
    slots = _slots(lay, group.rank, sparse_mode, "key", query_index.device)
    indices, values = [], []
    for slot in slots:
        result = single_indexer(_rows(lay, query_index, slot), _keys(lay, keys, slot), _rows(lay, weights, slot),
                                layout=layout, sparse_count=sparse_count, sparse_mode=sparse_mode,
                                return_value=return_value, backend=backend, **slot.kwargs)
        indices.append(result.sparse_indices)
        values.append(result.sparse_values)
    return LightningIndexerResult(_assemble(lay, indices, slots),
                                  _assemble(lay, values, slots) if return_value else None)


class _AllReduceSum(torch.autograd.Function):
    """The sum over ranks in the forward; the identity in the backward: each rank's loss is the global one, and
    each rank's gradients are those of the global loss w.r.t. its own shards (the other ranks' terms do not
    depend on them, except through gathered tensors, whose gradients the gather sums)."""

    @staticmethod
    def forward(ctx, x, group: comm.Group):
        return comm.all_reduce_sum(group, x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def indexer_kl_loss(query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum,
                    scale_value, *, query_rope=None, key_rope=None, layout: str = "BSND", sparse_mode: int = 3,
                    actual_seq_lengths_query=None, actual_seq_lengths_key=None, deterministic: bool = False,
                    reduction: str = "sum", group=None, load_balance: str | None = "head_tail", timeout=None,
                    backend: str = "auto") -> torch.Tensor:
    """Context-parallel `indexer_kl_loss`: returns the GLOBAL loss (the sum, or with reduction="mean" the mean over
    every rank's tokens) on every rank. Its backward gives each rank the gradients of that global loss w.r.t. its
    query_index / weights shards and (reduce-scattered) its key_index shard; call backward on every rank once.
    softmax_max / softmax_sum ([B, N2, S1, G] or TND [N2, T1, G]) are sharded on S1 / T1 like the queries."""
    if reduction not in ("sum", "mean"):
        raise ParamInvalidError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    group, lay = _setup(
        "indexer_kl_loss", dict(query=query, key=key, query_index=query_index, key_index=key_index, weights=weights,
                                sparse_indices=sparse_indices, softmax_max=softmax_max, softmax_sum=softmax_sum,
                                query_rope=query_rope, key_rope=key_rope),
        group, timeout, load_balance, layout,
        dict(q_name="query", kv_name="key", kv_lengths_name="actual_seq_lengths_key", scale=float(scale_value),
             mode=sparse_mode, reduction=reduction,
             actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_key=actual_seq_lengths_key))
    key_all = gather_sequence(group, lay.kv_plan, key, lay.seq)
    rope_all = None if key_rope is None else gather_sequence(group, lay.kv_plan, key_rope, lay.seq)
    slots = _slots(lay, group.rank, sparse_mode, "key", query.device)
    key_indices = GatherSequenceCopies.apply(key_index, group, lay.kv_plan, len(slots), lay.seq)
    total, count = None, 0
    for slot, key_index_all in zip(slots, key_indices, strict=True):
        q_index, k_index, indices = _rows(lay, query_index, slot), _keys(lay, key_index_all, slot), \
            _rows(lay, sparse_indices, slot)
        part = single.indexer_kl_loss(
            _rows(lay, query, slot), _keys(lay, key_all, slot), q_index, k_index, _rows(lay, weights, slot), indices,
            _rows(lay, softmax_max, slot, stat=True), _rows(lay, softmax_sum, slot, stat=True), scale_value,
            query_rope=_rows(lay, query_rope, slot), key_rope=_keys(lay, rope_all, slot), layout=layout,
            sparse_mode=sparse_mode, deterministic=deterministic, reduction="sum", backend=backend, **slot.kwargs)
        total = part if total is None else total + part
        if reduction == "mean":
            count += count_tokens_with_keys(q_index, k_index, indices, layout, sparse_mode,
                                            slot.kwargs.get("actual_seq_lengths_query"),
                                            slot.kwargs["actual_seq_lengths_key"])
    loss = _AllReduceSum.apply(total, group)
    if reduction == "mean":
        tokens = comm.all_reduce_sum(group, torch.tensor([float(count)], device=loss.device))
        loss = loss / tokens.clamp(min=1.0).reshape(())
    return loss
