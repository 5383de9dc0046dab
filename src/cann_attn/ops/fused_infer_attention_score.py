"""FusedInferAttentionScore (torch_npu.npu_fused_infer_attention_score, v1 and v2) and IncreFlashAttention
(docs/operators/fused_infer_attention_score.md, docs/operators/incre_flash_attention.md).

One operator for prefill (Q_S > 1, the PromptFlashAttention branch) and decode (Q_S = 1, the IncreFlashAttention
branch). `fia_problem.build_fia_problem` validates a call and describes it; this module allocates the outputs and
dispatches the description to the one dense computation of PromptFlashAttention (`infer_attention.attend`): FIA
called with PFA's arguments builds the same problem and gives the same bits. v2 and IncreFlashAttention are
renamings of v1's parameters.

Key/value reach the computation through one function, `kv_bnsd`; a paged cache (`block_table`, PageAttention)
is gathered instead by `paged_infer.PagedKv`, per group of sequences the attention computes together
(docs/semantics/paged-kv.md).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace

import torch

from ..errors import ParamInvalidError, ParamNullptrError, describe
from ..problem import antiquant as antiquants
from ..problem import layout as layouts
from ..problem import pse as pses
from ..problem.lengths import starts_of
from ..traceable import traced_as_custom_op
from .fia_problem import (
    DECODE_EMPTY_BATCH_LSE,
    FIA_LAYOUTS,
    PACKED,
    ROPE_DIM,
    SCALAR_TYPE_NUMBERS,
    FiaProblem,
    build_fia_problem,
    not_supported,
)
from .fia_problem import output_shape as _output_shape
from .flash_attention_score import INT_MAX
from .infer_attention import INVALID_LSE, attend, attend_paged, attend_pages

__all__ = ["FIA_LAYOUTS", "PACKED", "fused_infer_attention_score", "fused_infer_attention_score_v2", "kv_bnsd",
           "renamed_errors"]


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
    """(attention_out, softmax_lse) of softmax(scale * Q K^T + pse_shift, masked) V
    (docs/operators/fused_infer_attention_score.md). Q_S > 1 follows PromptFlashAttention (sparse_mode 0..4,
    pre/next tokens, actual lengths, int8 full and output quantisation); Q_S = 1 is decode: sparse_mode,
    pre/next_tokens and (outside TND) actual_seq_lengths have no effect, and the mask may be [B, KV_S].
    softmax_lse: [B, N, Q_S, 1] float32 (TND/NTD_TND: [T, N, 1]), +inf for rows that see no key
    (docs/semantics/invalid-rows.md); without softmax_lse_flag a [1] zero tensor."""
    params = dict(locals())
    del params["backend"]
    return _run(params, backend)


def _run(params: dict, backend: str, latent: antiquants.PagedLatent | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate (v1 parameter names, plus v2's learnable_sink / out_dtype), allocate the outputs, dispatch.
    `latent`: the int8 MLA query's paged latent, whose float32 pool views the params' key / value / key_rope are."""
    problem = build_fia_problem(**params)
    if latent is not None:
        problem = replace(problem, int8_latent=latent)
    query = problem.query
    out = torch.zeros(_output_shape(problem.out_layout, problem.batch, problem.q_seq, problem.num_heads,
                                    problem.v_dim), dtype=problem.plan.output_dtype, device=query.device)
    if problem.softmax_lse_flag:
        lse_shape = ((problem.q_seq, problem.num_heads, 1) if problem.packed
                     else (problem.batch, problem.num_heads, problem.q_seq, 1))
        lse = torch.full(lse_shape, INVALID_LSE, dtype=torch.float32, device=query.device)
    else:
        lse = torch.zeros(1, dtype=torch.float32, device=query.device)
    if query.numel() > 0:
        _dispatch(problem, out, lse if problem.softmax_lse_flag else None, backend)
    if problem.softmax_lse_flag and problem.decode:
        for b in _keyless_decode_batches(problem):
            lse[b] = DECODE_EMPTY_BATCH_LSE
    return out, lse


