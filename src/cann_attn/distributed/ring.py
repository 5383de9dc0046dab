"""Ring attention (docs/guides/context_parallel.md): each rank keeps its queries; the key/value shards travel
around the ring with isend/irecv, the next hop posted before the current block is computed (overlap), and each
block's output is merged into the running result by the one merge rule (problem/merge.py, RingAttentionUpdate's
softmax max/sum form). The backward runs the ring again with the merged output and statistics: each block's
FlashAttentionScoreGrad gives dq (kept) and dk/dv, which travel with their key/value shard and arrive home after the
last hop.
"""

from __future__ import annotations

import torch

from ..problem.merge import merge_blocks
from ..problem.stats import FLT_MAX, accumulation_dtype
from . import comm
from .blocks import AttentionSetup, block_backward, block_forward, plan_calls


class RingOptions:
    """Per call: the group and whether hops overlap the computation."""

    def __init__(self, group: comm.Group, overlap: bool):
        self.group, self.overlap = group, overlap


def ring_forward(setup: AttentionSetup, options: RingOptions, query, key, value):
    """(out [T, N, Dv] in the query dtype, max [N, T], sum [N, T]) of this rank's queries against every shard."""
    group = options.group
    rank, world = group.rank, group.world
    acc_dtype = accumulation_dtype(query.dtype)
    heads, rows, dim_v = setup.head_num, query.shape[0], value.shape[-1]
    out = torch.zeros(heads, rows, dim_v, dtype=acc_dtype, device=query.device)
    smax = torch.full((heads, rows), -FLT_MAX, dtype=acc_dtype, device=query.device)
    ssum = torch.full((heads, rows), FLT_MAX, dtype=acc_dtype, device=query.device)
    cur_k, cur_v = key.contiguous(), value.contiguous()
    for step in range(world):
        works, nxt_k, nxt_v = [], None, None
        if step < world - 1:
            nxt_k, nxt_v = torch.empty_like(cur_k), torch.empty_like(cur_v)
            works = comm.send_recv(group, [cur_k, cur_v], [nxt_k, nxt_v], (rank + 1) % world, (rank - 1) % world,
                                   "ring_kv")
            if not options.overlap:
                comm.wait_all(group, works, f"ring forward hop {step}")
                works = []  # a finished work is not waited for twice (gloo would wait for it again)
        for call in plan_calls(setup, rank, (rank - step) % world, query.device):
            b_out, b_max, b_sum = block_forward(setup, call, query, cur_k, cur_v)
            idx = call.q_rows
            merged = merge_blocks(out.index_select(1, idx), smax.index_select(1, idx), ssum.index_select(1, idx),
                                  b_out, b_max, b_sum)
            out.index_copy_(1, idx, merged[0].to(acc_dtype))
            smax.index_copy_(1, idx, merged[1].to(acc_dtype))
            ssum.index_copy_(1, idx, merged[2].to(acc_dtype))
        comm.wait_all(group, works, f"ring forward hop {step}")
        if nxt_k is not None:
            cur_k, cur_v = nxt_k, nxt_v
    return out.transpose(0, 1).to(query.dtype).contiguous(), smax, ssum


def ring_backward(setup: AttentionSetup, options: RingOptions, query, key, value, out, smax, ssum, d_out):
    """(dq, dk, dv) of this rank's shards."""
    group = options.group
    rank, world = group.rank, group.world
    acc_dtype = accumulation_dtype(query.dtype)
    dq = torch.zeros(query.shape, dtype=acc_dtype, device=query.device)
    cur_k, cur_v = key.contiguous(), value.contiguous()
    d_out = d_out.contiguous()
    pending = None  # (works, dk, dv) of the gradient accumulator arriving for the next shard
    for step in range(world):
        works, nxt_k, nxt_v = [], None, None
        if step < world - 1:
            nxt_k, nxt_v = torch.empty_like(cur_k), torch.empty_like(cur_v)
            works = comm.send_recv(group, [cur_k, cur_v], [nxt_k, nxt_v], (rank + 1) % world, (rank - 1) % world,
                                   "ring_kv")
            if not options.overlap:
                comm.wait_all(group, works, f"ring backward hop {step}")
                works = []  # a finished work is not waited for twice (gloo would wait for it again)
        dk = torch.zeros(cur_k.shape, dtype=acc_dtype, device=query.device)
        dv = torch.zeros(cur_v.shape, dtype=acc_dtype, device=query.device)
        for call in plan_calls(setup, rank, (rank - step) % world, query.device):
            g_q, g_k, g_v = block_backward(setup, call, query, cur_k, cur_v, d_out, out, smax, ssum)
            dq.index_add_(0, call.q_rows, g_q.to(acc_dtype))
            dk.index_add_(0, call.kv_rows, g_k.to(acc_dtype))
            dv.index_add_(0, call.kv_rows, g_v.to(acc_dtype))
        if pending is not None:
            comm.wait_all(group, pending[0], f"ring backward gradient hop {step}")
            dk, dv = dk + pending[1], dv + pending[2]
            pending = None
        if world > 1:
            # This shard's gradient so far moves on with it; after the last step it reaches its home rank.
            in_k, in_v = torch.empty_like(dk), torch.empty_like(dv)
            pending = (comm.send_recv(group, [dk, dv], [in_k, in_v], (rank + 1) % world, (rank - 1) % world,
                                      "ring_grad"), in_k, in_v)
        else:
            pending = ([], dk, dv)
        comm.wait_all(group, works, f"ring backward hop {step}")
        if nxt_k is not None:
            cur_k, cur_v = nxt_k, nxt_v
    comm.wait_all(group, pending[0], "ring backward gradient home hop")
    return dq.to(query.dtype), pending[1].to(key.dtype), pending[2].to(value.dtype)


class RingAttention(torch.autograd.Function):
    """Differentiable ring attention on packed [T, N, D] shards."""

    @staticmethod
    def forward(ctx, query, key, value, setup: AttentionSetup, options: RingOptions):
        out, smax, ssum = ring_forward(setup, options, query, key, value)
        ctx.save_for_backward(query, key, value, out, smax, ssum)
        ctx.setup, ctx.options = setup, options
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        query, key, value, out, smax, ssum = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.setup, ctx.options, query, key, value, out, smax, ssum, d_out)
        return dq, dk, dv, None, None
