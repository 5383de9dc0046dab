"""Independent float64 oracle of MlaProlog (torch_npu npu_mla_prolog_v3 / _v2), written from op-plugin's pages and
ops-transformer's MlaPrologV3 design note (docs/operators/mla_prolog.md): one token at a time, nothing imported from
``cann_attn`` outside this testing package. It validates nothing: feed valid inputs.

`mla_prolog_oracle` returns the float64 query, query_rope and query_norm rows and the caches as they must be after
the call: float64 copies of the given caches with the written elements replaced, and a mask of those elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F64 = torch.float64


@dataclass
class MlaPrologOracle:
    query: torch.Tensor  # [.., N, Hckv]
    query_rope: torch.Tensor  # [.., N, Dr]
    query_norm: torch.Tensor  # [.., Hcq] (int8 values with weight_quant_mode 1)
    query_norm_scale: torch.Tensor | None  # [T, 1] with weight_quant_mode 1
    kv_cache: torch.Tensor  # the cache's shape, float64
    kr_cache: torch.Tensor
    kv_written: torch.Tensor  # bool, the cache's shape
    kr_written: torch.Tensor
    query_scale: torch.Tensor | None = None  # [T, N, 1] with query_quant_mode 1 (dequant_scale_q_nope)
    # kv_cache_quant_mode 3: every token's int8 latent values [T, Hckv], rope key [T, Dr] and tile scales [T, tiles]
    # (the packed row's three parts; kv_cache then holds NaN for the bytes of the last two, kv_written all of them)
    packed_latent: torch.Tensor | None = None
    packed_key_rope: torch.Tensor | None = None
    tile_scales: torch.Tensor | None = None


def _rmsnorm(row: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    rms = torch.sqrt((row * row).sum() / row.numel() + eps)
    return gamma.to(F64) * row / rms


def _rope(row: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The design note's formula (15) element by element: pair i = (x_{2i}, x_{2i+1}) lands at channels i and
    Dr/2 + i, each with its own entry of the cos / sin row."""
    half = row.numel() // 2
    out = torch.empty_like(row)
    for i in range(half):
        even, odd = row[2 * i], row[2 * i + 1]
        out[i] = even * cos[i] - odd * sin[i]
        out[half + i] = odd * cos[half + i] + even * sin[half + i]
    return out


