"""Validation of FusedInferAttentionScore's parameters (v1; v2 and IncreFlashAttention rename into it) and
construction of its canonical description, `FiaProblem` (docs/operators/fused_infer_attention_score.md,
docs/operators/incre_flash_attention.md, docs/semantics/paged-kv.md).

`build_fia_problem` reads the layouts, lengths, paged caches, MLA rope, KV anti-quantisation, shared prefix, left
padding, masks, pse_shift and int8 output steps, rejecting what the documentation rejects, and returns everything
the operator's dispatch needs; it writes nothing and computes no attention.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import ParamInvalidError, ParamNullptrError, describe, require, require_finite, require_int
from ..problem import antiquant as antiquants
from ..problem import layout as layouts
from ..problem import sink as sinks
from ..problem.lengths import cumulative_lengths, per_batch_lengths, require_same_sequence_count, to_int_list
from ..problem.nz import NZ_DIMS, nz_shape
from ..problem.policy import beyond_docs
from .flash_attention_score import INT_MAX
from .infer_attention import (
    MAX_BATCH,
    MAX_BATCH_UNALIGNED,
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    QuantPlan,
    quant_plan,
    reject_offset_with_invalid_rows,
    validate_mask,
    validate_pse_shift,
)
from .paged_infer import PagedKv, cache_shape, fia_block_sizes, paged_kv

# input_layout -> (layout of query, key and value; layout of the output).
FIA_LAYOUTS = {
    "BSH": ("BSH", "BSH"), "BSND": ("BSND", "BSND"), "BNSD": ("BNSD", "BNSD"), "BNSD_BSND": ("BNSD", "BSND"),
    "BSH_NBSD": ("BSH", "NBSD"), "BSND_NBSD": ("BSND", "NBSD"), "BNSD_NBSD": ("BNSD", "NBSD"),
    "BSH_BNSD": ("BSH", "BNSD"), "BSND_BNSD": ("BSND", "BNSD"),
    "TND": ("TND", "TND"), "NTD": ("NTD", "NTD"), "TND_NTD": ("TND", "NTD"), "NTD_TND": ("NTD", "TND"),
}
PACKED = ("TND", "NTD")
# Layouts the documentation lists only for MLA with D = 128 (query_rope / key_rope given).
ROPE_ONLY_LAYOUTS = ("NTD", "BSH_BNSD", "BSND_BNSD")
INT8_OUT_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND")
MAX_DECODE_KV = 262144
MAX_PACKED_BATCH = 4096
ROPE_DIM = 64
MLA_DIMS = (128, 512)
MLA_LATENT_DIM = 512  # MLA over the latent cache: paged, NZ caches, N2 = 1
# Head dims production calls the packed layouts with beyond the documented ones (docs/semantics/beyond-docs.md).
PRODUCTION_PACKED_DIMS = (96, 256, 512)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# learnable_sink (v2): "仅支持TND、NTD_TND；仅支持value的D小于等于128" (npu_fused_infer_attention_score_v2 page).
SINK_LAYOUTS = ("TND", "NTD_TND")
MAX_SINK_VALUE_DIM = 128
# Q_S > 1 with separate key/value anti-quantisation factors: "要求query的s小于等于16" (v2 page, Q_S>1 section).
MAX_SEPARATE_ANTIQUANT_BF16_Q_S = 16
# out_dtype as op-plugin receives it: a torch.dtype turned into its c10::ScalarType number.
SCALAR_TYPE_NUMBERS = {torch.int8: 1, torch.float16: 5, torch.float32: 6, torch.bfloat16: 15,
                       torch.float8_e5m2: 23, torch.float8_e4m3fn: 24}
# NZ paged int8 cache [block_num, KV_N, D/32, block_size, 32] (GQA anti-quantisation + KV NZ section of the FIA pages).
NZ_HEAD_DIM = 128
NZ_BLOCK_SIZES = (128, 512)
NZ_HEAD_PAIRS = ((10, 1), (64, 8), (80, 8), (128, 16))
# Q_S = 1 whose key lengths are all 0 on a batch: the decode kernel fills that batch's output with zeros and its
# softmax_lse with -3.40e38 (ops-transformer IFA kernels, InitAllZeroOutput), not the inf of other invalid rows.
DECODE_EMPTY_BATCH_LSE = -3.40e38


@dataclass(frozen=True)
class FiaProblem:
    """One validated FusedInferAttentionScore call: what to attend, over which keys, with which masks and outputs.

    `act_q` / `act_kv` are per-sequence lengths (key lengths without the shared prefix); `sparse_mode`,
    `pre_tokens` and `next_tokens` are the effective ones (decode and left padding drop the band); `atten_mask` is
    the mask as the kernels read it ([B, KV_S] decode masks viewed as [B, 1, 1, KV_S]) and `mask_views` its
    per-batch views for modes 0/1."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_rope: torch.Tensor | None
    key_rope: torch.Tensor | None
    input_layout: str
    q_layout: str
    out_layout: str
    batch: int
    q_seq: int  # Q_S, or T of a packed layout
    k_seq: int  # KV_S of the key tensor (the page table's reach with PageAttention)
    num_heads: int
    heads_kv: int
    q_dim: int
    v_dim: int
    decode: bool
    act_q: list[int]
    act_kv: list[int]
    pages: PagedKv | None
    antiquant: antiquants.KvAntiquant | None
    prefix: tuple[torch.Tensor, torch.Tensor, int] | None
    q_pad: int | None
    kv_pad: int | None
    sparse_mode: int
    pre_tokens: int
    next_tokens: int
    atten_mask: torch.Tensor | None
    mask_views: list | None
    pse_shift: torch.Tensor | None
    plan: QuantPlan
    scale: float
    softmax_lse_flag: bool
    # Picks the PFA kernel's pipeline in the "npu" precision mode (docs/semantics/precision.md).
    inner_precise: int = 0
    sink: torch.Tensor | None = None  # learnable_sink (v2): one logit per query head, problem/sink.py
    # int4 key/value as given (packed in int32); `key` / `value` are then their unpacked int8 shapes on the meta
    # device until `with_int4_unpacked` makes them real (the decode loop reads the packed bytes instead).
    int4_packed: tuple[torch.Tensor, torch.Tensor] | None = None
    # The int8 MLA query's paged int8 latent: `key` / `value` / `key_rope` are then its float32 pool views, unfilled
    # until `with_latent_converted` (the decode loop reads the int8 pages instead; problem/antiquant.py).
    int8_latent: antiquants.PagedLatent | None = None

    @property
    def packed(self) -> bool:
        return self.q_layout in PACKED

    @property
    def rope(self) -> bool:
        return self.key_rope is not None

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix is None else self.prefix[2]

    @property
    def left_padding(self) -> bool:
        return self.q_pad is not None or self.kv_pad is not None

    def with_int4_unpacked(self) -> FiaProblem:
        """The problem with int4 key/value unpacked into real int8 tensors (`antiquant.unpack_int4`)."""
        if self.int4_packed is None:
            return self
        key, value = (antiquants.unpack_int4(t) for t in self.int4_packed)
        return replace(self, key=key, value=value, int4_packed=None)

    def with_latent_converted(self) -> FiaProblem:
        """The problem with the int8 latent's float32 pool filled (`PagedLatent.convert`): key / value / key_rope
        then hold their values."""
        if self.int8_latent is None:
            return self
        self.int8_latent.convert()
        return replace(self, int8_latent=None)

    def padded_window(self, b: int) -> tuple[int, int, int, int]:
        """(q0, q_end, kv0, kv_end): where batch b's valid query and key rows lie under left padding (they end
        `padding` positions before S; without a padding they start at 0)."""
        sq, skv = self.act_q[b], self.act_kv[b]
        q_end = self.q_seq - self.q_pad if self.q_pad is not None else sq
        kv_end = self.k_seq - self.kv_pad if self.kv_pad is not None else skv
        return q_end - sq, q_end, kv_end - skv, kv_end


