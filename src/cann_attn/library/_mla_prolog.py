"""Custom op of the MLA pre-processing, MlaProlog (docs/operators/mla_prolog.md): the one op whose schema marks
inputs as written (``kv_cache`` and ``kr_cache``, updated in place), so a compiled graph orders the cache reads of
the attention after it."""

import inspect

import torch
from torch import Tensor

from ..ops.mla_prolog import MlaPrologResult
from ..ops.mla_prolog import mla_prolog as _eager_mla_prolog


def _run(
    token_x: Tensor, weight_dq: Tensor, weight_uq_qr: Tensor, weight_uk: Tensor, weight_dkv_kr: Tensor,
    rmsnorm_gamma_cq: Tensor, rmsnorm_gamma_ckv: Tensor, rope_sin: Tensor, rope_cos: Tensor, kv_cache: Tensor,
    kr_cache: Tensor, cache_index: Tensor | None = None, dequant_scale_x: Tensor | None = None,
    dequant_scale_w_dq: Tensor | None = None, dequant_scale_w_uq_qr: Tensor | None = None,
    dequant_scale_w_dkv_kr: Tensor | None = None, quant_scale_ckv: Tensor | None = None,
    quant_scale_ckr: Tensor | None = None, smooth_scales_cq: Tensor | None = None,
    actual_seq_len: Tensor | None = None, k_nope_clip_alpha: Tensor | None = None, rmsnorm_epsilon_cq: float = 1e-05,
    rmsnorm_epsilon_ckv: float = 1e-05, cache_mode: str = "PA_BSND", query_norm_flag: bool = False,
    weight_quant_mode: int = 0, kv_cache_quant_mode: int = 0, query_quant_mode: int = 0, ckvkr_repo_mode: int = 0,
    quant_scale_repo_mode: int = 0, tile_size: int = 128, qc_qr_scale: float = 1.0, kc_scale: float = 1.0,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """MlaProlog -> (query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm); writes the caches."""
    return tuple(_eager_mla_prolog(**locals()))


_mla_prolog_op = torch.library.custom_op("cann_attn::mla_prolog", _run, mutates_args=("kv_cache", "kr_cache"))
_PARAMETERS = inspect.signature(_run)


@_mla_prolog_op.register_fake
def _(*args, **kwargs):
    bound = _PARAMETERS.bind(*args, **kwargs)
    bound.apply_defaults()
    token_x, weight_dq, weight_uk, rope_sin, query_norm_flag, weight_quant_mode, query_quant_mode = (
        bound.arguments[n] for n in ("token_x", "weight_dq", "weight_uk", "rope_sin", "query_norm_flag",
                                     "weight_quant_mode", "query_quant_mode"))
    lead = tuple(token_x.shape[:-1])
    heads, latent = weight_uk.shape[0], weight_uk.shape[2]
    dtype = weight_uk.dtype  # the float dtype (token_x is int8 with weight_quant_mode 2)
    empty = token_x.new_empty((0,), dtype=torch.float32)
    query_norm, scale_q_norm = token_x.new_empty((0,), dtype=dtype), empty.clone()
    if query_norm_flag:
        # weight_quant_mode 1 / 2: int8 c^Q with its float32 per-token scale [T, 1]
        quantized = weight_quant_mode in (1, 2)
        query_norm = token_x.new_empty((*lead, weight_dq.shape[1]), dtype=torch.int8 if quantized else dtype)
        if quantized:
            scale_q_norm = token_x.new_empty((torch.Size(lead).numel(), 1), dtype=torch.float32)
    # query_quant_mode 1: int8 query with its float32 scale per token and head [T, N, 1]
    quantized_query = query_quant_mode == 1
    scale_q_nope = token_x.new_empty((torch.Size(lead).numel(), heads, 1), dtype=torch.float32) \
        if quantized_query else empty
    return (token_x.new_empty((*lead, heads, latent), dtype=torch.int8 if quantized_query else dtype),
            token_x.new_empty((*lead, heads, rope_sin.shape[-1]), dtype=dtype), scale_q_nope, query_norm,
            scale_q_norm)


def mla_prolog(
    token_x: Tensor, weight_dq: Tensor, weight_uq_qr: Tensor, weight_uk: Tensor, weight_dkv_kr: Tensor,
    rmsnorm_gamma_cq: Tensor, rmsnorm_gamma_ckv: Tensor, rope_sin: Tensor, rope_cos: Tensor, kv_cache: Tensor,
    kr_cache: Tensor, **options,
) -> MlaPrologResult:
    """``cann_attn.mla_prolog`` through the ``cann_attn::mla_prolog`` custom op (keyword options as there)."""
    return MlaPrologResult(*torch.ops.cann_attn.mla_prolog(
        token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin,
        rope_cos, kv_cache, kr_cache, **options))
