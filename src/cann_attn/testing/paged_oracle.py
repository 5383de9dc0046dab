"""Paged KV caches for the float64 oracles: the contiguous keys a cache stands for, gathered page by page as
docs/semantics/paged-kv.md states the rule, then handed to the contiguous oracle. Written from that page only (it
imports nothing from cann_attn): logical key position p of sequence b lives in physical block
``block_table[b, p // block_size]`` at slot ``p % block_size``; only the first L_b positions of sequence b exist.

- `gather_sequences`: per sequence its L_b tokens, from a ``[block_num, block_size, ...]`` cache (FIA's BnBsH
  ``[block_num, block_size, H]``, SFA / LI "PA_BSND" ``[block_num, block_size, N, D]``) or a heads-first
  ``[block_num, N, block_size, D]`` one (FIA's BnNBsD);
- `unpage_fia`: FusedInferAttentionScore / IncreFlashAttention arguments (v1 spelling) with the caches replaced by
  contiguous key / value / key_rope in the query's layout (dense layouts: the table's reach ``W * block_size``
  positions, zeros past each L_b, so that atten_mask / pse_shift columns keep their meaning; TND / NTD: the
  sequences packed, the plain lengths turned into the cumulative ends the packed layout takes);
- `unpage_dsa`: the same for SparseFlashAttention ("PA_BSND" key / value / key_rope) and LightningIndexer
  (key_index);
- `paginate`: the inverse, for building cases: contiguous per-sequence tokens scattered over shuffled blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["gather_sequences", "paginate", "unpage_dsa", "unpage_fia"]


def _plain(lengths: Any) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        return [int(x) for x in lengths.reshape(-1).tolist()]
    return [int(x) for x in lengths]


def gather_sequences(cache: torch.Tensor, block_table: torch.Tensor, lengths: Sequence[int], block_size: int,
                     heads_first: bool = False) -> list[torch.Tensor]:
    """Sequence b's tokens ``[L_b, *token]``: position p from block ``block_table[b, p // block_size]``, slot
    ``p % block_size``. `heads_first`: the cache is ``[block_num, N, block_size, D]`` (tokens ``[N, D]``)."""
    if heads_first:
        cache = cache.permute(0, 2, 1, 3)
    table = block_table.to("cpu", torch.int64)
    out = []
    for b, n in enumerate(lengths):
        rows = []
        for p in range(n):
            rows.append(cache[int(table[b, p // block_size]), p % block_size])
        out.append(torch.stack(rows) if rows else cache.new_zeros((0, *cache.shape[2:])))
    return out


def _dense(seqs: list[torch.Tensor], width: int) -> torch.Tensor:
    """[B, width, *token], zeros past each sequence's length."""
    token = seqs[0].shape[1:] if seqs else ()
    out = torch.zeros((len(seqs), width, *token), dtype=seqs[0].dtype if seqs else torch.float32)
    for b, s in enumerate(seqs):
        out[b, : s.shape[0]] = s
    return out


def _cumulative(lengths: Sequence[int]) -> list[int]:
    return list(itertools.accumulate(lengths))


def _fia_layout_tensor(seqs: list[torch.Tensor], layout: str, heads: int, width: int) -> torch.Tensor:
    """Tokens (``[N, D]`` or ``[H]``) of every sequence as a contiguous tensor of query layout `layout`."""
    seqs = [s.reshape(s.shape[0], heads, -1) for s in seqs]  # [L, N, D]
    if layout in ("TND", "NTD"):
        packed = torch.cat(seqs)
        return packed if layout == "TND" else packed.permute(1, 0, 2).contiguous()
    dense = _dense(seqs, width)  # [B, S, N, D]
    if layout == "BSH":
        return dense.flatten(2)
    if layout == "BSND":
        return dense
    if layout == "BNSD":
        return dense.permute(0, 2, 1, 3).contiguous()
    raise ValueError(f"unpage_fia: no contiguous form for query layout {layout!r}")