def read_dims(tensor: torch.Tensor, layout: str, heads: int, param: str, heads_param: str):
    """(batch or None, S or T, N, D) of a tensor in a query/key layout (BSH, BSND, BNSD, TND, NTD)."""
    if layout == "NTD":
        require(tensor.dim() == 3, param, "a 3-D [N, T, D] tensor for layout NTD", tensor)
        return None, tensor.shape[1], tensor.shape[0], tensor.shape[2]
    dims = layouts.read_dims(tensor, layout, heads, param, heads_param)
    return dims.batch, dims.seq, dims.heads, dims.head_dim


def output_shape(layout: str, batch, seq: int, heads: int, dim: int) -> tuple[int, ...]:
    """attention_out's shape in an FIA output layout (NBSD and NTD included)."""
    if layout == "NBSD":
        return (heads, batch, seq, dim)
    if layout == "NTD":
        return (heads, seq, dim)
    return layouts.output_shape(layout, batch, seq, heads, dim)


def not_supported(param: str, value, what: str = "") -> None:
    if value is not None:
        raise ParamInvalidError(f"{param}: {what or 'not supported yet'}, got {describe(value)}")


def _padding(value, param: str) -> int | None:
    """query_padding_size / kv_padding_size: one int64 value (negative counts as 0)."""
    if value is None:
        return None
    require(isinstance(value, torch.Tensor) and value.numel() == 1
            and not value.is_floating_point() and value.dtype != torch.bool,
            param, "an integer tensor with one element", value)
    return max(0, int(value.reshape(()).item()))


@dataclass(frozen=True)
class _Shapes:
    """Batch, S, N and D of query, key and value as the layout (or the paged cache) gives them."""

    qb: int | None
    q_seq: int
    q_heads: int
    q_dim: int
    kb: int | None
    k_seq: int
    k_heads: int
    k_dim: int
    vb: int | None
    v_seq: int
    v_heads: int
    v_dim: int


