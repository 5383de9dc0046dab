"""Paged KV caches for the tests (docs/semantics/paged-kv.md): per-sequence keys scattered over shuffled physical
blocks, with garbage wherever the page-table rule says nothing is read."""

from __future__ import annotations

import torch

from fia_cases import rand

# Table entries no sequence reads: -1 (the usual padding), out-of-range ids and a stale valid id (filled in per
# table). The operators must not read through any of them.
UNUSED_TABLE_ENTRIES = (-1, 2**31 - 1, -(2**31), 10**6)


def paginate(named: dict[str, list[torch.Tensor]], block_size: int, gen: torch.Generator, *, spare_blocks: int = 2,
             extra_columns: int = 1, garbage: float = float("nan")) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Caches [block_num, block_size, *rest] for every name (all sharing one table) and the int32 block table.

    `named[name][b]` is sequence b's [L_b, *rest] keys. Logical blocks land on a random permutation of the
    physical blocks; slots beyond L_b, the spare blocks and the (floating) garbage hold `garbage`; unused table
    entries hold -1, out-of-range ids or a stale id of a block another sequence owns."""
    first = next(iter(named.values()))
    lengths = [int(t.shape[0]) for t in first]
    needed = [-(-n // block_size) for n in lengths]
    block_num = sum(needed) + spare_blocks
    width = max([*needed, 0]) + extra_columns
    perm = torch.randperm(block_num, generator=gen)
    choices = torch.tensor([*UNUSED_TABLE_ENTRIES, int(perm[0])], dtype=torch.int64)
    pick = torch.randint(0, len(choices), (len(lengths), max(width, 1)), generator=gen)
    table = choices[pick][:, :width].to(torch.int32)
    caches = {}
    for name, seqs in named.items():
        rest = tuple(seqs[0].shape[1:])
        dtype = seqs[0].dtype
        fill = garbage if dtype.is_floating_point else -7
        caches[name] = torch.full((block_num, block_size, *rest), fill, dtype=dtype)
    k = 0
    for b, n_blocks in enumerate(needed):
        for j in range(n_blocks):
            phys = int(perm[k])
            k += 1
            table[b, j] = phys
            lo, hi = j * block_size, min((j + 1) * block_size, lengths[b])
            for name, seqs in named.items():
                caches[name][phys, : hi - lo] = seqs[b][lo:hi]
    return caches, table


def int8_mla_pages(lengths: list[int], latent_dim: int, rope_dim: int, block_size: int, gen: torch.Generator):
    """An int8 MLA latent [B, S, 1, latent_dim] and its bf16 rope [B, S, 1, rope_dim] (random, S = max(lengths)), and
    the first lengths[b] tokens of each paginated: (latent, rope, {"k": .., "r": ..} pools, block table)."""
    s = max(lengths)
    latent = rand((len(lengths), s, 1, latent_dim), torch.int8, gen)
    rope = rand((len(lengths), s, 1, rope_dim), torch.bfloat16, gen)
    nd, table = paginate({"k": [latent[b, :n] for b, n in enumerate(lengths)],
                          "r": [rope[b, :n] for b, n in enumerate(lengths)]}, block_size, gen)
    return latent, rope, nd, table
