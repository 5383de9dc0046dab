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


def _group_place(group) -> tuple[int, int]:
    info = comm.resolve_group(group, None, torch.device("cpu"))
    return info.rank, info.world


def shard(x: torch.Tensor, seq_dim: int, *, group=None, load_balance: str | None = "head_tail",
          actual_seq_len=None) -> torch.Tensor:
    """This rank's part of the whole tensor `x` along `seq_dim` (no communication).

    `load_balance="head_tail"`: each sequence is cut into 2P equal chunks and rank r gets chunks r and 2P-1-r;
    None: P chunks, rank r gets chunk r. With `actual_seq_len` (the cumulative ends of packed TND sequences, no
    leading 0) every sequence is split that way. Differentiable (an index_select)."""
    rank, world = _group_place(group)
    plan = _plan(x, seq_dim, world, load_balance, actual_seq_len, local=False)
    return x.index_select(seq_dim, plan.global_index(rank, x.device))


def unshard(x: torch.Tensor, seq_dim: int, *, group=None, load_balance: str | None = "head_tail",
            actual_seq_len=None, timeout=None) -> torch.Tensor:
    """The whole tensor, on every rank, from every rank's shard (an all-gather; the inverse of `shard`).
    `actual_seq_len` is the global cumulative ends, as for `shard`. Not differentiable."""
    info = comm.resolve_group(group, timeout, x.device)
    plan = _plan(x, seq_dim, info.world, load_balance, actual_seq_len, local=True)
    moved = x.detach().movedim(seq_dim, 0)
    gathered = comm.all_gather_rank_major(info, moved)
    return gathered.index_select(0, plan.gather_order(x.device)).movedim(0, seq_dim)