def _check_inputs(query, key, value, input_layout, int_params: dict, num_heads, num_key_value_heads,
                  softmax_lse_flag) -> bool:
    """Tensors, dtypes, layout and integer attributes; returns whether key/value are int8 under a float query."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t is None:
            raise ParamNullptrError(f"{name}: a required input, got None")
        require(isinstance(t, torch.Tensor), name, "a torch.Tensor", t)
    require(query.dtype in (*FLOAT_DTYPES, torch.int8), "query", "dtype float16, bfloat16 or int8", query)
    int8_kv = key.dtype == torch.int8 and query.dtype != torch.int8
    require(key.dtype == query.dtype or int8_kv, "key", f"the query's dtype {query.dtype} or int8", key)
    require(value.dtype == key.dtype, "value", f"the key's dtype {key.dtype}", value)
    if not isinstance(input_layout, str) or input_layout not in FIA_LAYOUTS:
        raise ParamInvalidError(f"input_layout: expected one of {list(FIA_LAYOUTS)}, got {input_layout!r}")
    for name, v_ in int_params.items():
        require_int(v_, name)
    if num_heads <= 0:
        raise ParamInvalidError(f"num_heads: expected a positive int, got {num_heads!r}")
    if num_key_value_heads < 0:
        raise ParamInvalidError(f"num_key_value_heads: expected an int >= 0, got {num_key_value_heads!r}")
    if not isinstance(softmax_lse_flag, bool):
        raise ParamInvalidError(f"softmax_lse_flag: expected a bool, got {softmax_lse_flag!r}")
    return int8_kv


def _read_shapes(query, key, value, block_table, q_layout, num_heads, heads_kv, num_key_value_heads) -> _Shapes:
    """The shapes of query, key and value, checked against the head counts, each other and the size limits."""
    qb, q_seq, q_heads, q_dim = read_dims(query, q_layout, num_heads, "query", "num_heads")
    if block_table is None:
        kb, k_seq, k_heads, k_dim = read_dims(key, q_layout, heads_kv, "key", "num_key_value_heads")
        vb, v_seq, v_heads, v_dim = read_dims(value, q_layout, heads_kv, "value", "num_key_value_heads")
    else:
        # PageAttention: key/value are block caches; KV_S (what masks and pse_shift cover) is the table's reach.
        k_cache = cache_shape(key, "key", heads_kv, q_layout)
        v_cache = cache_shape(value, "value", heads_kv, q_layout)
        require(isinstance(block_table, torch.Tensor) and block_table.dim() == 2, "block_table",
                "a 2-D int32 tensor [B, max blocks per sequence]", block_table)
        kb = vb = qb
        k_seq = v_seq = block_table.shape[1] * k_cache.block_size
        k_heads, k_dim, v_heads, v_dim = k_cache.heads, k_cache.dim, v_cache.heads, v_cache.dim
    packed = q_layout in PACKED
    layouts.require_head_count(query, q_layout, q_heads, num_heads, "query", "num_heads")
    if q_layout != "BSH" and k_heads != heads_kv:
        raise ParamInvalidError(
            f"num_key_value_heads: expected the key's head count N={k_heads} (0 means num_heads), "
            f"got {num_key_value_heads}"
        )
    if num_heads % heads_kv != 0 or num_heads // heads_kv > MAX_GROUP:
        raise ParamInvalidError(
            f"num_key_value_heads: num_heads={num_heads} must be a multiple of it with a ratio <= {MAX_GROUP}, "
            f"got {heads_kv}"
        )
    require(num_heads <= MAX_HEADS, "num_heads", f"at most {MAX_HEADS}", num_heads)
    require(heads_kv <= MAX_HEADS, "num_key_value_heads", f"at most {MAX_HEADS}", heads_kv)
    require(k_dim == q_dim, "key", f"head dim D={q_dim} like the query", key)
    require(vb == kb and v_seq == k_seq and v_heads == k_heads, "value", f"the key's B, S and N {list(key.shape)}",
            value)
    require(v_dim == k_dim or (packed and q_dim == 192 and v_dim == 128), "value",
            f"head dim D={k_dim} like the key", value)
    if not packed:
        require(kb == qb, "key", f"batch B={qb} like the query", key)
        require(qb <= MAX_BATCH, "query", f"batch B <= {MAX_BATCH}", query)
    require(q_dim <= MAX_HEAD_DIM and (q_dim >= 1 or query.numel() == 0), "query", f"head dim D in 1..{MAX_HEAD_DIM}",
            query)
    return _Shapes(qb, q_seq, q_heads, q_dim, kb, k_seq, k_heads, k_dim, vb, v_seq, v_heads, v_dim)


def _check_rope(query, key, query_rope, key_rope, *, q_layout, num_heads, heads_kv, q_dim, sparse_mode,
                softmax_lse_flag, excluded) -> None:
    """MLA: query_rope / key_rope (D = 64) beside a query of D 128 or 512
    (docs/operators/fused_infer_attention_score.md, "MLA rope")."""
    if query_rope is None or key_rope is None:
        raise ParamInvalidError("query_rope/key_rope: must be given together")
    require(query_rope.dtype == query.dtype, "query_rope", f"the query's dtype {query.dtype}", query_rope)
    require(key_rope.dtype == query.dtype, "key_rope", f"the query's dtype {query.dtype}", key_rope)
    require(q_dim in MLA_DIMS, "query", f"head dim D in {MLA_DIMS} with query_rope", query)
    exp_q = (*query.shape[:-1], ROPE_DIM if q_layout != "BSH" else num_heads * ROPE_DIM)
    require(tuple(query_rope.shape) == exp_q, "query_rope", f"shape {list(exp_q)} (D={ROPE_DIM})", query_rope)
    if key.dim() == NZ_DIMS:  # an NZ cache: key_rope is one too ("key_rope的数据类型、数据格式与key一致")
        exp_k = nz_shape(key.shape[0], key.shape[1], ROPE_DIM, key.shape[3], key_rope.dtype)
    else:
        exp_k = (*key.shape[:-1], ROPE_DIM if q_layout != "BSH" else heads_kv * ROPE_DIM)
    require(tuple(key_rope.shape) == exp_k, "key_rope", f"shape {list(exp_k)} (D={ROPE_DIM})", key_rope)
    if q_dim == 512:
        require(heads_kv == 1, "num_key_value_heads", "1 for MLA with D=512", heads_kv)
        require(num_heads in (1, 2, 4, 8, 16, 32, 64, 128), "num_heads", "1, 2, 4, ..., 128 for MLA with D=512",
                num_heads)
        if sparse_mode not in (0, 3, 4):
            raise ParamInvalidError(f"sparse_mode: MLA with D=512 supports 0, 3 and 4, got {sparse_mode}")
        if softmax_lse_flag:
            beyond_docs("softmax_lse_flag", "softmax_lse with MLA D=512",
                        "vllm-ascend's decode context parallel MLA (vllm_ascend/attention/context_parallel/"
                        "mla_cp.py, softmax_lse_flag=True merged with npu_attention_update)")
    for name, t in excluded:
        not_supported(name, t, "not supported with query_rope/key_rope (MLA)")


def _check_packed(input_layout, value, q_dim, v_dim, rope, mha, atten_mask, sparse_mode, excluded) -> None:
    """TND / NTD: the head dims and inputs the packed layouts take. MHA (as many key/value heads as query heads)
    also takes D = 64 ("MHA场景Q_D、K_D、V_D都等于64", v2 page)."""
    if not rope and not mha and q_dim == v_dim == 64:
        beyond_docs("query", f"layout {input_layout} with D=64 and fewer key/value heads than query heads (GQA)",
                    "gpt-oss prefill in vllm-ascend (vllm_ascend/attention/attention_v1.py, "
                    "npu_fused_infer_attention_score_v2 with learnable_sink, TND, head dim 64, GQA)")
    elif not rope and q_dim == v_dim and q_dim in PRODUCTION_PACKED_DIMS:
        beyond_docs("query", f"layout {input_layout} with D={q_dim} (documented without rope: 128, 192, MHA 64)",
                    "cann-recipes-infer gemma_4 (models/gemma_4/models/modeling_gemma4.py, _attn_tnd_sliding: "
                    "npu_fused_infer_attention_score_v2 TND, head dim 256, GQA, sparse_mode 4, prefill and paged "
                    "decode) and vllm-ascend (vllm_ascend/attention/attention_v1.py, full_graph_fia: TND with "
                    "the model's head size)")
    elif not rope and not (q_dim == v_dim == 128 or (q_dim == 192 and v_dim in (128, 192))
                           or (mha and q_dim == v_dim == 64)):
        raise ParamInvalidError(
            f"query: layout {input_layout} without rope needs D=128 (or D=192 with value D 128/192, or D=64 with "
            f"as many key/value heads as query heads), got query D={q_dim}, value D={v_dim}"
        )
    if rope and q_dim == 128:
        require(v_dim == 128, "value", "head dim 128 with rope", value)
    for name, t in excluded:
        not_supported(name, t, f"not supported with layout {input_layout}")
    if atten_mask is not None and sparse_mode in (0, 1):
        raise ParamInvalidError(
            f"atten_mask: explicit masks (sparse_mode 0/1) with layout {input_layout} are not supported yet; "
            f"use sparse_mode 2, 3 or 4"
        )


def _kv_antiquant(query, *, int8_kv, decode, q_seq, kv_dims, antiquant_scale, antiquant_offset, key_antiquant_scale,
                  key_antiquant_offset, value_antiquant_scale, value_antiquant_offset, antiquant_mode,
                  key_antiquant_mode, value_antiquant_mode) -> antiquants.KvAntiquant | None:
    """The KV anti-quantisation factors of int8 key/value under a float query (`problem/antiquant.py`)."""
    separate_given = key_antiquant_scale is not None or value_antiquant_scale is not None \
        or key_antiquant_offset is not None or value_antiquant_offset is not None
    combined_given = antiquant_scale is not None or antiquant_offset is not None
    antiquant = None
    if int8_kv:
        require(query.dtype in (torch.float16, torch.bfloat16), "query",
                "float16 or bfloat16 with int8 key/value (anti-quantisation)", query)
        if not decode and not separate_given:
            require(query.dtype == torch.float16, "query", "float16 with int8 key/value and antiquant_scale when "
                    "Q_S > 1", query)
        if not decode and separate_given and query.dtype == torch.bfloat16:
            # "dequant_scale_key与dequant_scale_value非空场景，要求query的s小于等于16；要求query的dtype为bfloat16"
            require(q_seq <= MAX_SEPARATE_ANTIQUANT_BF16_Q_S, "query",
                    f"Q_S <= {MAX_SEPARATE_ANTIQUANT_BF16_Q_S} with a bfloat16 query and separate key/value "
                    f"anti-quantisation", query)
        if combined_given and separate_given:
            raise ParamInvalidError("antiquant_scale: give either antiquant_* or key_/value_antiquant_*, not both")
        if combined_given:
            if antiquant_scale is None:
                raise ParamInvalidError("antiquant_offset: only allowed together with antiquant_scale")
            antiquant = antiquants.combined(antiquant_scale, antiquant_offset, antiquant_mode,
                                            query_dtype=query.dtype, decode=decode, dims=kv_dims)
        elif separate_given:
            if key_antiquant_scale is None or value_antiquant_scale is None:
                raise ParamInvalidError("key_antiquant_scale/value_antiquant_scale: must be given together")
            antiquant = antiquants.separate(
                key_antiquant_scale, key_antiquant_offset, value_antiquant_scale, value_antiquant_offset,
                key_antiquant_mode, value_antiquant_mode, query_dtype=query.dtype, decode=decode, dims=kv_dims,
            )
        else:
            raise ParamInvalidError("antiquant_scale: int8 key/value with a float query need antiquant_scale or "
                                    "key_antiquant_scale/value_antiquant_scale, got None")
    else:
        for name, t in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset),
                        ("key_antiquant_scale", key_antiquant_scale), ("key_antiquant_offset", key_antiquant_offset),
                        ("value_antiquant_scale", value_antiquant_scale),
                        ("value_antiquant_offset", value_antiquant_offset)):
            not_supported(name, t, "only with int8 key/value and a float16/bfloat16 query")
    for name, mode in (("antiquant_mode", antiquant_mode), ("key_antiquant_mode", key_antiquant_mode),
                       ("value_antiquant_mode", value_antiquant_mode)):
        require_int(mode, name)
        if mode != 0 and antiquant is None:
            raise ParamInvalidError(f"{name}: only with KV anti-quantisation, got {mode}")
    return antiquant


def _shared_prefix(query, key, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len, *, q_layout,
                   heads_kv, k_dim, antiquant) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(key prefix, value prefix, length used) of the system prefix every batch's keys start with, or None."""
    if key_shared_prefix is None and value_shared_prefix is None:
        if actual_shared_prefix_len is not None:
            raise ParamInvalidError("actual_shared_prefix_len: only with key_shared_prefix/value_shared_prefix")
        return None
    if key_shared_prefix is None or value_shared_prefix is None:
        raise ParamInvalidError("key_shared_prefix/value_shared_prefix: must be given together")
    if query.dtype == torch.int8:
        raise ParamInvalidError("key_shared_prefix: not supported with int8 query/key/value")
    for name, t in (("key_shared_prefix", key_shared_prefix), ("value_shared_prefix", value_shared_prefix)):
        require(isinstance(t, torch.Tensor) and t.dtype == key.dtype and t.dim() == key.dim(), name,
                f"a {key.dim()}-D tensor of the key's dtype {key.dtype}", t)
        pb, _, ph, pd = read_dims(t, q_layout, heads_kv, name, "num_key_value_heads")
        require(pb == 1 and ph == heads_kv and pd == k_dim, name,
                f"batch 1 with the key's N={heads_kv} and D={k_dim}", t)
    p_seq = read_dims(key_shared_prefix, q_layout, heads_kv, "key_shared_prefix", "")[1]
    require(read_dims(value_shared_prefix, q_layout, heads_kv, "value_shared_prefix", "")[1] == p_seq,
            "value_shared_prefix", f"the key prefix's S={p_seq}", value_shared_prefix)
    if antiquant is not None and antiquant.per_token:
        raise ParamInvalidError("key_shared_prefix: per-token anti-quantisation of a shared prefix is not "
                                "supported yet")
    lengths = to_int_list(actual_shared_prefix_len, "actual_shared_prefix_len")
    if lengths is None:
        return key_shared_prefix, value_shared_prefix, p_seq
    if len(lengths) != 1 or not 0 <= lengths[0] <= p_seq:
        raise ParamInvalidError(
            f"actual_shared_prefix_len: expected one value in [0, {p_seq}] (the prefix's S), got {lengths}"
        )
    return key_shared_prefix, value_shared_prefix, lengths[0]