def _keyless_decode_batches(p: FiaProblem) -> list[int]:
    """Q_S = 1 batches without any key (key length 0 and no prefix, or a left-padded window outside the cache):
    the decode kernel writes them zeros and DECODE_EMPTY_BATCH_LSE (docs/semantics/invalid-rows.md)."""
    empty = []
    for b in range(p.batch):
        _, _, kv0, kv_end = p.padded_window(b)
        if kv0 < 0 or kv_end < 0 or p.act_kv[b] + p.prefix_len == 0:
            empty.append(b)
    return empty


def _query_with_rope(p: FiaProblem) -> torch.Tensor:
    """The query with query_rope appended to each head's D (MLA), else the query."""
    if p.query_rope is None:
        return p.query
    if p.q_layout != "BSH":
        return torch.cat([p.query, p.query_rope], dim=-1)
    lead = p.query.shape[:-1]
    return torch.cat([p.query.view(*lead, p.num_heads, p.q_dim),
                      p.query_rope.view(*lead, p.num_heads, ROPE_DIM)], -1).flatten(-2)


def _dispatch(p: FiaProblem, out: torch.Tensor, lse: torch.Tensor | None, backend: str) -> None:
    """Fill `out` (and `lse`) for a validated problem: packed sequences one by one, paged caches in place or per
    group of equal lengths, left-padded batches one by one, int8/int4 decode in the loop that anti-quantises as it
    reads, everything else in one `attend`."""
    common = {"heads_kv": p.heads_kv, "scale": p.scale, "sparse_mode": p.sparse_mode, "pre_tokens": p.pre_tokens,
              "next_tokens": p.next_tokens, "plan": p.plan, "backend": backend, "op": "fused_infer_attention_score",
              "inner_precise": p.inner_precise, "decode": p.decode}
    if p.sink is not None:
        common["sink"] = p.sink
    q_in = _query_with_rope(p)
    if p.int8_latent is not None:
        if _attend_int8_latent(p, q_in, out, lse, common):
            return
        p = p.with_latent_converted()
    if _attend_int8_decode(p, q_in, out, lse, common):
        return
    p = p.with_int4_unpacked()
    if p.packed:
        _attend_packed(p, q_in, out, lse, common)
    elif p.pages is not None:
        attend_pages(p.pages, _bnsd(q_in, p.q_layout, p.num_heads), _bnsd(out, p.out_layout, p.num_heads),
                     atten_mask=p.atten_mask, mask_views=p.mask_views, act_q=p.act_q, act_kv=p.act_kv,
                     pse_shift=p.pse_shift, softmax_lse=lse, antiquant=p.antiquant, **common)
    else:
        k_all, v_all = kv_bnsd(p.key, p.value, kv_layout=p.q_layout, heads_kv=p.heads_kv,
                               query_dtype=p.query.dtype, antiquant=p.antiquant, prefix=p.prefix,
                               key_rope=p.key_rope)
        q4, out4 = _bnsd(q_in, p.q_layout, p.num_heads), _bnsd(out, p.out_layout, p.num_heads)
        if p.left_padding:
            _attend_left_padded(p, q4, k_all, v_all, out4, lse, common)
        else:
            attend(q4, k_all, v_all, out4, atten_mask=p.atten_mask, mask_views=p.mask_views, act_q=p.act_q,
                   act_kv=[a + p.prefix_len for a in p.act_kv], pse_shift=p.pse_shift, softmax_lse=lse, **common)


