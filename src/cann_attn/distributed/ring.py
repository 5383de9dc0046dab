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
from ..problem.stats import accumulation_dtype, allocate
from . import comm
from .blocks import AttentionSetup, block_backward, block_forward, plan_calls, take


class RingOptions:
    """Per call: the group and whether hops overlap the computation."""

    def __init__(self, group: comm.Group, overlap: bool):
        self.group, self.overlap = group, overlap


class _KeyValueHops:
    """The key/value shard in hand and its trip around the ring: `post(step)` sends it to the next rank and receives
    the previous rank's into fresh buffers; `finish(step)` waits for the hop and makes the received shard the one in
    hand, dropping the one sent (after the last step, the last one: nothing holds it any more). At most two shards
    are alive, the one in hand and the one arriving (docs/guides/context_parallel.md, "Memory"). Without overlap
    `post` completes the hop."""

    def __init__(self, options: RingOptions, key: torch.Tensor, value: torch.Tensor, direction: str):
        self.group, self.overlap, self.direction = options.group, options.overlap, direction
        self.key, self.value = key.contiguous(), value.contiguous()
        self.shapes = self.key.shape, self.value.shape
        self._incoming, self._works = None, []

    def post(self, step: int) -> None:
        group = self.group
        self._incoming, self._works = None, []
        if step >= group.world - 1:
            return
        self._incoming = (torch.empty_like(self.key), torch.empty_like(self.value))
        self._works = comm.send_recv(group, [self.key, self.value], list(self._incoming),
                                     (group.rank + 1) % group.world, (group.rank - 1) % group.world, "ring_kv")
        if not self.overlap:
            comm.wait_all(group, self._works, f"ring {self.direction} hop {step}")
            self._works = []  # a finished work is not waited for twice (gloo would wait for it again)

    def finish(self, step: int) -> None:
        comm.wait_all(self.group, self._works, f"ring {self.direction} hop {step}")
        self._works = []
        # The shard in hand has been sent (its send has completed): the received one replaces it.
        self.key, self.value = self._incoming if self._incoming is not None else (None, None)
        self._incoming = None


def _adoptable(block: torch.Tensor, span: tuple[int, int] | None, rows: int, dim: int, dtype) -> bool:
    """Whether a block's result covers every row of a fresh accumulator and can become it (no zeros + copy)."""
    return span == (0, rows) and block.dtype == dtype and block.shape[dim] == rows


def ring_forward(setup: AttentionSetup, options: RingOptions, query, key, value):
    """(out [T, N, Dv] in the query dtype, max [N, T], sum [N, T]) of this rank's queries against every shard.

    Memory (docs/guides/context_parallel.md, "Memory"): the output accumulator is kept in the [T, N, Dv] layout the
    caller gets (no final copy), and a first block that covers every query row becomes it."""
    group = options.group
    rank, world = group.rank, group.world
    acc_dtype = accumulation_dtype(query.dtype)
    heads, rows_total, dim_v = setup.head_num, query.shape[0], value.shape[-1]
    out_tnd = None  # [T, N, Dv]; its [N, T, Dv] view is the layout of the blocks and of the merge
    # Rows no block reaches keep the invalid-row statistics, as in the single-process operator.
    smax, ssum = allocate((heads, rows_total), acc_dtype, query.device, keyless_rows=True)
    shards = _KeyValueHops(options, key, value, "forward")
    touched: set[tuple[int, int]] = set()  # (sequence, query slot) whose rows hold a block already
    for step in range(world):
        shards.post(step)
        for call in plan_calls(setup, rank, (rank - step) % world, query.device):
            b_out, b_max, b_sum = block_forward(setup, call, query, shards.key, shards.value)
            keys = {(b, call.q_slot) for b in call.seqs}
            if out_tnd is None and _adoptable(b_out, call.q_span, rows_total, 1, acc_dtype) \
                    and b_out.transpose(0, 1).is_contiguous():
                out_tnd = b_out.transpose(0, 1)
                smax.copy_(b_max)
                ssum.copy_(b_sum)
                touched |= keys
                continue
            if out_tnd is None:
                out_tnd = torch.zeros(rows_total, heads, dim_v, dtype=acc_dtype, device=query.device)
            out = out_tnd.transpose(0, 1)
            rows = [take(t, call.q_rows, call.q_span, 1) for t in (out, smax, ssum)]
            if keys & touched:
                b_out, b_max, b_sum = merge_blocks(*rows, b_out, b_max, b_sum)
            touched |= keys
            for acc, value_rows, new in zip((out, smax, ssum), rows, (b_out, b_max, b_sum), strict=True):
                if call.q_span is not None:
                    value_rows.copy_(new)
                else:
                    acc.index_copy_(1, call.q_rows, new.to(acc_dtype))
            del b_out, b_max, b_sum, rows  # this block's results, before the next block allocates its own
        shards.finish(step)
    if out_tnd is None:  # no block at all (every key masked for every query): zeros, as the operator gives
        out_tnd = torch.zeros(rows_total, heads, dim_v, dtype=acc_dtype, device=query.device)
    return out_tnd.to(query.dtype), smax, ssum