def build_fia_problem(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    dequant_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    dequant_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    antiquant_scale: torch.Tensor | None = None,
    antiquant_offset: torch.Tensor | None = None,
    key_antiquant_scale: torch.Tensor | None = None,
    key_antiquant_offset: torch.Tensor | None = None,
    value_antiquant_scale: torch.Tensor | None = None,
    value_antiquant_offset: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    query_padding_size: torch.Tensor | None = None,
    kv_padding_size: torch.Tensor | None = None,
    key_shared_prefix: torch.Tensor | None = None,
    value_shared_prefix: torch.Tensor | None = None,
    actual_shared_prefix_len=None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    key_rope_antiquant_scale: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
    learnable_sink: torch.Tensor | None = None,
    out_dtype: int | torch.dtype | None = None,
) -> FiaProblem:
    """Validate one npu_fused_infer_attention_score call (v1 argument names; `learnable_sink` and `out_dtype` are
    v2's) and describe it (docs/operators/fused_infer_attention_score.md). Raises ParamInvalidError /
    ParamNullptrError naming the parameter; reads the inputs only (int4 key/value are unpacked into new int8
    tensors)."""
    int4 = isinstance(key, torch.Tensor) and key.dtype == torch.int32
    int4_packed = None
    if int4:
        int4_packed = (key, value)
        key, value = _unpacked_int4_shapes(query, key, value, block_table=block_table, quant_scale2=quant_scale2,
                                           key_shared_prefix=key_shared_prefix)
    int8_kv = _check_inputs(
        query, key, value, input_layout,
        {"num_heads": num_heads, "num_key_value_heads": num_key_value_heads, "sparse_mode": sparse_mode,
         "pre_tokens": pre_tokens, "next_tokens": next_tokens, "inner_precise": inner_precise,
         "block_size": block_size},
        num_heads, num_key_value_heads, softmax_lse_flag)
    q_layout, out_layout = FIA_LAYOUTS[input_layout]
    packed = q_layout in PACKED
    heads_kv = num_key_value_heads or num_heads
    shapes = _read_shapes(query, key, value, block_table, q_layout, num_heads, heads_kv, num_key_value_heads)
    q_seq, k_seq, q_dim, k_dim, v_dim = shapes.q_seq, shapes.k_seq, shapes.q_dim, shapes.k_dim, shapes.v_dim
    if int4:
        require(q_dim % 64 == 0, "query", "head dim D a multiple of 64 with int4 key/value", query)

    # ---- packed (TND / NTD) lengths; everything else has B
    if packed:
        act_q_list = cumulative_lengths(actual_seq_lengths, q_seq, "actual_seq_lengths")
        # With a paged cache the key lengths are plain per-sequence counts, read with the page table below.
        act_kv_list = act_q_list if block_table is not None else cumulative_lengths(
            actual_seq_lengths_kv, k_seq, "actual_seq_lengths_kv")
        require_same_sequence_count(act_q_list, act_kv_list, "actual_seq_lengths", "actual_seq_lengths_kv")
        batch = len(act_q_list)
        require(batch <= MAX_PACKED_BATCH, "actual_seq_lengths", f"at most {MAX_PACKED_BATCH} sequences", batch)
        decode = False
    else:
        batch = shapes.qb
        decode = q_seq == 1
    rope = query_rope is not None or key_rope is not None

    # ---- PageAttention (docs/semantics/paged-kv.md)
    pages = None
    if block_table is not None:
        for name, t in (("query_padding_size", query_padding_size), ("kv_padding_size", kv_padding_size),
                        ("key_shared_prefix", key_shared_prefix)):
            not_supported(name, t, "not supported with PageAttention (block_table)")
        if query.dtype == torch.int8:
            raise ParamInvalidError("query: int8 query/key/value are not supported with PageAttention (block_table)")
        if int8_kv and not decode and not (key.dim() == 5 and q_seq <= MAX_SEPARATE_ANTIQUANT_BF16_Q_S):
            raise ParamInvalidError("key: int8 key/value with PageAttention need Q_S = 1 (or the NZ cache with "
                                    f"Q_S <= {MAX_SEPARATE_ANTIQUANT_BF16_Q_S}), got Q_S={q_seq}")
        rule = fia_block_sizes(decode=decode, wide=packed or (rope and q_dim == 512), int8_kv=int8_kv)
        pages = paged_kv(key, value, key_rope if rope else None, block_table, block_size=block_size,
                         kv_lengths=actual_seq_lengths_kv, batch=batch, heads_kv=heads_kv, q_layout=q_layout,
                         rule=rule)
        if packed:
            act_kv_list = list(pages.pages.kv_lengths)
    # Without block_table PageAttention is off ("开启必要条件是block_table存在且有效"): block_size is ignored, as
    # vLLM's PrefillNoCache passes its cache block size there (docs/operators/fused_infer_attention_score.md).
    not_supported("key_rope_antiquant_scale", key_rope_antiquant_scale, "reserved by the documentation")
    if inner_precise not in (0, 1, 2, 3) or (decode and inner_precise not in (0, 1)):
        raise ParamInvalidError(
            f"inner_precise: expected {'0 or 1 when Q_S = 1' if decode else '0..3'}, got {inner_precise}"
        )
    if input_layout == "BNSD_NBSD" and q_seq == 1 and rope:
        beyond_docs("input_layout", "BNSD_NBSD with Q_S = 1 (MLA decode)",
                    "vllm-ascend's MLA decode (vllm_ascend/attention/mla_v1.py, input_layout='BNSD_NBSD')")
    elif input_layout in ("BNSD_BSND", "BNSD_NBSD") and q_seq == 1:
        raise ParamInvalidError(f"input_layout: {input_layout} needs Q_S > 1, got Q_S=1")
    if input_layout == "BNSD_NBSD" and q_seq > 16:
        raise ParamInvalidError(f"input_layout: BNSD_NBSD needs Q_S <= 16, got Q_S={q_seq}")
    if input_layout in ROPE_ONLY_LAYOUTS and not rope:
        raise ParamInvalidError(f"input_layout: {input_layout} is documented for MLA only (query_rope/key_rope)")

    # ---- MLA rope and the packed layouts: the inputs neither takes
    rope_and_packed_exclude = (
        ("pse_shift", pse_shift), ("key_shared_prefix", key_shared_prefix),
        ("query_padding_size", query_padding_size), ("kv_padding_size", kv_padding_size),
        ("antiquant_scale", antiquant_scale), ("key_antiquant_scale", key_antiquant_scale),
        ("dequant_scale1", dequant_scale1), ("quant_scale2", quant_scale2),
    )
    if rope:
        _check_rope(query, key, query_rope, key_rope, q_layout=q_layout, num_heads=num_heads, heads_kv=heads_kv,
                    q_dim=q_dim, sparse_mode=sparse_mode, softmax_lse_flag=softmax_lse_flag,
                    excluded=rope_and_packed_exclude)
    if packed:
        _check_packed(input_layout, value, q_dim, v_dim, rope, heads_kv == num_heads, atten_mask, sparse_mode,
                      rope_and_packed_exclude)
    # ---- dtype rules of each branch
    if decode and query.dtype == torch.int8:
        raise ParamInvalidError("query: int8 query/key/value (full quantisation) is not supported when Q_S = 1")
    if not decode and not packed:
        alignment = 32 if query.dtype == torch.int8 else 16
        if q_dim % alignment != 0:
            require(batch <= MAX_BATCH_UNALIGNED, "query",
                    f"batch B <= {MAX_BATCH_UNALIGNED} when D={q_dim} is not a multiple of {alignment}", query)
        if q_layout in ("BSH", "BSND"):
            require(num_heads * q_dim < MAX_HIDDEN, "query", f"N * D < {MAX_HIDDEN} for layout {q_layout}", query)
        if sparse_mode not in (0, 1, 2, 3, 4):
            raise ParamInvalidError(f"sparse_mode: Q_S > 1 supports 0..4, got {sparse_mode}")
    if decode:
        require(k_seq <= MAX_DECODE_KV, "key", f"KV_S <= {MAX_DECODE_KV} when Q_S = 1", key)
        if rope and sparse_mode not in (0, 3, 4):
            raise ParamInvalidError(f"sparse_mode: MLA supports 0, 3 and 4, got {sparse_mode}")

    antiquant = _kv_antiquant(
        query, int8_kv=int8_kv, decode=decode, q_seq=q_seq, kv_dims=(batch, heads_kv, k_seq, k_dim),
        antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        key_antiquant_scale=key_antiquant_scale, key_antiquant_offset=key_antiquant_offset,
        value_antiquant_scale=value_antiquant_scale, value_antiquant_offset=value_antiquant_offset,
        antiquant_mode=antiquant_mode, key_antiquant_mode=key_antiquant_mode,
        value_antiquant_mode=value_antiquant_mode)
    if pages is not None and pages.shape.nz and int8_kv:
        _check_nz_cache(query, q_seq=q_seq, q_dim=q_dim, num_heads=num_heads, heads_kv=heads_kv,
                        block_size=pages.shape.block_size, antiquant=antiquant)
    elif pages is not None and pages.shape.nz and not (rope and q_dim == MLA_LATENT_DIM):
        # "当query的D等于512时 ... 支持key、value、key_rope的数据格式为ND或NZ": float NZ is an MLA cache.
        raise ParamInvalidError(f"key: a {key.dtype} NZ cache [block_num, KV_N, D/16, block_size, 16] is "
                                f"documented for MLA only (query_rope/key_rope with D = {MLA_LATENT_DIM}), got "
                                f"D = {q_dim}{'' if rope else ' without rope'}")
    prefix = _shared_prefix(query, key, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len,
                            q_layout=q_layout, heads_kv=heads_kv, k_dim=k_dim, antiquant=antiquant)
    prefix_len = 0 if prefix is None else prefix[2]

    # ---- left padding
    q_pad = _padding(query_padding_size, "query_padding_size")
    kv_pad = _padding(kv_padding_size, "kv_padding_size")
    if q_pad is not None:
        if decode:
            raise ParamInvalidError("query_padding_size: only takes effect when Q_S > 1")
        if actual_seq_lengths is None:
            raise ParamInvalidError("query_padding_size: needs actual_seq_lengths (left padding)")
    if kv_pad is not None and actual_seq_lengths_kv is None:
        raise ParamInvalidError("kv_padding_size: needs actual_seq_lengths_kv (left padding)")
    left_padding = q_pad is not None or kv_pad is not None
    if left_padding and prefix is not None:
        raise ParamInvalidError("key_shared_prefix: not supported with left padding")

    # ---- lengths of the dense layouts
    if not packed:
        act_q_list = [1] * batch if decode else per_batch_lengths(actual_seq_lengths, "actual_seq_lengths", batch,
                                                                   q_seq)
        act_kv_list = list(pages.pages.kv_lengths) if pages is not None else per_batch_lengths(
            actual_seq_lengths_kv, "actual_seq_lengths_kv", batch, k_seq)
    kv_total = k_seq + prefix_len  # the KV_S that masks and pse_shift cover

    # ---- masks and pse: decode has no band; its mask may be [B, KV_S]
    mode, pre, nxt = sparse_mode, pre_tokens, next_tokens
    mask = atten_mask
    if decode and not rope:
        mode, pre, nxt = 0, INT_MAX, INT_MAX
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch and batch != 1:
            mask = mask.view(batch, 1, 1, mask.shape[1])
    if left_padding and mode == 0:
        pre, nxt = INT_MAX, INT_MAX  # the documentation: left padding ignores pre/next_tokens in mode 0
    seq_q_mask = 1 if decode else (q_seq if not packed else max(act_q_list, default=0))
    mask_views = validate_mask(mask, mode, batch, num_heads, seq_q_mask, 0 if packed else kv_total, pre, nxt)
    if pse_shift is not None:
        validate_pse_shift(pse_shift, query, batch, num_heads, seq_q_mask, kv_total)
        if decode:
            require(pse_shift.shape[2] == 1, "pse_shift", "[B or 1, N, 1, KV_S] when Q_S = 1", pse_shift)
            require(q_dim % 16 == 0, "query", "head dim D divisible by 16 with pse_shift when Q_S = 1", query)
            require(pse_shift.dtype == query.dtype, "pse_shift", f"the query's dtype {query.dtype}", pse_shift)

    # ---- int8 (PromptFlashAttention's rules)
    plan = quant_plan(query, dequant_scale1, quant_scale1, dequant_scale2, quant_scale2, quant_offset2,
                      out_layout if out_layout != "NBSD" else "BNSD", num_heads, q_dim)
    if plan.output_dtype == torch.int8:
        if input_layout not in INT8_OUT_LAYOUTS:
            raise ParamInvalidError(f"quant_scale2: int8 output supports layouts {list(INT8_OUT_LAYOUTS)}, got "
                                    f"{input_layout}")
        if quant_scale2.numel() > 1 and (left_padding or softmax_lse_flag or q_dim % 32 != 0):
            raise ParamInvalidError("quant_scale2: per-channel int8 output is not supported with left padding, "
                                    "softmax_lse_flag or D not a multiple of 32")
        if sparse_mode == 4 and (pre_tokens < 0 or next_tokens < 0) and not decode:
            raise ParamInvalidError("quant_scale2: int8 output does not support sparse_mode 4 with negative "
                                    "pre_tokens/next_tokens")
        if plan.offset_nonzero and not decode:
            reject_offset_with_invalid_rows(mask is not None, mode, act_q_list,
                                            [a + prefix_len for a in act_kv_list], pre, nxt)
    if query.dtype == torch.int8 and softmax_lse_flag:
        raise ParamInvalidError("softmax_lse_flag: not supported with int8 query/key/value yet")
    _check_out_dtype(out_dtype, plan, query)
    sink = None
    if learnable_sink is not None:
        sink = _learnable_sink(learnable_sink, input_layout=input_layout, num_heads=num_heads, v_dim=v_dim,
                               quantised=int8_kv or query.dtype == torch.int8 or plan.output_dtype == torch.int8)

    problem = FiaProblem(
        query=query, key=key, value=value, query_rope=query_rope if rope else None,
        key_rope=key_rope if rope else None, input_layout=input_layout, q_layout=q_layout, out_layout=out_layout,
        batch=batch, q_seq=q_seq, k_seq=k_seq, num_heads=num_heads, heads_kv=heads_kv, q_dim=q_dim, v_dim=v_dim,
        decode=decode, act_q=act_q_list, act_kv=act_kv_list, pages=pages, antiquant=antiquant, prefix=prefix,
        q_pad=q_pad, kv_pad=kv_pad, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt, atten_mask=mask,
        mask_views=mask_views, pse_shift=pse_shift, plan=plan, scale=require_finite(scale, "scale"),
        softmax_lse_flag=softmax_lse_flag, inner_precise=inner_precise, sink=sink, int4_packed=int4_packed,
    )
    if left_padding:
        _check_padded_windows(problem)
    return problem


