"""Dropout masks: LSB-first bit packing, element order, TND blocks, generation (docs/semantics/dropout.md).

Element e of the logical keep mask is bit (e & 7) of byte (e >> 3); bit 1 = keep. Elements are numbered
row-major over [B, N1, Sq, Skv]; in TND, sequence b is a contiguous [N1, Sq_b, Skv_b] block and the blocks
follow one another without padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ParamInvalidError, describe, require, require_real


def pack_bits(keep: torch.Tensor) -> torch.Tensor:
    """Pack a boolean keep tensor (any shape, row-major) into LSB-first uint8 bytes."""
    flat = keep.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = (1 << torch.arange(8, dtype=torch.int32, device=flat.device)).to(torch.uint8)
    return (flat.view(-1, 8) * weights).sum(1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `numel` keep bits as a bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask.reshape(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:numel].bool()


def keep_prob_of(keep_prob: float, dropout_p: float | None) -> float:
    """The keep probability of a call that takes `dropout_p = 1 - keep_prob` as an alternative spelling of
    `keep_prob`: one of the two, not both (docs/semantics/dropout.md). Range checks of keep_prob itself stay with the
    operator's validation."""
    keep_prob = require_real(keep_prob, "keep_prob")
    if dropout_p is None:
        return keep_prob
    dropout_p = require_real(dropout_p, "dropout_p")
    require(0.0 <= dropout_p < 1.0, "dropout_p", "a float in [0, 1)", dropout_p)
    if keep_prob != 1.0:
        raise ParamInvalidError(f"dropout_p: give dropout_p or keep_prob, not both (dropout_p={dropout_p!r}, "
                                f"keep_prob={keep_prob!r})")
    return 1.0 - dropout_p


def drop_mask_numel(
    head_num: int,
    *,
    batch: int | None = None,
    seq_q: int | None = None,
    seq_kv: int | None = None,
    actual_seq_qlen: Sequence[int] | torch.Tensor | None = None,
    actual_seq_kvlen: Sequence[int] | torch.Tensor | None = None,
) -> int:
    """Number of mask elements: B*N1*Sq*Skv, or N1 * sum(Sq_b * Skv_b) for TND cumulative lengths."""
    from .lengths import require_same_sequence_count, to_int_list

    if actual_seq_qlen is not None or actual_seq_kvlen is not None:
        q_ends = to_int_list(actual_seq_qlen, "actual_seq_qlen") or []
        kv_ends = to_int_list(actual_seq_kvlen, "actual_seq_kvlen") or []
        require_same_sequence_count(q_ends, kv_ends, "actual_seq_qlen", "actual_seq_kvlen")
        total, pq, pk = 0, 0, 0
        for eq, ek in zip(q_ends, kv_ends, strict=True):
            total += (eq - pq) * (ek - pk)
            pq, pk = eq, ek
        return head_num * total
    if batch is None or seq_q is None or seq_kv is None:
        raise ParamInvalidError("drop_mask_numel: give batch, seq_q and seq_kv, or the TND cumulative lengths")
    return batch * head_num * seq_q * seq_kv


