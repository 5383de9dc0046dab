"""Sparse (DSA) attention over selected keys: forward and backward (docs/operators/sparse_flash_attention.md).

Rows of one sequence are processed in tiles; the selection rule comes from `problem.sparse.row_selection`.
Two ways to form the selected logits, chosen per tile by estimated cost, give identical results:
- gather: copy each row's selected K/V rows ([rows, T, D]) and use batched GEMMs (scattered selections,
  e.g. top-k of single tokens);
- union: one dense GEMM against the union of the tile's selected blocks, then pick each row's entries out of
  it (block selections shared by neighbouring rows, e.g. causal block-sparse patterns); where every row's valid
  entries are the union's blocks in order (each row's leading blocks), the GEMM's output is used as it stands.
Duplicated entries are kept (gathered twice, gradients added). No S1 x S2 matrix is ever formed.

Both paths compute products with keys a row did not select (unused entries gather token 0, clipped blocks their
tokens beyond thr, the union every block of the tile) and cancel them by masking, which relies on finite keys
and values: NaN + -inf and 0 * NaN are NaN. A sequence with a non-finite key or value (or, in the backward, a
non-finite query, d_out or out row) therefore takes the gather path with the rows of invalid entries zeroed and
their logits/gradients set (not added) to -inf/0, so that only the selected keys reach a row and a row reaches
only the keys it selected (docs/operators/sparse_flash_attention.md: P is the softmax over the selected set). The
checks cost one pass over K and V (and the query-side tensors) per sequence; the all-finite fast paths are unchanged.

Token selections (block size 1) in fp32 on the CPU take the native loops instead (`native`, C): each row's logits,
exponentials and weighted sums are formed from its valid entries' K/V rows read in place, which needs neither the
gather nor the isolation pass; the selection, the statistics' conventions and the normalisation stay here. Block
selections whose rows select different blocks (the union of a tile's blocks NATIVE_UNION_RATIO times the rows'
selections or more) take them too: the union path would multiply every row against every block of the union.

The query tile carries the softmax scale (the native forward scales fp32 queries per row itself, each product rounded
once as the tile's multiply rounds it); exponentials come from `softmax_exp.exp_shifted_` (the native loops use the
same base-2 rule and flush floor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...problem.sparse import RowSelection, row_selection
from . import native
from .softmax_exp import EXP2_FLOOR, LOG2E, exp_shifted_
from .workspace import Workspace

# Rows per forward tile. Token selections (block size 1) are gathered: 8 rows keep the gathered keys
# (8 x 512 x 576 fp32, 9.4 MB at DeepSeek-V3.2 shapes) in the last-level cache between the gather and the two
# GEMMs that read them; measured 10-15% faster than 16 rows on a 2-core EPYC (32 MB L3), whose gather ran at
# 26 vs 17 GB/s and whose M=16 GEMMs at 103 vs 79 GFLOP/s. Block selections mostly take the union path, whose
# dense GEMM gains from more rows.
GATHER_ROW_TILE = 8
ROW_TILE = 32
# The backward also writes [rows, T, D] per-entry dK/dV tiles: 32 rows measured faster than 16 (fewer, larger ops).
BACKWARD_ROW_TILE = 32
# Rows per call of the native loops (`native`, block size 1): the per-call Python work (query assembly, selection
# views, statistics) is amortised over many rows while the backward's per-entry P and dS buffers stay small
# ([rows, N1, K] fp32: 4 MB each at 128 rows of DeepSeek-V3.2 shapes).
NATIVE_ROW_TILE = 128
# Cost of gathering one fp32 element, in multiply-adds: memory traffic versus GEMM throughput on a CPU.
GATHER_COST = 8.0
INVALID_MAX = -2e38
# Block selections (block size > 1) take the native per-row loops where the union path would multiply every row
# against at least this many times the blocks the rows select (`_dispersed`). Measured by
# benchmarks/bench_sparse_dispersed.py (block 64, N1 16, D 512 + 64, each row 8 blocks drawn per 32-row tile from a
# pool of 8..64 blocks; one thread, CPU time, both paths alternated in one process, best of 3): from a union 1.25x
# the selection up, the native loops took 1.6-3.2x less time in the forward and 1.2-2.2x in the backward than the
# path chosen before (gather or union). At 1.0 (rows sharing their blocks) they gained 1.33x / 1.05x where the rows
# order their blocks differently, and the union's dense GEMM kept the backward 1.5x faster where each row's blocks
# are the union's in order (a block-causal pattern: bench_sparse_attention's mode 3 block 64).
NATIVE_UNION_RATIO = 1.25
# Bound on the [tiles, blocks] table that counts each tile's distinct blocks.
UNION_TABLE_ELEMENTS = 1 << 24


def query_with_rope(ws: Workspace, name: str, q: torch.Tensor, q_rope: torch.Tensor | None, dim_qk: int,
                    dtype: torch.dtype, factor: float, extra_heads: int = 0) -> torch.Tensor:
    """factor * (q ++ q_rope) in `dtype` for q [rows, N1, D] (+ q_rope [rows, N1, Dr]): a workspace view
    [rows, N1 + extra_heads, dim_qk] whose first N1 heads hold it (the extra heads are the caller's to fill).
    Assembled per tile, so no [S, N1, D + Dr] copy of the whole query is ever made."""
    rows, heads, d = q.shape
    tile = ws.take(name, (rows, heads + extra_heads, dim_qk), dtype)
    query = tile[:, :heads]
    query[..., :d] = q
    if q_rope is not None:
        query[..., d:] = q_rope
    query.mul_(factor)
    return tile


@dataclass
class SparseSequence:
    """One sequence's tensors as [S, N, D] / [S, D] views and its lengths."""

    q: torch.Tensor  # [Sq, N1, Dq]
    q_rope: torch.Tensor | None  # [Sq, N1, Dr]
    k: torch.Tensor  # [Skv, Dq + Dr] (key ++ key_rope, compute dtype)
    v: torch.Tensor  # [Skv, Dv]
    indices: torch.Tensor  # [Sq, K]
    seq_q: int
    seq_kv: int
    # DSA passes the same latent as key and value: V is then K's first Dv columns and is gathered with it.
    value_is_key: bool = False

    @property
    def dim_qk(self) -> int:
        return self.k.shape[-1]

    def query_tile(self, ws: Workspace, t0: int, t1: int, dtype: torch.dtype, factor: float,
                   value_rows: torch.Tensor | None = None) -> torch.Tensor:
        """factor * (query ++ query_rope) of rows [t0, t1) in `dtype`: [rows, N1, Dq + Dr] (a workspace view).

        With `value_rows` [rows, E, Dv] (only when V is K's first Dv columns) these are stacked below the N1
        query rows, zero-padded to Dq + Dr, giving [rows, N1 + E, Dq + Dr]: one GEMM against the gathered keys
        then yields both the logits and value_rows . V^T, reading the gathered keys once."""
        heads = self.q.shape[1]
        extra = 0 if value_rows is None else value_rows.shape[1]
        tile = query_with_rope(ws, "q", self.q[t0:t1], None if self.q_rope is None else self.q_rope[t0:t1],
                               self.dim_qk, dtype, factor, extra_heads=extra)
        if value_rows is not None:
            dv = value_rows.shape[-1]
            tile[:, heads:, :dv] = value_rows
            tile[:, heads:, dv:] = 0.0
        return tile

    def gather(self, ws: Workspace, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = ws.gather_rows("keys", self.k, tokens)
        if self.value_is_key:
            return keys, keys[..., : self.v.shape[-1]]
        return keys, ws.gather_rows("values", self.v, tokens)

    def key_range(self, blocks: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K and V rows of the sorted distinct `blocks` as views, where they are one run of whole blocks (a causal
        pattern's union) laid out as `gather` would write them (contiguous, 64-byte aligned): the GEMMs then see the
        same operands without the copy. None otherwise."""
        first, count = int(blocks[0]), blocks.numel()
        if int(blocks[-1]) != first + count - 1 or (first + count) * block_size > self.seq_kv:
            return None
        rows = slice(first * block_size, (first + count) * block_size)
        keys = self.k[rows]
        if self.value_is_key:
            values, own = keys[:, : self.v.shape[-1]], (keys,)
        else:
            values = self.v[rows]
            own = (keys, values)
        return (keys, values) if all(t.is_contiguous() and t.data_ptr() % 64 == 0 for t in own) else None

    @property
    def values(self) -> torch.Tensor:
        """V for loops that read rows in place: K's first Dv columns when V is the key latent (one array in cache
        instead of two copies of the same data)."""
        return self.k[:, : self.v.shape[-1]] if self.value_is_key else self.v

    def keys_values_finite(self) -> bool:
        """Whether K (key ++ key_rope) and V hold only finite values: the fast paths' masking needs it."""
        return all_finite(self.k, *(() if self.value_is_key else (self.v,)))

    def rows_finite(self, *row_tensors: torch.Tensor) -> bool:
        """Whether the query side (query, query_rope and `row_tensors`, e.g. the grad's d_out and out) holds only
        finite values. The backward's per-entry dK / dV products multiply a row's query and d_out by exactly 0 for
        the row's unused entries (added into token 0) and union columns it did not select: a NaN row would reach
        keys it never selected."""
        return all_finite(self.q, *(() if self.q_rope is None else (self.q_rope,)), *row_tensors)


def all_finite(*tensors: torch.Tensor) -> bool:
    """No NaN or inf in any of `tensors`, tested on their sums: a NaN or inf element makes a sum non-finite in any
    summation order, and one sum is ~25x cheaper than isfinite().all() (0.3 vs 7.4 ms at [4096, 576] fp32, one
    thread). Finite values whose sum overflows only send a sequence to the isolating path, which is exact too."""
    return all(bool(t.sum().isfinite()) for t in tensors)


@dataclass
class _TileKeys:
    """Selected logits of a row tile plus what the backward needs to route gradients back to keys."""

    z: torch.Tensor  # [rows, N1, T] masked logits (scale applied)
    extra: torch.Tensor | None  # [rows, E, T] products of the rows stacked below the queries, per entry
    sel: RowSelection
    keys: torch.Tensor  # gathered [rows, T, Dq] or union [U, Dq]
    values: torch.Tensor  # gathered [rows, T, Dv] or union [U, Dv]
    key_tokens: torch.Tensor  # positions of `keys` rows in the sequence
    union_pos: torch.Tensor | None  # [rows, T] column of each entry in the union (union mode)
    all_valid: bool  # every entry valid: every row has keys, no -inf in z
    # Union mode with every valid entry at its own column (union_pos[r, e] == e, T == U: e.g. each row selecting the
    # leading blocks of a causal pattern in order): z is the dense product itself and per-entry values need no
    # scatter into union columns.
    union_identity: bool = False


def _sequence_selection(seq: SparseSequence, sparse_mode: int, block_size: int) -> RowSelection:
    """The selection of every row of the sequence, computed once (tiles take narrowed views of it)."""
    rows = torch.arange(seq.seq_q, device=seq.k.device)
    return row_selection(seq.indices, rows, sparse_mode=sparse_mode, seq_q=seq.seq_q, seq_kv=seq.seq_kv,
                         block_size=block_size)


def _union_block_counts(selection: RowSelection, row_tile: int, n_blocks: int) -> list[int]:
    """Distinct selected blocks of each tile of `row_tile` rows (unused entries count as block 0, as in
    `_tile_keys`): the union path's width, for the gather-or-union choice, counted for all tiles in a few ops."""
    rows = selection.blocks.shape[0]
    n_tiles = -(-rows // row_tile)
    tiles_per_chunk = max(1, UNION_TABLE_ELEMENTS // max(n_blocks, 1))
    counts: list[int] = []
    for c0 in range(0, n_tiles, tiles_per_chunk):
        c1 = min(c0 + tiles_per_chunk, n_tiles)
        blocks = selection.blocks[c0 * row_tile: c1 * row_tile]
        tile = torch.arange(blocks.shape[0], device=blocks.device).floor_divide_(row_tile).unsqueeze(1)
        table = torch.zeros(c1 - c0, n_blocks, dtype=torch.bool, device=blocks.device)
        table[tile.expand_as(blocks), blocks] = True
        counts += table.sum(1).tolist()
    return counts


def _tile_union_counts(selection: RowSelection, row_tile: int, seq: SparseSequence, block_size: int,
                       isolate: bool) -> list[int]:
    """`_union_block_counts` of each row tile; 0 (the gather path) for every tile when `isolate`."""
    if isolate:
        return [0] * -(-selection.blocks.shape[0] // row_tile)
    return _union_block_counts(selection, row_tile, -(-seq.seq_kv // block_size))


def _tile_keys(seq: SparseSequence, q_tile: torch.Tensor, heads: int, sel: RowSelection, ws: Workspace,
               union_blocks_count: int, isolate: bool = False) -> _TileKeys:
    """Logits of the tile's selected entries from the first `heads` rows of `q_tile` (already scaled), -inf where
    an entry is invalid, and the plain products of any rows stacked below them. `union_blocks_count` (from
    `_union_block_counts`) prices the union path. `isolate` (keys or values not all finite): gather only, with
    the gathered rows of invalid entries zeroed and their logits set to exactly -inf, so that no unselected key
    reaches a row."""
    block_size = sel.block_size
    n_rows, stacked, d_qk = q_tile.shape
    width = sel.tokens.shape[1]
    d_all = d_qk + seq.v.shape[-1]
    device = q_tile.device
    union_width = union_blocks_count * block_size
    gather_cost = n_rows * width * d_all * (GATHER_COST + heads)
    union_cost = union_width * d_all * (GATHER_COST + n_rows * heads)
    if isolate or union_width == 0 or gather_cost <= union_cost:
        keys, values = seq.gather(ws, sel.tokens)
        if isolate:
            unselected = ~sel.valid.unsqueeze(-1)
            keys.masked_fill_(unselected, 0.0)
            if not seq.value_is_key:  # else values is a view of keys, zeroed already
                values.masked_fill_(unselected, 0.0)
        products = torch.bmm(q_tile, keys.transpose(1, 2), out=ws.take("z", (n_rows, stacked, width), q_tile.dtype))
        union_pos, key_tokens, union_identity = None, sel.tokens, False
    else:
        # Sorted distinct selected blocks without a sort: mark them in a per-block table. Unused entries hold
        # block 0, which may add one block to the union: harmless, their logits are masked.
        present = torch.zeros(-(-seq.seq_kv // block_size), dtype=torch.bool, device=device)
        present.index_fill_(0, sel.blocks.reshape(-1), True)
        union_blocks = present.nonzero().view(-1)
        offsets = torch.arange(block_size, device=device)
        key_tokens = (union_blocks.view(-1, 1) * block_size + offsets).reshape(-1).clamp_(max=seq.seq_kv - 1)
        keys, values = seq.key_range(union_blocks, block_size) or seq.gather(ws, key_tokens)
        dense = torch.mm(q_tile.reshape(-1, d_qk), keys.transpose(0, 1),
                         out=ws.take("dense", (n_rows * stacked, key_tokens.numel()), q_tile.dtype))
        dense = dense.view(n_rows, stacked, -1)
        slot = torch.searchsorted(union_blocks, sel.blocks.contiguous()).clamp_(max=union_blocks.numel() - 1)
        union_pos = (slot.unsqueeze(-1) * block_size + offsets).reshape(n_rows, -1)
        # Invalid entries' products are masked to -inf below whichever column they read, so only the valid entries'
        # columns must match for the dense product to serve as the gathered one.
        union_identity = union_pos.shape[1] == dense.shape[2] and bool(
            ((slot == torch.arange(slot.shape[1], device=device)) | ~sel.entry_valid).all())
        products = dense if union_identity else torch.gather(dense, 2, union_pos.unsqueeze(1).expand(-1, stacked, -1))
    z = products[:, :heads]
    extra = products[:, heads:] if stacked > heads else None
    all_valid = bool(sel.valid.all())
    if not all_valid and isolate:
        # Set, not add: a non-finite product (a row's own non-finite query times a zeroed key) must not survive.
        z.masked_fill_(~sel.valid.unsqueeze(1), float("-inf"))
    elif not all_valid:
        # A 0/-inf [rows, 1, T] addend: far cheaper than masked_fill_ with a mask broadcast over heads.
        z.add_(torch.zeros(sel.valid.shape, dtype=z.dtype, device=z.device).masked_fill_(~sel.valid, float("-inf"))
               .unsqueeze(1))
    return _TileKeys(z, extra, sel, keys, values, key_tokens, union_pos, all_valid, union_identity)


def _to_union(tk: _TileKeys, per_entry: torch.Tensor) -> torch.Tensor:
    """Sum per-entry values [rows, N1, T] into union columns [rows, N1, U] (duplicates add up)."""
    rows, heads, _ = per_entry.shape
    out = per_entry.new_zeros(rows, heads, tk.keys.shape[0])
    return out.scatter_add_(2, tk.union_pos.unsqueeze(1).expand(-1, heads, -1), per_entry)


def _weighted_values(tk: _TileKeys, p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """sum_e p[e] * V[e] for every row and head, written into `out` [rows, N1, Dv] (contiguous)."""
    rows, heads, _ = p.shape
    if tk.union_pos is None:
        return torch.bmm(p, tk.values, out=out)
    # With union_identity p already sits in union columns, and _to_union would return its bits: every p >= +0 (an
    # exponential), and invalid entries add exactly +0 to the zeros.
    union_p = p if tk.union_identity else _to_union(tk, p)
    return torch.mm(union_p.reshape(rows * heads, -1), tk.values, out=out.view(rows * heads, -1)).view_as(out)


def _use_native(seq: SparseSequence, selection: RowSelection, block_size: int, dtype: torch.dtype,
                row_tile: int) -> bool:
    """The native loops take token selections (block size 1: scattered keys, where the gather path's copies and
    M = N1 GEMMs are slowest) in fp32 on the CPU, and block selections whose rows select different blocks: where the
    union of a tile's blocks is NATIVE_UNION_RATIO times the blocks its rows select or more (`_dispersed`). Block
    selections that neighbouring rows share keep the union path's dense GEMMs."""
    if dtype != torch.float32 or not native.usable(seq.k, seq.v):
        return False
    return block_size == 1 or _dispersed(selection, row_tile, -(-seq.seq_kv // block_size))


def _dispersed(selection: RowSelection, row_tile: int, n_blocks: int) -> bool:
    """Whether the union path would compute NATIVE_UNION_RATIO times the rows' selected blocks or more: every row of
    a tile of `row_tile` rows is multiplied against the tile's whole union, while the native loops read each row's
    own valid blocks only."""
    rows = selection.blocks.shape[0]
    selected = int(selection.entry_valid.sum())
    if rows == 0 or selected == 0:
        return False
    counts = _union_block_counts(selection, row_tile, n_blocks)
    union = sum(count * min(row_tile, rows - tile * row_tile) for tile, count in enumerate(counts))
    return union >= NATIVE_UNION_RATIO * selected


def _normalise_rows(o: torch.Tensor, m: torch.Tensor, total: torch.Tensor, all_valid: bool,
                    row_max: torch.Tensor, row_sum: torch.Tensor) -> None:
    """out = o / total, softmax_max / softmax_sum of a tile from its largest logits m and totals.

    With every entry valid, m is finite and the total >= 1 (the maximum's term is exactly 1). Otherwise a row
    without a valid entry has max -inf and all-zero terms: total 0, output 0, max INVALID_MAX. total != 0 rather
    than > 0: a row that selected a non-finite key has a NaN total (and max), and keeps it rather than passing for a
    row with nothing selected."""
    if all_valid:
        o.div_(total.unsqueeze(-1))
        row_max.copy_(m)
    else:
        has_keys = total != 0
        o.div_(torch.where(has_keys, total, 1.0).unsqueeze(-1))
        row_max.copy_(torch.where(has_keys, m, INVALID_MAX))
    row_sum.copy_(total)


def _forward_native(seq: SparseSequence, selection: RowSelection, scale: float, out: torch.Tensor,
                    row_max: torch.Tensor, row_sum: torch.Tensor) -> None:
    """forward_sequence through the native loops: each row reads only its valid entries' K / V rows (so no
    isolation pass is needed for non-finite keys), and its sums are formed in a fixed order."""
    ws = Workspace(seq.k.device)
    heads, dim_v = seq.q.shape[1], seq.v.shape[-1]
    direct = out.dtype == torch.float32 and out.is_contiguous()
    # fp32 queries go to the loops as they are, which scale and join them per row (no [rows, N1, Dqk] copy).
    in_place = all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in (seq.q, seq.q_rope) if t is not None)
    for t0 in range(0, seq.seq_q, NATIVE_ROW_TILE):
        t1 = min(t0 + NATIVE_ROW_TILE, seq.seq_q)
        sel = selection.rows(t0, t1)
        all_valid = bool(sel.valid.all())
        if in_place:
            query = (seq.q[t0:t1], None if seq.q_rope is None else seq.q_rope[t0:t1], scale)
        else:
            query = (seq.query_tile(ws, t0, t1, torch.float32, scale), None, 1.0)
        o_tile = out[t0:t1] if direct else ws.take("pv", (t1 - t0, heads, dim_v), torch.float32)
        m = ws.take("m", (t1 - t0, heads), torch.float32)
        total = ws.take("total", (t1 - t0, heads), torch.float32)
        native.sfa_forward(query[0], seq.k, seq.values, sel.tokens, None if all_valid else sel.valid, LOG2E, EXP2_FLOOR,
                           o_tile, m, total, q_rope=query[1], scale=query[2])
        _normalise_rows(o_tile, m, total, all_valid, row_max[t0:t1], row_sum[t0:t1])
        if not direct:
            out[t0:t1] = o_tile


@torch.no_grad()  # kernels fill preallocated outputs; autograd pairs the ops one level up
def forward_sequence(seq: SparseSequence, scale: float, sparse_mode: int, block_size: int, dtype: torch.dtype,
                     out: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> None:
    """Fill out [Sq, N1, Dv] (any dtype; written per tile), row_max / row_sum [Sq, N1] of one sequence."""
    selection = _sequence_selection(seq, sparse_mode, block_size)
    if _use_native(seq, selection, block_size, dtype, ROW_TILE):
        _forward_native(seq, selection, scale, out, row_max, row_sum)
        return
    ws = Workspace(seq.k.device)
    row_tile = GATHER_ROW_TILE if block_size == 1 else ROW_TILE
    isolate = not seq.keys_values_finite()
    union_counts = _tile_union_counts(selection, row_tile, seq, block_size, isolate)
    # The weighted values go straight into `out` when it has the compute dtype (no copy per tile).
    direct = out.dtype == dtype and out.is_contiguous()
    for tile, t0 in enumerate(range(0, seq.seq_q, row_tile)):
        t1 = min(t0 + row_tile, seq.seq_q)
        q_tile = seq.query_tile(ws, t0, t1, dtype, scale)
        tk = _tile_keys(seq, q_tile, q_tile.shape[1], selection.rows(t0, t1), ws, union_counts[tile], isolate)
        m = tk.z.amax(-1)
        o_tile = out[t0:t1] if direct else ws.take("pv", (t1 - t0, *out.shape[1:]), dtype)
        # A row without a valid entry has max -inf: shift by 0 (its terms are all 0).
        shift = m if tk.all_valid else torch.where(m == float("-inf"), 0.0, m)
        p = exp_shifted_(tk.z, shift.unsqueeze(-1))
        total = p.sum(-1)
        _normalise_rows(_weighted_values(tk, p, o_tile), m, total, tk.all_valid, row_max[t0:t1], row_sum[t0:t1])
        if not direct:
            out[t0:t1] = o_tile


def _backward_native(seq: SparseSequence, selection: RowSelection, d_out: torch.Tensor, out: torch.Tensor,
                     row_max: torch.Tensor, row_sum: torch.Tensor, scale: float, dq: torch.Tensor, dk: torch.Tensor,
                     dv: torch.Tensor) -> None:
    """backward_sequence through the native loops: only valid entries are read or written, in row then entry
    order, so the result is deterministic and independent of the thread count."""
    ws = Workspace(seq.k.device)
    for t0 in range(0, seq.seq_q, NATIVE_ROW_TILE):
        t1 = min(t0 + NATIVE_ROW_TILE, seq.seq_q)
        sel = selection.rows(t0, t1)
        all_valid = bool(sel.valid.all())
        q_tile = seq.query_tile(ws, t0, t1, torch.float32, scale)
        do = d_out[t0:t1].to(torch.float32).contiguous()
        d_sum = (do * out[t0:t1].to(torch.float32)).sum(-1)
        has_keys = sel.row_has_keys.unsqueeze(-1)
        shift = torch.where(has_keys, row_max[t0:t1].to(torch.float32), 0.0).contiguous()
        inv_sum = torch.where(has_keys, 1.0 / row_sum[t0:t1].to(torch.float32), 0.0).contiguous()
        native.sfa_backward(q_tile, do, d_sum, shift, inv_sum, seq.k, seq.values, sel.tokens,
                            None if all_valid else sel.valid, LOG2E, EXP2_FLOOR, scale, dq[t0:t1], dk, dv)


@torch.no_grad()  # kernels fill preallocated outputs; autograd pairs the ops one level up
def backward_sequence(seq: SparseSequence, d_out: torch.Tensor, out: torch.Tensor, row_max: torch.Tensor,
                      row_sum: torch.Tensor, scale: float, sparse_mode: int, block_size: int, dtype: torch.dtype,
                      dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """dq [Sq, N1, Dq] written; dk [Skv, Dq] and dv [Skv, Dv] (fp32, zero-initialised, this sequence's only
    contributions) accumulated, in a fixed order."""
    selection = _sequence_selection(seq, sparse_mode, block_size)
    if _use_native(seq, selection, block_size, dtype, BACKWARD_ROW_TILE):
        _backward_native(seq, selection, d_out, out, row_max, row_sum, scale, dq, dk, dv)
        return
    ws = Workspace(seq.k.device)
    isolate = not (seq.keys_values_finite() and seq.rows_finite(d_out, out))
    union_counts = _tile_union_counts(selection, BACKWARD_ROW_TILE, seq, block_size, isolate)
    for tile, t0 in enumerate(range(0, seq.seq_q, BACKWARD_ROW_TILE)):
        t1 = min(t0 + BACKWARD_ROW_TILE, seq.seq_q)
        n = t1 - t0
        heads = seq.q.shape[1]
        # dP = dO V^T comes out of the logits' GEMM when V is K's first columns (rows stacked below Q).
        stacked = seq.query_tile(ws, t0, t1, dtype, scale, d_out[t0:t1] if seq.value_is_key else None)
        q_tile = stacked[:, :heads]
        tk = _tile_keys(seq, stacked, heads, selection.rows(t0, t1), ws, union_counts[tile], isolate)
        has_keys = tk.sel.row_has_keys.unsqueeze(-1)
        m = torch.where(has_keys, row_max[t0:t1].to(dtype), 0.0).unsqueeze(-1)
        inv_l = torch.where(has_keys, 1.0 / row_sum[t0:t1].to(dtype), 0.0).unsqueeze(-1)
        p = exp_shifted_(tk.z, m).mul_(inv_l)
        do = d_out[t0:t1].to(dtype)
        d_sum = (do * out[t0:t1].to(dtype)).sum(-1, keepdim=True)
        if tk.union_pos is None:
            dp = tk.extra if tk.extra is not None else torch.bmm(do, tk.values.transpose(1, 2),
                                                                  out=ws.take("dp", p.shape, dtype))
            ds = dp.sub_(d_sum).mul_(p)
            if isolate and not tk.all_valid:
                # Exactly 0 for invalid entries, whatever their row's statistics (a row that selected a NaN key has NaN
                # ones): their dK rows are added into token 0 (docs/operators/sparse_flash_attention.md: selected keys
                # only).
                invalid = ~tk.sel.valid.unsqueeze(1)
                p.masked_fill_(invalid, 0.0)
                ds.masked_fill_(invalid, 0.0)
            torch.bmm(ds, tk.keys, out=dq[t0:t1]).mul_(scale)
            width = tk.keys.shape[1]
            # dK = scale dS^T Q: the query tile carries the scale.
            dk_sel = torch.bmm(ds.transpose(1, 2), q_tile, out=ws.take("dk_sel", (n, width, seq.dim_qk), dtype))
            dv_sel = torch.bmm(p.transpose(1, 2), do, out=ws.take("dv_sel", (n, width, do.shape[-1]), dtype))
            if isolate and not tk.all_valid:
                # 0 * a non-finite query / d_out row is NaN: unused entries add exact zeros to token 0.
                unused = ~tk.sel.valid.unsqueeze(-1)
                dk_sel.masked_fill_(unused, 0.0)
                dv_sel.masked_fill_(unused, 0.0)
            dk.index_add_(0, tk.key_tokens.reshape(-1), dk_sel.flatten(0, 1))
            dv.index_add_(0, tk.key_tokens.reshape(-1), dv_sel.flatten(0, 1))
        else:
            dp = tk.extra
            if dp is None:
                dp_dense = (do.reshape(n * heads, -1) @ tk.values.transpose(0, 1)).view(n, heads, -1)
                dp = torch.gather(dp_dense, 2, tk.union_pos.unsqueeze(1).expand(-1, heads, -1))
            ds_u = _to_union(tk, p * (dp - d_sum)).view(n * heads, -1)
            p_u = _to_union(tk, p).view(n * heads, -1)
            dq[t0:t1] = (ds_u @ tk.keys).view(n, heads, -1).mul_(scale)
            dk.index_add_(0, tk.key_tokens, ds_u.transpose(0, 1) @ q_tile.reshape(n * heads, -1))
            dv.index_add_(0, tk.key_tokens, p_u.transpose(0, 1) @ do.reshape(n * heads, -1))