def unpage_fia(named: Mapping[str, Any]) -> dict[str, Any]:
    """FIA / IFA arguments (v1 spelling: actual_seq_lengths_kv, num_key_value_heads, input_layout) with the paged
    key / value (/ key_rope) replaced by their contiguous form; block_table / block_size removed."""
    out = dict(named)
    table, block_size = out.pop("block_table"), out.pop("block_size", None)
    if not block_size:  # the caches' block dimension: [block_num, block_size, H] or [block_num, N, block_size, D]
        block_size = out["key"].shape[1] if out["key"].dim() == 3 else out["key"].shape[2]
    block_size = int(block_size)
    lengths = _plain(out["actual_seq_lengths_kv"])
    layout = str(out.get("input_layout", "BSH")).split("_")[0]
    heads_kv = int(out.get("num_key_value_heads") or out.get("num_heads", 1))
    width = table.shape[1] * block_size
    for name in ("key", "value", "key_rope"):
        cache = out.get(name)
        if cache is None:
            continue
        seqs = gather_sequences(cache, table, lengths, block_size, heads_first=cache.dim() == 4)
        out[name] = _fia_layout_tensor(seqs, layout, heads_kv, width)
    if layout in ("TND", "NTD"):
        out["actual_seq_lengths_kv"] = _cumulative(lengths)
    return out


def unpage_dsa(named: Mapping[str, Any], caches: Sequence[str], lengths_name: str,
               layout_kv_name: str) -> dict[str, Any]:
    """SFA / LI arguments with the "PA_BSND" caches named in `caches` replaced by contiguous keys in the query's
    layout (``layout``: BSND ``[B, W * block_size, N2, D]`` or TND, lengths then cumulative); block_table and the
    key layout parameter removed."""
    out = dict(named)
    table = out.pop("block_table")
    out.pop(layout_kv_name, None)
    lengths = _plain(out[lengths_name])
    block_size = int(out[caches[0]].shape[1])
    width = table.shape[1] * block_size
    packed = out.get("layout", "BSND") == "TND"
    for name in caches:
        if out.get(name) is None:
            continue
        seqs = gather_sequences(out[name], table, lengths, block_size)
        out[name] = torch.cat(seqs) if packed else _dense(seqs, width)
    if packed:
        out[lengths_name] = _cumulative(lengths)
    return out


def paginate(sequences: Mapping[str, Sequence[torch.Tensor]], block_size: int, gen: torch.Generator, *,
             spare_blocks: int = 1, heads_first: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Caches ``[block_num, block_size, *token]`` (`heads_first`: ``[block_num, N, block_size, D]``) holding
    ``sequences[name][b]`` (``[L_b, *token]``) on shuffled blocks, and the int32 table ``[B, W]`` (unused entries -1,
    one spare column); slots nobody reads hold NaN (float) or -7."""
    first = next(iter(sequences.values()))
    lengths = [int(s.shape[0]) for s in first]
    needed = [-(-n // block_size) for n in lengths]
    block_num = sum(needed) + spare_blocks
    perm = torch.randperm(block_num, generator=gen).tolist()
    table = torch.full((len(lengths), max(needed, default=0) + 1), -1, dtype=torch.int32)
    caches = {}
    for name, seqs in sequences.items():
        fill = float("nan") if seqs[0].dtype.is_floating_point else -7
        caches[name] = torch.full((block_num, block_size, *seqs[0].shape[1:]), fill, dtype=seqs[0].dtype)
    used = iter(perm)
    for b, n_blocks in enumerate(needed):
        for j in range(n_blocks):
            phys = next(used)
            table[b, j] = phys
            lo, hi = j * block_size, min((j + 1) * block_size, lengths[b])
            for name, seqs in sequences.items():
                caches[name][phys, : hi - lo] = seqs[b][lo:hi]
    if heads_first:
        caches = {n: c.permute(0, 2, 1, 3).contiguous() for n, c in caches.items()}
    return caches, table
