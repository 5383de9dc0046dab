"""The sequence split every rank agrees on (docs/guides/context_parallel.md).

Each sequence (dense layouts: each of the B sequences of length S; TND: each packed document) is cut into C equal
chunks: C = 2P with `load_balance="head_tail"` (rank r holds chunks r and 2P-1-r, so causal work is balanced), or
C = P with `load_balance=None` (rank r holds chunk r). A rank's shard holds, sequence after sequence, its chunks in
increasing order. Every length must be a multiple of C, so that every rank's shard has the same size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import ParamInvalidError
from ..problem.lengths import starts_of

LOAD_BALANCES = ("head_tail", None)


def chunk_ids(rank: int, world: int, load_balance: str | None) -> tuple[int, ...]:
    """The chunks of every sequence that `rank` holds, in shard order."""
    if load_balance == "head_tail":
        return (rank, 2 * world - 1 - rank)
    return (rank,)


def chunk_count(world: int, load_balance: str | None) -> int:
    if load_balance not in LOAD_BALANCES:
        raise ParamInvalidError(f"load_balance: expected 'head_tail' or None, got {load_balance!r}")
    return 2 * world if load_balance == "head_tail" else world


@dataclass(frozen=True)
class SequencePlan:
    """The split of sequences of the given global lengths over `world` ranks."""

    lengths: tuple[int, ...]
    world: int
    load_balance: str | None

    def __post_init__(self):
        chunks = chunk_count(self.world, self.load_balance)
        bad = [n for n in self.lengths if n % chunks]
        if bad:
            raise ParamInvalidError(
                f"sequence length: context parallelism over {self.world} ranks with load_balance="
                f"{self.load_balance!r} cuts every sequence into {chunks} equal chunks; expected lengths that are "
                f"multiples of {chunks}, got {list(self.lengths)}")

    @property
    def chunks(self) -> int:
        return chunk_count(self.world, self.load_balance)

    def chunk_len(self, seq: int) -> int:
        return self.lengths[seq] // self.chunks

    def ids(self, rank: int) -> tuple[int, ...]:
        return chunk_ids(rank, self.world, self.load_balance)

    @cached_property
    def local_lengths(self) -> tuple[int, ...]:
        """Every rank's share of each sequence (the same on every rank)."""
        per = len(self.ids(0))
        return tuple(self.chunk_len(b) * per for b in range(len(self.lengths)))

    @cached_property
    def global_starts(self) -> tuple[int, ...]:
        """Where each sequence starts in the whole packed sequence."""
        return tuple(starts_of(self.lengths))

    @cached_property
    def local_starts(self) -> tuple[int, ...]:
        """Where each sequence's share starts in a rank's packed shard."""
        return tuple(starts_of(self.local_lengths))

    @property
    def local_total(self) -> int:
        return sum(self.local_lengths)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def local_chunk(self, seq: int, slot: int) -> tuple[int, int]:
        """(start in the shard, length) of the `slot`-th chunk a rank holds of sequence `seq`."""
        n = self.chunk_len(seq)
        return self.local_starts[seq] + slot * n, n

    def global_index(self, rank: int, device=None) -> torch.Tensor:
        """[local_total] int64: the position in the packed global sequence of each token of rank's shard."""
        parts = []
        for b in range(len(self.lengths)):
            n = self.chunk_len(b)
            for c in self.ids(rank):
                start = self.global_starts[b] + c * n
                parts.append(torch.arange(start, start + n, dtype=torch.int64, device=device))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    def gather_order(self, device=None) -> torch.Tensor:
        """[total] int64: for each global position, its index in the rank-major concatenation of all shards."""
        rank_major = torch.cat([self.global_index(r, device) for r in range(self.world)])
        order = torch.empty_like(rank_major)
        order[rank_major] = torch.arange(rank_major.numel(), dtype=torch.int64, device=device)
        return order
