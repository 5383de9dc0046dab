"""PromptFlashAttentionV2 (prefill inference with GQA, actual lengths and int8; seed PromptFlashAttentionV2.md)."""

from __future__ import annotations

import torch

from ..backends import kernels, select_backend
from ..backends.reference import flash_forward, quant_attention
from ..backends.triton.dense_plan import dense_unsupported
from ..errors import ParamInvalidError, ParamNullptrError, describe, require, require_int
from ..problem import layout as layouts
from ..problem import mask as masks
from ..problem import quant
from ..problem.attention import AttentionProblem, Run, mask_runs
from ..problem.lengths import per_batch_lengths
from ..problem.pse import SequencePse
from ..problem.stats import FLT_MAX
from ..traceable import traced_as_custom_op

INT_MAX = 2147483647
PFA_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND")
PFA_MODES = (0, 1, 2, 3, 4)
MAX_BATCH, MAX_HEADS, MAX_HEAD_DIM, MAX_GROUP = 65536, 256, 512, 64
MAX_BATCH_UNALIGNED, MAX_HIDDEN = 128, 65535
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


@traced_as_custom_op
def prompt_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    deq_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    deq_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    num_heads: int = 1,
    scale_value: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = 0,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """Prefill attention softmax(scale * Q K^T + pse_shift, masked) V, per batch over its actual lengths.

    Layouts BSH, BSND, BNSD, BNSD_BSND (input BNSD, output BSND); GQA via `num_key_value_heads` (0 = num_heads;
    ratio <= 64). `actual_seq_lengths(_kv)`: None (full S), one value for every batch, or >= B values (the first
    B). sparse_mode 0..4 with each batch's actual lengths; next_tokens defaults to 0; modes 1..4 need the mask
    (docs/semantics/masks.md). Rows beyond the actual query length and rows with no visible key are 0 (3). pse_shift:
    S = scale * x + pse_shift, its top-left block used (4). int8 (7): int8 inputs need deq_scale1, quant_scale1,
    deq_scale2 (float32 or trans_quant_param words); quant_scale2 (+ quant_offset2) quantize the output to int8.
    Output dtype: int8 with quant_scale2, else float16 for int8 inputs, else the query's dtype.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t is None:
            raise ParamNullptrError(f"{name}: a required input, got None")
        require(isinstance(t, torch.Tensor), name, "a torch.Tensor", t)
        require(t.dtype in (torch.float16, torch.bfloat16, torch.int8, torch.float32, torch.float64), name,
                "dtype float16, bfloat16 or int8", t)
    require(key.dtype == query.dtype, "key", f"the query's dtype {query.dtype}", key)
    require(value.dtype == query.dtype, "value", f"the query's dtype {query.dtype}", value)
    layouts.check_layout(input_layout, PFA_LAYOUTS)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ParamInvalidError(f"num_heads: expected a positive int, got {num_heads!r}")
    if isinstance(num_key_value_heads, bool) or not isinstance(num_key_value_heads, int) or num_key_value_heads < 0:
        raise ParamInvalidError(f"num_key_value_heads: expected an int >= 0, got {num_key_value_heads!r}")
    heads_kv = num_key_value_heads or num_heads
    q = layouts.read_dims(query, input_layout, num_heads, "query", "num_heads")
    kv_layout = "BNSD" if input_layout == "BNSD_BSND" else input_layout
    k = layouts.read_dims(key, kv_layout, heads_kv, "key", "num_key_value_heads")
    v = layouts.read_dims(value, kv_layout, heads_kv, "value", "num_key_value_heads")
    if q.heads != num_heads:
        raise ParamInvalidError(f"num_heads: expected the query's head count N={q.heads}, got {num_heads}")
    if input_layout != "BSH" and k.heads != heads_kv:
        raise ParamInvalidError(
            f"num_key_value_heads: expected the key's head count N={k.heads} (0 means num_heads), "
            f"got {num_key_value_heads}"
        )
    if num_heads % heads_kv != 0 or num_heads // heads_kv > MAX_GROUP:
        raise ParamInvalidError(
            f"num_key_value_heads: num_heads={num_heads} must be a multiple of it with a ratio <= {MAX_GROUP}, "
            f"got {heads_kv}"
        )
    require(k.head_dim == q.head_dim, "key", f"head dim D={q.head_dim} like the query", key)
    require(v.head_dim == q.head_dim and v.seq == k.seq and v.batch == k.batch and v.heads == k.heads, "value",
            f"the key's shape {list(key.shape)}", value)
    require(k.batch == q.batch, "key", f"batch B={q.batch} like the query", key)
    # D = 0 makes an empty query, which returns an empty output (docs/semantics/errors.md; seed: "如果是空则直接返回").
    require(q.head_dim <= MAX_HEAD_DIM and (q.head_dim >= 1 or query.numel() == 0), "query",
            f"head dim D in 1..{MAX_HEAD_DIM}", query)
    require(num_heads <= MAX_HEADS, "num_heads", f"at most {MAX_HEADS}", num_heads)
    alignment = 32 if query.dtype == torch.int8 else 16
    if q.head_dim % alignment != 0:
        require(q.batch <= MAX_BATCH_UNALIGNED, "query",
                f"batch B <= {MAX_BATCH_UNALIGNED} when D={q.head_dim} is not a multiple of {alignment}", query)
    if input_layout in ("BSH", "BSND"):
        require(num_heads * q.head_dim < MAX_HIDDEN, "query", f"N * D < {MAX_HIDDEN} for layout {input_layout}",
                query)
    require(q.batch <= MAX_BATCH, "query", f"batch B <= {MAX_BATCH}", query)
    for name, value_ in (("sparse_mode", sparse_mode), ("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        require_int(value_, name)
    if sparse_mode not in PFA_MODES:
        raise ParamInvalidError(f"sparse_mode: PromptFlashAttentionV2 supports 0..4, got {sparse_mode}")

    batch, seq_q, seq_kv = q.batch, q.seq, k.seq
    act_q = per_batch_lengths(actual_seq_lengths, "actual_seq_lengths", batch, seq_q)
    act_kv = per_batch_lengths(actual_seq_lengths_kv, "actual_seq_lengths_kv", batch, seq_kv)
    explicit_views = _validate_mask(atten_mask, sparse_mode, batch, num_heads, seq_q, seq_kv, pre_tokens,
                                    next_tokens)
    _validate_pse_shift(pse_shift, query, batch, num_heads, seq_q, seq_kv)
    plan = _quant_plan(query, deq_scale1, quant_scale1, deq_scale2, quant_scale2, quant_offset2,
                       "BSND" if input_layout == "BNSD_BSND" else input_layout, num_heads, q.head_dim)
    if plan.offset_nonzero:
        _reject_offset_with_invalid_rows(atten_mask is not None, sparse_mode, act_q, act_kv, pre_tokens, next_tokens)
    # Every tensor goes to the backend as a [B, N, S, D] view, so input and output layouts may differ.
    problem = AttentionProblem(
        layout="BNSD", batch=batch, heads_q=num_heads,
        heads_kv=heads_kv, dim_qk=q.head_dim, dim_v=q.head_dim, scale=float(scale_value), keep_prob=1.0,
        softmax_layout="", runs=_runs(atten_mask, explicit_views, sparse_mode, act_q, act_kv, pre_tokens,
                                      next_tokens, pse_shift, float(scale_value)),
    )
    q_bnsd = layouts.as_bnsd(query, input_layout, num_heads)
    k_bnsd = layouts.as_bnsd(key, kv_layout, heads_kv)
    v_bnsd = layouts.as_bnsd(value, kv_layout, heads_kv)
    # With the tensors, the check also covers the kernels' int32 in-sequence offsets (PFA has no limit on S).
    backend = select_backend(
        backend, query.device, op="prompt_flash_attention",
        unsupported=lambda: dense_unsupported(problem, query.dtype, output_dtype=plan.output_dtype,
                                              tensors={"q": q_bnsd, "k": k_bnsd, "v": v_bnsd}),
    )

    out_layout = "BSND" if input_layout == "BNSD_BSND" else input_layout
    out = torch.zeros(layouts.output_shape(out_layout, batch, seq_q, num_heads, q.head_dim),
                      dtype=plan.output_dtype, device=query.device)
    if query.numel() == 0:
        return out
    out_bnsd = layouts.as_bnsd(out, out_layout, num_heads)
    if query.dtype == torch.int8:
        quant_attention.forward(problem, q_bnsd, k_bnsd, v_bnsd, out_bnsd, plan)
    elif plan.output_dtype == torch.int8:
        dense = torch.zeros(out_bnsd.shape, dtype=torch.float32, device=query.device)
        row_max = torch.full((*out_bnsd.shape[:-1], 8), -FLT_MAX, dtype=torch.float32, device=query.device)
        row_sum = torch.empty_like(row_max)
        flash_forward.forward(problem, q_bnsd, k_bnsd, v_bnsd, dense, row_max, row_sum)
        quant_attention.quantize_output(problem, dense, row_max[..., 0] > -FLT_MAX, out_bnsd, plan)
    else:
        kernels("dense_forward", backend).forward(problem, q_bnsd, k_bnsd, v_bnsd, out_bnsd)
    return out


def _validate_mask(atten_mask, sparse_mode, batch, heads, seq_q, seq_kv, pre_tokens, next_tokens):
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
    # The mask may be padded beyond (Q_S, KV_S) (the seed recommends padding KV_S to 32 with ones): only its
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


def _validate_pse_shift(pse_shift, query, batch, heads, seq_q, seq_kv) -> None:
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


def _quant_plan(query, deq_scale1, quant_scale1, deq_scale2, quant_scale2, quant_offset2, out_layout, heads, dim):
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


def _reject_offset_with_invalid_rows(has_mask, sparse_mode, act_q, act_kv, pre_tokens, next_tokens) -> None:
    """A nonzero quant_offset2 would turn rows with no visible key into quant(0) + offset
    (docs/operators/prompt_flash_attention.md)."""
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


def _runs(atten_mask, explicit_views, sparse_mode, act_q, act_kv, pre_tokens, next_tokens, pse_shift, scale):
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
            source = pse_shift if pse_shift.shape[0] == 1 else pse_shift[b0 : b0 + count]
            pse = SequencePse(0, scale, m.seq_q, m.seq_kv, source=source)
        runs.append(Run(b0, count, m.seq_q, m.seq_kv, 0, 0, m, pse))
    return runs