def gen_drop_mask(
    numel: int,
    keep_prob: float,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A bit-packed keep mask of ceil(numel/8) bytes where each bit is 1 with probability keep_prob."""
    if not 0.0 < keep_prob <= 1.0:
        raise ParamInvalidError(f"keep_prob: expected a value in (0, 1], got {keep_prob!r}")
    gen_device = generator.device if generator is not None else torch.device(device or "cpu")
    chunks = []
    chunk = 1 << 24  # a multiple of 8 that bounds temporary memory for very large masks
    for start in range(0, numel, chunk):
        count = min(chunk, numel - start)
        chunks.append(pack_bits(torch.rand(count, generator=generator, device=gen_device) < keep_prob))
    packed = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=gen_device)
    return packed.to(device) if device is not None else packed


def validate_drop_mask(drop_mask: torch.Tensor, numel: int, param: str = "drop_mask") -> None:
    needed = math.ceil(numel / 8)
    if not isinstance(drop_mask, torch.Tensor) or drop_mask.dtype != torch.uint8 or drop_mask.numel() < needed:
        raise ParamInvalidError(
            f"{param}: expected a uint8 bit-packed tensor of at least ceil({numel}/8)={needed} bytes, "
            f"got {describe(drop_mask)}"
        )


@dataclass(frozen=True)
class SequenceDropout:
    """Keep bits of a run of `count` sequences of Sq x Skv whose first element index is `base`; the sequences
    follow one another with a stride of N1 * Sq * Skv elements."""

    mask: torch.Tensor  # flat uint8
    keep_prob: float
    base: int
    count: int
    heads: int
    seq_q: int
    seq_kv: int

    def row_starts(self, i0: int, i1: int, j0: int) -> torch.Tensor:
        """[count, N1, i1 - i0] int64 (on the mask's device): the element index of (row i, column j0) of every
        sequence and head; a row's next columns are the next elements (bits)."""
        plane = self.seq_q * self.seq_kv
        idx_dev = self.mask.device
        seq = torch.arange(self.count, device=idx_dev, dtype=torch.int64).view(-1, 1, 1) * (self.heads * plane)
        head = torch.arange(self.heads, device=idx_dev, dtype=torch.int64).view(1, -1, 1) * plane
        rows = torch.arange(i0, i1, device=idx_dev, dtype=torch.int64).view(1, 1, -1) * self.seq_kv
        return self.base + seq + head + rows + j0

    def keep_tile(self, i0: int, i1: int, j0: int, j1: int, device: torch.device) -> torch.Tensor:
        """Boolean keep tile [count, N1, i1 - i0, j1 - j0]: element e's bit is bit e % 8 (LSB first) of byte e // 8.

        A row's bits are consecutive. Where every row of the tile starts at the same bit within its byte (Skv, the
        base and j0 multiples of 8, as in most shapes), whole bytes are gathered and unpacked (8x fewer indices;
        ~15x faster at 8 x 256 x 1024); else each element is indexed."""
        idx_dev = self.mask.device
        starts = self.row_starts(i0, i1, j0).unsqueeze(-1)  # [count, N1, rows, 1]
        cols = j1 - j0
        shift = (self.base + j0) % 8
        if self.seq_kv % 8 == 0:  # then Sq * Skv is too: every row starts `shift` bits into a byte
            n_bytes = (shift + cols + 7) // 8
            byte = self.mask[(starts >> 3) + torch.arange(n_bytes, device=idx_dev, dtype=torch.int64)]
            bits = (byte.unsqueeze(-1) >> torch.arange(8, device=idx_dev, dtype=torch.uint8)) & 1
            return bits.flatten(-2)[..., shift : shift + cols].bool().to(device)
        element = starts + torch.arange(cols, device=idx_dev, dtype=torch.int64)
        byte = self.mask[element >> 3]
        return ((byte >> (element & 7).to(torch.uint8)) & 1).bool().to(device)


def sequence_bases(heads: int, seq_q: Sequence[int], seq_kv: Sequence[int]) -> tuple[int, ...]:
    """Element index of each sequence's first element: sequence b is an [N1, Sq_b, Skv_b] block and the blocks
    follow one another (docs/semantics/dropout.md)."""
    bases, total = [], 0
    for sq, skv in zip(seq_q, seq_kv, strict=True):
        bases.append(total)
        total += heads * sq * skv
    return tuple(bases)


def block_elements(base: int, seq_q: int, seq_kv: int, heads: range, rows: range, cols: range,
                   device=None) -> torch.Tensor:
    """[len(heads) * len(rows) * len(cols)] int64, head-major: the element indices of a block of the sequence whose
    first element is `base` (element = base + h * Sq * Skv + i * Skv + j, docs/semantics/dropout.md)."""
    h = torch.arange(heads.start, heads.stop, dtype=torch.int64, device=device).view(-1, 1, 1)
    i = torch.arange(rows.start, rows.stop, dtype=torch.int64, device=device).view(1, -1, 1)
    j = torch.arange(cols.start, cols.stop, dtype=torch.int64, device=device).view(1, 1, -1)
    return (base + h * (seq_q * seq_kv) + i * seq_kv + j).reshape(-1)


# ------------------------------------------------------------------------------------------ positional keep bits
# Context parallelism draws each keep bit from its element's position instead of a generator stream, so that the
# mask of a block computed on any rank, at any world size, is the matching part of one logical mask
# (docs/guides/context_parallel.md). Constants of splitmix64 as signed int64 (torch has no uint64 arithmetic;
# int64 products wrap modulo 2**64 as unsigned ones do).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_LOW34, _LOW37, _LOW33 = (1 << 34) - 1, (1 << 37) - 1, (1 << 33) - 1


def _to_signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def positional_keep(seed: int, element: torch.Tensor, keep_prob: float) -> torch.Tensor:
    """Keep bits of logical elements `element` (int64 tensor of indices into the row-major [B, N1, Sq, Skv] /
    TND-block order of docs/semantics/dropout.md) under `seed`: element e is kept iff u(e) < keep_prob with
    u(e) = (splitmix64(seed * 0x9E3779B97F4A7C15 + e) >> 40) / 2**24 (the top 24 bits; splitmix64's finaliser
    z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31, mod 2**64)."""
    z = element.to(torch.int64) + _to_signed64(int(seed) * _GOLDEN)
    z = z ^ ((z >> 30) & _LOW34)
    z = z * _MIX1
    z = z ^ ((z >> 27) & _LOW37)
    z = z * _MIX2
    z = z ^ ((z >> 31) & _LOW33)
    top24 = (z >> 40) & 0xFFFFFF
    return top24 < math.ceil(keep_prob * (1 << 24))


def positional_drop_mask(seed: int, keep_prob: float, head_num: int, seq_q: Sequence[int], seq_kv: Sequence[int],
                         device: torch.device | str | None = None) -> torch.Tensor:
    """The whole bit-packed mask of sequences with these lengths (dense layouts: B equal entries) drawn by
    `positional_keep`: what a single-process `flash_attention_score` call takes to reproduce a context-parallel
    run with the same seed."""
    numel = head_num * sum(q * k for q, k in zip(seq_q, seq_kv, strict=True))
    chunks, chunk = [], 1 << 23  # a multiple of 8: chunks pack into whole bytes
    for start in range(0, numel, chunk):
        element = torch.arange(start, min(numel, start + chunk), dtype=torch.int64, device=device)
        chunks.append(pack_bits(positional_keep(seed, element, keep_prob)))
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=device)
