"""What PromptFlashAttentionV2, FusedInferAttentionScore and IncreFlashAttention share: mask, pse_shift and int8
validation, the per-sequence runs, and `attend`, the one dense computation they all dispatch to
(docs/operators/prompt_flash_attention.md, docs/operators/fused_infer_attention_score.md).

Everything here works on [B, N, S, D] views; the operators read their own layouts and lengths first.
"""

from __future__ import annotations

import torch

from ..backends import kernels, resolve_backend, select_backend
from ..backends.reference import decode_forward, flash_forward, npu_attention, quant_attention
from ..backends.reference.workspace import Workspace
from ..backends.triton.dense_plan import dense_unsupported
from ..errors import ParamInvalidError, describe, require
from ..problem import antiquant as antiquants
from ..problem import mask as masks
from ..problem import precision, quant, stats
from ..problem import sink as sinks
from ..problem.attention import AttentionProblem, Run, mask_runs
from ..problem.pse import SequencePse, batch_rows
from ..problem.stats import FLT_MAX, STAT_WIDTH
from .paged_infer import PagedKv, length_groups

MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
# PromptFlashAttention's documented shape limits, which FIA's prefill branch keeps
# (docs/operators/prompt_flash_attention.md, docs/operators/fused_infer_attention_score.md).
MAX_BATCH, MAX_HEADS, MAX_HEAD_DIM, MAX_GROUP = 65536, 256, 512, 64
MAX_BATCH_UNALIGNED, MAX_HIDDEN = 128, 65535


def validate_mask(atten_mask, sparse_mode, batch, heads, seq_q, seq_kv, pre_tokens, next_tokens):
    """Per-batch explicit mask views [Nm, Q_S, KV_S] for modes 0/1, None otherwise (modes 2..4 generate)."""
    if atten_mask is None:
        if sparse_mode in (1, 2, 3, 4):
            raise ParamInvalidError(f"atten_mask: required for sparse_mode {sparse_mode}, got None")
        return None
    require(isinstance(atten_mask, torch.Tensor), "atten_mask", "a torch.Tensor", atten_mask)
    masks.check_mask_dtype(atten_mask, MASK_DTYPES)
    if sparse_mode in (2, 3, 4):
        if atten_mask.dim() in (3, 4) and all(d == 1 for d in atten_mask.shape[:-2]):
            squeezed = atten_mask.reshape(atten_mask.shape[-2:])
        else:
            squeezed = atten_mask
        masks.validate_compressed_mask(squeezed, sparse_mode)
        if sparse_mode == 4:
            masks.check_band(pre_tokens, next_tokens)
        return None
    if sparse_mode == 0:
        masks.check_band(pre_tokens, next_tokens)
    # The mask may be padded beyond (Q_S, KV_S) (the PromptFlashAttentionV2 documentation recommends padding KV_S to
    # 32 with ones): only its
    # top-left block is read.
    rows, cols = atten_mask.shape[-2:] if atten_mask.dim() >= 2 else (0, 0)
    if rows < seq_q or cols < seq_kv or atten_mask.dim() > 4:
        raise ParamInvalidError(
            f"atten_mask: the last two dims must cover [Q_S, KV_S]=[{seq_q}, {seq_kv}], got {describe(atten_mask)}"
        )
    shape = tuple(atten_mask.shape)
    if len(shape) == 3 and shape[0] == batch and batch != 1:
        return [atten_mask[b].unsqueeze(0) for b in range(batch)]
    return masks.explicit_mask_views(atten_mask, batch, heads, rows, cols)


