"""FusedInferAttentionScore (torch_npu.npu_fused_infer_attention_score, v1 and v2) and IncreFlashAttention
(docs/operators/fused_infer_attention_score.md, docs/operators/incre_flash_attention.md).

One operator for prefill (Q_S > 1, the PromptFlashAttention branch) and decode (Q_S = 1, the IncreFlashAttention
branch). The dense computation is PromptFlashAttention's (`infer_attention.attend`): FIA called with PFA's arguments
builds the same problem and gives the same bits. On top of it, this module reads FIA's layouts (with output-layout
conversions and the packed TND/NTD ones), left padding, the shared prefix, MLA rope, KV anti-quantisation and the
log-sum-exp output.

Key/value reach the computation through one function, `kv_bnsd`; a paged cache (`block_table`, PageAttention)
is gathered instead by `paged_infer.PagedKv`, per group of sequences the attention computes together
(docs/semantics/paged-kv.md).
"""

from __future__ import annotations

import contextlib

import torch

from ..backends.reference.workspace import Workspace
from ..errors import ParamInvalidError, ParamNullptrError, describe, require, require_int
from ..problem import antiquant as antiquants
from ..problem import layout as layouts
from ..problem import pse as pses
from ..problem.lengths import (
    cumulative_lengths,
    per_batch_lengths,
    require_same_sequence_count,
    starts_of,
    to_int_list,
)
from ..traceable import traced_as_custom_op
from .flash_attention_score import INT_MAX
from .infer_attention import (
    INVALID_LSE,
    MAX_BATCH,
    MAX_BATCH_UNALIGNED,
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    attend,
    attend_paged,
    quant_plan,
    reject_offset_with_invalid_rows,
    validate_mask,
    validate_pse_shift,
)
from .paged_infer import cache_shape, fia_block_sizes, length_groups, paged_kv

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
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _read(tensor: torch.Tensor, layout: str, heads: int, param: str, heads_param: str):
    """(batch or None, S or T, N, D) of a tensor in a query/key layout (BSH, BSND, BNSD, TND, NTD)."""
    if layout == "NTD":
        require(tensor.dim() == 3, param, "a 3-D [N, T, D] tensor for layout NTD", tensor)
        return None, tensor.shape[1], tensor.shape[0], tensor.shape[2]
    dims = layouts.read_dims(tensor, layout, heads, param, heads_param)
    return dims.batch, dims.seq, dims.heads, dims.head_dim


