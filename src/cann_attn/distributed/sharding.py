"""`shard` / `unshard`: the sequence split every rank agrees on (docs/guides/context_parallel.md)."""

from __future__ import annotations

import torch

from ..errors import ParamInvalidError
from ..problem.lengths import lengths_of_ends
from . import comm
from .plan import SequencePlan


def _plan(x: torch.Tensor, seq_dim: int, world: int, load_balance, actual_seq_len, *, local: bool) -> SequencePlan:
    if not isinstance(x, torch.Tensor):
        raise ParamInvalidError(f"x: expected a tensor, got {type(x).__name__}")
    if not -x.dim() <= seq_dim < x.dim():
        raise ParamInvalidError(f"seq_dim: expected an axis of the {x.dim()}-D tensor, got {seq_dim!r}")
    size = x.shape[seq_dim] * (world if local else 1)
    if actual_seq_len is None:
        return SequencePlan((size,), world, load_balance)
    lengths = lengths_of_ends(actual_seq_len, "actual_seq_len")
    if sum(lengths) != size:
        raise ParamInvalidError(f"actual_seq_len: the sequences end at {sum(lengths)}, expected the packed length "
                                f"{size} of axis {seq_dim}")
    return SequencePlan(tuple(lengths), world, load_balance)


def shard(x: torch.Tensor, seq_dim: int, *, group=None, load_balance: str | None = "head_tail",
          actual_seq_len=None, verify: bool = True) -> torch.Tensor:
    """This rank's part of the whole tensor `x` along `seq_dim`.

    Every rank passes the same whole tensor and keeps its own part. `verify` checks that they did: one all-gather
    of a 3-integer checksum of `x` (:func:`cann_attn.distributed.comm.fingerprint`), which raises
    ParamInvalidError on every rank when a rank's data differs (a rank with other data would otherwise give wrong
    results without any error). With `verify=False` there is no communication.

    Args:
        x: the whole tensor, the same on every rank.
        seq_dim: the axis that holds the sequence (see :func:`seq_dim` for an attention layout).
        group: the process group (None: the default group).
        load_balance: `"head_tail"`: each sequence is cut into 2P equal chunks and rank r gets chunks r and
            2P-1-r; None: P chunks, rank r gets chunk r.
        actual_seq_len: the cumulative ends of packed TND sequences (no leading 0): every sequence is split that
            way.
        verify: compare the ranks' `x` first (one small collective).

    Returns:
        This rank's part, differentiable (an index_select).
    """
    info = comm.resolve_group(group, None, x.device if isinstance(x, torch.Tensor) else torch.device("cpu"))
    plan = _plan(x, seq_dim, info.world, load_balance, actual_seq_len, local=False)
    if verify:
        comm.require_same_tensor(info, x, "x", "shard")
    return x.index_select(seq_dim, plan.global_index(info.rank, x.device))


def unshard(x: torch.Tensor, seq_dim: int, *, group=None, load_balance: str | None = "head_tail",
            actual_seq_len=None, timeout=None) -> torch.Tensor:
    """The whole tensor, on every rank, from every rank's shard (an all-gather; the inverse of `shard`).
    `actual_seq_len` is the global cumulative ends, as for `shard`. Not differentiable."""
    info = comm.resolve_group(group, timeout, x.device)
    plan = _plan(x, seq_dim, info.world, load_balance, actual_seq_len, local=True)
    moved = x.detach().movedim(seq_dim, 0)
    gathered = comm.all_gather_rank_major(info, moved)
    return gathered.index_select(0, plan.gather_order(x.device)).movedim(0, seq_dim)
