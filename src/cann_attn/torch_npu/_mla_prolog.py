"""torch_npu's MLA pre-processing spellings: npu_mla_prolog, npu_mla_prolog_v2, npu_mla_prolog_v3
(docs/operators/mla_prolog.md). All three write kv_cache / kr_cache in place; v1 and v2 also return them."""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

from ..errors import ParamInvalidError
from ..ops.mla_prolog import mla_prolog
from ._registry import npu_op

_V1_V2_ARGS = (
    "(Tensor token_x, Tensor weight_dq, Tensor weight_uq_qr, Tensor weight_uk, Tensor weight_dkv_kr, "
    "Tensor rmsnorm_gamma_cq, Tensor rmsnorm_gamma_ckv, Tensor rope_sin, Tensor rope_cos, Tensor cache_index, "
    "Tensor kv_cache, Tensor kr_cache, *, Tensor? dequant_scale_x=None, Tensor? dequant_scale_w_dq=None, "
    "Tensor? dequant_scale_w_uq_qr=None, Tensor? dequant_scale_w_dkv_kr=None, Tensor? quant_scale_ckv=None, "
    "Tensor? quant_scale_ckr=None, Tensor? smooth_scales_cq=None, float rmsnorm_epsilon_cq=1e-05, "
    "float rmsnorm_epsilon_ckv=1e-05, str cache_mode=\"PA_BSND\")"
)
ALL_RELEASES = ("7.1", "7.2", "7.3", "26.0", "current")
NPU_MLA_PROLOG_SCHEMAS = {ALL_RELEASES: "npu_mla_prolog" + _V1_V2_ARGS + " -> (Tensor, Tensor, Tensor, Tensor)"}
NPU_MLA_PROLOG_V2_SCHEMAS = {
    ALL_RELEASES: "npu_mla_prolog_v2" + _V1_V2_ARGS + " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}
_V3_HEAD = (
    "npu_mla_prolog_v3(Tensor token_x, Tensor weight_dq, Tensor weight_uq_qr, Tensor weight_uk, "
    "Tensor weight_dkv_kr, Tensor rmsnorm_gamma_cq, Tensor rmsnorm_gamma_ckv, Tensor rope_sin, Tensor rope_cos, "
    "Tensor(a!) kv_cache, Tensor(b!) kr_cache, *, Tensor? cache_index=None, Tensor? dequant_scale_x=None, "
    "Tensor? dequant_scale_w_dq=None, Tensor? dequant_scale_w_uq_qr=None, Tensor? dequant_scale_w_dkv_kr=None, "
    "Tensor? quant_scale_ckv=None, Tensor? quant_scale_ckr=None, Tensor? smooth_scales_cq=None, "
    "Tensor? actual_seq_len=None, Tensor? k_nope_clip_alpha=None, float rmsnorm_epsilon_cq=1e-05, "
    "float rmsnorm_epsilon_ckv=1e-05, str cache_mode=\"PA_BSND\", bool query_norm_flag=False, "
    "int weight_quant_mode=0, int kv_cache_quant_mode=0, int query_quant_mode=0, int ckvkr_repo_mode=0, "
    "int quant_scale_repo_mode=0, int tile_size=128, float qc_qr_scale=1.0, float kc_scale=1.0"
)
_V3_RETURNS = ") -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
NPU_MLA_PROLOG_V3_SCHEMAS = {
    ("7.3", "26.0"): _V3_HEAD + _V3_RETURNS,
    ("current",): _V3_HEAD + ", int? token_x_dtype=None, int? weight_dq_dtype=None, int? weight_uq_qr_dtype=None, "
    "int? weight_dkv_kr_dtype=None, int? kv_cache_dtype=None" + _V3_RETURNS,
}
V1_V2_CACHE_MODES = ("PA_BSND", "PA_NZ")


def _is_int8(t) -> bool:
    return isinstance(t, Tensor) and t.dtype == torch.int8


def _scenario_of_dtypes(token_x, weight_uq_qr, kv_cache, *, full_quant: bool) -> dict[str, int]:
    """The v1 / v2 pages select the quantised scenario by dtypes (v3 by its mode parameters): int8 weight_uq_qr is
    the partial quantisation (weight_quant_mode 1), int8 token_x (v2 only) the full one (2); an int8 kv_cache is then
    the quantised cache of that scenario: per channel (kv_cache_quant_mode 2) or per tensor with the int8 query
    (kv_cache_quant_mode 1, query_quant_mode 1); docs/operators/mla_prolog.md, "Outputs"."""
    weight_mode = 2 if full_quant and _is_int8(token_x) else 1 if _is_int8(weight_uq_qr) else 0
    if not _is_int8(kv_cache):
        return {"weight_quant_mode": weight_mode}
    if weight_mode == 0:
        raise ParamInvalidError("kv_cache: an int8 cache is the quantised-cache scenario of int8 weights (weight_uq_qr"
                                + (", or token_x and every weight" if full_quant else "") + "); got float ones")
    return {"weight_quant_mode": weight_mode, "kv_cache_quant_mode": 2 if weight_mode == 1 else 1,
            "query_quant_mode": 1 if weight_mode == 2 else 0}


def _paged_prolog(
    token_x: Tensor, weight_dq: Tensor, weight_uq_qr: Tensor, weight_uk: Tensor, weight_dkv_kr: Tensor,
    rmsnorm_gamma_cq: Tensor, rmsnorm_gamma_ckv: Tensor, rope_sin: Tensor, rope_cos: Tensor, cache_index: Tensor,
    kv_cache: Tensor, kr_cache: Tensor, *, dequant_scale_x: Tensor | None = None,
    dequant_scale_w_dq: Tensor | None = None, dequant_scale_w_uq_qr: Tensor | None = None,
    dequant_scale_w_dkv_kr: Tensor | None = None, quant_scale_ckv: Tensor | None = None,
    quant_scale_ckr: Tensor | None = None, smooth_scales_cq: Tensor | None = None,
    rmsnorm_epsilon_cq: float = 1e-05, rmsnorm_epsilon_ckv: float = 1e-05, cache_mode: str = "PA_BSND",
) -> tuple[Tensor, ...]:
    """(query, query_rope, kv_cache, kr_cache, dequant_scale_q_nope) of the v1 / v2 spellings (their pages list the
    paged cache modes only; the quantised scenario follows the dtypes, `_scenario_of_dtypes`)."""
    return _paged_call(locals(), full_quant=True)


def _paged_call(arguments: dict, *, full_quant: bool) -> tuple[Tensor, ...]:
    """_paged_prolog's computation on its bound `arguments`; `full_quant`: whether the spelling's page lists the
    full quantisation (v2) or only the partial one (v1)."""
    token_x, weight_uq_qr, kv_cache, kr_cache, cache_mode = (
        arguments[n] for n in ("token_x", "weight_uq_qr", "kv_cache", "kr_cache", "cache_mode"))
    if cache_mode not in V1_V2_CACHE_MODES:
        raise ParamInvalidError(f"cache_mode: expected one of {list(V1_V2_CACHE_MODES)}, got {cache_mode!r}")
    modes = _scenario_of_dtypes(token_x, weight_uq_qr, kv_cache, full_quant=full_quant)
    out = mla_prolog(**arguments, **modes)
    if modes.get("query_quant_mode"):
        return out.query, out.query_rope, kv_cache, kr_cache, out.dequant_scale_q_nope
    no_scale = torch.zeros(1, dtype=torch.float32, device=token_x.device)
    return out.query, out.query_rope, kv_cache, kr_cache, no_scale


def _paged_spelling(name: str, outputs: int, doc: str, *, full_quant: bool):
    """The v1 / v2 function: _paged_prolog's signature, its first `outputs` results."""
    signature = inspect.signature(_paged_prolog)

    def call(*args, **kwargs) -> tuple[Tensor, ...]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return _paged_call(dict(bound.arguments), full_quant=full_quant)[:outputs]

    functools.update_wrapper(call, _paged_prolog)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = doc
    return call


npu_mla_prolog = npu_op(NPU_MLA_PROLOG_SCHEMAS)(_paged_spelling(
    "npu_mla_prolog", 4, "torch_npu.npu_mla_prolog -> ``(query, query_rope, kv_cache, kr_cache)``, the caches "
    "updated in place.", full_quant=False))
npu_mla_prolog_v2 = npu_op(NPU_MLA_PROLOG_V2_SCHEMAS)(_paged_spelling(
    "npu_mla_prolog_v2", 5, "torch_npu.npu_mla_prolog_v2 -> ``(query, query_rope, kv_cache, kr_cache, "
    "dequant_scale_q_nope)``, the caches updated in place; dequant_scale_q_nope is float32 [T, N, 1] with int8 "
    "token_x and an int8 kv_cache (the int8 query's scales), else [1] (zero: the query is not quantised).",
    full_quant=True))


@npu_op(NPU_MLA_PROLOG_V3_SCHEMAS)
def npu_mla_prolog_v3(
    token_x: Tensor, weight_dq: Tensor, weight_uq_qr: Tensor, weight_uk: Tensor, weight_dkv_kr: Tensor,
    rmsnorm_gamma_cq: Tensor, rmsnorm_gamma_ckv: Tensor, rope_sin: Tensor, rope_cos: Tensor, kv_cache: Tensor,
    kr_cache: Tensor, *, cache_index: Tensor | None = None, dequant_scale_x: Tensor | None = None,
    dequant_scale_w_dq: Tensor | None = None, dequant_scale_w_uq_qr: Tensor | None = None,
    dequant_scale_w_dkv_kr: Tensor | None = None, quant_scale_ckv: Tensor | None = None,
    quant_scale_ckr: Tensor | None = None, smooth_scales_cq: Tensor | None = None,
    actual_seq_len: Tensor | None = None, k_nope_clip_alpha: Tensor | None = None,
    rmsnorm_epsilon_cq: float = 1e-05, rmsnorm_epsilon_ckv: float = 1e-05, cache_mode: str = "PA_BSND",
    query_norm_flag: bool = False, weight_quant_mode: int = 0, kv_cache_quant_mode: int = 0,
    query_quant_mode: int = 0, ckvkr_repo_mode: int = 0, quant_scale_repo_mode: int = 0, tile_size: int = 128,
    qc_qr_scale: float = 1.0, kc_scale: float = 1.0, token_x_dtype: int | None = None,
    weight_dq_dtype: int | None = None, weight_uq_qr_dtype: int | None = None,
    weight_dkv_kr_dtype: int | None = None, kv_cache_dtype: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """torch_npu.npu_mla_prolog_v3 -> ``(query, query_rope, dequant_scale_q_nope, query_norm,
    dequant_scale_q_norm)``, kv_cache / kr_cache updated in place. The ``*_dtype`` overrides (for storage dtypes
    torch has no name for) must be None."""
    for name, value in (("token_x_dtype", token_x_dtype), ("weight_dq_dtype", weight_dq_dtype),
                        ("weight_uq_qr_dtype", weight_uq_qr_dtype), ("weight_dkv_kr_dtype", weight_dkv_kr_dtype),
                        ("kv_cache_dtype", kv_cache_dtype)):
        if value is not None:
            raise ParamInvalidError(f"{name}: a storage-dtype override for quantised inputs, which are not "
                                    f"supported; expected None, got {value!r}")
    return tuple(mla_prolog(
        token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin,
        rope_cos, kv_cache, kr_cache, cache_index=cache_index, dequant_scale_x=dequant_scale_x,
        dequant_scale_w_dq=dequant_scale_w_dq, dequant_scale_w_uq_qr=dequant_scale_w_uq_qr,
        dequant_scale_w_dkv_kr=dequant_scale_w_dkv_kr, quant_scale_ckv=quant_scale_ckv,
        quant_scale_ckr=quant_scale_ckr, smooth_scales_cq=smooth_scales_cq, actual_seq_len=actual_seq_len,
        k_nope_clip_alpha=k_nope_clip_alpha, rmsnorm_epsilon_cq=rmsnorm_epsilon_cq,
        rmsnorm_epsilon_ckv=rmsnorm_epsilon_ckv, cache_mode=cache_mode, query_norm_flag=query_norm_flag,
        weight_quant_mode=weight_quant_mode, kv_cache_quant_mode=kv_cache_quant_mode,
        query_quant_mode=query_quant_mode, ckvkr_repo_mode=ckvkr_repo_mode,
        quant_scale_repo_mode=quant_scale_repo_mode, tile_size=tile_size, qc_qr_scale=qc_qr_scale,
        kc_scale=kc_scale))
