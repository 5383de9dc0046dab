"""Decode attention on the CPU reference backend: one query token per sequence, no mask, no pse
(docs/operators/fused_infer_attention_score.md, "Backends").

The general tiled forward converts a run's keys and values to fp32 before its GEMMs, which for one query row per
sequence costs more than the attention itself (a [B, N2, S, D] copy per call). Here the native loops read the
caches in place in their own dtype (fp32, fp16, bf16), widen a tile of key/value rows at a time for all the query
heads of its GQA group and keep an online softmax per grouped query row, long sequences split into chunks across
the threads (docs/guides/backends.md, "Decode": the order of the sums): memory stays O(rows x D) per thread
whatever S is. A bf16 query over bf16 keys is passed unscaled: its scores are bf16 dot products times the scale.
Semantics stay with the problem: each sequence attends to its first Skv keys (the runs' lengths), sequences without
keys keep the caller's zero output and invalid-row statistics.
"""

from __future__ import annotations

import torch

from ...problem import antiquant as antiquants
from ...problem.attention import AttentionProblem
from ...problem.dequant import dequantize_values
from ...problem.stats import value_column_scales
from . import native
from .flash_forward import has_non_finite


def usable(problem: AttentionProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           dequant: bool = False, key_rope: torch.Tensor | None = None) -> bool:
    """Every run has at most one query row, no mask and no pse, on a dense layout, and the native decode loop can
    read the caches."""
    if problem.tnd or problem.sink is not None or query.device.type != "cpu" or query.dtype not in native.DECODE_DTYPES:
        return False
    for run in problem.runs:
        if run.seq_q > 1 or run.pse is not None or run.dropout is not None or run.mask.hides_keys:
            return False
    return native.decode_usable(key, value, query.dtype if dequant else None, key_rope)