def _check_padded_windows(p: FiaProblem) -> None:
    """Every batch's left-padded rows must start inside the tensors; when Q_S = 1 a key window outside them
    gives zeros instead (the documentation)."""
    for b in range(p.batch):
        q0, _, kv0, kv_end = p.padded_window(b)
        if p.q_pad is not None and q0 < 0:
            raise ParamInvalidError(f"query_padding_size: batch {b} starts at Q_S - padding - actual length = {q0} "
                                    f"< 0")
        if (kv0 < 0 or kv_end < 0) and not p.decode:
            raise ParamInvalidError(f"kv_padding_size: batch {b} starts at KV_S - padding - actual length = {kv0} "
                                    f"< 0")


def _unpacked_int4_shapes(query, key: torch.Tensor, value, *, block_table, quant_scale2, key_shared_prefix):
    """Meta-device int8 stand-ins of int4 key/value packed in int32 (the last dim 8x wider), for validation."""
    require(isinstance(value, torch.Tensor) and value.dtype == torch.int32, "value",
            "int32 (packed int4) like the key", value)
    require(isinstance(query, torch.Tensor) and query.dtype in (torch.float16, torch.bfloat16), "query",
            "float16 or bfloat16 with int4 key/value", query)
    # PageAttention: "不支持Q为bfloat16、float16、key、value为int4（int32）的场景";
    # "int4（int32）伪量化场景不支持后量化".
    not_supported("block_table", block_table, "PageAttention does not take int4 key/value")
    not_supported("quant_scale2", quant_scale2, "int8 output is not supported with int4 key/value")
    not_supported("key_shared_prefix", key_shared_prefix, "not supported with int4 key/value yet")
    return tuple(torch.empty((*t.shape[:-1], t.shape[-1] * antiquants.INT4_PER_INT32), dtype=torch.int8,
                             device="meta") for t in (key, value))