def _accumulate(acc: torch.Tensor | None, shape, rows, span, grad: torch.Tensor, dtype) -> torch.Tensor:
    """acc (None: not allocated yet) plus grad at the given rows; a first gradient that covers every row and is
    contiguous becomes the accumulator (no zeros + add)."""
    if acc is None:
        if _adoptable(grad, span, shape[0], 0, dtype) and grad.is_contiguous() and grad.shape == shape:
            return grad
        acc = torch.zeros(shape, dtype=dtype, device=grad.device)
    if span is not None:
        acc.narrow(0, *span).add_(grad)
    else:
        acc.index_add_(0, rows, grad.to(dtype))
    return acc


def ring_backward(setup: AttentionSetup, options: RingOptions, query, key, value, out, smax, ssum, d_out):
    """(dq, dk, dv) of this rank's shards.

    Memory: dq and the dk/dv accumulator of the shard in hand are allocated on their first block (or are that
    block's gradient when it covers the whole shard); the key/value shard in hand is dropped once its send has
    completed, before the gradient exchange allocates the buffers the previous rank's dk/dv arrive in (the exchange
    cannot be done in place)."""
    group = options.group
    rank, world = group.rank, group.world
    acc_dtype = accumulation_dtype(query.dtype)
    shards = _KeyValueHops(options, key, value, "backward")
    key_shape, value_shape = shards.shapes
    d_out = d_out.contiguous()
    dq = grad_k = grad_v = None
    # The gradient accumulator of the shard in hand: built at step 0, then the one the previous rank sends along
    # (posted at the end of its previous step, at the same time as ours: waiting for it costs one hop).
    arriving = []
    for step in range(world):
        # The dk/dv exchange first: once it has completed, the accumulator we sent is free before the next
        # key/value shard's buffers are allocated (both were posted before this step's blocks anyway).
        comm.wait_all(group, arriving, f"ring backward gradient hop {step}")
        arriving = []
        shards.post(step)
        for call in plan_calls(setup, rank, (rank - step) % world, query.device):
            g_q, g_k, g_v = block_backward(setup, call, query, shards.key, shards.value, d_out, out, smax, ssum)
            dq = _accumulate(dq, query.shape, call.q_rows, call.q_span, g_q, acc_dtype)
            grad_k = _accumulate(grad_k, key_shape, call.kv_rows, call.kv_span, g_k, acc_dtype)
            grad_v = _accumulate(grad_v, value_shape, call.kv_rows, call.kv_span, g_v, acc_dtype)
            del g_q, g_k, g_v
        if grad_k is None:  # no block of this shard reached this rank's queries
            grad_k = torch.zeros(key_shape, dtype=acc_dtype, device=query.device)
        if grad_v is None:
            grad_v = torch.zeros(value_shape, dtype=acc_dtype, device=query.device)
        shards.finish(step)
        if world > 1:
            # This shard's gradient so far moves on with it; after the last step it reaches its home rank.
            in_k, in_v = torch.empty_like(grad_k), torch.empty_like(grad_v)
            arriving = comm.send_recv(group, [grad_k, grad_v], [in_k, in_v], (rank + 1) % world, (rank - 1) % world,
                                      "ring_grad")
            grad_k, grad_v = in_k, in_v
            del in_k, in_v
    comm.wait_all(group, arriving, "ring backward gradient home hop")
    if dq is None:
        dq = torch.zeros(query.shape, dtype=acc_dtype, device=query.device)
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