@torch.no_grad()
def forward(problem: AttentionProblem, query, key, value, out, softmax_max=None, softmax_sum=None,
            block_table: torch.Tensor | None = None,
            kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, packed_int4: bool = False,
            key_rope: torch.Tensor | None = None, int8_query: antiquants.Int8QueryRows | None = None) -> None:
    """Fill `out` [B, N, 1, Dv] (and the [B, N, 1, 8] statistics when given) of sequences that have keys. With
    `block_table`, key and value are paged caches seen as [block_num, N2, block_size, D], read in place through the
    table (docs/semantics/paged-kv.md): the same loop over the same rows, so the same bits as contiguous caches.
    With `kv_scales` (per-channel key / value scales [N2, D], fp32) key and value are int8, anti-quantised to the
    query's dtype as the loop reads them (problem/antiquant.py); `packed_int4`: key / value are the int8 bytes of
    int4 values packed two to a byte. `key_rope` (MLA): the rope keys' cache, of the key's layout, whose rows follow
    each key's (the query carries its rope columns after D). `int8_query` (an int8 MLA query over an int8 latent
    with `kv_scales` and `key_rope`): the scores come from its rows, exact integer dot products plus the rope's
    (docs/guides/backends.md, "Decode"), not from `query`."""
    batch, heads, heads_kv = problem.batch, problem.heads_q, problem.heads_kv
    group = heads // heads_kv
    lengths = torch.zeros(batch, dtype=torch.int64)
    for run in problem.runs:
        if run.seq_q > 0:
            lengths[run.b0 : run.b0 + run.count] = run.seq_kv
    pairs = batch * heads_kv
    # bf16 query and keys: the scores are bf16 dot products times the scale, as the fused forward's bf16 scores
    # (docs/guides/backends.md, "Decode"); else the query converted first, then scaled (as the tiled forward).
    bf16_dots = query.dtype == key.dtype == torch.bfloat16 and kv_scales is None \
        and (key_rope is None or key_rope.dtype == torch.bfloat16)
    if bf16_dots:
        rows, scale = query[:, :, 0].contiguous(), problem.scale
    else:
        rows, scale = _scaled_query(query, problem.scale), 1.0
    acc = torch.empty((pairs, group, problem.dim_v), dtype=torch.float32)
    row_max = torch.empty((pairs, group), dtype=torch.float32)
    row_sum = torch.empty((pairs, group), dtype=torch.float32)
    dequant = None if kv_scales is None else (*kv_scales, query.dtype)
    native.decode_rows(rows.view(pairs, group, -1), key, value, lengths, acc, row_max, row_sum, block_table, dequant,
                       packed_int4, key_rope, scale,
                       None if int8_query is None else int8_query.loop_rows(pairs, group))
    seen = (lengths > 0).nonzero().view(-1)
    if seen.numel() == 0:
        return
    denom = row_sum.unsqueeze(-1)
    if has_non_finite(acc):
        if int8_query is not None:
            # The int8 query's scores again (the same integers), the value scales times the column powers of two.
            values = dequantize_values(_channels_last(value), kv_scales[1].view(1, -1, 1, kv_scales[1].shape[-1]),
                                       query.dtype)
            scales = value_column_scales(_rows_read(values, block_table, lengths).abs().amax(dim=(0, 1)),
                                         int(lengths.max()))
            if scales is not None:
                native.decode_rows(rows.view(pairs, group, -1), key, value, lengths, acc, row_max, row_sum, block_table,
                                   (kv_scales[0], kv_scales[1] * scales, query.dtype), packed_int4, key_rope, scale,
                                   int8_query.loop_rows(pairs, group))
                denom = denom * scales
        else:
            # P V overflowed on values near FLT_MAX: again with V scaled by exact powers of two per column (`stats`),
            # as fp32 copies of the caches (the loop reads key and value in one dtype).
            if packed_int4:
                key, value = (antiquants.unpack_int4(x.view(torch.int32)) for x in (key, value))
            if kv_scales is not None:  # the values the loop read (NZ caches as [block_num, N2, block_size, D])
                key, value = (dequantize_values(_channels_last(x), s.view(1, s.shape[0], 1, -1), query.dtype)
                              for x, s in zip((key, value), kv_scales, strict=True))
            if key_rope is not None:  # the keys the loop read: latent ++ rope columns
                key, value = torch.cat([_channels_last(key), _channels_last(key_rope)], dim=-1), _channels_last(value)
            scales = value_column_scales(_rows_read(value, block_table, lengths).abs().amax(dim=(0, 1)),
                                         int(lengths.max()))
            if scales is not None:
                # fp32 copies: the scores from the fp32 query, scaled first, whatever the dtype.
                q = _scaled_query(query, problem.scale) if bf16_dots else rows
                native.decode_rows(q.view(pairs, group, -1), key.float(), value.float() * scales, lengths, acc, row_max,
                                   row_sum, block_table)
                denom = denom * scales
    normalised = (acc / denom).view(batch, heads, -1)
    out[seen, :, 0] = normalised[seen].to(out.dtype)
    if softmax_max is not None:
        softmax_max[seen, :, 0] = row_max.view(batch, heads)[seen].unsqueeze(-1).to(softmax_max.dtype)
        softmax_sum[seen, :, 0] = row_sum.view(batch, heads)[seen].unsqueeze(-1).to(softmax_sum.dtype)


def _scaled_query(query: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, N, D] fp32: the query rows converted, then scaled (fp32 products of the input values)."""
    q = torch.empty(query.shape[:2] + query.shape[3:], dtype=torch.float32)
    q.copy_(query[:, :, 0])
    return q.mul_(scale)


def _rows_read(cache: torch.Tensor, block_table: torch.Tensor | None, lengths: torch.Tensor) -> torch.Tensor:
    """[rows, N2, D]: the value rows the loop read, positions below each sequence's length: the slots and blocks
    beyond them (padding, unconverted blocks of a converted pool in problem/antiquant.py) may hold anything, NaN
    included, and must not steer the value scaling. `cache` is [B, N2, S, D], or paged [block_num, N2,
    block_size, D] read through `block_table`."""
    span = int(lengths.max())
    positions = torch.arange(span)
    batch, position = (positions < lengths.view(-1, 1)).nonzero(as_tuple=True)
    if block_table is None:
        return cache[batch, :, position]
    block_size = cache.shape[2]
    blocks = block_table.to(torch.int64)[batch, position // block_size]
    return cache[blocks, :, position % block_size]


def _channels_last(cache: torch.Tensor) -> torch.Tensor:
    """A cache's rows with their channels on the last axis: an NZ cache [block_num, N2, D/c0, block_size, c0] as
    [block_num, N2, block_size, D] (a copy), any other as it is."""
    return cache.permute(0, 1, 3, 2, 4).flatten(-2) if cache.dim() == 5 else cache