def _check_nz_cache(query, *, q_seq: int, q_dim: int, num_heads: int, heads_kv: int, block_size: int,
                    antiquant) -> None:
    """The GQA anti-quantisation + KV NZ constraints of the FIA pages: bfloat16 query, D = 128, Q_S <= 16,
    separate factors without offsets; block sizes other than 128 / 512 and other head pairs are computed as well
    (docs/semantics/beyond-docs.md)."""
    require(query.dtype == torch.bfloat16, "query", "bfloat16 with an int8 NZ cache", query)
    require(q_dim == NZ_HEAD_DIM, "query", f"head dim D = {NZ_HEAD_DIM} with an int8 NZ cache", query)
    require(q_seq <= MAX_SEPARATE_ANTIQUANT_BF16_Q_S, "query",
            f"Q_S <= {MAX_SEPARATE_ANTIQUANT_BF16_Q_S} with an int8 NZ cache", query)
    if antiquant is None or antiquant.has_offset:
        raise ParamInvalidError("key_antiquant_offset: an int8 NZ cache takes key/value_antiquant_scale without "
                                "offsets")
    if block_size not in NZ_BLOCK_SIZES:
        beyond_docs("block_size", f"block size {block_size} (documented: 128 or 512) with an int8 NZ cache",
                    "vllm-ascend's C8 decode (vllm_ascend/attention/attention_v1.py, _forward_c8_decode: any "
                    "multiple of 32)")
    if (num_heads, heads_kv) not in NZ_HEAD_PAIRS:
        beyond_docs("num_key_value_heads", f"the head pair ({num_heads}, {heads_kv}) (documented: "
                    f"{', '.join(map(str, NZ_HEAD_PAIRS))}) with an int8 NZ cache",
                    "vllm-ascend's C8 decode (vllm_ascend/attention/attention_v1.py, _forward_c8_decode: the "
                    "model's heads per tensor-parallel rank)")


