"""MlaProlog (torch_npu npu_mla_prolog_v3): the golden of ``cann-attn golden`` from the float64 oracle of
``cann_attn.testing.mla_prolog_oracle``, and verify cases (docs/operators/mla_prolog.md).

The operator writes ``kv_cache`` / ``kr_cache`` in place: their states after the call are the outputs
``kv_cache_out`` / ``kr_cache_out`` (every element: the rows ``cache_index`` names hold the new token's latent and
rope key, every other element what the input held)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...ops.mla_prolog import PER_TILE
from ...testing.mla_prolog_oracle import mla_prolog_oracle
from . import _common as common
from ._common import (
    BF16,
    I8,
    OPERATORS,
    TORCH_NPU_NAMES,
    Call,
    Case,
    Outputs,
    bind,
    by_name,
    int8_values,
    outputs_of,
    randn,
    register,
    written_output,
)

OP = "mla_prolog"
OUTPUTS = ("query", "query_rope", "dequant_scale_q_nope", "query_norm", "dequant_scale_q_norm")
WRITTEN = ("kv_cache", "kr_cache")
_REPO_MODE = ("fixed by kv_cache_quant_mode: 1 with its packed rows (3), else 0 (the operator refuses other "
              "combinations); the golden refuses kv_cache_quant_mode 3")


class PrologOperator(common.Operator):
    """MlaProlog's golden record, which also refuses kv_cache_quant_mode 3: its packed rows mix int8, float and
    float32 bytes, for which compare has no rule."""

    def check(self, named: Mapping[str, Any]) -> None:
        super().check(named)
        if named.get("kv_cache_quant_mode") == PER_TILE:
            raise common.UnsupportedParameter(OP, "kv_cache_quant_mode", message=(
                "kv_cache_quant_mode: 3 writes packed rows (int8 latent, rope key and float32 tile scales as bytes "
                "of one int8 row) that compare cannot judge as int8 values; the golden takes 0, 1 or 2"))


def _golden(call: Call) -> Outputs:
    named = by_name(OP, call)
    oracle = mla_prolog_oracle(**OPERATORS[OP].oracle_kwargs(named))
    out = {"query": oracle.query, "query_rope": oracle.query_rope, written_output("kv_cache"): oracle.kv_cache,
           written_output("kr_cache"): oracle.kr_cache}
    if named.get("query_quant_mode") == 1:
        out["dequant_scale_q_nope"] = oracle.query_scale
    if named.get("query_norm_flag"):
        out["query_norm"] = oracle.query_norm
        if oracle.query_norm_scale is not None:
            out["dequant_scale_q_norm"] = oracle.query_norm_scale
    return out


def _dtypes(named: Mapping[str, Any]) -> dict[str, torch.dtype]:
    dtype = named["weight_uk"].dtype  # the float dtype (token_x is int8 with weight_quant_mode 2)
    return {"query": I8 if named.get("query_quant_mode") == 1 else dtype, "query_rope": dtype,
            "dequant_scale_q_nope": torch.float32, "dequant_scale_q_norm": torch.float32,
            "query_norm": I8 if named.get("weight_quant_mode") in (1, 2) else dtype,
            written_output("kv_cache"): named["kv_cache"].dtype, written_output("kr_cache"): named["kr_cache"].dtype}


def _rms_norm(v: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return gamma * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs in, half-split order out (docs/operators/mla_prolog.md, RoPE)."""
    half = v.shape[-1] // 2
    pairs = v.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return pairs * cos + torch.cat([-pairs[..., half:], pairs[..., :half]], -1) * sin


def _int8(v: torch.Tensor) -> torch.Tensor:
    return torch.round(v).clamp(-128, 127)


