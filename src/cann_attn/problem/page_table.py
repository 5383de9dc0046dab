"""Paged KV caches (PageAttention): the one rule shared by every operator that takes a `block_table`
(docs/semantics/paged-kv.md).

A paged cache holds the keys (values, rope keys) of every sequence of a batch in fixed-size physical blocks of
`block_size` tokens: [block_num, block_size, N, D] (SFA / LI "PA_BSND", FIA's [block_num, block_size, H]) or
[block_num, N, block_size, D] (FIA's BnNBsD). Row b of the 2-D int32 `block_table` lists the physical blocks of
sequence b in logical order, so logical key position p of sequence b lives in block `block_table[b, p // bs]` at
slot `p % bs` (torch_npu npu_sparse_flash_attention / npu_lightning_indexer / npu_incre_flash_attention docs, and
the op-plugin CPU goldens that rebuild a contiguous cache block by block in exactly this order).

Sequence b has L_b keys (its actual KV length, required with a paged cache) and uses its first
ceil(L_b / bs) table entries; those must name existing blocks (0 <= id < block_num). Everything else is never
read and may hold anything: later table entries (-1, stale or out-of-range ids), the slots of a partially filled
last block beyond L_b, and blocks no sequence names. Constraints checked here (each a ParamInvalidError naming
the parameter): block_table int32 and 2-D, one row per sequence, at least max_b ceil(L_b / bs) columns, used
entries in range, block_num >= the blocks the sequences need together, and the block size rule of the operator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ParamInvalidError, ParamNullptrError, describe, require
from .lengths import IntList, per_batch_lengths

PAGED_KV_LAYOUT = "PA_BSND"
# a slot-mapping entry (MlaProlog's cache_index) of a padding token: nothing is written for it
# (docs/semantics/beyond-docs.md)
PADDING_SLOT = -1


@dataclass(frozen=True)
class BlockSizeRule:
    """The block sizes an operator accepts: multiples of `multiple` in [minimum, maximum]."""

    multiple: int
    maximum: int
    minimum: int = 1

    def check(self, block_size: int, param: str) -> None:
        if block_size < max(self.minimum, 1) or block_size > self.maximum or block_size % self.multiple:
            low = max(self.minimum, self.multiple)
            raise ParamInvalidError(
                f"{param}: expected a block size that is a multiple of {self.multiple} in [{low}, {self.maximum}], "
                f"got {block_size}"
            )


# npu_sparse_flash_attention / npu_lightning_indexer (PA_BSND key): "block_size取值为16的倍数，最大支持1024".
DSA_BLOCK_SIZES = BlockSizeRule(multiple=16, maximum=1024)


@dataclass(frozen=True)
class PageTable:
    """A validated block table: `table` is the caller's [B, W] tensor (never copied), `kv_lengths` the per-sequence
    key counts, `block_count` the cache's number of physical blocks."""

    table: torch.Tensor
    block_size: int
    block_count: int
    kv_lengths: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.kv_lengths)

    def select(self, batches: range) -> PageTable:
        """The table of the consecutive sequences `batches`, as a batch of its own (rows are views)."""
        return PageTable(self.table[batches.start : batches.stop], self.block_size, self.block_count,
                         self.kv_lengths[batches.start : batches.stop])

    def blocks_used(self, b: int) -> int:
        """Table entries sequence b reads: ceil(L_b / block_size)."""
        return -(-self.kv_lengths[b] // self.block_size)

    def blocks_of(self, b: int) -> torch.Tensor:
        """The physical blocks of sequence b in logical order (int64, on the table's device)."""
        return self.table[b, : self.blocks_used(b)].to(torch.int64)

    def locate(self, b: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(physical block, slot) of logical key positions of sequence b (each in [0, L_b))."""
        positions = positions.to(device=self.table.device, dtype=torch.int64)
        return self.blocks_of(b)[positions // self.block_size], positions % self.block_size

    def _blocks_follow(self, tokens: torch.Tensor) -> bool:
        """Whether a [block_num, block_size, ...] view's blocks follow one another in memory (its first two dims
        merge into one row axis without a copy)."""
        return tokens.stride(0) == tokens.shape[1] * tokens.stride(1)

    @torch.no_grad()  # a paged cache is an inference input (docs/semantics/paged-kv.md)
    def gather_tokens(self, tokens: torch.Tensor, batches, out: torch.Tensor | None = None) -> torch.Tensor:
        """The keys of the sequences `batches`, in order, from `tokens` [block_num, block_size, *rest]: written
        into `out` ([sum L_b, *rest], any strides, e.g. columns of a wider buffer; its dtype may differ) or
        returned. One row gather through the table reads nothing else; a cache whose blocks do not follow one
        another in memory takes one indexed read of (block, slot) pairs."""
        rows = torch.cat([self.physical_rows(b) for b in batches]).to(tokens.device)
        direct = self._blocks_follow(tokens) and (out is None or out.dtype == tokens.dtype)
        if direct:
            return torch.index_select(tokens.flatten(0, 1), 0, rows, **({} if out is None else {"out": out}))
        gathered = tokens[rows // self.block_size, rows % self.block_size]
        return gathered if out is None else out.copy_(gathered)

    def sequence_columns(self, caches: list[torch.Tensor], b: int, dtype: torch.dtype) -> torch.Tensor:
        """The L_b keys of sequence b from several caches [block_num, block_size, 1, D_i] side by side:
        [L_b, sum D_i] in `dtype` (e.g. key ++ key_rope), each gathered straight into its columns (one pass over
        the keys, like concatenating contiguous ones), never one operation per block."""
        out = torch.empty((self.kv_lengths[b], sum(c.shape[-1] for c in caches)), dtype=dtype,
                          device=caches[0].device)
        col = 0
        for cache in caches:
            width = cache.shape[-1]
            self.gather_tokens(cache[:, :, 0], [b], out=out[:, col : col + width])
            col += width
        return out

    def used_blocks(self) -> torch.Tensor:
        """The physical blocks some sequence reads, ascending (int64)."""
        blocks = [self.blocks_of(b) for b in range(self.batch)]
        return torch.unique(torch.cat(blocks)) if blocks else torch.zeros(0, dtype=torch.int64)

    @staticmethod
    def take_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """cache[blocks] for a contiguous [block_num, ...] cache, copied block by block as 8-byte words where the
        block size allows (PyTorch's byte-wise index_select is an order of magnitude slower)."""
        per_block = cache[0].numel() * cache.element_size() if cache.shape[0] else 0
        if cache.is_contiguous() and per_block % 8 == 0 and per_block:
            words = cache.view(cache.shape[0], -1).view(torch.int64)
            return words.index_select(0, blocks).view(cache.dtype).view(-1, *cache.shape[1:])
        return cache.index_select(0, blocks)

    def compacted(self, used: torch.Tensor) -> torch.Tensor:
        """The int32 table over a cache holding only the blocks `used` (block used[i] becomes block i); entries no
        sequence reads become 0 (never read)."""
        position = torch.zeros(self.block_count, dtype=torch.int64, device=used.device)
        position[used] = torch.arange(used.numel(), device=used.device)
        table = torch.zeros_like(self.table)
        for b in range(self.batch):
            n = self.blocks_used(b)
            table[b, :n] = position[self.blocks_of(b).to(used.device)].to(table.dtype)
        return table

    def physical_rows(self, b: int) -> torch.Tensor:
        """Flat row (block * block_size + slot) of each of sequence b's L_b positions in a cache seen as
        [block_num * block_size, ...] rows (int64)."""
        blocks, slots = self.locate(b, torch.arange(self.kv_lengths[b], device=self.table.device))
        return blocks * self.block_size + slots


def page_table(block_table, *, block_size: int, block_count: int, kv_lengths: IntList | None, batch: int,
               rule: BlockSizeRule, lengths_param: str, block_size_param: str = "block_size",
               table_param: str = "block_table", cache_param: str = "key") -> PageTable:
    """Validate a paged cache's `block_table` and per-sequence key lengths (docs/semantics/paged-kv.md).

    `block_size` and `block_count` come from the cache's shape (or the operator's `block_size` argument, which the
    caller has checked against it); `kv_lengths` are plain per-sequence lengths (None is an error: a paged cache
    has no S to default to); `batch` is the query's number of sequences; `cache_param` names the key cache in
    errors."""
    rule.check(block_size, block_size_param)
    if block_table is None:
        raise ParamNullptrError(f"{table_param}: required with a paged KV cache, got None")
    require(isinstance(block_table, torch.Tensor), table_param, "an int32 torch.Tensor", block_table)
    require(block_table.dtype == torch.int32, table_param, "dtype int32", block_table)
    require(block_table.dim() == 2, table_param, "a 2-D tensor [B, max blocks per sequence]", block_table)
    require(block_table.shape[0] == batch, table_param, f"one row per sequence (B={batch})", block_table)
    if kv_lengths is None:
        raise ParamNullptrError(f"{lengths_param}: required with a paged KV cache (per-sequence key counts), got None")
    # One key count per sequence (a single value is not copied: the table and the cache are per sequence).
    lengths = per_batch_lengths(kv_lengths, lengths_param, batch, None, broadcast=False)
    needed = [-(-length // block_size) for length in lengths]
    width = block_table.shape[1]
    if needed and max(needed) > width:
        b = needed.index(max(needed))
        raise ParamInvalidError(
            f"{table_param}: expected at least {max(needed)} columns (sequence {b} has {lengths[b]} keys in blocks "
            f"of {block_size}), got {describe(block_table)}"
        )
    if sum(needed) > block_count:
        raise ParamInvalidError(
            f"{cache_param}: expected at least {sum(needed)} blocks (the blocks the sequences need together), got "
            f"block_num={block_count}"
        )
    if sum(needed):
        used = torch.arange(width, device=block_table.device).view(1, -1) < torch.tensor(
            needed, device=block_table.device).view(-1, 1)
        entries = block_table[used]
        low, high = int(entries.min()), int(entries.max())
        if low < 0 or high >= block_count:
            bad = low if low < 0 else high
            raise ParamInvalidError(
                f"{table_param}: entries a sequence reads must be block ids in [0, {block_count - 1}], got {bad}"
            )
    return PageTable(block_table, block_size, block_count, tuple(lengths))