def _nz_flat_index(block: int, slot: int, channel: int, *, block_size: int, width: int, c0: int) -> int:
    """Element (block, slot, head 0, channel) of an NZ paged cache in memory order: blocks of [width / c0,
    block_size, c0]."""
    return ((block * (width // c0) + channel // c0) * block_size + slot) * c0 + channel % c0


def mla_prolog_oracle(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, gamma_cq, gamma_ckv, rope_sin,
                      rope_cos, kv_cache, kr_cache, cache_index=None, *, cache_mode: str = "PA_BSND",
                      eps_cq: float = 1e-5, eps_ckv: float = 1e-5, qc_qr_scale: float = 1.0,
                      kc_scale: float = 1.0, dequant_scale_w_uq_qr=None, smooth_scales_cq=None, dequant_scale_x=None,
                      dequant_scale_w_dq=None, dequant_scale_w_dkv_kr=None, kv_cache_quant_mode: int = 0,
                      query_quant_mode: int = 0, quant_scale_ckv=None, quant_scale_ckr=None, tile_size: int = 128,
                      k_nope_clip_alpha=None) -> MlaPrologOracle:
    """With `dequant_scale_w_uq_qr` (weight_quant_mode 1: int8 weight_uq_qr) c^Q is quantised per token as the
    MlaPrologV3 design note's dynamic quantisation says, scale = max |c^Q * smooth| / 127, int8 = round(c^Q * smooth
    / scale) (ties to even), and the int8 product is dequantised by scale * dequant_scale_w_uq_qr[column]. With
    `dequant_scale_x` (weight_quant_mode 2: int8 token_x, weight_dq, weight_dkv_kr too) the two down projections are
    x8 W8 * dequant_scale_x[token] * dequant_scale_w_*[column].

    Cache quantisation (the page's quantised-cache scenarios; MlaProlog's kernel multiplies by the quant scale and
    rounds, ties to even): `kv_cache_quant_mode` 2 writes round(latent * quant_scale_ckv[c]) and round(key rope *
    quant_scale_ckr[c]) (per channel), 1 writes round(latent * quant_scale_ckv) (one value) and the rope key as is;
    values beyond [-128, 127] saturate. `query_quant_mode` 1 (with cache mode 1) makes the query int8 per token and
    head: scale = max |q^N| / 127 (1 for a row of zeros), query = round(q^N / scale), query_rope = RoPE(q^R) *
    quant_scale_ckv / scale.

    `kv_cache_quant_mode` 3 (the packed rows of ckvkr_repo_mode = quant_scale_repo_mode = 1, MlaProlog's per-tile
    quantisation in ops-transformer's kernel): per tile of `tile_size` latent channels a = max |x|, x clipped to
    [-alpha a, alpha a] (alpha = k_nope_clip_alpha), scale = alpha a / 127, int8 round(x / scale) (a tile of zeros:
    zeros, scale 0); the row is [int8 latent | rope key | float32 scales] in kv_cache, kr_cache untouched."""
    heads, nope_dim, latent = weight_uk.shape
    rope_dim = rope_sin.shape[-1]
    lead = tuple(token_x.shape[:-1])
    x = token_x.to(F64).reshape(-1, token_x.shape[-1])
    sin, cos = rope_sin.to(F64).reshape(-1, rope_dim), rope_cos.to(F64).reshape(-1, rope_dim)
    w_dq, w_uq_qr, w_uk, w_dkv_kr = (w.to(F64) for w in (weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr))
    tokens = x.shape[0]
    query = torch.zeros(tokens, heads, latent, dtype=F64)
    query_rope = torch.zeros(tokens, heads, rope_dim, dtype=F64)
    query_norm = torch.zeros(tokens, w_dq.shape[1], dtype=F64)
    latents = torch.zeros(tokens, latent, dtype=F64)
    key_ropes = torch.zeros(tokens, rope_dim, dtype=F64)
    query_norm_scale = torch.zeros(tokens, 1, dtype=F64) if dequant_scale_w_uq_qr is not None else None
    query_scale = torch.zeros(tokens, heads, 1, dtype=F64) if query_quant_mode == 1 else None
    tile_scales = torch.zeros(tokens, latent // tile_size, dtype=F64) if kv_cache_quant_mode == 3 else None
    ckv = None if quant_scale_ckv is None else quant_scale_ckv.to(F64).reshape(-1)
    ckr = None if quant_scale_ckr is None else quant_scale_ckr.to(F64).reshape(-1)

    def to_int8(v):
        return torch.clamp(torch.round(v), -128, 127)

    def down(t, w, w_scale):
        if dequant_scale_x is None:
            return x[t] @ w
        return (x[t] @ w) * dequant_scale_x.to(F64).reshape(-1)[t] * w_scale.to(F64).reshape(-1)

    for t in range(tokens):
        c_q = qc_qr_scale * _rmsnorm(down(t, w_dq, dequant_scale_w_dq), gamma_cq, eps_cq)
        if dequant_scale_w_uq_qr is None:
            query_norm[t] = c_q
            q_all = c_q @ w_uq_qr
        else:
            smoothed = c_q if smooth_scales_cq is None else c_q * smooth_scales_cq.to(F64).reshape(-1)
            scale = smoothed.abs().max() / 127
            quantized = torch.round(smoothed / scale) if scale > 0 else torch.zeros_like(smoothed)
            query_norm[t], query_norm_scale[t] = quantized, scale
            q_all = (quantized @ w_uq_qr) * scale * dequant_scale_w_uq_qr.to(F64).reshape(-1)
        for n in range(heads):
            head = q_all[n * (nope_dim + rope_dim) : (n + 1) * (nope_dim + rope_dim)]
            query[t, n] = head[:nope_dim] @ w_uk[n]
            query_rope[t, n] = _rope(head[nope_dim:], cos[t], sin[t])
            if query_quant_mode == 1:
                peak = query[t, n].abs().max()
                scale = peak / 127 if peak > 0 else torch.tensor(1.0, dtype=F64)
                query[t, n] = to_int8(query[t, n] / scale)
                query_rope[t, n] = query_rope[t, n] * ckv[0] / scale
                query_scale[t, n, 0] = scale
        kv = down(t, w_dkv_kr, dequant_scale_w_dkv_kr)
        latents[t] = kc_scale * _rmsnorm(kv[:latent], gamma_ckv, eps_ckv)
        key_ropes[t] = _rope(kv[latent:], cos[t], sin[t])
        if kv_cache_quant_mode == 1:
            latents[t] = to_int8(latents[t] * ckv[0])
        elif kv_cache_quant_mode == 2:
            latents[t] = to_int8(latents[t] * ckv)
            key_ropes[t] = to_int8(key_ropes[t] * ckr)
        elif kv_cache_quant_mode == 3:
            alpha = float(k_nope_clip_alpha.reshape(-1)[0])
            for i in range(latent // tile_size):
                tile = latents[t, i * tile_size : (i + 1) * tile_size]
                bound = alpha * tile.abs().max()
                scale = bound / 127
                tile_scales[t, i] = scale
                tile.copy_(to_int8(torch.clamp(tile, -bound, bound) / scale) if scale > 0 else torch.zeros_like(tile))

    cache_rows = ((kv_cache, latents), (kr_cache, key_ropes))
    if kv_cache_quant_mode == 3:  # the rope key and scales bytes of the packed row: written, values left NaN
        packed = torch.full((tokens, kv_cache.shape[-1]), float("nan"), dtype=F64)
        packed[:, :latent] = latents
        cache_rows = ((kv_cache, packed), (kr_cache, key_ropes[:, :0]))
    caches = []
    for cache, rows in cache_rows:
        expected = cache.to(F64).clone()
        written = torch.zeros(cache.shape, dtype=torch.bool)
        flat_expected, flat_written = expected.view(-1), written.view(-1)
        width = rows.shape[1]
        for t in range(tokens):
            if cache_mode in ("BSND", "TND"):
                targets = [t * width + c for c in range(width)]
            elif cache.shape[0] * cache.shape[1] == 0:
                targets = []
            else:
                slot = int(cache_index.reshape(-1)[t])
                if slot == -1:  # a padding token (docs/semantics/beyond-docs.md): not written
                    continue
                block, offset, block_size = slot // cache.shape[1], slot % cache.shape[1], cache.shape[1]
                if cache_mode == "PA_NZ":
                    # 32 bytes of channels per group: 16 for bf16 / fp16; float32 / float64 pools (the reference
                    # backend's) group 16 channels as bf16 ones do
                    c0 = 32 if cache.element_size() == 1 else 16
                    targets = [_nz_flat_index(block, offset, c, block_size=block_size, width=width, c0=c0)
                               for c in range(width)]
                else:
                    targets = [(block * block_size + offset) * width + c for c in range(width)]
            for c, target in enumerate(targets):
                flat_expected[target] = rows[t, c]
                flat_written[target] = True
        caches += [expected, written]
    return MlaPrologOracle(query.reshape(*lead, heads, latent), query_rope.reshape(*lead, heads, rope_dim),
                           query_norm.reshape(*lead, -1), query_norm_scale, caches[0], caches[2], caches[1], caches[3],
                           query_scale, *((latents, key_ropes, tile_scales) if kv_cache_quant_mode == 3 else ()))