def _bnsd(tensor: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """[B, N, S, D] view of a non-packed tensor (NBSD outputs included)."""
    if layout == "NBSD":
        return tensor.permute(1, 0, 2, 3)
    return layouts.as_bnsd(tensor, layout, heads)


def _packed_rows(tensor: torch.Tensor, layout: str, start: int, length: int) -> torch.Tensor:
    """[1, N, length, D] view of one sequence of a TND / NTD tensor."""
    if layout == "TND":
        return layouts.tnd_run(tensor, start, 1, length)
    return tensor[:, start : start + length].unsqueeze(0)


def _output_shape(layout: str, batch, seq: int, heads: int, dim: int) -> tuple[int, ...]:
    if layout == "NBSD":
        return (heads, batch, seq, dim)
    if layout == "NTD":
        return (heads, seq, dim)
    return layouts.output_shape(layout, batch, seq, heads, dim)


def kv_bnsd(key: torch.Tensor, value: torch.Tensor, *, kv_layout: str, heads_kv: int, query_dtype: torch.dtype,
            antiquant: antiquants.KvAntiquant | None, prefix: tuple[torch.Tensor, torch.Tensor, int] | None,
            key_rope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value every query row attends to, as [B, N2, S, D] tensors (views where nothing changes).

    In order: int8 key/value anti-quantised to the query dtype (`problem/antiquant.py`); the shared prefix
    (its first `len` positions) put in front of every batch's keys; key_rope appended to the key's head dim. The
    PageAttention gather is `paged_infer.PagedKv.group_bnsd`."""
    k = _bnsd(key, kv_layout, heads_kv)
    v = _bnsd(value, kv_layout, heads_kv)
    if antiquant is not None:
        k = antiquants.dequantize(k, antiquant.key, query_dtype)
        v = antiquants.dequantize(v, antiquant.value, query_dtype)
    if key_rope is not None:
        k = torch.cat([k, _bnsd(key_rope, kv_layout, heads_kv).to(k.dtype)], dim=-1)
    if prefix is not None:
        pk, pv, length = prefix
        pk = _bnsd(pk, kv_layout, heads_kv)[:, :, :length]
        pv = _bnsd(pv, kv_layout, heads_kv)[:, :, :length]
        if antiquant is not None:
            pk = antiquants.dequantize(pk, antiquant.key, query_dtype)
            pv = antiquants.dequantize(pv, antiquant.value, query_dtype)
        if key_rope is not None:
            raise ParamInvalidError("key_shared_prefix: not supported together with query_rope/key_rope")
        batch = k.shape[0]
        k = torch.cat([pk.expand(batch, -1, -1, -1).to(k.dtype), k], dim=2)
        v = torch.cat([pv.expand(batch, -1, -1, -1).to(v.dtype), v], dim=2)
    return k, v


def _not_supported(param: str, value, what: str = "") -> None:
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


@traced_as_custom_op
def fused_infer_attention_score(
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
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention_out, softmax_lse) of softmax(scale * Q K^T + pse_shift, masked) V (docs/operators/
    fused_infer_attention_score.md). Q_S > 1 follows PromptFlashAttention (sparse_mode 0..4, pre/next tokens,
    actual lengths, int8 full and output quantisation); Q_S = 1 is decode: sparse_mode, pre/next_tokens and (outside
    TND) actual_seq_lengths have no effect, and the mask may be [B, KV_S]. softmax_lse: [B, N, Q_S, 1] float32
    (TND/NTD_TND: [T, N, 1]), -inf (log 0) for rows that see no key; without softmax_lse_flag a [1] zero tensor."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t is None:
            raise ParamNullptrError(f"{name}: a required input, got None")
        require(isinstance(t, torch.Tensor), name, "a torch.Tensor", t)
    require(query.dtype in (*FLOAT_DTYPES, torch.int8), "query", "dtype float16, bfloat16 or int8", query)
    if key.dtype == torch.int32:
        raise ParamInvalidError(f"key: int4 key/value (packed in int32) are not supported yet, got {describe(key)}")
    int8_kv = key.dtype == torch.int8 and query.dtype != torch.int8
    require(key.dtype == query.dtype or int8_kv, "key", f"the query's dtype {query.dtype} or int8", key)
    require(value.dtype == key.dtype, "value", f"the key's dtype {key.dtype}", value)
    if not isinstance(input_layout, str) or input_layout not in FIA_LAYOUTS:
        raise ParamInvalidError(f"input_layout: expected one of {list(FIA_LAYOUTS)}, got {input_layout!r}")
    q_layout, out_layout = FIA_LAYOUTS[input_layout]
    packed = q_layout in PACKED
    for name, v_ in (("num_heads", num_heads), ("num_key_value_heads", num_key_value_heads),
                     ("sparse_mode", sparse_mode), ("pre_tokens", pre_tokens), ("next_tokens", next_tokens),
                     ("inner_precise", inner_precise), ("block_size", block_size)):
        require_int(v_, name)
    if num_heads <= 0:
        raise ParamInvalidError(f"num_heads: expected a positive int, got {num_heads!r}")
    if num_key_value_heads < 0:
        raise ParamInvalidError(f"num_key_value_heads: expected an int >= 0, got {num_key_value_heads!r}")
    if not isinstance(softmax_lse_flag, bool):
        raise ParamInvalidError(f"softmax_lse_flag: expected a bool, got {softmax_lse_flag!r}")
    heads_kv = num_key_value_heads or num_heads

    # ---- shapes
    qb, q_seq, q_heads, q_dim = _read(query, q_layout, num_heads, "query", "num_heads")
    if block_table is None:
        kb, k_seq, k_heads, k_dim = _read(key, q_layout, heads_kv, "key", "num_key_value_heads")
        vb, v_seq, v_heads, v_dim = _read(value, q_layout, heads_kv, "value", "num_key_value_heads")
    else:
        # PageAttention: key/value are block caches; KV_S (what masks and pse_shift cover) is the table's reach.
        k_cache = cache_shape(key, "key", heads_kv, q_layout)
        v_cache = cache_shape(value, "value", heads_kv, q_layout)
        require(isinstance(block_table, torch.Tensor) and block_table.dim() == 2, "block_table",
                "a 2-D int32 tensor [B, max blocks per sequence]", block_table)
        kb = vb = qb
        k_seq = v_seq = block_table.shape[1] * k_cache.block_size
        k_heads, k_dim, v_heads, v_dim = k_cache.heads, k_cache.dim, v_cache.heads, v_cache.dim
    if q_heads != num_heads:
        raise ParamInvalidError(f"num_heads: expected the query's head count N={q_heads}, got {num_heads}")
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
        batch = qb
        decode = q_seq == 1
    rope = query_rope is not None or key_rope is not None

    # ---- PageAttention (docs/semantics/paged-kv.md)
    pages = None
    if block_table is not None:
        for name, t in (("query_padding_size", query_padding_size), ("kv_padding_size", kv_padding_size),
                        ("key_shared_prefix", key_shared_prefix)):
            _not_supported(name, t, "not supported with PageAttention (block_table)")
        if query.dtype == torch.int8:
            raise ParamInvalidError("query: int8 query/key/value are not supported with PageAttention (block_table)")
        if int8_kv:
            raise ParamInvalidError("key: int8 key/value (anti-quantisation) with PageAttention are not supported "
                                    "yet")
        rule = fia_block_sizes(decode=decode, wide=packed or (rope and q_dim == 512), int8_kv=int8_kv)
        pages = paged_kv(key, value, key_rope if rope else None, block_table, block_size=block_size,
                         kv_lengths=actual_seq_lengths_kv, batch=batch, heads_kv=heads_kv, q_layout=q_layout,
                         rule=rule)
        if packed:
            act_kv_list = list(pages.pages.kv_lengths)
    elif block_size != 0:
        raise ParamInvalidError(f"block_size: only used by PageAttention (with block_table), got {block_size}")
    _not_supported("key_rope_antiquant_scale", key_rope_antiquant_scale, "reserved by the documentation")
    if inner_precise not in (0, 1, 2, 3) or (decode and inner_precise not in (0, 1)):
        raise ParamInvalidError(
            f"inner_precise: expected {'0 or 1 when Q_S = 1' if decode else '0..3'}, got {inner_precise}"
        )
    if input_layout in ("BNSD_BSND", "BNSD_NBSD") and q_seq == 1:
        raise ParamInvalidError(f"input_layout: {input_layout} needs Q_S > 1, got Q_S=1")
    if input_layout == "BNSD_NBSD" and q_seq > 16:
        raise ParamInvalidError(f"input_layout: BNSD_NBSD needs Q_S <= 16, got Q_S={q_seq}")
    if input_layout in ROPE_ONLY_LAYOUTS and not rope:
        raise ParamInvalidError(f"input_layout: {input_layout} is documented for MLA only (query_rope/key_rope)")

    # ---- MLA rope
    # Inputs neither MLA rope nor the packed layouts take.
    rope_and_packed_exclude = (
        ("pse_shift", pse_shift), ("key_shared_prefix", key_shared_prefix),
        ("query_padding_size", query_padding_size), ("kv_padding_size", kv_padding_size),
        ("antiquant_scale", antiquant_scale), ("key_antiquant_scale", key_antiquant_scale),
        ("dequant_scale1", dequant_scale1), ("quant_scale2", quant_scale2),
    )
    if rope:
        if query_rope is None or key_rope is None:
            raise ParamInvalidError("query_rope/key_rope: must be given together")
        require(query_rope.dtype == query.dtype, "query_rope", f"the query's dtype {query.dtype}", query_rope)
        require(key_rope.dtype == query.dtype, "key_rope", f"the query's dtype {query.dtype}", key_rope)
        require(q_dim in MLA_DIMS, "query", f"head dim D in {MLA_DIMS} with query_rope", query)
        exp_q = (*query.shape[:-1], ROPE_DIM if q_layout != "BSH" else num_heads * ROPE_DIM)
        require(tuple(query_rope.shape) == exp_q, "query_rope", f"shape {list(exp_q)} (D={ROPE_DIM})", query_rope)
        exp_k = (*key.shape[:-1], ROPE_DIM if q_layout != "BSH" else heads_kv * ROPE_DIM)
        require(tuple(key_rope.shape) == exp_k, "key_rope", f"shape {list(exp_k)} (D={ROPE_DIM})", key_rope)
        if q_dim == 512:
            require(heads_kv == 1, "num_key_value_heads", "1 for MLA with D=512", heads_kv)
            require(num_heads in (1, 2, 4, 8, 16, 32, 64, 128), "num_heads", "1, 2, 4, ..., 128 for MLA with D=512",
                    num_heads)
            if sparse_mode not in (0, 3, 4):
                raise ParamInvalidError(f"sparse_mode: MLA with D=512 supports 0, 3 and 4, got {sparse_mode}")
            if softmax_lse_flag:
                raise ParamInvalidError("softmax_lse_flag: not supported for MLA with D=512")
        for name, t in rope_and_packed_exclude:
            _not_supported(name, t, "not supported with query_rope/key_rope (MLA)")
    # ---- packed layouts
    if packed:
        if not rope and not (q_dim == v_dim == 128 or (q_dim == 192 and v_dim in (128, 192))):
            raise ParamInvalidError(
                f"query: layout {input_layout} without rope needs D=128 (or D=192 with value D 128/192), got "
                f"query D={q_dim}, value D={v_dim}"
            )
        if rope and q_dim == 128:
            require(v_dim == 128, "value", "head dim 128 with rope", value)
        for name, t in rope_and_packed_exclude:
            _not_supported(name, t, f"not supported with layout {input_layout}")
        if atten_mask is not None and sparse_mode in (0, 1):
            raise ParamInvalidError(
                f"atten_mask: explicit masks (sparse_mode 0/1) with layout {input_layout} are not supported yet; "
                f"use sparse_mode 2, 3 or 4"
            )
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

    # ---- KV anti-quantisation
    separate_given = key_antiquant_scale is not None or value_antiquant_scale is not None \
        or key_antiquant_offset is not None or value_antiquant_offset is not None
    combined_given = antiquant_scale is not None or antiquant_offset is not None
    kv_dims = (batch, heads_kv, k_seq, k_dim)
    antiquant = None
    if int8_kv:
        require(query.dtype in (torch.float16, torch.bfloat16), "query",
                "float16 or bfloat16 with int8 key/value (anti-quantisation)", query)
        if not decode:
            require(query.dtype == torch.float16, "query", "float16 with int8 key/value when Q_S > 1", query)
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
            _not_supported(name, t, "only with int8 key/value and a float16/bfloat16 query")
    for name, mode in (("antiquant_mode", antiquant_mode), ("key_antiquant_mode", key_antiquant_mode),
                       ("value_antiquant_mode", value_antiquant_mode)):
        require_int(mode, name)
        if mode != 0 and antiquant is None:
            raise ParamInvalidError(f"{name}: only with KV anti-quantisation, got {mode}")

    # ---- shared prefix
    prefix = None
    if key_shared_prefix is not None or value_shared_prefix is not None:
        if key_shared_prefix is None or value_shared_prefix is None:
            raise ParamInvalidError("key_shared_prefix/value_shared_prefix: must be given together")
        if query.dtype == torch.int8:
            raise ParamInvalidError("key_shared_prefix: not supported with int8 query/key/value")
        for name, t in (("key_shared_prefix", key_shared_prefix), ("value_shared_prefix", value_shared_prefix)):
            require(isinstance(t, torch.Tensor) and t.dtype == key.dtype and t.dim() == key.dim(), name,
                    f"a {key.dim()}-D tensor of the key's dtype {key.dtype}", t)
            pb, _, ph, pd = _read(t, q_layout, heads_kv, name, "num_key_value_heads")
            require(pb == 1 and ph == heads_kv and pd == k_dim, name,
                    f"batch 1 with the key's N={heads_kv} and D={k_dim}", t)
        p_seq = _read(key_shared_prefix, q_layout, heads_kv, "key_shared_prefix", "")[1]
        require(_read(value_shared_prefix, q_layout, heads_kv, "value_shared_prefix", "")[1] == p_seq,
                "value_shared_prefix", f"the key prefix's S={p_seq}", value_shared_prefix)
        if antiquant is not None and antiquant.per_token:
            raise ParamInvalidError("key_shared_prefix: per-token anti-quantisation of a shared prefix is not "
                                    "supported yet")
        lengths = to_int_list(actual_shared_prefix_len, "actual_shared_prefix_len")
        if lengths is None:
            p_len = p_seq
        else:
            if len(lengths) != 1 or not 0 <= lengths[0] <= p_seq:
                raise ParamInvalidError(
                    f"actual_shared_prefix_len: expected one value in [0, {p_seq}] (the prefix's S), got {lengths}"
                )
            p_len = lengths[0]
        prefix = (key_shared_prefix, value_shared_prefix, p_len)
    elif actual_shared_prefix_len is not None:
        raise ParamInvalidError("actual_shared_prefix_len: only with key_shared_prefix/value_shared_prefix")
    prefix_len = 0 if prefix is None else prefix[2]

    # ---- padding
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

    # ---- outputs
    out = torch.zeros(_output_shape(out_layout, batch, q_seq, num_heads, v_dim), dtype=plan.output_dtype,
                      device=query.device)
    if softmax_lse_flag:
        lse_shape = (q_seq, num_heads, 1) if packed else (batch, num_heads, q_seq, 1)
        lse = torch.full(lse_shape, INVALID_LSE, dtype=torch.float32, device=query.device)
    else:
        lse = torch.zeros(1, dtype=torch.float32, device=query.device)
    if query.numel() == 0:
        return out, lse

    q_in = torch.cat([query, query_rope], dim=-1) if rope and q_layout != "BSH" else query
    if rope and q_layout == "BSH":
        q_in = torch.cat([query.view(*query.shape[:-1], num_heads, q_dim),
                          query_rope.view(*query.shape[:-1], num_heads, ROPE_DIM)], -1).flatten(-2)
    if packed or pages is not None:
        k_all, v_all = key, value
    else:
        k_all, v_all = kv_bnsd(key, value, kv_layout=q_layout, heads_kv=heads_kv, query_dtype=query.dtype,
                               antiquant=antiquant, prefix=prefix, key_rope=key_rope)
    scale_value = float(scale)
    common = {"heads_kv": heads_kv, "scale": scale_value, "sparse_mode": mode, "pre_tokens": pre,
              "next_tokens": nxt, "plan": plan, "backend": backend, "op": "fused_infer_attention_score"}

    if packed:
        q_starts, kv_starts = starts_of(act_q_list), starts_of(act_kv_list)
        for b in range(batch):
            sq, skv = act_q_list[b], act_kv_list[b]
            if pages is not None:
                k_b, v_b = pages.group_bnsd(range(b, b + 1))
            else:
                k_b = _packed_rows(k_all, q_layout, kv_starts[b], skv)
                if rope:
                    k_b = torch.cat([k_b, _packed_rows(key_rope, q_layout, kv_starts[b], skv)], dim=-1)
                v_b = _packed_rows(v_all, q_layout, kv_starts[b], skv)
            q_b = _packed_rows(q_in, q_layout, q_starts[b], sq)
            out_b = _packed_rows(out, out_layout, q_starts[b], sq)
            lse_b = _packed_rows(lse, "TND", q_starts[b], sq) if softmax_lse_flag else None
            attend(q_b, k_b, v_b, out_b, atten_mask=mask,
                   mask_views=None, act_q=[sq], act_kv=[skv], pse_shift=None, softmax_lse=lse_b, **common)
        return out, lse

    q4 = _bnsd(q_in, q_layout, num_heads)
    out4 = _bnsd(out, out_layout, num_heads)
    lse4 = lse if softmax_lse_flag else None
    if pages is not None:
        k_view, v_view = pages.cache_views()
        # In place through the table where a kernel can (Triton, the reference decode loop); rope keys need the
        # key ++ rope rows assembled, so MLA gathers.
        if key_rope is None and attend_paged(
                q4, k_view, v_view, out4, block_table=pages.pages.table.to(query.device), atten_mask=mask,
                mask_views=mask_views, act_q=act_q_list, act_kv=act_kv_list, pse_shift=pse_shift,
                softmax_lse=lse4, **common):
            return out, lse
        # Per group of equal-length sequences (the attention's own batched runs): only their tokens are gathered.
        workspace = Workspace(query.device)
        for group in length_groups(act_q_list, act_kv_list):
            g = slice(group.start, group.stop)
            k_g, v_g = pages.group_bnsd(group, workspace)
            pse_g = None if pse_shift is None else pses.batch_rows(pse_shift, group.start, len(group))
            attend(q4[g], k_g, v_g, out4[g], atten_mask=mask, mask_views=None if mask_views is None else mask_views[g],
                   act_q=act_q_list[g], act_kv=act_kv_list[g], pse_shift=pse_g,
                   softmax_lse=None if lse4 is None else lse4[g], **common)
        return out, lse
    if not left_padding:
        attend(q4, k_all, v_all, out4, atten_mask=mask, mask_views=mask_views, act_q=act_q_list,
               act_kv=[a + prefix_len for a in act_kv_list], pse_shift=pse_shift, softmax_lse=lse4, **common)
        return out, lse
    # Left padding: each batch's valid rows end `padding` positions before S; masks and pse_shift are read at the
    # same positions as the data.
    for b in range(batch):
        sq, skv = act_q_list[b], act_kv_list[b]
        q_end = q_seq - (q_pad or 0) if q_pad is not None else sq
        kv_end = k_seq - kv_pad if kv_pad is not None else skv
        q0, kv0 = q_end - sq, kv_end - skv
        if q_pad is not None and q0 < 0:
            raise ParamInvalidError(f"query_padding_size: batch {b} starts at Q_S - padding - actual length = {q0} "
                                    f"< 0")
        if kv0 < 0 or kv_end < 0:
            if decode:
                continue  # the documentation: a negative start or end returns zeros when Q_S = 1
            raise ParamInvalidError(f"kv_padding_size: batch {b} starts at KV_S - padding - actual length = {kv0} "
                                    f"< 0")
        views = None if mask_views is None else [mask_views[b][..., q0:q_end, kv0:kv_end]]
        pse_b = None
        if pse_shift is not None:
            pse_b = pses.batch_rows(pse_shift, b, 1)[:, :, q0:q_end, kv0:kv_end]
        attend(q4[b : b + 1, :, q0:q_end], k_all[b : b + 1, :, kv0:kv_end], v_all[b : b + 1, :, kv0:kv_end],
               out4[b : b + 1, :, q0:q_end], atten_mask=mask,
               mask_views=views, act_q=[sq], act_kv=[skv], pse_shift=pse_b,
               softmax_lse=None if lse4 is None else lse4[b : b + 1, :, q0:q_end], **common)
    return out, lse


def renamed_errors(names: dict[str, str]):
    """A context manager that rewrites the parameter names leading a ParamInvalidError / ParamNullptrError message
    ("a/b: ...") from FIA's v1 spelling to a sibling operator's (v2, IncreFlashAttention)."""
    @contextlib.contextmanager
    def rename():
        try:
            yield
        except (ParamInvalidError, ParamNullptrError) as exc:
            message = exc.message
            head, sep, tail = message.partition(": ")
            if sep and " " not in head:
                head = "/".join(names.get(part, part) for part in head.split("/"))
                raise type(exc)(head + sep + tail) from None
            raise

    return rename()


# v1 parameter -> v2 parameter, for error messages.
V2_NAMES = {
    "actual_seq_lengths": "actual_seq_qlen", "actual_seq_lengths_kv": "actual_seq_kvlen",
    "key_antiquant_scale": "dequant_scale_key", "key_antiquant_offset": "dequant_offset_key",
    "value_antiquant_scale": "dequant_scale_value", "value_antiquant_offset": "dequant_offset_value",
    "key_antiquant_mode": "key_quant_mode", "value_antiquant_mode": "value_quant_mode",
    "quant_scale2": "quant_scale_out", "quant_offset2": "quant_offset_out", "num_heads": "num_query_heads",
    "scale": "softmax_scale", "softmax_lse_flag": "return_softmax_lse",
}
V2_RESERVED = ("dequant_scale_key_rope", "quant_scale_p", "query_dtype", "key_dtype", "value_dtype",
               "query_rope_dtype", "key_rope_dtype", "key_shared_prefix_dtype", "value_shared_prefix_dtype",
               "dequant_scale_query_dtype", "dequant_scale_key_dtype", "dequant_scale_value_dtype",
               "dequant_scale_key_rope_dtype")


@traced_as_custom_op
def fused_infer_attention_score_v2(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    block_table: torch.Tensor | None = None,
    dequant_scale_query: torch.Tensor | None = None,
    dequant_scale_key: torch.Tensor | None = None,
    dequant_offset_key: torch.Tensor | None = None,
    dequant_scale_value: torch.Tensor | None = None,
    dequant_offset_value: torch.Tensor | None = None,
    dequant_scale_key_rope: torch.Tensor | None = None,
    quant_scale_out: torch.Tensor | None = None,
    quant_offset_out: torch.Tensor | None = None,
    quant_scale_p: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    softmax_scale: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    input_layout: str = "BSH",
    sparse_mode: int = 0,
    block_size: int = 0,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    value_quant_mode: int = 0,
    inner_precise: int = 0,
    return_softmax_lse: bool = False,
    query_dtype: int | None = None,
    key_dtype: int | None = None,
    value_dtype: int | None = None,
    query_rope_dtype: int | None = None,
    key_rope_dtype: int | None = None,
    key_shared_prefix_dtype: int | None = None,
    value_shared_prefix_dtype: int | None = None,
    dequant_scale_query_dtype: int | None = None,
    dequant_scale_key_dtype: int | None = None,
    dequant_scale_value_dtype: int | None = None,
    dequant_scale_key_rope_dtype: int | None = None,
    out_dtype: int | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu's npu_fused_infer_attention_score_v2 argument set over the same computation as
    `fused_infer_attention_score` (docs/operators/fused_infer_attention_score.md, "v2"): the KV anti-quantisation
    factors are `dequant_scale_key` / `dequant_offset_key` / `dequant_scale_value` / `dequant_offset_value` with
    `key_quant_mode` / `value_quant_mode`; int8 output is `quant_scale_out` (+ `quant_offset_out`). Full int8/FP8
    quantisation (`dequant_scale_query`, `query_quant_mode`), `learnable_sink`, `out_dtype`, sparse_mode 9 and the
    reserved parameters raise ParamInvalidError (not supported yet / reserved)."""
    reserved = {"dequant_scale_key_rope": dequant_scale_key_rope, "quant_scale_p": quant_scale_p,
                "query_dtype": query_dtype, "key_dtype": key_dtype, "value_dtype": value_dtype,
                "query_rope_dtype": query_rope_dtype, "key_rope_dtype": key_rope_dtype,
                "key_shared_prefix_dtype": key_shared_prefix_dtype,
                "value_shared_prefix_dtype": value_shared_prefix_dtype,
                "dequant_scale_query_dtype": dequant_scale_query_dtype,
                "dequant_scale_key_dtype": dequant_scale_key_dtype,
                "dequant_scale_value_dtype": dequant_scale_value_dtype,
                "dequant_scale_key_rope_dtype": dequant_scale_key_rope_dtype}
    for name, given in reserved.items():
        if given is not None:
            raise ParamInvalidError(f"{name}: reserved by the documentation (leave it None), got {given!r}")
    _not_supported("learnable_sink", learnable_sink)
    _not_supported("dequant_scale_query", dequant_scale_query, "full quantisation of the query is not supported yet")
    if out_dtype is not None:
        raise ParamInvalidError(f"out_dtype: not supported yet, got {out_dtype!r}")
    if query_quant_mode != 0:
        raise ParamInvalidError(f"query_quant_mode: query quantisation is not supported yet, got {query_quant_mode!r}")
    if sparse_mode == 9:
        raise ParamInvalidError("sparse_mode: 9 (tree mask) is not supported yet")
    if isinstance(query, torch.Tensor) and query.dtype == torch.int8:
        raise ParamInvalidError("query: int8 full quantisation through v2 is not supported yet")
    with renamed_errors(V2_NAMES):
        return fused_infer_attention_score(
            query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, actual_seq_lengths=actual_seq_qlen,
            actual_seq_lengths_kv=actual_seq_kvlen, quant_scale2=quant_scale_out, quant_offset2=quant_offset_out,
            key_antiquant_scale=dequant_scale_key, key_antiquant_offset=dequant_offset_key,
            value_antiquant_scale=dequant_scale_value, value_antiquant_offset=dequant_offset_value,
            block_table=block_table, query_rope=query_rope, key_rope=key_rope, num_heads=num_query_heads,
            scale=softmax_scale, pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
            num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode, inner_precise=inner_precise,
            block_size=block_size, key_antiquant_mode=key_quant_mode, value_antiquant_mode=value_quant_mode,
            softmax_lse_flag=return_softmax_lse, backend=backend,
        )