def _write_rows(cache: torch.Tensor, rows: torch.Tensor, named: Mapping[str, Any]) -> torch.Tensor:
    """A copy of `cache` with token t's row written where the docs' cache table puts it, through the callers'
    views (PA_NZ: [BlockNum, 1, width / c0, BlockSize, c0], c0 = 32 bytes of the cache's dtype)."""
    out, width = cache.clone(), cache.shape[-1]
    if not str(named.get("cache_mode", "PA_BSND")).startswith("PA_"):
        out.view(-1, width).copy_(rows.to(out.dtype))
        return out
    slots = named["cache_index"].reshape(-1)
    kept = slots >= 0
    slots, rows = slots[kept], rows[kept].to(out.dtype)
    blocks, block_size = out.shape[:2]
    if named.get("cache_mode") == "PA_NZ":
        c0 = 32 // out.element_size() if out.element_size() in (1, 2) else 16
        view = out.view(blocks, 1, width // c0, block_size, c0)
        view[slots // block_size, 0, :, slots % block_size, :] = rows.view(-1, width // c0, c0)
    else:
        out.view(-1, width)[slots] = rows
    return out


def _naive(call: Call) -> Outputs:
    """The computation in plain PyTorch in the float dtype (the flash-attn rule's reference): matmuls, norms and
    rope in bf16, the dynamic quantisations in fp32, the int8 products exact then scaled."""
    n = by_name(OP, call)
    dtype, f32 = n["weight_uk"].dtype, torch.float32
    if dtype not in (torch.float16, BF16):
        return {}
    heads, nope, latent = n["weight_uk"].shape
    rope = n["rope_sin"].shape[-1]
    x = n["token_x"].reshape(-1, n["token_x"].shape[-1])
    cos, sin = n["rope_cos"].reshape(-1, 1, rope), n["rope_sin"].reshape(-1, 1, rope)
    mode = n.get("weight_quant_mode", 0)

    def down(weight: str, scale: str) -> torch.Tensor:
        if mode != 2:
            return x @ n[weight]
        exact = x.double() @ n[weight].double()
        return (exact * n["dequant_scale_x"].double().reshape(-1, 1) * n[scale].double()).to(dtype)

    c_q = n.get("qc_qr_scale", 1.0) * _rms_norm(down("weight_dq", "dequant_scale_w_dq"), n["rmsnorm_gamma_cq"],
                                                n.get("rmsnorm_epsilon_cq", 1e-5))
    out: dict[str, torch.Tensor] = {"query_norm": c_q}
    if mode in (1, 2):
        smooth = n.get("smooth_scales_cq")
        v = c_q.to(f32) * (1 if smooth is None else smooth.reshape(1, -1))
        scale = v.abs().amax(-1, keepdim=True) / 127
        c8 = _int8(v / torch.where(scale > 0, scale, 1))
        up = ((c8.double() @ n["weight_uq_qr"].double()) * scale.double()
              * n["dequant_scale_w_uq_qr"].double()).to(dtype)
        out.update(query_norm=c8, dequant_scale_q_norm=scale)
    else:
        up = c_q @ n["weight_uq_qr"]
    q = up.view(-1, heads, nope + rope)
    query = torch.einsum("tnd,ndc->tnc", q[..., :nope], n["weight_uk"])
    query_rope = _rotate(q[..., nope:], cos, sin)
    kv = down("weight_dkv_kr", "dequant_scale_w_dkv_kr")
    kv_rows = n.get("kc_scale", 1.0) * _rms_norm(kv[:, :latent], n["rmsnorm_gamma_ckv"],
                                                 n.get("rmsnorm_epsilon_ckv", 1e-5))
    kr_rows = _rotate(kv[:, None, latent:], cos, sin)[:, 0]
    kv_mode = n.get("kv_cache_quant_mode", 0)
    if kv_mode:
        ckv = n["quant_scale_ckv"].reshape(1, -1)[:, : 1 if kv_mode == 1 else None]
        kv_rows = _int8(kv_rows.to(f32) * ckv)
    if kv_mode == 2:
        kr_rows = _int8(kr_rows.to(f32) * n["quant_scale_ckr"].reshape(1, -1))
    if n.get("query_quant_mode") == 1:
        scale = query.to(f32).abs().amax(-1, keepdim=True) / 127
        scale = torch.where(scale > 0, scale, 1)
        query_rope = (query_rope.to(f32) * (n["quant_scale_ckv"].reshape(-1)[0] / scale)).to(dtype)
        query = _int8(query.to(f32) / scale)
        out["dequant_scale_q_nope"] = scale
    lead = tuple(n["token_x"].shape[:-1])
    out.update(query=query.reshape(*lead, heads, latent), query_rope=query_rope.reshape(*lead, heads, rope),
               **{written_output("kv_cache"): _write_rows(n["kv_cache"], kv_rows, n),
                  written_output("kr_cache"): _write_rows(n["kr_cache"], kr_rows, n)})
    out["query_norm"] = out["query_norm"].reshape(*lead, -1)
    return out


common.register_operator(PrologOperator(
    OP, OUTPUTS, _golden, _dtypes, oracle=mla_prolog_oracle, written=WRITTEN, naive=_naive,
    renames={"rmsnorm_gamma_cq": "gamma_cq", "rmsnorm_gamma_ckv": "gamma_ckv", "rmsnorm_epsilon_cq": "eps_cq",
             "rmsnorm_epsilon_ckv": "eps_ckv"},
    consumed={"weight_quant_mode": "the golden reads the weight quantisation from the scale tensors given "
                                   "(dequant_scale_w_uq_qr: mode 1, dequant_scale_x too: mode 2); the operator "
                                   "checks that the mode agrees with them",
              "query_norm_flag": "whether query_norm (and its dequant_scale_q_norm) is an output"},
    no_effect={"ckvkr_repo_mode": _REPO_MODE, "quant_scale_repo_mode": _REPO_MODE},
    unsupported={"actual_seq_len": "the block-index cache modes that take it are refused by the operator"},
))
TORCH_NPU_NAMES["npu_mla_prolog_v3"] = OP


def _rotary(gen: torch.Generator, lead: tuple[int, ...], rope: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """cos / sin rows as a rotary embedding builds them: [c_0 .. c_{Dr/2-1}] twice, at random positions."""
    positions = torch.randint(0, 4096, lead, generator=gen).to(torch.float64)
    angle = positions[..., None] * 10000.0 ** (-torch.arange(rope // 2, dtype=torch.float64) * 2 / rope)
    angle = torch.cat([angle, angle], -1)
    return {"rope_sin": angle.sin().to(dtype), "rope_cos": angle.cos().to(dtype)}


def prolog_named(gen: torch.Generator, *, lead: tuple[int, ...], cache_mode: str = "PA_BSND", hidden: int = 64,
                 q_latent: int = 32, heads: int = 2, nope: int = 16, rope: int = 64, latent: int = 64,
                 blocks: int = 3, block_size: int = 16, dtype: torch.dtype = BF16, quant: str = "") -> dict[str, Any]:
    """The arguments of one call, built as the recipes build them (distinct slots over the pool). `quant`: "c8",
    deepseek_r1's C8 decode (int8 token_x and weights with their scales, an int8 latent pool quantised per tensor,
    an int8 query: weight_quant_mode 2, kv_cache_quant_mode 1, query_quant_mode 1); "per_channel", int8
    weight_uq_qr and int8 caches quantised per channel (weight_quant_mode 1, kv_cache_quant_mode 2)."""
    tokens = int(torch.Size(lead).numel())

    def weight(rows: int, cols: int) -> torch.Tensor:
        return randn(gen, (rows, cols), dtype, std=rows ** -0.5)

    named: dict[str, Any] = {
        "token_x": randn(gen, (*lead, hidden), dtype), "weight_dq": weight(hidden, q_latent),
        "weight_uq_qr": weight(q_latent, heads * (nope + rope)),
        "weight_uk": randn(gen, (heads, nope, latent), dtype, std=nope ** -0.5),
        "weight_dkv_kr": weight(hidden, latent + rope),
        "rmsnorm_gamma_cq": randn(gen, (q_latent,), dtype, std=0.1) + 1,
        "rmsnorm_gamma_ckv": randn(gen, (latent,), dtype, std=0.1) + 1, **_rotary(gen, lead, rope, dtype),
        "cache_mode": cache_mode, "query_norm_flag": True,
    }
    cache_lead = (blocks, block_size) if cache_mode.startswith("PA_") else lead
    named["kv_cache"] = randn(gen, (*cache_lead, 1, latent), dtype)
    named["kr_cache"] = randn(gen, (*cache_lead, 1, rope), dtype)
    if cache_mode.startswith("PA_"):
        slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
        named["cache_index"] = slots.to(torch.int64).view(lead)
    int8_weights = {"c8": ("weight_dq", "weight_uq_qr", "weight_dkv_kr"), "per_channel": ("weight_uq_qr",)}
    for name in int8_weights.get(quant, ()):
        rows, columns = named[name].shape
        named[name] = int8_values(gen, (rows, columns))
        scale = {"weight_dq": "dequant_scale_w_dq", "weight_uq_qr": "dequant_scale_w_uq_qr",
                 "weight_dkv_kr": "dequant_scale_w_dkv_kr"}[name]
        named[scale] = torch.rand(1, columns, generator=gen) / (127 * rows ** 0.5)
    if quant == "c8":
        named["token_x"] = int8_values(gen, (*lead, hidden))
        named["dequant_scale_x"] = torch.rand(tokens, 1, generator=gen) / 64 + 1 / 127
        named["kv_cache"] = int8_values(gen, named["kv_cache"].shape)
        named.update(weight_quant_mode=2, kv_cache_quant_mode=1, query_quant_mode=1,
                     quant_scale_ckv=torch.tensor([40.0]))
    elif quant == "per_channel":
        named["kv_cache"] = int8_values(gen, named["kv_cache"].shape)
        named["kr_cache"] = int8_values(gen, named["kr_cache"].shape)
        named.update(weight_quant_mode=1, kv_cache_quant_mode=2,
                     quant_scale_ckv=30 + 10 * torch.rand(1, latent, generator=gen),
                     quant_scale_ckr=30 + 10 * torch.rand(1, rope, generator=gen))
    return named


def prolog_case(name: str, **shape: Any) -> Case:
    def build(gen: torch.Generator) -> Call:
        return bind(OP, prolog_named(gen, **shape))

    label = f"{shape.get('cache_mode', 'PA_BSND')} tokens {list(shape['lead'])} {shape.get('quant', '')}".rstrip()
    return Case(op=OP, name=name, dtype=shape.get("dtype", BF16), shape=label, build=build,
                run=outputs_of(OP, OUTPUTS, WRITTEN), oracle=_golden, naive=_naive)


register(
    prolog_case("pa_bsnd_tokens", lead=(5,)),
    prolog_case("pa_nz_batch_seq", lead=(2, 3), cache_mode="PA_NZ"),
    prolog_case("tnd", lead=(4,), cache_mode="TND"),
    # The quantised calls in fp32 (the reference backend's): from bf16 values the int8 query_norm may land one step
    # off the float64 golden's, and an int8 query computed past it two (docs/operators/mla_prolog.md)
    prolog_case("c8_pa_nz_fp32", lead=(4,), cache_mode="PA_NZ", dtype=torch.float32, quant="c8"),
    prolog_case("per_channel_pa_bsnd_fp32", lead=(2, 2), dtype=torch.float32, quant="per_channel"),
)
