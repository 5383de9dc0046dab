"""Reference computation of MlaProlog on token rows (docs/operators/mla_prolog.md).

The products and norms run in float32 (float64 for float64 inputs) and are rounded to the input dtype where the
operator keeps its intermediates in it: after x W^DQ, after the query RmsNorm (also the query_norm output), after
c^Q W^UQQR, after x W^DKVKR, and at the outputs. For float32 / float64 inputs the roundings change nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ...problem.nz import nz_shape, nz_tokens
from ...problem.page_table import PADDING_SLOT
from ...problem.quant import round_to_int8
from ...problem.rmsnorm import rms_norm
from ...problem.rope import interleaved_rope

if TYPE_CHECKING:
    from ...ops.mla_prolog import MlaPrologProblem


class MlaPrologRows(NamedTuple):
    """Per token row, in the input dtype: query [T, N, Hckv] (int8 with query_quant_mode 1), query_rope [T, N, Dr],
    query_norm [T, Hcq] (c^Q), latent [T, Hckv] and key_rope [T, Dr] (what went into the caches, in the caches'
    dtypes; with kv_cache_quant_mode 3 latent holds the packed int8 rows [T, Dtile] and key_rope is None)."""

    query: torch.Tensor
    query_rope: torch.Tensor
    query_norm: torch.Tensor
    latent: torch.Tensor
    key_rope: torch.Tensor | None
    query_norm_scale: torch.Tensor | None  # float32 [T, 1] when c^Q is quantised (query_norm is then int8)
    query_scale: torch.Tensor | None = None  # float32 [T, N, 1] with query_quant_mode 1 (dequant_scale_q_nope)


class QuantScales(NamedTuple):
    """The float32 scales of weight_quant_mode 1 / 2 (None where the mode takes none)."""

    x: torch.Tensor | None = None  # [T, 1] or [T]: per token of an int8 token_x
    w_dq: torch.Tensor | None = None  # [1, Hcq]
    w_uq_qr: torch.Tensor | None = None  # [1, N (D + Dr)]
    w_dkv_kr: torch.Tensor | None = None  # [1, Hckv + Dr]
    smooth_cq: torch.Tensor | None = None  # [1, Hcq] or [1]
    ckv: torch.Tensor | None = None  # quant_scale_ckv: [1, Hckv] per channel, or one value ([1], [1, 1], [1, Hckv])
    ckr: torch.Tensor | None = None  # quant_scale_ckr: [1, Dr]
    clip_alpha: torch.Tensor | None = None  # k_nope_clip_alpha: [1] (kv_cache_quant_mode 3)


def dequantized_product(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        compute: torch.dtype) -> torch.Tensor:
    """(a8 @ w8) * a_scale[row] * w_scale[column] of int8 rows a [T, K] and an int8 weight [K, C]: the sums exact
    in float64 (an fp32 sum of thousands of int8 products can pass 2^24), then scaled in `compute`."""
    exact = (a.double() @ w.double()).to(compute)
    return exact * a_scale.reshape(-1, 1).to(compute) * w_scale.reshape(1, -1).to(compute)


def mla_prolog(problem: MlaPrologProblem, x: torch.Tensor, weight_dq: torch.Tensor, weight_uq_qr: torch.Tensor,
               weight_uk: torch.Tensor, weight_dkv_kr: torch.Tensor, gamma_cq: torch.Tensor, gamma_ckv: torch.Tensor,
               sin: torch.Tensor, cos: torch.Tensor, scales: QuantScales, kv_cache: torch.Tensor,
               kr_cache: torch.Tensor, slots: torch.Tensor | None) -> MlaPrologRows:
    """The rows of x [T, He] (sin / cos [T, Dr]), in the float dtype of weight_uk, after writing each token's latent
    and rope key into the caches (`write_caches`)."""
    dtype = weight_uk.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32

    def kept(t: torch.Tensor) -> torch.Tensor:
        """t as the operator keeps it between its stages: rounded to the float dtype, widened again."""
        return t.to(dtype).to(compute)

    def down(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.Tensor:
        if p.quantized_x:
            return dequantized_product(x, scales.x, weight, weight_scale, compute)
        return x.to(compute) @ weight.to(compute)

    p = problem
    sin_c, cos_c = sin.to(compute), cos.to(compute)
    c_q = kept(p.qc_qr_scale * rms_norm(kept(down(weight_dq, scales.w_dq)), gamma_cq, p.epsilon_cq))
    q_norm, q_norm_scale = c_q.to(dtype), None
    if p.quantized_uq_qr:
        q_norm, q_norm_scale = quantize_per_token(c_q, scales.smooth_cq)
        up = dequantized_product(q_norm, q_norm_scale, weight_uq_qr, scales.w_uq_qr, compute)
        q_norm_scale = q_norm_scale.to(torch.float32)
    else:
        up = c_q @ weight_uq_qr.to(compute)
    per_head = kept(up).view(-1, p.heads, p.nope_dim + p.rope_dim)
    q_nope, q_rope = per_head[..., : p.nope_dim], per_head[..., p.nope_dim :]
    query = torch.einsum("tnd,ndc->tnc", q_nope, weight_uk.to(compute)).contiguous()  # [T, N, Hckv] rows
    query_rope = interleaved_rope(q_rope, cos_c.unsqueeze(1), sin_c.unsqueeze(1))
    kv = kept(down(weight_dkv_kr, scales.w_dkv_kr))
    latent = p.kc_scale * rms_norm(kv[:, : p.latent], gamma_ckv, p.epsilon_ckv)
    key_rope = kept(interleaved_rope(kv[:, p.latent :], cos_c, sin_c))
    query, query_rope, query_scale = kept(query), kept(query_rope), None
    if p.query_quant_mode == 1:
        query, query_rope, query_scale = quantize_query(query, query_rope, scales.ckv.reshape(-1)[0].to(compute))
    if p.packed_rows:  # one packed row per token, into kv_cache alone
        latent = pack_rows(latent, key_rope.to(dtype), scales.clip_alpha.reshape(()).to(compute), p.tile_size)
        key_rope = None
    elif p.kv_cache_quant_mode:  # the latent quantised from its fp32 value, the rope key from its rounded one
        ckv = scales.ckv.reshape(1, -1)[:, : 1 if p.kv_cache_quant_mode == 1 else None]
        latent = round_to_int8(latent * ckv.to(compute))
    if p.kv_cache_quant_mode == 2:
        key_rope = round_to_int8(key_rope * scales.ckr.reshape(1, -1).to(compute))
    rows = MlaPrologRows(query.to(torch.int8 if query_scale is not None else dtype), query_rope.to(dtype), q_norm,
                         latent.to(kv_cache.dtype), None if key_rope is None else key_rope.to(kr_cache.dtype),
                         q_norm_scale, query_scale)
    write_caches(kv_cache, kr_cache, rows.latent, rows.key_rope, slots, paged=p.paged, nz=p.cache_mode == "PA_NZ")
    return rows


def pack_rows(latent: torch.Tensor, key_rope: torch.Tensor, alpha: torch.Tensor, tile_size: int) -> torch.Tensor:
    """kv_cache_quant_mode 3: per token the int8 row [Hckv int8 latent | Dr rope values (their bytes) | one float32
    scale per tile of `tile_size` latent channels] (docs/operators/mla_prolog.md). Per tile: a = max |x|, x clipped
    to [-alpha a, alpha a], scale = alpha a / 127, int8 round(x / scale) (ties to even); a tile of zeros gives zeros
    and scale 0."""
    tokens = latent.shape[0]
    tiles = latent.view(tokens, -1, tile_size)
    bound = alpha * tiles.abs().amax(-1, keepdim=True)
    scale = bound / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = round_to_int8(torch.where(scale > 0, torch.clamp(tiles, -bound, bound) / safe, 0)).view(tokens, -1)
    parts = (quantized.view(torch.uint8), key_rope.contiguous().view(torch.uint8),
             scale.reshape(tokens, -1).to(torch.float32).contiguous().view(torch.uint8))
    return torch.cat(parts, -1).view(torch.int8)


def write_caches(kv_cache: torch.Tensor, kr_cache: torch.Tensor, latent: torch.Tensor, key_rope: torch.Tensor | None,
                 slots: torch.Tensor | None, *, paged: bool, nz: bool) -> None:
    """Write token t's latent [T, Hckv] and rope key [T, Dr] (the caches' dtype) at its cache row: slot slots[t]
    = block * BlockSize + offset of a paged cache [BlockNum, BlockSize, Nkv, width] (PA_NZ: its memory read as NZ
    blocks, `problem/nz.py`; slots None: a pool of 0 blocks), row t of a BSND / TND cache. Nothing else is
    touched. `key_rope` None: the rope keys are inside the latent rows (kv_cache_quant_mode 3), kr_cache untouched."""
    pairs = [(kv_cache, latent)] + ([] if key_rope is None else [(kr_cache, key_rope)])
    if not paged:
        for cache, values in pairs:
            cache.view(-1, values.shape[-1]).copy_(values)
        return
    if slots is None:
        return
    kept = slots != PADDING_SLOT
    slots = slots[kept]
    if slots.numel() == 0:
        return
    for cache, values in ((cache, values[kept]) for cache, values in pairs):
        blocks, block_size, kv_heads = cache.shape[0], cache.shape[1], cache.shape[2]
        block, offset = slots // block_size, slots % block_size
        if nz:
            tokens = nz_tokens(cache.view(nz_shape(blocks, kv_heads, values.shape[-1], block_size, cache.dtype)))
            tokens[block, offset] = values.view(-1, kv_heads, *tokens.shape[-2:])
        else:
            cache[block, offset] = values.view(-1, kv_heads, values.shape[-1])


def quantize_query(query: torch.Tensor, query_rope: torch.Tensor,
                   ckv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query_quant_mode 1 on query [T, N, Hckv] and query_rope [T, N, Dr] (values in the float dtype): per token and
    head scale = max |query| / 127 (1 for a row of zeros), int8 round(query / scale) ties to even; query_rope
    multiplied by quant_scale_ckv / scale, so that with the per-tensor int8 latent both score parts carry the same
    factor. Returns (int8 query, query_rope, float32 scales [T, N, 1])."""
    scale = query.abs().amax(dim=-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return round_to_int8(query / scale), query_rope * (ckv / scale), scale.to(torch.float32)


def quantize_per_token(c_q: torch.Tensor, smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic int8 quantisation of the query latent rows (the design note's formula): v = c^Q * smooth,
    scale = max |v| / 127 per row ([T, 1], in c_q's dtype), int8 round(v / scale), ties to even; a zero row gives
    zeros."""
    v = c_q if smooth is None else c_q * smooth.to(c_q.dtype).reshape(1, -1)
    scale = v.abs().amax(dim=-1, keepdim=True) / 127
    values = round_to_int8(torch.where(scale > 0, v / torch.where(scale > 0, scale, 1), 0))
    return values, scale
