"""Dequantisation of the quantised inference operators, the one place the rule lives (docs/semantics/precision.md,
"Dequantisation"): `dequantize_values` computes (x + offset) * scale in fp32, rounded once to the target dtype, for
FIA / IFA's KV antiquant (problem/antiquant.py, which adds its scale layouts and int4 unpacking) and the quantised DSA
operators below (docs/operators/quant_dsa.md).

QuantLightningIndexer (per-token-head, mode 0): an int8 / float8_e4m3fn query row h of token t and key s meet as
(Scale_Q[t, h] * Scale_K[s]) * (Q[t, h] . K[s]): the dot product of the quantised values (exact in fp32 for int8 and
D <= 1024), scaled by the outer product of the two scales, before the ReLU (torch_npu npu_quant_lightning_indexer,
计算公式).

KvQuantSparseFlashAttention (per-tile, mode 2, `quant_scale_repo_mode` 1 "combine"): each cache row holds, side by
side along D, the quantised latent (512 int8 / fp8 values), the rope part (64 values of the query's dtype, as
bytes) and one float32 scale per `tile_size` = 128 latent values (as bytes): 512 + 64 * 2 + 4 * 4 = 656 bytes. The
latent is dequantised as x * scale of its tile, taken in fp32 and rounded once to the query's dtype: the formula
of FIA's KV antiquant without an offset (op-plugin's CPU golden of the operator does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
# KvQuantSparseFlashAttention's only documented combined layout: D_nope, D_rope, tile (attention_mode 2,
# rope_head_dim 64, tile_size 128).
LATENT_DIM, ROPE_DIM, TILE_SIZE = 512, 64, 128
SCALE_BYTES = 4


def score_scales(query_scale: torch.Tensor, key_scale: torch.Tensor) -> torch.Tensor:
    """Scale_Q @ Scale_K^T of a tile: query_scale [rows, H] and key_scale [S] -> [rows, H, S] fp32 factors of the
    quantised dot products (fp16 x fp16 products are exact in fp32)."""
    return query_scale.to(torch.float32).unsqueeze(-1) * key_scale.to(torch.float32).view(1, 1, -1)


def dequantize_values(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, offset: torch.Tensor | None = None,
                      *, out: torch.Tensor | None = None) -> torch.Tensor:
    """(x + offset) * scale of quantised values x (int8, or fp8 / any float, converted exactly), with fp32 `scale` /
    `offset` broadcasting against x: taken in fp32 and rounded once to `dtype` (into `out` when given, else a new
    tensor of the broadcast shape)."""
    if offset is None and x.dtype == torch.int8 and dtype in (torch.float16, torch.bfloat16):
        narrow = scale.to(dtype)
        # An int8 value times a scale that `dtype` holds exactly is exact in fp32 (at most 8 + 11 significant
        # bits), so PyTorch's `dtype` multiply (fp32 product, one rounding) gives the same bits in one pass.
        if torch.equal(narrow.to(torch.float32), scale):
            return torch.mul(x, narrow) if out is None else torch.mul(x, narrow, out=out)
    if offset is None and dtype == torch.float32 and out is None:
        # Exact conversion into the fp32 result, then one in-place fp32 multiply: the same bits as the promoting
        # multiply below, in a quarter of its time on the CPU (no per-element type promotion).
        out = torch.empty(torch.broadcast_shapes(x.shape, scale.shape), dtype=dtype, device=x.device)
        return out.copy_(x).mul_(scale)
    # One pass for int8 without offset: the values promote to fp32 inside the multiplication and its fp32 product is
    # rounded once on the write to `dtype` (fp8 has no such promotion: converted first, exactly).
    values = x if x.dtype == torch.int8 and offset is None else x.to(torch.float32)
    if offset is not None:
        values = values + offset
    if out is None:
        out = torch.empty(torch.broadcast_shapes(x.shape, scale.shape), dtype=dtype, device=x.device)
    return torch.mul(values, scale, out=out)


def dequantize_tiles(x: torch.Tensor, scales: torch.Tensor, tile: int, dtype: torch.dtype) -> torch.Tensor:
    """x [..., n * tile] (int8 / fp8) times the fp32 scale of its tile, scales [..., n], by `dequantize_values`
    (a new tensor)."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    dequantize_values(x.unflatten(-1, (scales.shape[-1], tile)), scales.to(torch.float32).unsqueeze(-1), dtype,
                      out=out.unflatten(-1, (scales.shape[-1], tile)))
    return out


@dataclass(frozen=True)
class CombinedCache:
    """Views into a combined KV cache [..., 656 bytes] (no copy): the quantised latent, the rope part in the query's
    dtype and the per-tile fp32 scales."""

    latent: torch.Tensor
    rope: torch.Tensor
    scales: torch.Tensor


def packed_row_bytes(latent: int, rope_dim: int, tile_size: int, dtype: torch.dtype) -> int:
    """Bytes of one packed row: `latent` int8 values, `rope_dim` values of the float `dtype`, one float32 scale per
    `tile_size` latent values; the row MlaProlog's kv_cache_quant_mode 3 writes (docs/operators/mla_prolog.md) and
    KvQuantSparseFlashAttention reads."""
    return latent + rope_dim * torch.empty((), dtype=dtype).element_size() + SCALE_BYTES * (latent // tile_size)


def combined_width(query_dtype: torch.dtype) -> int:
    """Bytes per cache row: latent + rope in the query's dtype + one fp32 scale per tile (656 for fp16 / bf16)."""
    return packed_row_bytes(LATENT_DIM, ROPE_DIM, TILE_SIZE, query_dtype)


def split_combined(cache: torch.Tensor, query_dtype: torch.dtype) -> CombinedCache:
    """The three parts of a combined cache row (the caller has checked its width, `combined_width`)."""
    rope_end = LATENT_DIM + ROPE_DIM * torch.empty((), dtype=query_dtype).element_size()
    as_bytes = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    return CombinedCache(cache[..., :LATENT_DIM], as_bytes[..., LATENT_DIM:rope_end].view(query_dtype),
                         as_bytes[..., rope_end:].view(torch.float32))
