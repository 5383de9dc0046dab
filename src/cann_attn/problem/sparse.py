"""Which keys a DSA query row attends to (docs/operators/sparse_flash_attention.md).

Entry e of row t's `sparse_indices` selects the block [idx*bs, idx*bs + bs) of its sequence's own keys. With
thr(t) = Skv - Sq + t + 1 (sparse_mode 3) or Skv (mode 0), only the first n = min(K, ceil(thr / bs)) entries
are examined; scanning stops at the first -1; an entry whose block starts at >= thr is skipped; a block that
straddles thr is clipped to [idx*bs, thr). Duplicated entries count twice. This module is the one place that
rule lives; forward, backward and the indexer loss all call `row_selection`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPARSE_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)


def causal_threshold(sparse_mode: int, seq_q: int, seq_kv: int, rows: torch.Tensor) -> torch.Tensor:
    """thr(t): keys [0, thr) are visible to row t (int64 tensor like `rows`)."""
    if sparse_mode == 3:
        return rows + (seq_kv - seq_q + 1)
    return torch.full_like(rows, seq_kv)


@dataclass(frozen=True)
class RowSelection:
    """Selected keys of a tile of rows: `blocks` [rows, E] block ids (clamped to a valid block where unused),
    `tokens` [rows, E * bs] key positions (clamped to 0 where invalid), `valid` [rows, E * bs] bool."""

    blocks: torch.Tensor
    entry_valid: torch.Tensor
    tokens: torch.Tensor
    valid: torch.Tensor
    block_size: int
    scanned: torch.Tensor  # [rows] examined entries per row (valid entries lie within them)

    @property
    def row_has_keys(self) -> torch.Tensor:
        return self.valid.any(-1)

    def rows(self, r0: int, r1: int) -> RowSelection:
        """The selection of rows [r0, r1) (views), narrowed to the widest of their scans."""
        e = max(1, int(self.scanned[r0:r1].max().item())) if r1 > r0 else 1
        t = e * self.block_size
        return RowSelection(self.blocks[r0:r1, :e], self.entry_valid[r0:r1, :e], self.tokens[r0:r1, :t],
                            self.valid[r0:r1, :t], self.block_size, self.scanned[r0:r1])


def scan_lengths(indices: torch.Tensor, thr: torch.Tensor, block_size: int) -> torch.Tensor:
    """How many leading entries of each row of `indices` [rows, K] are examined (int64 [rows]):
    n = min(K, ceil(thr / bs)) (0 where thr <= 0), cut at the first -1 (scanning stops there).

    An examined entry e then counts iff idx >= 0 and its block starts before thr (idx * bs < thr, i.e.
    idx < ceil(thr / bs)); its tokens are clipped to [idx * bs, thr). Kernels that apply the rule per entry
    take these lengths as input, so the scan-and-stop part lives only here."""
    k = indices.shape[-1]
    examined = torch.clamp((thr + block_size - 1) // block_size, min=0, max=k)  # n = min(K, ceil(thr / bs))
    is_pad = indices == -1
    first_pad = torch.where(is_pad.any(-1), is_pad.to(torch.int8).argmax(-1), k)
    return torch.minimum(examined, first_pad)


def row_selection(
    indices: torch.Tensor, rows: torch.Tensor, *, sparse_mode: int, seq_q: int, seq_kv: int, block_size: int
) -> RowSelection:
    """Apply the selection rule to `indices` [rows, K] (int32/int64) of the query rows `rows` (int64 [rows])."""
    idx = indices.to(torch.int64)
    thr = causal_threshold(sparse_mode, seq_q, seq_kv, rows).clamp(max=seq_kv)
    scanned = scan_lengths(idx, thr, block_size)
    # Only entries up to the largest scan length of the tile can be valid: keep the tile narrow.
    width = max(1, int(scanned.max().item())) if scanned.numel() else 1
    # Clamp before multiplying: int64 entries near 2**63 / bs would overflow idx * bs and wrap into the visible
    # range. Any entry >= ceil(Skv / bs) starts at or beyond Skv >= thr and is skipped
    # (docs/operators/sparse_flash_attention.md); the
    # clamped value still is, and -1 stays -1.
    idx = idx[:, :width].clamp(max=-(-seq_kv // block_size))
    position = torch.arange(width, device=idx.device).view(1, -1)
    block_start = idx * block_size
    entry_valid = (position < scanned.view(-1, 1)) & (idx >= 0) & (block_start < thr.view(-1, 1))
    offsets = torch.arange(block_size, device=idx.device).view(1, 1, -1)
    tokens = (block_start.unsqueeze(-1) + offsets).reshape(idx.shape[0], -1)
    valid = entry_valid.repeat_interleave(block_size, dim=-1) & (tokens < thr.view(-1, 1))
    blocks = torch.where(entry_valid, idx, 0)
    return RowSelection(blocks, entry_valid, torch.where(valid, tokens, 0), valid, block_size, scanned)


def indexer_selection(
    indices: torch.Tensor, rows: torch.Tensor, *, sparse_mode: int, seq_q: int, seq_kv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseLightningIndexerGradKLLoss rule (docs/operators/lightning_indexer.md): of the first k_t = min(K, thr(t))
    entries of row t, those equal to -1 or outside [0, thr) are skipped (no early stop). Returns (tokens [rows, W]
    clamped to 0 where invalid, valid [rows, W])."""
    idx = indices.to(torch.int64)
    thr = causal_threshold(sparse_mode, seq_q, seq_kv, rows).clamp(min=0, max=seq_kv)
    examined = thr.clamp(max=idx.shape[-1])
    width = max(1, int(examined.max().item())) if examined.numel() else 1
    idx = idx[:, :width]
    position = torch.arange(width, device=idx.device).view(1, -1)
    valid = (position < examined.view(-1, 1)) & (idx >= 0) & (idx < thr.view(-1, 1))
    return torch.where(valid, idx, 0), valid


def allowed_keys(sparse_mode: int, seq_q: int, seq_kv: int, rows: torch.Tensor) -> torch.Tensor:
    """Number of keys row t may select in the lightning indexer: [0, thr(t)) clipped to [0, Skv]."""
    return causal_threshold(sparse_mode, seq_q, seq_kv, rows).clamp(min=0, max=seq_kv)
