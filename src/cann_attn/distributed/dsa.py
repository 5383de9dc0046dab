"""DSA under context parallelism (docs/guides/context_parallel.md), as the DeepSeek-V3.2 recipes do it: every
sequence tensor (queries, query_index, weights, sparse_indices rows, softmax statistics rows) is sharded like the
queries; the N2 = 1 latent key/value, key_rope and the indexer keys are all-gathered once per call, so indices stay
in global positions; the gradients of the gathered tensors are reduce-scattered back to their shards.

A rank's query chunk [g0, g0 + n) of a sequence with Sq queries and Skv keys sees, under sparse_mode 3, the keys
s <= Skv - Sq + t (t global). Each chunk runs as its own call with the actual key length Skv - Sq + g0 + n: the
operators' causal threshold (Lk - Lq + t_local + 1) is then the global one, and keys past it are never read.
BSND without actual lengths (every sequence full).
"""

from __future__ import annotations

import torch

from .. import autograd as single
from ..errors import ParamInvalidError
from ..ops.lightning_indexer import LightningIndexerResult, count_tokens_with_keys
from ..ops.lightning_indexer import lightning_indexer as single_indexer
from . import comm
from .plan import SequencePlan

SEQ = 1  # the sequence axis of BSND tensors


class GatherSequenceCopies(torch.autograd.Function):
    """`copies` separate whole tensors from one shard (one per chunk call). Backward: the copies' gradients
    (the operator's dtype) are summed in fp32 and reduce-scattered in fp32, then cast once, so that the gathered
    tensor's gradient adds each call's partial gradient without rounding every partial sum to bf16."""

    @staticmethod
    def forward(ctx, x, group: comm.Group, plan: SequencePlan, copies: int):
        ctx.group, ctx.plan, ctx.dtype = group, plan, x.dtype
        whole = gather_sequence(group, plan, x)
        return tuple(whole if i == 0 else whole.clone() for i in range(copies))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        group, plan = ctx.group, ctx.plan
        present = [g for g in grads if g is not None]
        total = present[0].to(torch.float32)
        for g in present[1:]:
            total = total + g.to(torch.float32)
        rank_major = torch.cat([plan.global_index(r, total.device) for r in range(group.world)])
        moved = total.movedim(SEQ, 0).index_select(0, rank_major)
        return comm.reduce_scatter_rank_major(group, moved).movedim(0, SEQ).to(ctx.dtype), None, None, None


def gather_sequence(group: comm.Group, plan: SequencePlan, x: torch.Tensor) -> torch.Tensor:
    gathered = comm.all_gather_rank_major(group, x.detach().movedim(SEQ, 0))
    return gathered.index_select(0, plan.gather_order(x.device)).movedim(0, SEQ).contiguous()


def _chunks(plan: SequencePlan, rank: int, seq_q: int, seq_kv: int, sparse_mode: int):
    """(local rows slice, key length of the call) of every chunk this rank holds."""
    n = plan.chunk_len(0)
    out = []
    for slot, c in enumerate(plan.ids(rank)):
        kv_len = max(0, seq_kv - seq_q + c * n + n) if sparse_mode == 3 else seq_kv
        out.append((slice(slot * n, slot * n + n), kv_len))
    return out


