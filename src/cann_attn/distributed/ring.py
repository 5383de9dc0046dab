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
from .blocks import AttentionSetup, block_backward, block_forward, plan_calls, take


class RingOptions:
    """Per call: the group and whether hops overlap the computation."""

    def __init__(self, group: comm.Group, overlap: bool):
        self.group, self.overlap = group, overlap


class _KeyValueHops:
    """The key/value shard in hand and its trip around the ring: `post(step)` sends it to the next rank and receives
    the previous rank's (into the buffers freed two hops ago, which alternate with the current ones); `finish(step)`
    waits for the hop and makes the received shard the one in hand. Without overlap `post` completes the hop
    (docs/guides/context_parallel.md)."""

    def __init__(self, options: RingOptions, key: torch.Tensor, value: torch.Tensor, direction: str):
        self.group, self.overlap, self.direction = options.group, options.overlap, direction
        self.key, self.value = key.contiguous(), value.contiguous()
        self._spare = None  # the buffers received two hops ago, free again
        self._incoming, self._works = None, []

    def post(self, step: int) -> None:
        group = self.group
        self._incoming, self._works = None, []
        if step >= group.world - 1:
            return
        if self._spare is not None:
            self._incoming = self._spare
        else:
            self._incoming = (torch.empty_like(self.key), torch.empty_like(self.value))
        self._works = comm.send_recv(group, [self.key, self.value], list(self._incoming),
                                     (group.rank + 1) % group.world, (group.rank - 1) % group.world, "ring_kv")
        if not self.overlap:
            comm.wait_all(group, self._works, f"ring {self.direction} hop {step}")
            self._works = []  # a finished work is not waited for twice (gloo would wait for it again)

    def finish(self, step: int) -> None:
        comm.wait_all(self.group, self._works, f"ring {self.direction} hop {step}")
        if self._incoming is not None:
            # The shard in hand (unless it is the caller's key/value) is free once its send has completed, as now.
            self._spare = (self.key, self.value) if step > 0 else None
            self.key, self.value = self._incoming


def ring_forward(setup: AttentionSetup, options: RingOptions, query, key, value):
    """(out [T, N, Dv] in the query dtype, max [N, T], sum [N, T]) of this rank's queries against every shard."""
    group = options.group
    rank, world = group.rank, group.world
    acc_dtype = accumulation_dtype(query.dtype)
    heads, rows, dim_v = setup.head_num, query.shape[0], value.shape[-1]
    out = torch.zeros(heads, rows, dim_v, dtype=acc_dtype, device=query.device)
    smax = torch.full((heads, rows), -FLT_MAX, dtype=acc_dtype, device=query.device)
    ssum = torch.full((heads, rows), FLT_MAX, dtype=acc_dtype, device=query.device)
    shards = _KeyValueHops(options, key, value, "forward")
    touched: set[tuple[int, int]] = set()  # (sequence, query slot) whose rows hold a block already
    for step in range(world):
        shards.post(step)
        for call in plan_calls(setup, rank, (rank - step) % world, query.device):
            b_out, b_max, b_sum = block_forward(setup, call, query, shards.key, shards.value)
            rows = [take(t, call.q_rows, call.q_span, 1) for t in (out, smax, ssum)]
            keys = {(b, call.q_slot) for b in call.seqs}
            if keys & touched:
                b_out, b_max, b_sum = merge_blocks(*rows, b_out, b_max, b_sum)
            touched |= keys
            for acc, value_rows, new in zip((out, smax, ssum), rows, (b_out, b_max, b_sum), strict=True):
                if call.q_span is not None:
                    value_rows.copy_(new)
                else:
                    acc.index_copy_(1, call.q_rows, new.to(acc_dtype))
        shards.finish(step)
    return out.transpose(0, 1).to(query.dtype).contiguous(), smax, ssum


def ring_backward(setup: AttentionSetup, options: RingOptions, query, key, value, out, smax, ssum, d_out):
    """(dq, dk, dv) of this rank's shards."""
    group = options.group
    rank, world = group.rank, group.world
    acc_dtype = accumulation_dtype(query.dtype)
    dq = torch.zeros(query.shape, dtype=acc_dtype, device=query.device)
    shards = _KeyValueHops(options, key, value, "backward")
    d_out = d_out.contiguous()
    # The gradient accumulator of the shard in hand: zeros at step 0, then the one the previous rank sends along
    # (posted at the end of its previous step, at the same time as ours: waiting for it costs one hop).
    grad_k = torch.zeros(shards.key.shape, dtype=acc_dtype, device=query.device)
    grad_v = torch.zeros(shards.value.shape, dtype=acc_dtype, device=query.device)
    arriving = []
    for step in range(world):
        shards.post(step)
        comm.wait_all(group, arriving, f"ring backward gradient hop {step}")
        for call in plan_calls(setup, rank, (rank - step) % world, query.device):
            g_q, g_k, g_v = block_backward(setup, call, query, shards.key, shards.value, d_out, out, smax, ssum)
            for acc, rows, span, grad in ((dq, call.q_rows, call.q_span, g_q), (grad_k, call.kv_rows, call.kv_span,
                                          g_k), (grad_v, call.kv_rows, call.kv_span, g_v)):
                if span is not None:
                    acc.narrow(0, *span).add_(grad)
                else:
                    acc.index_add_(0, rows, grad.to(acc_dtype))
        if world > 1:
            # This shard's gradient so far moves on with it; after the last step it reaches its home rank.
            in_k, in_v = torch.empty_like(grad_k), torch.empty_like(grad_v)
            arriving = comm.send_recv(group, [grad_k, grad_v], [in_k, in_v], (rank + 1) % world, (rank - 1) % world,
                                      "ring_grad")
            grad_k, grad_v = in_k, in_v
        shards.finish(step)
    comm.wait_all(group, arriving, "ring backward gradient home hop")
    return dq.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)


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