def scalar_type_number(out_dtype, name: str = "out_dtype") -> int | None:
    """A torch.dtype as its c10::ScalarType number (what op-plugin's binding passes for an `int?` dtype); a number
    unchanged. Anything else (a string, a bool, a float, another dtype) is a ParamInvalidError naming `name`
    (`out_dtype_of`)."""
    dtype = out_dtype_of(out_dtype, name)
    return None if dtype is None else SCALAR_TYPE_NUMBERS[dtype]


def out_dtype_of(out_dtype, name: str = "out_dtype") -> torch.dtype | None:
    """v2's `out_dtype` (or another dtype parameter, `name`) as a torch.dtype: given as a torch.dtype, or as the
    c10::ScalarType number op-plugin's binding turns a dtype into."""
    if out_dtype is None or out_dtype in SCALAR_TYPE_NUMBERS:
        return out_dtype
    if isinstance(out_dtype, int) and not isinstance(out_dtype, bool):
        for dtype, number in SCALAR_TYPE_NUMBERS.items():
            if number == out_dtype:
                return dtype
    raise ParamInvalidError(f"{name}: expected a torch.dtype (or its ScalarType number) among "
                            f"{[str(d) for d in SCALAR_TYPE_NUMBERS]}, got {out_dtype!r}")


def _check_out_dtype(out_dtype, plan: QuantPlan, query) -> None:
    """`out_dtype` "当输入为int8或float8_e4m3fn时，可通过该参数指定输出的数据类型": with int8 output
    (quant_scale_out) it must say int8 (FP8 outputs are not supported yet); with float inputs and no output
    quantisation the output keeps the query's dtype, so only that dtype is accepted."""
    dtype = out_dtype_of(out_dtype)
    if dtype is None or dtype == plan.output_dtype:
        return
    if plan.output_dtype == torch.int8:
        raise ParamInvalidError(f"out_dtype: only int8 output is supported with quant_scale_out here, got {dtype}")
    raise ParamInvalidError(f"out_dtype: takes effect with int8/FP8 inputs or quant_scale_out; these inputs give "
                            f"{plan.output_dtype} (the query's dtype {query.dtype}), got {dtype}")