def validate_pse_shift(pse_shift, query, batch, heads, seq_q, seq_kv) -> None:
    if pse_shift is None:
        return
    require(isinstance(pse_shift, torch.Tensor), "pse_shift", "a torch.Tensor", pse_shift)
    allowed = (torch.float16, torch.bfloat16) if query.dtype == torch.int8 else (query.dtype,)
    require(pse_shift.dtype in allowed, "pse_shift", f"dtype in {allowed}", pse_shift)
    ok = (pse_shift.dim() == 4 and pse_shift.shape[0] in (1, batch) and pse_shift.shape[1] == heads
          and pse_shift.shape[2] >= seq_q and pse_shift.shape[3] >= seq_kv)
    require(ok, "pse_shift", f"[B or 1, N={heads}, >= Q_S={seq_q}, >= KV_S={seq_kv}]", pse_shift)


class QuantPlan:
    """Which int8 steps run, with their decoded scales (docs/operators/prompt_flash_attention.md)."""

    def __init__(self, output_dtype, deq1=None, quant1=None, deq2=None, scale2=None, offset2=None):
        self.output_dtype = output_dtype
        self.deq1, self.quant1, self.deq2 = deq1, quant1, deq2
        self.scale2, self.offset2 = scale2, offset2

    @property
    def offset_nonzero(self) -> bool:
        return self.offset2 is not None and bool((self.offset2 != 0).any())


def quant_plan(query, deq_scale1, quant_scale1, deq_scale2, quant_scale2, quant_offset2, out_layout, heads, dim):
    named = {"deq_scale1": deq_scale1, "quant_scale1": quant_scale1, "deq_scale2": deq_scale2,
             "quant_scale2": quant_scale2, "quant_offset2": quant_offset2}
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise ParamInvalidError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    int8_in = query.dtype == torch.int8
    if quant_offset2 is not None and quant_scale2 is None:
        raise ParamInvalidError("quant_offset2: only allowed together with quant_scale2")
    scale_dtypes = (torch.float32, torch.bfloat16) if query.dtype == torch.bfloat16 else (torch.float32,)
    scale2 = offset2 = None
    if quant_scale2 is not None:
        scale2 = quant.output_channel_scale(quant_scale2, "quant_scale2", out_layout, heads, dim, scale_dtypes)
        if quant_offset2 is not None:
            if quant_offset2.dtype != quant_scale2.dtype or quant_offset2.shape != quant_scale2.shape:
                raise ParamInvalidError(
                    f"quant_offset2: expected quant_scale2's dtype and shape {describe(quant_scale2)}, "
                    f"got {describe(quant_offset2)}"
                )
            offset2 = quant.output_channel_scale(quant_offset2, "quant_offset2", out_layout, heads, dim, scale_dtypes)
    if int8_in:
        for name in ("deq_scale1", "quant_scale1", "deq_scale2"):
            if named[name] is None:
                raise ParamInvalidError(f"{name}: required when query/key/value are int8, got None")
        plan = QuantPlan(
            torch.int8 if scale2 is not None else torch.float16,
            deq1=quant.decode_deq_scale(deq_scale1, "deq_scale1"),
            quant1=quant.per_tensor_float(quant_scale1, "quant_scale1"),
            deq2=quant.decode_deq_scale(deq_scale2, "deq_scale2"),
            scale2=scale2, offset2=offset2,
        )
        return plan
    for name in ("deq_scale1", "quant_scale1", "deq_scale2"):
        if named[name] is not None:
            raise ParamInvalidError(f"{name}: only allowed with int8 query/key/value, got {describe(named[name])}")
    if scale2 is not None:
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise ParamInvalidError(
                f"quant_scale2: int8 output needs float16/bfloat16 or int8 inputs, got {query.dtype}"
            )
        return QuantPlan(torch.int8, scale2=scale2, offset2=offset2)
    return QuantPlan(query.dtype)


