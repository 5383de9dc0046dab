"""Ulysses attention (docs/guides/context_parallel.md): an all-to-all turns sequence shards of every head into the
whole sequence of N/P heads; each rank runs FlashAttentionScore on its heads (the whole sequence, so masks and ALiBi
are those of the single-process call); a second all-to-all turns the output back into sequence shards. The backward
is the same exchange in reverse around FlashAttentionScoreGrad."""

from __future__ import annotations

import torch

from . import comm
from .plan import SequencePlan


def seq_to_head(group: comm.Group, plan: SequencePlan, x: torch.Tensor) -> torch.Tensor:
    """[T_local, N, D] sequence shard -> [T, N/P, D]: this rank's heads over the whole packed sequence."""
    world = group.world
    tokens, heads, dim = x.shape
    parts = x.reshape(tokens, world, heads // world, dim).transpose(0, 1)  # part p = heads of rank p
    gathered = comm.all_to_all(group, parts.contiguous())  # part p = rank p's tokens of my heads
    rank_major = gathered.reshape(world * tokens, heads // world, dim)
    return rank_major.index_select(0, plan.gather_order(x.device))


def head_to_seq(group: comm.Group, plan: SequencePlan, x: torch.Tensor) -> torch.Tensor:
    """Inverse of `seq_to_head`: [T, N/P, D] -> [T_local, N, D]."""
    world = group.world
    rank_major_index = torch.cat([plan.global_index(r, x.device) for r in range(world)])
    parts = x.index_select(0, rank_major_index).reshape(world, plan.local_total, x.shape[1], x.shape[2])
    back = comm.all_to_all(group, parts)  # part p = my tokens of rank p's heads
    return back.transpose(0, 1).reshape(plan.local_total, world * x.shape[1], x.shape[2])


class SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: comm.Group, plan: SequencePlan):
        ctx.group, ctx.plan = group, plan
        return seq_to_head(group, plan, x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return head_to_seq(ctx.group, ctx.plan, grad.contiguous()), None, None


class HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: comm.Group, plan: SequencePlan):
        ctx.group, ctx.plan = group, plan
        return head_to_seq(group, plan, x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return seq_to_head(ctx.group, ctx.plan, grad.contiguous()), None, None