def _learnable_sink(learnable_sink, *, input_layout: str, num_heads: int, v_dim: int, quantised: bool):
    """v2's learnable_sink: the FA family's sink (problem/sink.py), one logit per query head, bfloat16 [Q_N]
    (float32 too); only TND / NTD_TND, value D <= 128, no quantisation (v2 page, "learnable_sink约束")."""
    require(isinstance(learnable_sink, torch.Tensor) and learnable_sink.dtype in (torch.bfloat16, torch.float32)
            and tuple(learnable_sink.shape) == (num_heads,), "learnable_sink",
            f"a bfloat16 tensor of shape [{num_heads}] (one logit per query head)", learnable_sink)
    if input_layout not in SINK_LAYOUTS:
        raise ParamInvalidError(f"learnable_sink: supported with input_layout {list(SINK_LAYOUTS)} only, got "
                                f"{input_layout!r}")
    if v_dim > MAX_SINK_VALUE_DIM:
        raise ParamInvalidError(f"learnable_sink: needs value head dim D <= {MAX_SINK_VALUE_DIM}, got {v_dim}")
    if quantised:
        raise ParamInvalidError("learnable_sink: not supported with quantised inputs or outputs")
    return sinks.check_sink(learnable_sink.float(), num_heads, "learnable_sink")
