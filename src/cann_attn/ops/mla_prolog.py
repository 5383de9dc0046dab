"""MlaProlog (torch_npu npu_mla_prolog / _v2 / _v3): the MLA pre-processing of one attention layer's new tokens,
queries out and the key/value latent and rope key written into the caches in place (docs/operators/mla_prolog.md).

Every argument is checked before anything is computed or written: a refused call leaves both caches untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..backends import select_backend
from ..backends.reference import mla_prolog as reference
from ..errors import ParamInvalidError, ParamNullptrError, describe, require, require_bool, require_finite, require_int
from ..problem.dequant import packed_row_bytes
from ..problem.nz import nz_layout_chunk
from ..problem.page_table import PADDING_SLOT, BlockSizeRule
from ..problem.policy import beyond_docs
from ..traceable import traced_as_custom_op

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
PAGED_MODES = ("PA_BSND", "PA_NZ")
CACHE_MODES = (*PAGED_MODES, "BSND", "TND")
BLOCK_INDEX_MODES = ("PA_BLK_BSND", "PA_BLK_NZ")
MLA_PROLOG_BLOCK_SIZES = BlockSizeRule(multiple=16, maximum=1024, minimum=16)  # kv_cache / kr_cache dim 1
KV_HEADS = 1

# The quantised scenarios and what each mode parameter's non-zero values select (op-plugin's page). Computed:
# weight_quant_mode 1 and 2, kv_cache_quant_mode 2 with weight_quant_mode 1, kv_cache_quant_mode 1 with
# weight_quant_mode 2 and query_quant_mode 1, kv_cache_quant_mode 3 (packed rows) with weight_quant_mode 1 or 2
# (COMPUTED_SCENARIOS); every other non-zero value is refused naming its parameter.
QUANT_MODES = {
    "weight_quant_mode": {0: "no weight quantisation", 1: "int8 weight_uq_qr", 2: "int8 weight_dq, weight_uq_qr and "
                          "weight_dkv_kr (int8 token_x)", 3: "per-tile / mxfp8 weights"},
    "kv_cache_quant_mode": {0: "no cache quantisation", 1: "per-tensor int8 kv_cache", 2: "per-channel int8 caches",
                            3: "per-tile int8 kv_cache"},
    "query_quant_mode": {0: "no query quantisation", 1: "per-token-head int8 query"},
    "ckvkr_repo_mode": {0: "separate kv_cache and kr_cache", 1: "kv_cache and kr_cache stored together"},
    "quant_scale_repo_mode": {0: "scales apart from the data", 1: "scales stored with the data"},
}


# (weight_quant_mode, kv_cache_quant_mode, query_quant_mode) of the scenarios computed (docs/operators/mla_prolog.md)
COMPUTED_SCENARIOS = {(0, 0, 0), (1, 0, 0), (2, 0, 0), (1, 2, 0), (2, 1, 1), (1, 3, 0), (2, 3, 0)}
PER_TILE = 3  # kv_cache_quant_mode of the packed rows: int8 latent, rope key, tile scales (both repo modes 1)


class MlaPrologResult(NamedTuple):
    """query [.., N, Hckv] (int8 with query_quant_mode 1), query_rope [.., N, Dr] (token_x's leading dims),
    dequant_scale_q_nope (float32 [T, N, 1] with query_quant_mode 1, else [0]), query_norm ([.., Hcq] with
    query_norm_flag, int8 with weight_quant_mode 1 / 2, else [0])
    and dequant_scale_q_norm (float32 [T, 1] with query_norm_flag and weight_quant_mode 1 / 2, else [0])."""

    query: torch.Tensor
    query_rope: torch.Tensor
    dequant_scale_q_nope: torch.Tensor
    query_norm: torch.Tensor
    dequant_scale_q_norm: torch.Tensor


@dataclass(frozen=True)
class MlaPrologProblem:
    """The sizes and scalars of one call (the letters of op-plugin's page)."""

    token_shape: tuple[int, ...]  # (T,) or (B, S)
    hidden: int  # He
    q_latent: int  # Hcq
    heads: int  # N
    nope_dim: int  # D
    rope_dim: int  # Dr
    latent: int  # Hckv
    cache_mode: str
    epsilon_cq: float
    epsilon_ckv: float
    qc_qr_scale: float
    kc_scale: float
    query_norm: bool
    weight_quant_mode: int  # 1: int8 weight_uq_qr (c^Q quantised per token); 2: also int8 token_x, W^DQ, W^DKVKR
    kv_cache_quant_mode: int = 0  # 1: int8 kv_cache per tensor; 2: int8 kv_cache and kr_cache per channel; 3: per tile
    query_quant_mode: int = 0  # 1: int8 query per token and head, with dequant_scale_q_nope
    tile_size: int = 128  # kv_cache_quant_mode 3: latent channels per int8 tile

    @property
    def paged(self) -> bool:
        """Whether token t goes to the slot cache_index[t] names (PA_BSND / PA_NZ) rather than to cache row t."""
        return self.cache_mode in PAGED_MODES

    @property
    def packed_rows(self) -> bool:
        """kv_cache_quant_mode 3: each token's int8 latent, rope key and tile scales in one kv_cache row."""
        return self.kv_cache_quant_mode == PER_TILE

    @property
    def quantized_uq_qr(self) -> bool:
        return self.weight_quant_mode in (1, 2)

    @property
    def quantized_x(self) -> bool:
        return self.weight_quant_mode == 2

    @property
    def tokens(self) -> int:
        return int(torch.Size(self.token_shape).numel())


def _present(tensor, name: str) -> torch.Tensor:
    if tensor is None:
        raise ParamNullptrError(f"{name}: a required tensor, got None")
    require(isinstance(tensor, torch.Tensor), name, "a torch.Tensor", tensor)
    return tensor


# weight_quant_mode -> the scale tensors it takes (the others must be None)
WEIGHT_QUANT_SCALES = {
    0: (),
    1: ("dequant_scale_w_uq_qr", "smooth_scales_cq"),
    2: ("dequant_scale_x", "dequant_scale_w_dq", "dequant_scale_w_uq_qr", "dequant_scale_w_dkv_kr", "smooth_scales_cq"),
}
# kv_cache_quant_mode -> the scale tensors it takes
KV_QUANT_SCALES = {0: (), 1: ("quant_scale_ckv",), 2: ("quant_scale_ckv", "quant_scale_ckr"),
                   PER_TILE: ("k_nope_clip_alpha",)}
# weight_quant_mode -> the inputs that are int8 in it
INT8_INPUTS = {0: (), 1: ("weight_uq_qr",), 2: ("token_x", "weight_dq", "weight_uq_qr", "weight_dkv_kr")}


_SCENARIOS_TEXT = ("weight_quant_mode 0, 1 or 2; kv_cache_quant_mode 2 with weight_quant_mode 1; kv_cache_quant_mode "
                   "1 with weight_quant_mode 2 and query_quant_mode 1; kv_cache_quant_mode 3 with weight_quant_mode 1 "
                   "or 2 and ckvkr_repo_mode = quant_scale_repo_mode = 1 (the packed rows); otherwise both repo "
                   "modes 0")


def _check_modes(modes: dict[str, int], quant_tensors: dict[str, torch.Tensor | None], actual_seq_len,
                 tile_size) -> tuple[int, int, int]:
    """(weight_quant_mode, kv_cache_quant_mode, query_quant_mode), one of COMPUTED_SCENARIOS, after refusing every
    other mode or combination naming the first mode parameter (in signature order) outside the computed ones."""
    for name, value in modes.items():
        value = require_int(value, name)
        meanings = QUANT_MODES[name]
        if value not in meanings:
            raise ParamInvalidError(f"{name}: expected one of {sorted(meanings)}, got {value}")
    scenario = tuple(int(modes[n]) for n in ("weight_quant_mode", "kv_cache_quant_mode", "query_quant_mode"))
    repo = (int(modes["ckvkr_repo_mode"]), int(modes["quant_scale_repo_mode"]))
    if scenario not in COMPUTED_SCENARIOS or repo != ((1, 1) if scenario[1] == PER_TILE else (0, 0)):
        name = _refused_mode(modes, scenario)
        raise ParamInvalidError(
            f"{name}: {modes[name]} ({QUANT_MODES[name][modes[name]]}) is not supported with weight_quant_mode="
            f"{scenario[0]}, kv_cache_quant_mode={scenario[1]}, query_quant_mode={scenario[2]}: computed are "
            f"{_SCENARIOS_TEXT} (docs/operators/mla_prolog.md)")
    require_int(tile_size, "tile_size")
    quant_mode, kv_quant_mode, query_quant_mode = scenario
    taken = WEIGHT_QUANT_SCALES[quant_mode] + KV_QUANT_SCALES[kv_quant_mode]
    for name, tensor in quant_tensors.items():
        if tensor is not None and name not in taken:
            raise ParamInvalidError(f"{name}: weight_quant_mode={quant_mode}, kv_cache_quant_mode={kv_quant_mode} "
                                    f"does not take it; expected None, got {describe(tensor)}")
    if actual_seq_len is not None:
        raise ParamInvalidError("actual_seq_len: only the block-index cache modes (PA_BLK_BSND, PA_BLK_NZ) take it, "
                                "and they are not supported; expected None")
    return quant_mode, kv_quant_mode, query_quant_mode



def _refused_mode(modes: dict[str, int], scenario: tuple[int, int, int]) -> str:
    """The mode parameter a refused combination names: for a computed scenario the storage mode that does not fit
    it (the packed rows of kv_cache_quant_mode 3 need both repo modes 1, every other cache both 0); otherwise a
    storage mode set without the packed rows, then the mxfp8 weights no combination computes, then the cache mode,
    then the query mode."""
    packed = scenario[1] == PER_TILE
    for name in ("ckvkr_repo_mode", "quant_scale_repo_mode"):
        if modes[name] != int(packed) and (scenario in COMPUTED_SCENARIOS or not packed):
            return name
    if modes["weight_quant_mode"] == 3:
        return "weight_quant_mode"
    return "kv_cache_quant_mode" if modes["kv_cache_quant_mode"] else "query_quant_mode"


def _check_quant_scales(scales: dict[str, torch.Tensor | None], quant_mode: int, kv_quant_mode: int, *, tokens: int,
                        q_latent: int, uq_qr_columns: int, dkv_kr_columns: int, latent: int, rope_dim: int,
                        device: torch.device) -> None:
    """The float32 scale tensors of the quantised scenarios: per-column dequant scales [1, columns] of each int8
    weight, the per-token dequant scales of an int8 token_x ([T, 1] or [T]), the optional smooth scales of the
    query latent ([1, Hcq] or [1]); the cache quantisation scales: per channel [1, Hckv] / [1, Dr]
    (kv_cache_quant_mode 2), one value for the whole latent cache (kv_cache_quant_mode 1: [1], or [1, Hckv] holding
    one value repeated, as deepseek_r1 builds it). All but smooth_scales_cq are required."""
    per_tensor = ((1,), (1, 1), (1, latent))
    shapes = {"dequant_scale_x": ((tokens, 1), (tokens,)), "dequant_scale_w_dq": ((1, q_latent),),
              "dequant_scale_w_uq_qr": ((1, uq_qr_columns),), "dequant_scale_w_dkv_kr": ((1, dkv_kr_columns),),
              "smooth_scales_cq": ((1, q_latent), (1,)),
              "quant_scale_ckv": per_tensor if kv_quant_mode == 1 else ((1, latent),),
              "quant_scale_ckr": ((1, rope_dim),), "k_nope_clip_alpha": ((1,),)}
    for name in WEIGHT_QUANT_SCALES[quant_mode] + KV_QUANT_SCALES[kv_quant_mode]:
        tensor = scales[name]
        if tensor is None:
            if name == "smooth_scales_cq":
                continue
            of_cache = name in KV_QUANT_SCALES[kv_quant_mode]
            mode = "kv_cache_quant_mode" if of_cache else "weight_quant_mode"
            value = kv_quant_mode if of_cache else quant_mode
            raise ParamNullptrError(f"{name}: required with {mode}={value}, got None")
        expected = " or ".join(str(list(shape)) for shape in shapes[name])
        require(isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32
                and tuple(tensor.shape) in shapes[name], name, f"a float32 tensor {expected}", tensor)
        require(tensor.device == device, name, f"token_x's device {device}", tensor)
    if kv_quant_mode == 1:
        ckv = scales["quant_scale_ckv"].reshape(-1)
        require(bool((ckv == ckv[0]).all()), "quant_scale_ckv", "one value for the whole latent "
                "(kv_cache_quant_mode=1 quantises per tensor), repeated if given as [1, Hckv]", ckv)


def _check_cache_mode(cache_mode) -> str:
    if not isinstance(cache_mode, str):
        raise ParamInvalidError(f"cache_mode: expected a str, got {cache_mode!r}")
    if cache_mode in BLOCK_INDEX_MODES:
        raise ParamInvalidError(f"cache_mode: {cache_mode!r} (one cache_index entry per block, with actual_seq_len) "
                                f"is not supported; expected one of {list(CACHE_MODES)}")
    if cache_mode not in CACHE_MODES:
        raise ParamInvalidError(f"cache_mode: expected one of {list(CACHE_MODES)}, got {cache_mode!r}")
    return cache_mode


def _check_weights(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, gamma_cq, gamma_ckv, rope_sin,
                   rope_cos, quant_mode: int) -> tuple[int, ...]:
    """(He, Hcq, N, D, Dr, Hckv) after checking every weight's dtype and shape against token_x and each other. The
    float dtype is token_x's, or weight_uk's with an int8 token_x (weight_quant_mode 2)."""
    int8_inputs = INT8_INPUTS[quant_mode]
    if "token_x" in int8_inputs:
        require(token_x.dtype == torch.int8, "token_x", f"dtype int8 with weight_quant_mode={quant_mode}", token_x)
        require(weight_uk.dtype in FLOAT_DTYPES, "weight_uk", "dtype bfloat16 (float16 / float32 / float64 on the "
                "reference backend)", weight_uk)
        dtype = weight_uk.dtype
    else:
        dtype = token_x.dtype
        require(dtype in FLOAT_DTYPES, "token_x",
                "dtype bfloat16 (float16 / float32 / float64 on the reference backend; int8 with weight_quant_mode=2)",
                token_x)
    require(token_x.dim() in (2, 3), "token_x", "a 2-D [T, He] or 3-D [B, S, He] tensor", token_x)
    hidden = token_x.shape[-1]
    require(hidden > 0, "token_x", "a hidden size He > 0", token_x)
    for name, tensor in (("weight_dq", weight_dq), ("weight_uq_qr", weight_uq_qr), ("weight_uk", weight_uk),
                         ("weight_dkv_kr", weight_dkv_kr), ("rmsnorm_gamma_cq", gamma_cq),
                         ("rmsnorm_gamma_ckv", gamma_ckv), ("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        if name in int8_inputs:
            require(tensor.dtype == torch.int8, name, f"dtype int8 with weight_quant_mode={quant_mode}", tensor)
        else:
            require(tensor.dtype == dtype, name, f"the float dtype {dtype} (int8 weights only with weight_quant_mode "
                    f"1: weight_uq_qr, or 2: weight_dq, weight_uq_qr, weight_dkv_kr)", tensor)
        require(tensor.device == token_x.device, name, f"token_x's device {token_x.device}", tensor)
    require(weight_uk.dim() == 3 and min(weight_uk.shape) > 0, "weight_uk", "a 3-D tensor [N, D, Hckv]", weight_uk)
    heads, nope_dim, latent = weight_uk.shape
    require(weight_dq.dim() == 2 and weight_dq.shape[0] == hidden and weight_dq.shape[1] > 0, "weight_dq",
            f"a 2-D tensor [He, Hcq] with He = {hidden} (token_x's last dim)", weight_dq)
    q_latent = weight_dq.shape[1]
    require(gamma_cq.dim() == 1 and gamma_cq.shape[0] == q_latent, "rmsnorm_gamma_cq",
            f"a 1-D tensor [Hcq] = [{q_latent}] (weight_dq's columns)", gamma_cq)
    require(gamma_ckv.dim() == 1 and gamma_ckv.shape[0] == latent, "rmsnorm_gamma_ckv",
            f"a 1-D tensor [Hckv] = [{latent}] (weight_uk's last dim)", gamma_ckv)
    lead = tuple(token_x.shape[:-1])
    require(rope_sin.dim() == token_x.dim() and tuple(rope_sin.shape[:-1]) == lead, "rope_sin",
            f"a tensor [{', '.join(map(str, lead))}, Dr] (token_x's leading dims)", rope_sin)
    rope_dim = rope_sin.shape[-1]
    require(rope_dim > 0 and rope_dim % 2 == 0, "rope_sin", "an even rope width Dr > 0 (its last dim)", rope_sin)
    require(rope_cos.shape == rope_sin.shape, "rope_cos", f"rope_sin's shape {list(rope_sin.shape)}", rope_cos)
    require(weight_uq_qr.dim() == 2 and tuple(weight_uq_qr.shape) == (q_latent, heads * (nope_dim + rope_dim)),
            "weight_uq_qr", f"a 2-D tensor [Hcq, N * (D + Dr)] = [{q_latent}, {heads * (nope_dim + rope_dim)}] "
            f"(Hcq of weight_dq, N and D of weight_uk, Dr of rope_sin)", weight_uq_qr)
    require(weight_dkv_kr.dim() == 2 and tuple(weight_dkv_kr.shape) == (hidden, latent + rope_dim), "weight_dkv_kr",
            f"a 2-D tensor [He, Hckv + Dr] = [{hidden}, {latent + rope_dim}]", weight_dkv_kr)
    return hidden, q_latent, heads, nope_dim, rope_dim, latent


def _check_caches(token_x, kv_cache, kr_cache, cache_mode: str, latent: int, rope_dim: int,
                  dtype: torch.dtype, kv_quant_mode: int, tile_size: int) -> None:
    """Shapes per cache_mode; dtypes: int8 for kv_cache with kv_cache_quant_mode 1 / 2 / 3 and kr_cache with 2, else
    the float dtype. kv_cache_quant_mode 3 writes packed rows [.., 1, Dtile] into kv_cache alone; kr_cache is then an
    empty tensor of the float dtype (what the recipes pass) and the layout one of PA_BSND, BSND, TND."""
    lead = tuple(token_x.shape[:-1])
    int8_caches = {0: (), 1: ("kv_cache",), 2: ("kv_cache", "kr_cache"), PER_TILE: ("kv_cache",)}[kv_quant_mode]
    caches = (("kv_cache", kv_cache, latent), ("kr_cache", kr_cache, rope_dim))
    if kv_quant_mode == PER_TILE:
        require(tile_size > 0 and latent % tile_size == 0, "tile_size", f"a positive divisor of Hckv = {latent}",
                tile_size)
        if cache_mode == "PA_NZ":
            raise ParamInvalidError("cache_mode: 'PA_NZ' with kv_cache_quant_mode=3 (packed rows in NZ order) is not "
                                    "supported; expected 'PA_BSND', 'BSND' or 'TND'")
        require(kr_cache.numel() == 0 and kr_cache.dtype == dtype, "kr_cache", f"an empty {dtype} tensor with "
                f"ckvkr_repo_mode=1 (the rope key goes into kv_cache's rows)", kr_cache)
        caches = (("kv_cache", kv_cache, packed_row_bytes(latent, rope_dim, tile_size, dtype)),)
    for name, cache, width in caches:
        if name in int8_caches:
            require(cache.dtype == torch.int8, name, f"dtype int8 with kv_cache_quant_mode={kv_quant_mode}", cache)
        else:
            require(cache.dtype == dtype, name, f"the float dtype {dtype} (int8 with kv_cache_quant_mode 1: "
                    f"kv_cache, 2: kv_cache and kr_cache)", cache)
        require(cache.device == token_x.device, name, f"token_x's device {token_x.device}", cache)
        if cache_mode in PAGED_MODES:
            expected = f"a 4-D tensor [BlockNum, BlockSize, {KV_HEADS}, {width}] ({cache_mode})"
            require(cache.dim() == 4 and tuple(cache.shape[2:]) == (KV_HEADS, width), name, expected, cache)
        elif cache_mode == "BSND":
            require(token_x.dim() == 3, "token_x", "a 3-D tensor [B, S, He] with cache_mode 'BSND'", token_x)
            require(tuple(cache.shape) == (*lead, KV_HEADS, width), name,
                    f"a tensor [B, S, {KV_HEADS}, {width}] = {[*lead, KV_HEADS, width]} (cache_mode 'BSND')", cache)
        else:
            require(token_x.dim() == 2, "token_x", "a 2-D tensor [T, He] with cache_mode 'TND'", token_x)
            require(tuple(cache.shape) == (*lead, KV_HEADS, width), name,
                    f"a tensor [T, {KV_HEADS}, {width}] = {[*lead, KV_HEADS, width]} (cache_mode 'TND')", cache)
    if cache_mode not in PAGED_MODES:
        return
    require(kv_quant_mode == PER_TILE or kr_cache.shape[:2] == kv_cache.shape[:2], "kr_cache",
            f"kv_cache's [BlockNum, BlockSize] = {list(kv_cache.shape[:2])}", kr_cache)
    block_size = kv_cache.shape[1]
    MLA_PROLOG_BLOCK_SIZES.check(block_size, "kv_cache")
    if cache_mode == "PA_NZ":
        for name, cache, width in (("kv_cache", kv_cache, latent), ("kr_cache", kr_cache, rope_dim)):
            c0 = nz_layout_chunk(cache.dtype)
            require(width % c0 == 0, name, f"a last dim that is a multiple of {c0} (the NZ channel group of "
                    f"{cache.dtype})", cache)
            require(cache.is_contiguous(), name, "a contiguous tensor (PA_NZ reads its memory as NZ blocks)", cache)


def _check_cache_index(cache_index, token_x, kv_cache, cache_mode: str) -> torch.Tensor | None:
    """The flat slot of every token, or None where nothing is written (BSND / TND write every token in order; a
    paged cache of 0 blocks is left as it is)."""
    if cache_mode not in PAGED_MODES:
        if cache_index is not None:
            raise ParamInvalidError(f"cache_index: cache_mode {cache_mode!r} writes token t at cache row t and takes "
                                    f"no cache_index; expected None")
        return None
    if cache_index is None:
        raise ParamNullptrError(f"cache_index: required with cache_mode {cache_mode!r}, got None")
    require(isinstance(cache_index, torch.Tensor), "cache_index", "a torch.Tensor", cache_index)
    lead = list(token_x.shape[:-1])
    require(cache_index.dtype == torch.int64, "cache_index", "dtype int64", cache_index)
    require(list(cache_index.shape) == lead, "cache_index", f"a tensor {lead} (token_x's leading dims: [T] or "
            f"[B, S])", cache_index)
    require(cache_index.device == token_x.device, "cache_index", f"token_x's device {token_x.device}", cache_index)
    slots = kv_cache.shape[0] * kv_cache.shape[1]
    if slots == 0:
        return None
    flat = cache_index.reshape(-1)
    if flat.numel():
        low, high = int(flat.min()), int(flat.max())
        if low < PADDING_SLOT or high >= slots:
            bad = low if low < PADDING_SLOT else high
            raise ParamInvalidError(f"cache_index: expected every slot in [0, BlockNum * BlockSize) = [0, {slots}) "
                                    f"(or -1: a padding token, not written), got {bad}")
        if low == PADDING_SLOT:
            beyond_docs("cache_index", "a slot of -1 (outside [0, BlockNum * BlockSize))",
                        "vllm-ascend vllm_ascend/attention/sfa_v1.py passes its slot_mapping, whose graph-mode "
                        "padding tokens hold -1 (vllm_ascend/worker/model_runner_v1.py)")
        written = flat[flat != PADDING_SLOT]
        if torch.unique(written).numel() != written.numel():
            raise ParamInvalidError("cache_index: expected a different slot for every token, got a slot written "
                                    "twice (the order of the two writes is undefined)")
    return flat


def _check_scalars(epsilon_cq, epsilon_ckv, qc_qr_scale, kc_scale, query_norm_flag) -> tuple:
    values = []
    for name, value in (("rmsnorm_epsilon_cq", epsilon_cq), ("rmsnorm_epsilon_ckv", epsilon_ckv),
                        ("qc_qr_scale", qc_qr_scale), ("kc_scale", kc_scale)):
        values.append(require_finite(value, name))
    query_norm = require_bool(query_norm_flag, "query_norm_flag")
    if query_norm and values[2] != 1.0:
        raise ParamInvalidError(f"qc_qr_scale: {values[2]} with query_norm_flag=True is not supported: the page does "
                                f"not say whether query_norm carries the scale; expected 1.0")
    return (*values, query_norm)


@traced_as_custom_op
def mla_prolog(
    token_x: torch.Tensor,
    weight_dq: torch.Tensor,
    weight_uq_qr: torch.Tensor,
    weight_uk: torch.Tensor,
    weight_dkv_kr: torch.Tensor,
    rmsnorm_gamma_cq: torch.Tensor,
    rmsnorm_gamma_ckv: torch.Tensor,
    rope_sin: torch.Tensor,
    rope_cos: torch.Tensor,
    kv_cache: torch.Tensor,
    kr_cache: torch.Tensor,
    *,
    cache_index: torch.Tensor | None = None,
    dequant_scale_x: torch.Tensor | None = None,
    dequant_scale_w_dq: torch.Tensor | None = None,
    dequant_scale_w_uq_qr: torch.Tensor | None = None,
    dequant_scale_w_dkv_kr: torch.Tensor | None = None,
    quant_scale_ckv: torch.Tensor | None = None,
    quant_scale_ckr: torch.Tensor | None = None,
    smooth_scales_cq: torch.Tensor | None = None,
    actual_seq_len: torch.Tensor | None = None,
    k_nope_clip_alpha: torch.Tensor | None = None,
    rmsnorm_epsilon_cq: float = 1e-05,
    rmsnorm_epsilon_ckv: float = 1e-05,
    cache_mode: str = "PA_BSND",
    query_norm_flag: bool = False,
    weight_quant_mode: int = 0,
    kv_cache_quant_mode: int = 0,
    query_quant_mode: int = 0,
    ckvkr_repo_mode: int = 0,
    quant_scale_repo_mode: int = 0,
    tile_size: int = 128,
    qc_qr_scale: float = 1.0,
    kc_scale: float = 1.0,
    backend: str = "auto",
) -> MlaPrologResult:
    """MLA pre-processing: queries of the new tokens, and their key/value latent and rope key written into
    `kv_cache` / `kr_cache` in place (docs/operators/mla_prolog.md).

    c^Q = qc_qr_scale * RmsNorm(x W^DQ); [q^C | q^R] per head = c^Q W^UQQR; query = q^C W^UK (per head);
    query_rope = RoPE(q^R); latent = kc_scale * RmsNorm((x W^DKVKR)[:Hckv]) and key rope = RoPE((x W^DKVKR)[Hckv:])
    go to the cache rows `cache_index` names (PA_BSND / PA_NZ) or to row t of a BSND / TND cache. token_x is
    [T, He] or [B, S, He]; weight_dq [He, Hcq], weight_uq_qr [Hcq, N * (D + Dr)], weight_uk [N, D, Hckv],
    weight_dkv_kr [He, Hckv + Dr] (NZ-cast or plain: the same values). Computed: the unquantised call,
    weight_quant_mode=1 (int8 weight_uq_qr, c^Q quantised per token: query_norm int8 with dequant_scale_q_norm) and
    weight_quant_mode=2 (also int8 token_x, weight_dq, weight_dkv_kr with their dequant scales), the int8 caches of
    kv_cache_quant_mode=2 (per channel, with weight_quant_mode=1) and kv_cache_quant_mode=1 (per tensor, with
    weight_quant_mode=2 and query_quant_mode=1: the query int8 per token and head, dequant_scale_q_nope its scales,
    query_rope multiplied by quant_scale_ckv / dequant_scale_q_nope).
    """
    names = ("token_x", "weight_dq", "weight_uq_qr", "weight_uk", "weight_dkv_kr", "rmsnorm_gamma_cq",
             "rmsnorm_gamma_ckv", "rope_sin", "rope_cos", "kv_cache", "kr_cache")
    tensors = [token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv,
               rope_sin, rope_cos, kv_cache, kr_cache]
    for name, tensor in zip(names, tensors, strict=True):
        _present(tensor, name)
    quant_mode, kv_quant_mode, query_quant_mode = _check_modes(
        {"weight_quant_mode": weight_quant_mode, "kv_cache_quant_mode": kv_cache_quant_mode,
         "query_quant_mode": query_quant_mode, "ckvkr_repo_mode": ckvkr_repo_mode,
         "quant_scale_repo_mode": quant_scale_repo_mode},
        {"dequant_scale_x": dequant_scale_x, "dequant_scale_w_dq": dequant_scale_w_dq,
         "dequant_scale_w_uq_qr": dequant_scale_w_uq_qr, "dequant_scale_w_dkv_kr": dequant_scale_w_dkv_kr,
         "quant_scale_ckv": quant_scale_ckv, "quant_scale_ckr": quant_scale_ckr,
         "smooth_scales_cq": smooth_scales_cq, "k_nope_clip_alpha": k_nope_clip_alpha},
        actual_seq_len, tile_size)
    cache_mode = _check_cache_mode(cache_mode)
    hidden, q_latent, heads, nope_dim, rope_dim, latent = _check_weights(
        token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin,
        rope_cos, quant_mode)
    dtype = weight_uk.dtype  # the float dtype: token_x's but with weight_quant_mode 2
    _check_quant_scales(
        {"dequant_scale_x": dequant_scale_x, "dequant_scale_w_dq": dequant_scale_w_dq,
         "dequant_scale_w_uq_qr": dequant_scale_w_uq_qr, "dequant_scale_w_dkv_kr": dequant_scale_w_dkv_kr,
         "smooth_scales_cq": smooth_scales_cq, "quant_scale_ckv": quant_scale_ckv, "quant_scale_ckr": quant_scale_ckr,
         "k_nope_clip_alpha": k_nope_clip_alpha},
        quant_mode, kv_quant_mode, tokens=token_x.shape[:-1].numel(), q_latent=q_latent,
        uq_qr_columns=weight_uq_qr.shape[-1], dkv_kr_columns=weight_dkv_kr.shape[-1], latent=latent,
        rope_dim=rope_dim, device=token_x.device)
    _check_caches(token_x, kv_cache, kr_cache, cache_mode, latent, rope_dim, dtype, kv_quant_mode, tile_size)
    slots = _check_cache_index(cache_index, token_x, kv_cache, cache_mode)
    epsilon_cq, epsilon_ckv, qc_qr, kc, query_norm = _check_scalars(
        rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, qc_qr_scale, kc_scale, query_norm_flag)
    problem = MlaPrologProblem(tuple(token_x.shape[:-1]), hidden, q_latent, heads, nope_dim, rope_dim, latent,
                               cache_mode, epsilon_cq, epsilon_ckv, qc_qr, kc, query_norm, quant_mode, kv_quant_mode,
                               query_quant_mode, int(tile_size))
    select_backend(backend, token_x.device, op="mla_prolog",
                   unsupported=lambda: "MlaProlog is computed by the reference backend only")
    rows = reference.mla_prolog(
        problem, token_x.reshape(-1, hidden), weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
        rmsnorm_gamma_ckv, rope_sin.reshape(-1, rope_dim), rope_cos.reshape(-1, rope_dim),
        reference.QuantScales(dequant_scale_x, dequant_scale_w_dq, dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr,
                              smooth_scales_cq, quant_scale_ckv, quant_scale_ckr, k_nope_clip_alpha),
        kv_cache, kr_cache, slots)
    lead = problem.token_shape
    empty = token_x.new_empty((0,), dtype=torch.float32)
    query_norm_out = rows.query_norm.reshape(*lead, q_latent) if query_norm else token_x.new_empty((0,), dtype=dtype)
    scale_q_norm = rows.query_norm_scale if query_norm and problem.quantized_uq_qr else empty.clone()
    scale_q_nope = rows.query_scale if rows.query_scale is not None else empty.clone()
    return MlaPrologResult(rows.query.reshape(*lead, heads, latent), rows.query_rope.reshape(*lead, heads, rope_dim),
                           scale_q_nope, query_norm_out, scale_q_norm)