def _attend_int8_decode(p: FiaProblem, q_in: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                        common: dict) -> bool:
    """Decode over contiguous int8 key/value with per-channel (per-tensor, per-head) factors: the reference
    decode loop anti-quantises each key row as it reads it (problem/antiquant.py's rule), instead of a
    dequantised copy of the whole cache. False, computing nothing, where it does not apply."""
    if (p.antiquant is None or not p.decode or p.pages is not None or p.prefix is not None or p.left_padding
            or p.rope):
        return False
    scales = p.antiquant.channel_scales(p.heads_kv, p.q_dim, p.v_dim)
    if scales is None:
        return False
    # int4: the packed int32 words as bytes (two values a byte, value 2k in the low nibble on little-endian hosts).
    key, value = p.int4_packed if p.int4_packed is not None else (p.key, p.value)
    if p.int4_packed is not None:
        if sys.byteorder != "little":
            return False
        key, value = key.view(torch.int8), value.view(torch.int8)
    k4, v4 = _bnsd(key, p.q_layout, p.heads_kv), _bnsd(value, p.q_layout, p.heads_kv)
    return attend_paged(
        _bnsd(q_in, p.q_layout, p.num_heads), k4, v4, _bnsd(out, p.out_layout, p.num_heads), block_table=None,
        atten_mask=p.atten_mask, mask_views=p.mask_views, act_q=p.act_q, act_kv=p.act_kv, pse_shift=p.pse_shift,
        softmax_lse=lse, kv_scales=scales, packed_int4=p.int4_packed is not None, **common)


def _attend_int8_latent(p: FiaProblem, q_in: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                        common: dict) -> bool:
    """The int8 MLA query's decode (one query token per sequence) over its int8 latent (paged, or contiguous as
    pages of one token): the decode loop reads the int8 pages in place through the table and scores the int8 query
    rows against them, exact integer dot products plus the rope's (problem/antiquant.py's Int8QueryRows), the values
    x * scale in fp32 as it reads each row, instead of converting every block the table names first. False,
    computing nothing, where it does not apply (the caller converts the pool then)."""
    if p.prefix is not None or p.left_padding or any(sq != 1 for sq in p.act_q):
        return False
    latent = p.int8_latent
    key, value, key_rope = latent.loop_caches()
    table = latent.block_table if p.pages is not None else _token_table(p, key.shape[0])
    lse_rows = lse
    if p.packed:
        def rows(t: torch.Tensor) -> torch.Tensor:
            return _token_rows(t, p.q_layout)
        lse_rows = None if lse is None else lse.unsqueeze(2)
        out4 = _token_rows(out, p.out_layout)
    else:
        def rows(t: torch.Tensor) -> torch.Tensor:
            return _bnsd(t, p.q_layout, p.num_heads)
        out4 = _bnsd(out, p.out_layout, p.num_heads)
    return attend_paged(rows(q_in), key, value, out4, block_table=table.to(q_in.device),
                        atten_mask=p.atten_mask, mask_views=None if p.packed else p.mask_views, act_q=p.act_q,
                        act_kv=p.act_kv, pse_shift=None if p.packed else p.pse_shift, softmax_lse=lse_rows,
                        kv_scales=latent.channel_scales(), key_rope=key_rope,
                        int8_query=latent.query_rows(p.scale, rows), **common)