def reject_offset_with_invalid_rows(has_mask, sparse_mode, act_q, act_kv, pre_tokens, next_tokens) -> None:
    """A nonzero quant_offset2 would turn rows with no visible key into quant(0) + offset
    (docs/operators/prompt_flash_attention.md): refused exactly where the operator documentation
    intercepts it, from the mode, the band
    and the lengths. A row that the mask's content hides entirely is not among them (modes 1 and 2: "不会出现满足拦截
    条件的情况") and gives 0 like every invalid row."""
    for b, (sq, skv) in enumerate(zip(act_q, act_kv, strict=True)):
        if sparse_mode == 0 and has_mask:
            bad = sq - skv - pre_tokens > 0 or next_tokens < 0
        elif sparse_mode == 3:
            bad = skv < sq
        elif sparse_mode == 4:
            bad = pre_tokens < 0 or next_tokens + skv - sq < 0
        else:
            bad = False
        if bad:
            raise ParamInvalidError(
                f"quant_offset2: a nonzero offset is rejected when rows with no visible key can occur "
                f"(batch {b}: sparse_mode={sparse_mode}, actual lengths q={sq}, kv={skv}, pre_tokens={pre_tokens}, "
                f"next_tokens={next_tokens}); quantize outside the operator instead"
            )


def sequence_runs(atten_mask, explicit_views, sparse_mode, act_q, act_kv, pre_tokens, next_tokens, pse_shift, scale):
    seq_masks = []
    for b, (sq, skv) in enumerate(zip(act_q, act_kv, strict=True)):
        if atten_mask is None:
            seq_masks.append(masks.full_attention(sq, skv))
            continue
        explicit = None if explicit_views is None else explicit_views[b][..., :sq, :skv].unsqueeze(0)
        seq_masks.append(masks.sequence_mask(sparse_mode, sq, skv, pre_tokens=pre_tokens, next_tokens=next_tokens,
                                             explicit=explicit))
    runs = []
    for b0, count in mask_runs(seq_masks, one_per_sequence=explicit_views is not None):
        m = seq_masks[b0]
        pse = None
        if pse_shift is not None:
            pse = SequencePse(0, scale, m.seq_q, m.seq_kv, source=batch_rows(pse_shift, b0, count))
        runs.append(Run(b0, count, m.seq_q, m.seq_kv, 0, 0, m, pse))
    return runs


# softmax_lse of a row that sees no key: "softmaxLseFlag为True时,数据为inf的代表无效数据"
# (aclnnFusedInferAttentionScore, aclnnFusedInferAttentionScoreV4); docs/semantics/invalid-rows.md. Q_S = 1
# batches without keys differ: see fia_problem.DECODE_EMPTY_BATCH_LSE.
INVALID_LSE = float("inf")


