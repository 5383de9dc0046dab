"""Sparse (DSA) attention over selected keys: forward and backward (SEMANTICS.md section 8).

Rows of one sequence are processed in tiles; the selection rule comes from `problem.sparse.row_selection`.
Two ways to form the selected logits, chosen per tile by estimated cost, give identical results:
- gather: copy each row's selected K/V rows ([rows, T, D]) and use batched GEMMs (scattered selections,
  e.g. top-k of single tokens);
- union: one dense GEMM against the union of the tile's selected blocks, then pick each row's entries out of
  it (block selections shared by neighbouring rows, e.g. causal block-sparse patterns).
Duplicated entries are kept (gathered twice, gradients added). No S1 x S2 matrix is ever formed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...problem.sparse import RowSelection, row_selection
from .workspace import Workspace

ROW_TILE = 32
# Cost of gathering one fp32 element, in multiply-adds: memory traffic versus GEMM throughput on a CPU.
GATHER_COST = 8.0
INVALID_MAX = -2e38


@dataclass
class SparseSequence:
    """One sequence's tensors as [S, N, D] / [S, D] views and its lengths."""

    q: torch.Tensor  # [Sq, N1, Dq] (query, or query ++ query_rope)
    k: torch.Tensor  # [Skv, Dq]
    v: torch.Tensor  # [Skv, Dv]
    indices: torch.Tensor  # [Sq, K]
    seq_q: int
    seq_kv: int
    # DSA passes the same latent as key and value: V is then K's first Dv columns and is gathered with it.
    value_is_key: bool = False

    def gather(self, ws: Workspace, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = ws.gather_rows("keys", self.k, tokens)
        if self.value_is_key:
            return keys, keys[..., : self.v.shape[-1]]
        return keys, ws.gather_rows("values", self.v, tokens)


@dataclass
class _TileKeys:
    """Selected logits of a row tile plus what the backward needs to route gradients back to keys."""

    z: torch.Tensor  # [rows, N1, T] masked logits (scale applied)
    sel: RowSelection
    keys: torch.Tensor  # gathered [rows, T, Dq] or union [U, Dq]
    values: torch.Tensor  # gathered [rows, T, Dv] or union [U, Dv]
    key_tokens: torch.Tensor  # positions of `keys` rows in the sequence
    union_pos: torch.Tensor | None  # [rows, T] column of each entry in the union (union mode)


def _tile_keys(seq: SparseSequence, q_tile: torch.Tensor, rows: torch.Tensor, scale: float, sparse_mode: int,
               block_size: int, ws: Workspace) -> _TileKeys:
    sel = row_selection(seq.indices[rows], rows, sparse_mode=sparse_mode, seq_q=seq.seq_q, seq_kv=seq.seq_kv,
                        block_size=block_size)
    n_rows, heads, d_qk = q_tile.shape
    width = sel.tokens.shape[1]
    d_all = d_qk + seq.v.shape[-1]
    # Sorted distinct selected blocks without a sort: mark them in a per-block table.
    present = torch.zeros(-(-seq.seq_kv // block_size), dtype=torch.bool, device=rows.device)
    present[sel.blocks[sel.entry_valid]] = True
    union_blocks = present.nonzero().view(-1)
    union_width = union_blocks.numel() * block_size
    gather_cost = n_rows * width * d_all * (GATHER_COST + heads)
    union_cost = union_width * d_all * (GATHER_COST + n_rows * heads)
    if union_width == 0 or gather_cost <= union_cost:
        keys, values = seq.gather(ws, sel.tokens)
        z = torch.bmm(q_tile, keys.transpose(1, 2), out=ws.take("z", (n_rows, heads, width), q_tile.dtype))
        union_pos, key_tokens = None, sel.tokens
    else:
        offsets = torch.arange(block_size, device=rows.device)
        key_tokens = (union_blocks.view(-1, 1) * block_size + offsets).reshape(-1).clamp_(max=seq.seq_kv - 1)
        keys, values = seq.gather(ws, key_tokens)
        dense = torch.mm(q_tile.reshape(-1, d_qk), keys.transpose(0, 1),
                         out=ws.take("dense", (n_rows * heads, key_tokens.numel()), q_tile.dtype))
        dense = dense.view(n_rows, heads, -1)
        slot = torch.searchsorted(union_blocks, sel.blocks).clamp_(max=union_blocks.numel() - 1)
        union_pos = (slot.unsqueeze(-1) * block_size + offsets).reshape(n_rows, -1)
        z = torch.gather(dense, 2, union_pos.unsqueeze(1).expand(-1, heads, -1))
    z = z.mul_(scale).masked_fill_(~sel.valid.unsqueeze(1), float("-inf"))
    return _TileKeys(z, sel, keys, values, key_tokens, union_pos)


def _to_union(tk: _TileKeys, per_entry: torch.Tensor) -> torch.Tensor:
    """Sum per-entry values [rows, N1, T] into union columns [rows, N1, U] (duplicates add up)."""
    rows, heads, _ = per_entry.shape
    out = per_entry.new_zeros(rows, heads, tk.keys.shape[0])
    return out.scatter_add_(2, tk.union_pos.unsqueeze(1).expand(-1, heads, -1), per_entry)


def _weighted_values(tk: _TileKeys, p: torch.Tensor) -> torch.Tensor:
    """sum_e p[e] * V[e] for every row and head: [rows, N1, Dv]."""
    if tk.union_pos is None:
        return torch.bmm(p, tk.values)
    rows, heads, _ = p.shape
    return (_to_union(tk, p).view(rows * heads, -1) @ tk.values).view(rows, heads, -1)


def forward_sequence(seq: SparseSequence, scale: float, sparse_mode: int, block_size: int, dtype: torch.dtype,
                     out: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> None:
    """Fill out [Sq, N1, Dv], row_max / row_sum [Sq, N1] of one sequence."""
    ws = Workspace(seq.q.device)
    for t0 in range(0, seq.seq_q, ROW_TILE):
        rows = torch.arange(t0, min(t0 + ROW_TILE, seq.seq_q), device=seq.q.device)
        q_tile = seq.q[t0 : t0 + rows.numel()].to(dtype)
        tk = _tile_keys(seq, q_tile, rows, scale, sparse_mode, block_size, ws)
        m = tk.z.amax(-1)
        has_keys = tk.sel.row_has_keys.unsqueeze(-1)
        shift = torch.where(has_keys, m, 0.0)
        p = torch.exp(tk.z - shift.unsqueeze(-1))
        total = p.sum(-1)
        o = _weighted_values(tk, p) / torch.where(has_keys, total, 1.0).unsqueeze(-1)
        out[t0 : t0 + rows.numel()] = torch.where(has_keys.unsqueeze(-1), o, 0.0)
        row_max[t0 : t0 + rows.numel()] = torch.where(has_keys, m, INVALID_MAX)
        row_sum[t0 : t0 + rows.numel()] = torch.where(has_keys, total, 0.0)


def backward_sequence(seq: SparseSequence, d_out: torch.Tensor, out: torch.Tensor, row_max: torch.Tensor,
                      row_sum: torch.Tensor, scale: float, sparse_mode: int, block_size: int, dtype: torch.dtype,
                      dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """dq [Sq, N1, Dq] written; dk [Skv, Dq] and dv [Skv, Dv] (fp32) accumulated, in a fixed order."""
    ws = Workspace(seq.q.device)
    for t0 in range(0, seq.seq_q, ROW_TILE):
        n = min(ROW_TILE, seq.seq_q - t0)
        rows = torch.arange(t0, t0 + n, device=seq.q.device)
        q_tile = seq.q[t0 : t0 + n].to(dtype)
        tk = _tile_keys(seq, q_tile, rows, scale, sparse_mode, block_size, ws)
        has_keys = tk.sel.row_has_keys.unsqueeze(-1)
        m = torch.where(has_keys, row_max[t0 : t0 + n].to(dtype), 0.0).unsqueeze(-1)
        inv_l = torch.where(has_keys, 1.0 / row_sum[t0 : t0 + n].to(dtype), 0.0).unsqueeze(-1)
        p = torch.exp(tk.z - m).mul_(inv_l)
        do = d_out[t0 : t0 + n].to(dtype)
        d_sum = (do * out[t0 : t0 + n].to(dtype)).sum(-1, keepdim=True)
        heads = p.shape[1]
        if tk.union_pos is None:
            dp = torch.bmm(do, tk.values.transpose(1, 2))
            ds = p * (dp - d_sum) * scale  # the softmax scale folded in once, on the small [rows, N1, T] tile
            dq[t0 : t0 + n] = torch.bmm(ds, tk.keys)
            width = tk.keys.shape[1]
            dk_sel = torch.bmm(ds.transpose(1, 2), q_tile, out=ws.take("dk_sel", (n, width, q_tile.shape[-1]), dtype))
            dv_sel = torch.bmm(p.transpose(1, 2), do, out=ws.take("dv_sel", (n, width, do.shape[-1]), dtype))
            dk.index_add_(0, tk.key_tokens.reshape(-1), dk_sel.flatten(0, 1))
            dv.index_add_(0, tk.key_tokens.reshape(-1), dv_sel.flatten(0, 1))
        else:
            dp_dense = (do.reshape(n * heads, -1) @ tk.values.transpose(0, 1)).view(n, heads, -1)
            dp = torch.gather(dp_dense, 2, tk.union_pos.unsqueeze(1).expand(-1, heads, -1))
            ds_u = _to_union(tk, p * (dp - d_sum) * scale).view(n * heads, -1)
            p_u = _to_union(tk, p).view(n * heads, -1)
            dq[t0 : t0 + n] = (ds_u @ tk.keys).view(n, heads, -1)
            dk.index_add_(0, tk.key_tokens, ds_u.transpose(0, 1) @ q_tile.reshape(n * heads, -1))
            dv.index_add_(0, tk.key_tokens, p_u.transpose(0, 1) @ do.reshape(n * heads, -1))