def _token_table(p: FiaProblem, tokens: int) -> torch.Tensor:
    """A block table over contiguous caches seen as blocks of one token (int32 [B, max Skv]): sequence b's key p is
    token start_b + p (packed sequences follow each other; others are S tokens apart). Past a sequence's length,
    token 0 (never read)."""
    starts = starts_of(p.act_kv) if p.packed else [b * (tokens // p.batch) for b in range(p.batch)]
    width = max([1, *p.act_kv])
    table = torch.zeros(p.batch, width, dtype=torch.int32)
    for b, (start, n) in enumerate(zip(starts, p.act_kv, strict=True)):
        table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
    return table


def _token_rows(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A TND / NTD tensor of one token per sequence as its [T, N, 1, D] batch."""
    return (t if layout == "TND" else t.transpose(0, 1)).unsqueeze(2)


def _attend_packed(p: FiaProblem, q_in: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                   common: dict) -> None:
    """TND / NTD: each sequence's rows as a [1, N, S, D] view."""
    if _attend_packed_decode(p, q_in, out, lse, common):
        return
    q_starts, kv_starts = starts_of(p.act_q), starts_of(p.act_kv)
    for b in range(p.batch):
        sq, skv = p.act_q[b], p.act_kv[b]
        if p.pages is not None:
            k_b, v_b = p.pages.group_bnsd(range(b, b + 1))
        else:
            k_b = _packed_rows(p.key, p.q_layout, kv_starts[b], skv)
            if p.rope:
                k_b = torch.cat([k_b, _packed_rows(p.key_rope, p.q_layout, kv_starts[b], skv)], dim=-1)
            v_b = _packed_rows(p.value, p.q_layout, kv_starts[b], skv)
        q_b = _packed_rows(q_in, p.q_layout, q_starts[b], sq)
        out_b = _packed_rows(out, p.out_layout, q_starts[b], sq)
        lse_b = None if lse is None else _packed_rows(lse, "TND", q_starts[b], sq)
        attend(q_b, k_b, v_b, out_b, atten_mask=p.atten_mask, mask_views=None, act_q=[sq], act_kv=[skv],
               pse_shift=None, softmax_lse=lse_b, page_size=0 if p.pages is None else p.pages.shape.block_size,
               **common)


def _attend_packed_decode(p: FiaProblem, q_in: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                          common: dict) -> bool:
    """One query token per sequence over paged MLA caches: the T tokens as a [T, N, 1, D] batch that the decode
    loop reads in place through the table (latent and rope rows joined as it reads them), the loop each sequence
    would take alone (the same bits as gathering it). False, computing nothing, where it does not apply."""
    if p.pages is None or p.key_rope is None or p.antiquant is not None or any(sq != 1 for sq in p.act_q):
        return False
    return attend_paged(_token_rows(q_in, p.q_layout), *p.pages.loop_caches(), _token_rows(out, p.out_layout),
                        block_table=p.pages.pages.table.to(q_in.device), atten_mask=p.atten_mask, mask_views=None,
                        act_q=p.act_q, act_kv=p.act_kv, pse_shift=None,
                        softmax_lse=None if lse is None else lse.unsqueeze(2),
                        key_rope=p.pages.loop_caches(rope=True), **common)


def _attend_left_padded(p: FiaProblem, q4, k_all, v_all, out4, lse4, common: dict) -> None:
    """Left padding: each batch's valid rows end `padding` positions before S; masks and pse_shift are read at the
    same positions as the data."""
    for b in range(p.batch):
        sq, skv = p.act_q[b], p.act_kv[b]
        q0, q_end, kv0, kv_end = p.padded_window(b)
        if kv0 < 0 or kv_end < 0:
            continue  # Q_S = 1 (the builder rejects it otherwise): the documentation gives zeros
        views = None if p.mask_views is None else [p.mask_views[b][..., q0:q_end, kv0:kv_end]]
        pse_b = None
        if p.pse_shift is not None:
            pse_b = pses.batch_rows(p.pse_shift, b, 1)[:, :, q0:q_end, kv0:kv_end]
        attend(q4[b : b + 1, :, q0:q_end], k_all[b : b + 1, :, kv0:kv_end], v_all[b : b + 1, :, kv0:kv_end],
               out4[b : b + 1, :, q0:q_end], atten_mask=p.atten_mask,
               mask_views=views, act_q=[sq], act_kv=[skv], pse_shift=pse_b,
               softmax_lse=None if lse4 is None else lse4[b : b + 1, :, q0:q_end], **common)


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
def _int8_query_out_dtype(out_dtype, rope_dtype: torch.dtype) -> torch.dtype:
    """The int8 MLA query's output is the rope dtype ("输出为bfloat16"); out_dtype may only restate it."""
    if out_dtype is not None and out_dtype not in (rope_dtype, SCALAR_TYPE_NUMBERS[rope_dtype]):
        raise ParamInvalidError(f"out_dtype: an int8 query outputs query_rope's dtype {rope_dtype}, got {out_dtype!r}")
    return rope_dtype


def _check_dtype_code(name: str, code, tensor) -> None:
    """`*_dtype` (reserved by the documentation) may only restate its tensor's dtype, as a torch.dtype or its
    c10::ScalarType number (what op-plugin receives); anything else would ask for a reinterpretation the pages do
    not define."""
    if code is None:
        return
    number = SCALAR_TYPE_NUMBERS.get(code) if isinstance(code, torch.dtype) else code
    own = SCALAR_TYPE_NUMBERS.get(tensor.dtype) if isinstance(tensor, torch.Tensor) else None
    if isinstance(number, bool) or not isinstance(number, int) or own is None or number != own:
        given = describe(tensor) if isinstance(tensor, torch.Tensor) else "no tensor"
        raise ParamInvalidError(f"{name}: reserved by the documentation; only its tensor's own dtype is accepted "
                                f"({given}), got {code!r}")


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
    out_dtype: int | torch.dtype | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu's npu_fused_infer_attention_score_v2 argument set over the same computation as
    `fused_infer_attention_score` (docs/operators/fused_infer_attention_score.md, "v2"): the KV anti-quantisation
    factors are `dequant_scale_key` / `dequant_offset_key` / `dequant_scale_value` / `dequant_offset_value` with
    `key_quant_mode` / `value_quant_mode`; int8 output is `quant_scale_out` (+ `quant_offset_out`), `out_dtype` (a
    torch.dtype or its ScalarType number) the output dtype it names; `learnable_sink` (bfloat16 [Q_N], TND /
    NTD_TND) one extra softmax logit per query head (docs/semantics/sinks.md). Full int8/FP8 quantisation
    (`dequant_scale_query`, `query_quant_mode`), sparse_mode 9 and the reserved parameters raise ParamInvalidError
    (not supported yet / reserved)."""
    named_dtypes = {"query_dtype": (query_dtype, query), "key_dtype": (key_dtype, key),
                    "value_dtype": (value_dtype, value), "query_rope_dtype": (query_rope_dtype, query_rope),
                    "key_rope_dtype": (key_rope_dtype, key_rope),
                    "dequant_scale_query_dtype": (dequant_scale_query_dtype, dequant_scale_query),
                    "dequant_scale_key_dtype": (dequant_scale_key_dtype, dequant_scale_key),
                    "dequant_scale_value_dtype": (dequant_scale_value_dtype, dequant_scale_value)}
    for name, (code, tensor) in named_dtypes.items():
        _check_dtype_code(name, code, tensor)
    reserved = {"dequant_scale_key_rope": dequant_scale_key_rope,
                "key_shared_prefix_dtype": key_shared_prefix_dtype,
                "value_shared_prefix_dtype": value_shared_prefix_dtype,
                "dequant_scale_key_rope_dtype": dequant_scale_key_rope_dtype}
    for name, given in reserved.items():
        if given is not None:
            raise ParamInvalidError(f"{name}: reserved by the documentation (leave it None), got {given!r}")
    not_supported("quant_scale_p", quant_scale_p, "reserved (the documentation gives it no meaning)")
    if sparse_mode == 9:
        raise ParamInvalidError("sparse_mode: 9 (tree mask) is not supported yet")
    int8_query = isinstance(query, torch.Tensor) and query.dtype == torch.int8
    quantised_out_dtype = latent = None
    if int8_query or query_quant_mode != 0 or dequant_scale_query is not None:
        if query_quant_mode != 0 and (isinstance(query_quant_mode, bool)
                                      or query_quant_mode not in antiquants.QUERY_QUANT_MODES):
            raise ParamInvalidError(f"query_quant_mode: only 3 (per-token per-head, int8 MLA query) is documented, "
                                    f"got {query_quant_mode!r}")
        if not int8_query:
            param = "query_quant_mode" if query_quant_mode else "dequant_scale_query"
            raise ParamInvalidError(f"{param}: full quantisation of the query (query_quant_mode 3 with "
                                    f"dequant_scale_query) needs an int8 query, got {describe(query)}")
        if query_quant_mode == 0:
            raise ParamInvalidError("query_quant_mode: an int8 query takes 3 (per-token per-head), got 0")
        if dequant_scale_query is None:
            raise ParamNullptrError("dequant_scale_query: an int8 query needs its per-token per-head scales")
        for name, given in (("dequant_offset_key", dequant_offset_key), ("dequant_offset_value", dequant_offset_value),
                            ("quant_scale_out", quant_scale_out), ("quant_offset_out", quant_offset_out)):
            not_supported(name, given, "not supported with an int8 query (full quantisation)")
        quantised = antiquants.dequantise_mla_query(
            query, key, value, query_rope=query_rope, key_rope=key_rope, dequant_scale_query=dequant_scale_query,
            dequant_scale_key=dequant_scale_key, dequant_scale_value=dequant_scale_value,
            key_quant_mode=key_quant_mode, value_quant_mode=value_quant_mode, input_layout=input_layout,
            num_heads=num_query_heads, block_table=block_table)
        query, key, value, latent = quantised.query, quantised.key, quantised.value, quantised.latent
        query_rope, key_rope = quantised.query_rope, quantised.key_rope
        dequant_scale_key = dequant_scale_value = None
        key_quant_mode = value_quant_mode = 0
        quantised_out_dtype = _int8_query_out_dtype(out_dtype, quantised.out_dtype)
        out_dtype = None
    elif antiquants.PAGED_TOKEN_MODE in (key_quant_mode, value_quant_mode):
        if not isinstance(query, torch.Tensor) or query.dtype not in (torch.float16, torch.bfloat16):
            raise ParamInvalidError(f"query: key_quant_mode 4 needs a float16 or bfloat16 query, got {describe(query)}")
        key, value = antiquants.dequantise_paged_tokens(
            key, value, query_dtype=query.dtype, block_table=block_table, dequant_scale_key=dequant_scale_key,
            dequant_scale_value=dequant_scale_value, dequant_offset_key=dequant_offset_key,
            dequant_offset_value=dequant_offset_value, key_quant_mode=key_quant_mode,
            value_quant_mode=value_quant_mode)
        dequant_scale_key = dequant_scale_value = None
        key_quant_mode = value_quant_mode = 0
    elif isinstance(key, torch.Tensor) and key.dtype == torch.float8_e4m3fn:
        raise ParamInvalidError(f"key_quant_mode: a float8_e4m3fn cache takes 4 (per-token scales over a paged "
                                f"cache) for key and value, got {key_quant_mode!r} and {value_quant_mode!r}")
    with renamed_errors(V2_NAMES):
        out, lse = _run(dict(
            query=query, key=key, value=value, pse_shift=pse_shift, atten_mask=atten_mask,
            actual_seq_lengths=actual_seq_qlen,
            actual_seq_lengths_kv=actual_seq_kvlen, quant_scale2=quant_scale_out, quant_offset2=quant_offset_out,
            key_antiquant_scale=dequant_scale_key, key_antiquant_offset=dequant_offset_key,
            value_antiquant_scale=dequant_scale_value, value_antiquant_offset=dequant_offset_value,
            block_table=block_table, query_rope=query_rope, key_rope=key_rope, num_heads=num_query_heads,
            scale=softmax_scale, pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
            num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode, inner_precise=inner_precise,
            block_size=block_size, key_antiquant_mode=key_quant_mode, value_antiquant_mode=value_quant_mode,
            softmax_lse_flag=return_softmax_lse, learnable_sink=learnable_sink, out_dtype=out_dtype,
        ), backend, latent)
    rounded = quantised_out_dtype if int8_query else None
    return (out, lse) if rounded is None else (out.to(rounded), lse)