def _invalid_row_stats(out: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 row max / sum for `out`'s rows, prefilled with the invalid-row values: rows no kernel visits (beyond
    the actual lengths, runs without keys) keep them (docs/semantics/invalid-rows.md)."""
    return stats.allocate((*out.shape[:-1], STAT_WIDTH), torch.float32, device, keyless_rows=True)


def _write_lse(softmax_lse: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> None:
    """softmax_lse = max + log(sum) of each row's statistics, `INVALID_LSE` for rows that see no key
    (docs/operators/fused_infer_attention_score.md)."""
    m, s = row_max[..., :1], row_sum[..., :1]
    valid = m > -FLT_MAX
    softmax_lse.copy_(torch.where(valid, m + torch.log(torch.where(valid, s, 1.0)), INVALID_LSE))


def _bnsd_problem(query, out, heads_kv, scale, atten_mask, mask_views, sparse_mode, act_q, act_kv, pre_tokens,
                  next_tokens, pse_shift, sink=None) -> AttentionProblem:
    """The attention problem of [B, N, S, D] query / output views: one run per group of sequences with equal
    masks."""
    return AttentionProblem(
        layout="BNSD", batch=query.shape[0], heads_q=query.shape[1], heads_kv=heads_kv, dim_qk=query.shape[-1],
        dim_v=out.shape[-1], scale=scale, keep_prob=1.0, softmax_layout="",
        runs=sequence_runs(atten_mask, mask_views, sparse_mode, act_q, act_kv, pre_tokens, next_tokens, pse_shift,
                           scale),
        sink=sink,
    )


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, *, heads_kv: int, scale: float,
    atten_mask, mask_views, sparse_mode: int, act_q: list[int], act_kv: list[int], pre_tokens: int, next_tokens: int,
    pse_shift, plan: QuantPlan, backend: str, op: str, softmax_lse: torch.Tensor | None = None,
    inner_precise: int = 1, decode: bool | None = None, sink: torch.Tensor | None = None, page_size: int = 0,
) -> None:
    """Fill `out` ([B, N, Sq, Dv] view of the zero-initialised output) with attention over [B, N(kv), S, D] views,
    and `softmax_lse` ([B, N, Sq, 1] float32 view) when given: lse = max + log(sum) of the scaled, masked logits,
    `INVALID_LSE` for rows that see no key. `mask_views` are `validate_mask`'s per-batch views. `inner_precise`
    and `decode` (FIA's choice of the IFA kernel; default: one query row) pick the kernel's pipeline in the "npu"
    precision mode (docs/semantics/precision.md). `sink` ([N] float32, FIA v2's learnable_sink): one more softmax
    logit per head (problem/sink.py), which the lse includes; rows without keys then have lse = sink and output 0.
    `page_size`: the block size of the paged cache key / value were gathered from (0: contiguous), which the decode
    kernel's key block depends on in the "npu" mode (docs/semantics/precision.md, "Key blocks")."""
    problem = _bnsd_problem(query, out, heads_kv, scale, atten_mask, mask_views, sparse_mode, act_q, act_kv,
                            pre_tokens, next_tokens, pse_shift, sink)
    # With the tensors, the check also covers the kernels' int32 in-sequence offsets (no limit on S here).
    backend = select_backend(
        backend, query.device, op=op,
        unsupported=lambda: dense_unsupported(problem, query.dtype, output_dtype=plan.output_dtype,
                                              tensors={"q": query, "k": key, "v": value}),
    )
    if query.numel() == 0:
        return
    if precision.npu_mode():
        pipeline = precision.infer_pipeline(op, query.dtype, key.dtype, plan.output_dtype, inner_precise,
                                            query.shape[2] == 1 if decode is None else decode,
                                            pse=pse_shift is not None)
        _attend_npu(problem, pipeline, query, key, value, out, plan, softmax_lse, page_size)
        return
    if query.dtype == torch.int8:
        quant_attention.forward(problem, query, key, value, out, plan)
        return
    stats_needed = softmax_lse is not None or plan.output_dtype == torch.int8 or sink is not None
    # One query token per sequence without mask or pse: the decode loop reads the caches in place.
    dense = decode_forward if backend == "reference" and plan.output_dtype != torch.int8 and decode_forward.usable(
        problem, query, key, value) else kernels("dense_forward", backend)
    if not stats_needed:
        dense.forward(problem, query, key, value, out)
        return
    # Rows no kernel visits (beyond the actual lengths, runs without keys) keep the invalid-row statistics.
    row_max, row_sum = _invalid_row_stats(out, query.device)
    if plan.output_dtype == torch.int8:
        dense = torch.zeros(out.shape, dtype=torch.float32, device=query.device)
        flash_forward.forward(problem, query, key, value, dense, row_max, row_sum)
        quant_attention.quantize_output(problem, dense, row_max[..., 0] > -FLT_MAX, out, plan)
    else:
        dense.forward(problem, query, key, value, out, row_max, row_sum)
    if sink is not None:
        sinks.finish_keyless_rows(problem, out, row_max, row_sum)
    if softmax_lse is not None:
        _write_lse(softmax_lse, row_max, row_sum)


def _attend_npu(problem: AttentionProblem, pipeline: precision.AttentionPipeline, query, key, value, out, plan,
                softmax_lse, page_size: int) -> None:
    """`attend` in the "npu" precision mode: the kernel's rounding pipeline; an int8 output quantises its result as
    the kernel's PostQuant step rounds."""
    row_max, row_sum = _invalid_row_stats(out, query.device)
    quant_inputs = plan if query.dtype == torch.int8 else None
    if plan.output_dtype == torch.int8:
        dense = torch.zeros(out.shape, dtype=torch.float32, device=query.device)
        npu_attention.forward(problem, pipeline, query, key, value, dense, row_max, row_sum, quant=quant_inputs,
                              page_size=page_size)
        post_quant = precision.post_quant_pipeline(pipeline, per_channel=plan.scale2.numel() > 1)
        quant_attention.quantize_output(problem, dense, row_max[..., 0] > -FLT_MAX, out, plan, post_quant)
    else:
        npu_attention.forward(problem, pipeline, query, key, value, out, row_max, row_sum, quant=quant_inputs,
                              page_size=page_size)
    if softmax_lse is not None:
        _write_lse(softmax_lse, row_max, row_sum)


def attend_paged(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, *, block_table: torch.Tensor | None,
    heads_kv: int, scale: float, atten_mask, mask_views, sparse_mode: int, act_q: list[int], act_kv: list[int],
    pre_tokens: int, next_tokens: int, pse_shift, plan: QuantPlan, backend: str, op: str,
    softmax_lse: torch.Tensor | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    packed_int4: bool = False, inner_precise: int = 1, decode: bool | None = None,
    key_rope: torch.Tensor | None = None, int8_query: antiquants.Int8QueryRows | None = None,
) -> bool:
    """`attend` over paged caches read in place (docs/semantics/paged-kv.md): key / value are [block_num, N2,
    block_size, D] views and `block_table` maps each sequence's logical blocks. The Triton dense kernel reads any
    case it supports through the table; on the reference backend the decode loop does (one query token, no mask or
    pse), the loop contiguous caches take, so the bits are the same. Returns False, computing nothing, where
    neither applies (int8, the "npu" precision mode, or another reference case): the caller then gathers; the caller
    passes `inner_precise` and `decode` on to `attend`. With `kv_scales` (per-channel [N2, D] key / value scales)
    the pages are int8 and the reference decode loop anti-quantises each row as it reads it (problem/antiquant.py's
    rule); other backends return False. `block_table=None`: key / value are contiguous [B, N2, S, D] views;
    `packed_int4`: they are the bytes of int4 values packed two to a byte ([.., D/2]). `key_rope` (MLA): the rope
    keys' cache, of the key's layout (NZ included), whose rows follow each key's; the reference decode loop reads
    it (other backends return False). `int8_query` (with `kv_scales` and `key_rope`: an int8 MLA query over its int8
    latent): the loop scores these int8 rows instead of `query`'s (problem/antiquant.py)."""
    if query.dtype == torch.int8 or plan.output_dtype == torch.int8 or precision.npu_mode():
        return False
    problem = _bnsd_problem(query, out, heads_kv, scale, atten_mask, mask_views, sparse_mode, act_q, act_kv,
                            pre_tokens, next_tokens, pse_shift)
    resolved = resolve_backend(backend, query.device, op, warn=False, unsupported=lambda: dense_unsupported(
        problem, query.dtype, output_dtype=plan.output_dtype, tensors={"q": query, "o": out}))
    if resolved == "reference" and not decode_forward.usable(problem, query, key, value, kv_scales is not None,
                                                              key_rope):
        return False
    if (kv_scales is not None or key_rope is not None) and resolved != "reference":
        return False  # int8 pages are anti-quantised, rope keys joined, in the reference decode loop only
    select_backend(resolved, query.device, op=op, unsupported=lambda: None)  # counts the dispatch
    if query.numel() == 0:
        return True
    kernel = kernels("dense_forward", "triton") if resolved == "triton" else decode_forward
    row_max = row_sum = None
    if softmax_lse is not None:
        row_max, row_sum = _invalid_row_stats(out, query.device)
    extra = {} if kv_scales is None else {"kv_scales": kv_scales, "packed_int4": packed_int4}
    if key_rope is not None:
        extra["key_rope"] = key_rope
    if int8_query is not None:
        extra["int8_query"] = int8_query
    kernel.forward(problem, query, key, value, out, row_max, row_sum, block_table=block_table, **extra)
    if softmax_lse is not None:
        _write_lse(softmax_lse, row_max, row_sum)
    return True


def attend_pages(pages: PagedKv, query: torch.Tensor, out: torch.Tensor, *, atten_mask, mask_views,
                 act_q: list[int], act_kv: list[int], pse_shift, softmax_lse: torch.Tensor | None = None,
                 antiquant: antiquants.KvAntiquant | None = None, **common) -> None:
    """`attend` over the paged caches `pages` for [B, N, S, D] query / output views (docs/semantics/paged-kv.md):
    in place through the table where a kernel can (`attend_paged`); else, and with rope keys (the key ++ rope rows
    must be assembled), per group of equal-length sequences (the attention's own batched runs), gathering only
    their tokens. int8 caches (NZ included) are anti-quantised with `antiquant` (problem/antiquant.py): per page
    read, into compact pages the kernels then read in place, when the factors do not depend on the token; else
    per gathered group. `common` are `attend`'s remaining keywords."""
    views, table = pages.cache_views(), pages.pages.table
    if antiquant is not None and pages.key_rope is None:
        scales = antiquant.channel_scales(pages.shape.heads, query.shape[-1], out.shape[-1])
        # The decode loop reads NZ caches [block_num, N2, D/c0, block_size, c0] chunk by chunk.
        caches = (pages.key, pages.value) if pages.shape.nz else views
        if scales is not None and caches is not None and attend_paged(
                query, *caches, out, block_table=table.to(query.device), atten_mask=atten_mask, mask_views=mask_views,
                act_q=act_q, act_kv=act_kv, pse_shift=pse_shift, softmax_lse=softmax_lse, kv_scales=scales,
                **common):
            return  # the decode loop anti-quantised each row as it read it
    if antiquant is not None and not antiquant.per_token and pages.key_rope is None:
        *views, table = pages.dequantized_blocks(antiquant, query.dtype)
    elif antiquant is not None:
        views = None
    if views is not None and pages.key_rope is None and attend_paged(
            query, *views, out, block_table=table.to(query.device), atten_mask=atten_mask,
            mask_views=mask_views, act_q=act_q, act_kv=act_kv, pse_shift=pse_shift, softmax_lse=softmax_lse,
            **common):
        return
    if antiquant is None and pages.key_rope is not None and attend_paged(
            query, *pages.loop_caches(), out, block_table=table.to(query.device), atten_mask=atten_mask,
            mask_views=mask_views, act_q=act_q, act_kv=act_kv, pse_shift=pse_shift, softmax_lse=softmax_lse,
            key_rope=pages.loop_caches(rope=True), **common):
        return  # MLA decode: the loop joins each key's latent and rope rows as it reads them
    workspace = Workspace(query.device)
    for group in length_groups(act_q, act_kv):
        g = slice(group.start, group.stop)
        k_g, v_g = pages.group_bnsd(group, workspace)
        if antiquant is not None:
            factors = antiquant.batches(g)
            k_g = antiquants.dequantize(k_g, factors.key, query.dtype)
            v_g = antiquants.dequantize(v_g, factors.value, query.dtype)
        pse_g = None if pse_shift is None else batch_rows(pse_shift, group.start, len(group))
        attend(query[g], k_g, v_g, out[g], atten_mask=atten_mask,
               mask_views=None if mask_views is None else mask_views[g], act_q=act_q[g], act_kv=act_kv[g],
               pse_shift=pse_g, softmax_lse=None if softmax_lse is None else softmax_lse[g],
               page_size=pages.shape.block_size, **common)
