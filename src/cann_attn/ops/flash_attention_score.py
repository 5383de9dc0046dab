"""FlashAttentionScore and FlashAttentionVarLenScore (training forward; FlashAttentionVarLenScore documentation)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..backends import kernels, select_backend
from ..backends.reference import npu_attention
from ..backends.triton.dense_plan import dense_unsupported
from ..errors import ParamInvalidError
from ..problem import layout as layouts
from ..problem import precision, stats
from ..problem import sink as sinks
from ..traceable import traced_as_custom_op
from .fa_problem import FaShapes, build_problem

INT_MAX = 2147483647
FORWARD_MODES = (0, 1, 2, 3, 4, 5, 6, 7, 8)
VARLEN_MODES = (0, 1, 2, 3, 4, 6, 7, 8)


class FlashAttentionScoreResult(NamedTuple):
    attention_out: torch.Tensor
    softmax_max: torch.Tensor
    softmax_sum: torch.Tensor
    softmax_out: torch.Tensor


@traced_as_custom_op
def flash_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    drop_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    q_start_idx=None,
    kv_start_idx=None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    inner_precise: int = 0,
    sparse_mode: int = 0,
    pse_type: int = 1,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    backend: str = "auto",
) -> FlashAttentionScoreResult:
    """Training forward of FlashAttentionScore: softmax(mask(S)) with dropout, times value.

    Layouts BSH, SBH, BSND, BNSD, TND (docs/semantics/layouts.md); masks via sparse_mode 0..8, pre/next_tokens, prefix
    and atten_mask (docs/semantics/masks.md); fully masked rows give 0 with softmax_max = -FLT_MAX, softmax_sum =
    FLT_MAX (docs/semantics/invalid-rows.md); pse types 0..3 with q/kv start indices (docs/semantics/pse.md); dropout
    from the bit-packed `drop_mask` with `keep_prob` (docs/semantics/dropout.md). Returns attention_out (query layout,
    value's D), softmax_max / softmax_sum ([B,N1,Sq,8]; TND [T,N1,8] laid out as `softmax_layout` says,
    docs/semantics/softmax-stats.md) and an empty softmax_out. `padding_mask` is reserved and ignored. `sink`
    (float32 [N1], optional) adds one logit per query head to every row's softmax, dropped before P V; the
    statistics then include it (docs/semantics/sinks.md).
    """
    return _run(locals(), FORWARD_MODES, "flash_attention_score")


@traced_as_custom_op
def flash_attention_var_len_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str = "TND",
    *,
    pse: torch.Tensor | None = None,
    drop_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    q_start_idx=None,
    kv_start_idx=None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    inner_precise: int = 0,
    sparse_mode: int = 0,
    pse_type: int = 1,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    backend: str = "auto",
) -> FlashAttentionScoreResult:
    """FlashAttentionVarLenScore: `flash_attention_score` for packed TND sequences only.

    actual_seq_qlen / actual_seq_kvlen are required cumulative ends without a leading 0 (docs/semantics/layouts.md);
    sparse_mode 5 is not supported (docs/semantics/masks.md).
    """
    if input_layout != "TND":
        raise ParamInvalidError(f"input_layout: flash_attention_var_len_score expects 'TND', got {input_layout!r}")
    return _run(locals(), VARLEN_MODES, "flash_attention_var_len_score")


def _run(args: dict, allowed_modes: tuple[int, ...], op: str) -> FlashAttentionScoreResult:
    query, key, value = args["query"], args["key"], args["value"]
    problem, shapes = build_problem(
        query, key, value, args["head_num"], args["input_layout"],
        pse=args["pse"], drop_mask=args["drop_mask"], atten_mask=args["atten_mask"], prefix=args["prefix"],
        actual_seq_qlen=args["actual_seq_qlen"], actual_seq_kvlen=args["actual_seq_kvlen"],
        q_start_idx=args["q_start_idx"], kv_start_idx=args["kv_start_idx"], scale_value=args["scale_value"],
        keep_prob=args["keep_prob"], pre_tokens=args["pre_tokens"], next_tokens=args["next_tokens"],
        inner_precise=args["inner_precise"], sparse_mode=args["sparse_mode"], pse_type=args["pse_type"],
        softmax_layout=args["softmax_layout"], allowed_modes=allowed_modes, sink=args["sink"],
    )
    qkv = {"q": query, "k": key, "v": value}
    backend = select_backend(args["backend"], query.device, op=op,
                             unsupported=lambda: dense_unsupported(problem, query.dtype, tensors=qkv))
    out, softmax_max, softmax_sum = dense_forward(problem, shapes, backend, query, key, value)
    softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
    return FlashAttentionScoreResult(out, softmax_max, softmax_sum, softmax_out)


def dense_forward(problem, shapes: FaShapes, backend: str, query, key, value
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention_out, softmax_max, softmax_sum of a validated problem (the forward, and the grad when it recomputes
    them). Rows no kernel visits (runs without keys, TND end-of-document padding) keep 0 output and invalid-row
    statistics (docs/semantics/invalid-rows.md); with a sink, rows of runs without keys get the sink's statistics
    (docs/semantics/sinks.md)."""
    out_shape = layouts.output_shape(problem.layout, shapes.batch, shapes.total_q, shapes.heads_q, shapes.dim_v)
    keyless_rows = problem.has_keyless_rows or shapes.padding_q > 0
    # The reference forward writes every row of every run with keys, so without keyless rows nothing needs the zeros
    # (1.8 ms of memset on an 8 MB output, ~1.5% of a B=1 N=8 S=2048 fp32 forward on one thread).
    written = not keyless_rows and backend == "reference" and not precision.npu_mode()
    out = (torch.empty if written else torch.zeros)(out_shape, dtype=query.dtype, device=query.device)
    stat_shape = stats.stats_shape(problem.tnd, shapes.batch, shapes.heads_q, shapes.total_q)
    softmax_max, softmax_sum = stats.allocate(stat_shape, stats.accumulation_dtype(query.dtype), query.device,
                                              keyless_rows=keyless_rows)
    if out.numel() > 0 and precision.npu_mode():
        npu_attention.forward(problem, precision.fa_pipeline(query.dtype), query, key, value, out, softmax_max,
                              softmax_sum)
    elif out.numel() > 0:
        kernels("dense_forward", backend).forward(problem, query, key, value, out, softmax_max, softmax_sum)
    if problem.sink is not None:
        sinks.finish_keyless_rows(problem, out, softmax_max, softmax_sum)
    return out, softmax_max, softmax_sum