def _setup(name: str, tensors: dict, group, timeout, load_balance, layout, extra: dict):
    """Validates one rank's call and agrees with the others; returns (group, plan, Sq, Skv)."""
    first = next(t for t in tensors.values() if isinstance(t, torch.Tensor))
    info = comm.resolve_group(group, timeout, first.device)
    error, signature, result = None, {}, None
    try:
        if layout != "BSND":
            raise ParamInvalidError(f"layout: {name} under context parallelism supports 'BSND', got {layout!r}")
        for key in ("actual_seq_lengths_query", "actual_seq_lengths_kv", "actual_seq_lengths_key"):
            if extra.get(key) is not None:
                raise ParamInvalidError(f"{key}: not supported under context parallelism (full sequences only)")
        q_name, kv_name = extra["q_name"], extra["kv_name"]
        seq_q = tensors[q_name].shape[SEQ] * info.world
        seq_kv = tensors[kv_name].shape[SEQ] * info.world
        plan = SequencePlan((seq_q,), info.world, load_balance)
        SequencePlan((seq_kv,), info.world, load_balance)
        result = (plan, seq_q, seq_kv)
        signature = {k: (list(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else t
                     for k, t in tensors.items()}
        signature.update({k: v for k, v in extra.items() if not k.startswith("actual")}, load_balance=load_balance)
    except Exception as exc:
        error = exc
    comm.agree(info, signature, error)
    return (info, *result)


def sparse_attention(query, key, value, sparse_indices, scale_value, *, query_rope=None, key_rope=None,
                     sparse_block_size: int = 1, layout: str = "BSND", sparse_mode: int = 3,
                     actual_seq_lengths_query=None, actual_seq_lengths_kv=None, deterministic: bool = False,
                     group=None, load_balance: str | None = "head_tail", timeout=None,
                     backend: str = "auto") -> torch.Tensor:
    """Context-parallel `cann_attn.sparse_attention`: this rank's query shard (and its sparse_indices rows, in
    global key positions) against the all-gathered latent key/value; returns this rank's output shard.
    Differentiable: d_key / d_value / d_key_rope are reduce-scattered to their shards."""
    group, plan, seq_q, seq_kv = _setup(
        "sparse_attention", dict(query=query, key=key, value=value, sparse_indices=sparse_indices,
                                 query_rope=query_rope, key_rope=key_rope),
        group, timeout, load_balance, layout,
        dict(q_name="query", kv_name="key", scale=float(scale_value), block=sparse_block_size, mode=sparse_mode,
             value_is_key=value is key, actual_seq_lengths_query=actual_seq_lengths_query,
             actual_seq_lengths_kv=actual_seq_lengths_kv))
    kv_plan = SequencePlan((seq_kv,), group.world, load_balance)
    chunks = _chunks(plan, group.rank, seq_q, seq_kv, sparse_mode)
    keys = GatherSequenceCopies.apply(key, group, kv_plan, len(chunks))
    values = keys if value is key else GatherSequenceCopies.apply(value, group, kv_plan, len(chunks))
    ropes = [None] * len(chunks) if key_rope is None else GatherSequenceCopies.apply(key_rope, group, kv_plan,
                                                                                      len(chunks))
    outs = []
    for (rows, kv_len), key_all, value_all, rope_all in zip(chunks, keys, values, ropes, strict=True):
        outs.append(single.sparse_attention(
            query[:, rows], key_all, value_all, sparse_indices[:, rows], scale_value,
            query_rope=None if query_rope is None else query_rope[:, rows], key_rope=rope_all,
            actual_seq_lengths_kv=[kv_len] * query.shape[0], sparse_block_size=sparse_block_size, layout=layout,
            sparse_mode=sparse_mode, deterministic=deterministic, backend=backend))
    return torch.cat(outs, dim=SEQ)


def lightning_indexer(query_index, key_index, weights, *, sparse_count: int = 2048, sparse_mode: int = 3,
                      layout: str = "BSND", return_value: bool = False, actual_seq_lengths_query=None,
                      actual_seq_lengths_key=None, group=None, load_balance: str | None = "head_tail", timeout=None,
                      backend: str = "auto") -> LightningIndexerResult:
    """Context-parallel `lightning_indexer`: top-k keys (global positions) of this rank's query_index / weights
    rows against the all-gathered key_index."""
    group, plan, seq_q, seq_kv = _setup(
        "lightning_indexer", dict(query_index=query_index, key_index=key_index, weights=weights), group, timeout,
        load_balance, layout,
        dict(q_name="query_index", kv_name="key_index", count=sparse_count, mode=sparse_mode,
             values=return_value, actual_seq_lengths_query=actual_seq_lengths_query,
             actual_seq_lengths_key=actual_seq_lengths_key))
    keys = gather_sequence(group, SequencePlan((seq_kv,), group.world, load_balance), key_index)
    indices, values = [], []
    for rows, kv_len in _chunks(plan, group.rank, seq_q, seq_kv, sparse_mode):
        result = single_indexer(query_index[:, rows], keys, weights[:, rows],
                                actual_seq_lengths_key=[kv_len] * query_index.shape[0], layout=layout,
                                sparse_count=sparse_count, sparse_mode=sparse_mode, return_value=return_value,
                                backend=backend)
        indices.append(result.sparse_indices)
        values.append(result.sparse_values)
    return LightningIndexerResult(torch.cat(indices, dim=SEQ),
                                  torch.cat(values, dim=SEQ) if return_value else None)


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
    softmax_max / softmax_sum ([B, N2, S1, G]) are sharded on S1 like the queries."""
    if reduction not in ("sum", "mean"):
        raise ParamInvalidError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    group, plan, seq_q, seq_kv = _setup(
        "indexer_kl_loss", dict(query=query, key=key, query_index=query_index, key_index=key_index, weights=weights,
                                sparse_indices=sparse_indices, softmax_max=softmax_max, softmax_sum=softmax_sum,
                                query_rope=query_rope, key_rope=key_rope),
        group, timeout, load_balance, layout,
        dict(q_name="query", kv_name="key", scale=float(scale_value), mode=sparse_mode, reduction=reduction,
             actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_key=actual_seq_lengths_key))
    kv_plan = SequencePlan((seq_kv,), group.world, load_balance)
    key_all = gather_sequence(group, kv_plan, key)
    rope_all = None if key_rope is None else gather_sequence(group, kv_plan, key_rope)
    chunks = _chunks(plan, group.rank, seq_q, seq_kv, sparse_mode)
    key_indices = GatherSequenceCopies.apply(key_index, group, kv_plan, len(chunks))
    total, count = None, 0
    for (rows, kv_len), key_index_all in zip(chunks, key_indices, strict=True):
        lengths = [kv_len] * query.shape[0]
        stat_rows = (slice(None), slice(None), rows)
        part = single.indexer_kl_loss(
            query[:, rows], key_all, query_index[:, rows], key_index_all, weights[:, rows], sparse_indices[:, rows],
            softmax_max[stat_rows], softmax_sum[stat_rows], scale_value,
            query_rope=None if query_rope is None else query_rope[:, rows], key_rope=rope_all,
            actual_seq_lengths_key=lengths, layout=layout, sparse_mode=sparse_mode, deterministic=deterministic,
            reduction="sum", backend=backend)
        total = part if total is None else total + part
        if reduction == "mean":
            count += count_tokens_with_keys(query_index[:, rows], key_index_all, sparse_indices[:, rows], layout,
                                            sparse_mode, None, lengths)
    loss = _AllReduceSum.apply(total, group)
    if reduction == "mean":
        tokens = comm.all_reduce_sum(group, torch.tensor([float(count)], device=loss.device))
        loss = loss / tokens.clamp(min=1.0).reshape(())
    return loss
