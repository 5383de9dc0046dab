"""The "npu" precision mode of the dense attention kernels: the problem's own masks, pse, dropout, lengths and sinks,
rounded where the NPU kernel rounds (`problem.precision.AttentionPipeline` / `GradPipeline`;
docs/semantics/precision.md).

A tiled PyTorch loop, separate from the "exact" kernels (which it leaves untouched; it borrows their native
online-softmax step): per query tile of `BLOCK_Q` rows (`FUSED_BLOCK_Q` on the fused fp16 path below without a mask) and
per key block of the kernel's width (`problem.precision.key_block`), the scores, logits, probabilities, P V products
and the running output each pass through their stage's Cast (one native pass per cast where available); the row max
and sum stay fp32, the division comes last. A GEMM whose stage rounds to fp16 / bf16 runs in float64 (an exact sum
rounded once: an fp32 sum rounded again would move fp16 logits by whole steps); one whose stage keeps fp32
accumulates in fp32, as the cube does. The fp16 pipelines take each tile's casts, softmax step and P's cast in one
native pass from the float64 scores to the float64 P (`native.npu_fp16_softmax_step`), and the running output's
rescale and add in another (`native.npu_fp16_accumulate`), into buffers reused from tile to tile: the same bits as
the separate passes. The int8 PromptFlashAttention path quantises P and dequantises the products as
`quant_attention` does, in the pipeline's fp16 stages. The backward recomputes P from the saved statistics (S and dP
exact sums) and rounds P and dS before their fp32-accumulating GEMMs.
SparseFlashAttention and its grad take the same stages over each row's selected keys (the selection rule stays in
`problem.sparse`).
"""

from __future__ import annotations

import math
import threading

import torch

from ...problem import sink as sinks
from ...problem.attention import AttentionProblem, Run
from ...problem.mask import TileState, VisibleColumns, add_mask_bias
from ...problem.precision import (
    ASCEND_QUANT,
    HALF_AWAY,
    SFA_KEY_BLOCK,
    AttentionPipeline,
    Cast,
    GradPipeline,
    IndexerPipeline,
    KeyShape,
    QuantIndexerPipeline,
    amla_factor,
    amla_rescale_bits,
    key_block,
    round_float,
)
from ...problem.stats import FLT_MAX
from . import native
from .flash_backward import pse_grad_target, row_sums, runs_to_fill
from .flash_forward import group_rows, key_tiles, softmax_step, write_stat
from .softmax_exp import EXP2_FLOOR, LOG2E
from .sparse_attention import INVALID_MAX
from .sparse_attention import _sequence_selection as sequence_selection

BLOCK_Q = 128
# The gradient's key tile (its dQ sums run over one tile's columns at a time).
KEY_TILE = 4 * BLOCK_Q
# The query tile of the fused fp16 path where no mask cuts a key tile by its rows: MKL's dgemm packs the K block once
# per call, so 256 rows halve that work (~25 ms of 550 at B 1, N 8, S 2048, D 128); every row sees the same key
# blocks and columns whatever the tile's height, and its float64 sums of fp16 products are exact, so no bit moves.
FUSED_BLOCK_Q = 256


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (batched) in float64: exact for fp16/bf16 operands up to the float64 rounding of long sums; into `out`
    (a reused buffer) when given."""
    return torch.bmm(a.to(torch.float64), b.to(torch.float64), out=out)


def _cube(a: torch.Tensor, b: torch.Tensor, stage: Cast, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (batched) for a GEMM whose result leaves at `stage`: fp16 / bf16-valued fp32 operands accumulated in
    fp32 (BLAS order) where the stage keeps fp32; the exact sum (float64) where it rounds to fp16 / bf16, so that the
    result is rounded once (an fp32 sum rounded again would move fp16 logits by whole ulps). `out`: a float64
    buffer for the exact sum."""
    if stage.dtype == torch.float32 and a.dtype == b.dtype == torch.float32:
        return torch.bmm(a, b)
    return _gemm(a, b, out)


@torch.no_grad()
def forward(problem: AttentionProblem, pipeline: AttentionPipeline, query, key, value, out, softmax_max=None,
            softmax_sum=None, quant=None, page_size: int = 0) -> None:
    """Fill `out` (query layout) and, when given, the [.., 8] statistics for every run with keys, rounding as
    `pipeline` says. `quant` (int8 PromptFlashAttention's `QuantPlan`) dequantises int8 inputs; `out` is then the
    fp16 (or fp32, for a later int8 quantisation) result. `page_size`: the block size of the paged cache the keys
    were gathered from (0: contiguous), which the decode kernel's key block reads."""
    block = key_block(pipeline, key_shape(problem, page_size))
    for run in problem.runs:
        if run.seq_q > 0 and run.seq_kv > 0:
            max_view = None if softmax_max is None else problem.stat_view(softmax_max, run)
            sum_view = None if softmax_sum is None else problem.stat_view(softmax_sum, run)
            _forward_run(problem, pipeline, block, run, query, key, value, problem.q_view(out, run), max_view,
                         sum_view, quant)


def key_shape(problem: AttentionProblem, page_size: int = 0) -> KeyShape:
    """What the kernels' tiling reads of `problem` and of its cache's `page_size` (`problem.precision.key_block`)."""
    masked = any(run.mask.hides_keys for run in problem.runs)
    return KeyShape(seq_q=max((run.seq_q for run in problem.runs), default=0),
                    seq_kv=max((run.seq_kv for run in problem.runs), default=0), dim=problem.dim_qk,
                    has_mask=masked, layout=problem.layout, group=problem.heads_q // problem.heads_kv,
                    page_size=page_size)


def _scale(pipeline: AttentionPipeline, scale: float) -> torch.Tensor:
    """The softmax scale as the kernel holds it: a constant of the logits' dtype (static_cast<computeType>)."""
    return pipeline.logits(torch.tensor(scale, dtype=torch.float64).to(torch.float32))


def _rounded(cast: Cast, x: torch.Tensor) -> torch.Tensor:
    """`cast(x)`, in one native pass where x is fp32 on the CPU (the same bits; a float64 GEMM result takes the
    Cast's own single rounding)."""
    if cast.dtype == torch.float32:
        return x.to(torch.float32)
    if x.dtype == torch.float32 and native.usable(x):
        return native.npu_round(x, cast.dtype == torch.float16, cast.rounding == HALF_AWAY)
    if _wide_fp16(cast, x):
        return native.npu_round_wide_fp16(x, cast.rounding == HALF_AWAY)
    return cast(x)


def _wide_fp16(cast: Cast, x: torch.Tensor) -> bool:
    """Whether the native pass rounds this float64 GEMM result to `cast` (fp16: always through round to odd, as
    `Cast` does; bf16 takes another route for fp32 subnormals and stays with `Cast`)."""
    return (cast.dtype == torch.float16 and x.dtype == torch.float64 and x.device.type == "cpu"
            and native.library() is not None)


def _logits(problem: AttentionProblem, pipeline: AttentionPipeline, run: Run, s: torch.Tensor, i0, i1, j0, j1,
            state: TileState, quant) -> torch.Tensor:
    """Masked logits of one tile [c, N1, rows, cols] in fp32 (contiguous) from its scores GEMM's result s, rounded
    at the scores and logits stages."""
    c, rows, cols = run.count, i1 - i0, j1 - j0
    scale = _scale(pipeline, problem.scale)
    if quant is None and pipeline.logits.dtype == torch.float16 and _wide_fp16(pipeline.scores, s):
        # the scores' and the logits' casts in one native pass
        s = native.npu_round_wide_fp16(s, pipeline.scores.rounding == HALF_AWAY, float(scale),
                                       pipeline.logits.rounding == HALF_AWAY).view(c, problem.heads_q, rows, cols)
    else:
        # int8: the int32 products dequantised by the cube's fixpipe into fp16 (one rounding)
        s = _rounded(pipeline.scores, s) if quant is None else round_float(s * quant.deq1, torch.float16).float()
        s = _rounded(pipeline.logits, s.view(c, problem.heads_q, rows, cols).mul_(scale))
    if run.pse is not None:
        s = _rounded(pipeline.logits, s + _rounded(pipeline.logits, run.pse.tile(i0, i1, j0, j1, s.device,
                                                                                torch.float32)))
    if state is TileState.PARTIAL:
        # the fill for NaN / +inf logits only where a tile has one (a finite sum rules both out)
        add_mask_bias(s, run.mask.bias_tile(i0, i1, j0, j1, torch.float32, s.device),
                      finite=bool(torch.isfinite(s.sum())), in_place=True)
    return s


def _forward_run(problem: AttentionProblem, pipeline: AttentionPipeline, block: int, run: Run, query, key, value,
                 out_view, max_view, sum_view, quant) -> None:
    c, n2, heads = run.count, problem.heads_kv, problem.heads_q
    # The GEMM operands widened to what their GEMM sums in (`_cube`; int8 exactly, in float64): K and V once per run,
    # each query tile as it comes (a run-sized float64 copy of Q is fresh memory on every call).
    exact_scores = quant is not None or pipeline.scores.dtype != torch.float32
    exact_products = quant is not None or pipeline.products.dtype != torch.float32
    q_all = problem.q_view(query, run)
    q_dtype = torch.float64 if exact_scores else torch.float32
    k = problem.kv_view(key, run).to(q_dtype).reshape(c * n2, run.seq_kv, -1)
    v = problem.kv_view(value, run).reshape(c * n2, run.seq_kv, -1)
    if exact_products:
        # widened into column-major storage in one pass: MKL's dgemm takes P V ~10-15% faster so at 128 x 1024 x 128
        # tiles; the float64 sums of fp16 products are exact, so the layout cannot move their bits
        v = torch.empty((v.shape[0], v.shape[2], v.shape[1]), dtype=torch.float64, device=v.device).transpose(1, 2) \
            .copy_(v)
    else:
        v = v.to(torch.float32)
    dv = v.shape[-1]
    fp32_running = pipeline.accumulator.dtype == torch.float32
    fused = _fused_fp16_step(pipeline, run, quant, q_all)
    fused_running = fused and _fused_fp16_running(pipeline)
    scratch = _Scratch()
    sink_heads = None if problem.sink is None else sinks.head_values(problem.sink, torch.float32, query.device)
    tile_rows = FUSED_BLOCK_Q if fused and not run.mask.hides_keys else BLOCK_Q
    for i0 in range(0, run.seq_q, tile_rows):
        i1 = min(i0 + tile_rows, run.seq_q)
        rows = i1 - i0
        q_tile = group_rows(q_all[:, :, i0:i1], n2).to(q_dtype)
        row_max = torch.full((c, heads, rows), float("-inf"), device=query.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros((c, heads, rows, dv), device=query.device)
        lo, hi = run.mask.key_range(i0, i1)
        for tile_start, tile_end, state in key_tiles(run, i0, i1, block):
            # One online-softmax step per kernel tile; only its columns the rows may see are computed (the others
            # would add exact zeros).
            j0, j1 = _visible_columns(run, i0, i1, max(tile_start, lo), min(tile_end, hi), state)
            # the scores' float64 sums in a buffer reused from tile to tile
            s = _cube(q_tile, k[:, j0:j1].transpose(1, 2), pipeline.scores,
                      out=scratch.take("s", (*q_tile.shape[:2], j1 - j0), torch.float64, query.device)
                      if fused else None)
            if fused:
                p, correction = _fused_probabilities(problem, pipeline, run, s, i0, i1, j0, j1, state, row_max,
                                                     row_sum)
                if fused_running:
                    products = _gemm(p, v[:, j0:j1], out=scratch.take("pv", (*p.shape[:2], dv), torch.float64,
                                                                      query.device))
                    native.npu_fp16_accumulate(acc, products, correction,
                                               products_away=pipeline.products.rounding == HALF_AWAY,
                                               rescale_away=pipeline.rescale_cast.rounding == HALF_AWAY,
                                               acc_away=pipeline.accumulator.rounding == HALF_AWAY)
                    continue
                products = _products(pipeline, p, v, j0, j1, quant).view(acc.shape)
            else:
                p = _logits(problem, pipeline, run, s, i0, i1, j0, j1, state, quant)
                correction = softmax_step(p, row_max, row_sum)
                if run.dropout is not None:
                    keep = run.dropout.keep_tile(i0, i1, j0, j1, p.device).to(torch.float32)
                    p = p * (keep / problem.keep_prob if pipeline.dropout_in_probabilities else keep)
                products = _products(pipeline, _rounded(pipeline.probabilities, p), v, j0, j1, quant).view(acc.shape)
            if fp32_running:
                acc.mul_(correction.unsqueeze(-1)).add_(products)
            else:
                scaled = _rounded(pipeline.accumulator, acc * _rounded(pipeline.rescale_cast, correction).unsqueeze(-1))
                acc = _rounded(pipeline.accumulator, scaled + products)
        if sink_heads is not None:
            acc = pipeline.accumulator(acc * sinks.merge_into_rows_(row_max, row_sum, sink_heads).unsqueeze(-1))
        valid = row_sum != 0
        keep_prob = 1.0 if pipeline.dropout_in_probabilities else problem.keep_prob
        divisor = pipeline.divisor(torch.where(valid, row_sum * keep_prob, 1.0)).unsqueeze(-1)
        out_view[:, :, i0:i1] = pipeline.output(acc / divisor).masked_fill_(~valid.unsqueeze(-1), 0.0)
        if max_view is not None:
            write_stat(max_view[:, :, i0:i1], torch.where(valid, row_max, -FLT_MAX))
            write_stat(sum_view[:, :, i0:i1], torch.where(valid, row_sum, FLT_MAX))


def _fused_fp16_step(pipeline: AttentionPipeline, run: Run, quant, q_all: torch.Tensor) -> bool:
    """Whether a tile's softmax step runs as one native pass from the float64 scores to the float64 probabilities
    (`_fused_probabilities`): an fp16 pipeline whose scores, logits and probabilities round to fp16 and whose P V
    sums exactly, without int8 quantisation or dropout, on the CPU with the native loops."""
    fp16 = all(stage.dtype == torch.float16 for stage in
               (pipeline.scores, pipeline.logits, pipeline.probabilities, pipeline.products))
    return (fp16 and quant is None and run.dropout is None and q_all.device.type == "cpu"
            and native.library() is not None)


def _fused_fp16_running(pipeline: AttentionPipeline) -> bool:
    """Whether the running output's rescale and add run as one native pass (`native.npu_fp16_accumulate`): a
    running output and rescale factor rounded to fp16 (the products already are, where the step is fused)."""
    return pipeline.accumulator.dtype == torch.float16 and pipeline.rescale_cast.dtype == torch.float16


def _fused_probabilities(problem: AttentionProblem, pipeline: AttentionPipeline, run: Run, s: torch.Tensor, i0, i1,
                         j0, j1, state: TileState, row_max: torch.Tensor,
                         row_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, correction) of one tile of an fp16 pipeline (`_fused_fp16_step`): the scores' float64 sums s [c * N2,
    G * rows, cols] are overwritten with the probabilities rounded to fp16, as float64 (the P V GEMM's operand);
    row_max / row_sum are updated. The logits' casts run inside the pass unless a pse or a mask touches the tile
    (`_logits` then gives them, masked)."""
    logits = None
    if run.pse is not None or state is TileState.PARTIAL:
        logits = _logits(problem, pipeline, run, s, i0, i1, j0, j1, state, None)
    correction = torch.empty_like(row_max)
    native.npu_fp16_softmax_step(s, logits, row_max, row_sum, correction, LOG2E, EXP2_FLOOR,
                                 scores_away=pipeline.scores.rounding == HALF_AWAY,
                                 scale=float(_scale(pipeline, problem.scale)),
                                 logits_away=pipeline.logits.rounding == HALF_AWAY,
                                 p_away=pipeline.probabilities.rounding == HALF_AWAY)
    return s, correction


def _visible_columns(run: Run, i0: int, i1: int, j0: int, j1: int, state: TileState,
                     columns: VisibleColumns | None = None) -> tuple[int, int]:
    """Columns [j0, j1) of a key tile cut after the last one an explicit mask leaves visible to rows [i0, i1) (a
    causal mask tensor: the tile's part past the diagonal), as the band's key range already cuts band masks.
    `columns`: the rows' `run.mask.visible_columns`, where the caller has read them."""
    if state is not TileState.PARTIAL:
        return j0, j1
    return j0, (run.mask.visible_end(i0, i1, j0, j1) if columns is None else columns.visible_end(j0, j1))


def _products(pipeline: AttentionPipeline, p: torch.Tensor, v: torch.Tensor, j0: int, j1: int, quant) -> torch.Tensor:
    """P V of one key block, [c * N2, G * rows, Dv], rounded at the products stage; int8 inputs quantise P with
    quant_scale1 first (AscendQuant: fp16 P times the fp16 scale) and dequantise the int32 products with deq_scale2
    (one fp16 rounding)."""
    cols = p.shape[-1]
    p = p.reshape(v.shape[0], -1, cols)
    if quant is None:
        return _rounded(pipeline.products, _cube(p, v[:, j0:j1], pipeline.products))
    p_q = ASCEND_QUANT(p, torch.tensor(quant.quant1, device=p.device), None).to(torch.float32)
    return round_float(_gemm(p_q, v[:, j0:j1]) * quant.deq2, torch.float16).to(torch.float32)


@torch.no_grad()
def backward(problem: AttentionProblem, pipeline: GradPipeline, query, key, value, dy, attention_in, softmax_max,
             softmax_sum, dq, dk, dv, dpse_source: torch.Tensor | None, dsink_acc: torch.Tensor | None = None) -> None:
    """The gradients of every run (as `flash_backward.backward`), P and dS rounded before their GEMMs and the
    gradients rounded once at the end, as `pipeline` says."""
    workspace = _workspace(query.device)
    try:
        for run, dk_view, dv_view in runs_to_fill(problem, dk, dv):
            workspace.reserve(_grad_buffers(problem, run))
            _backward_run(problem, pipeline, run, query, key, value, dy, attention_in, softmax_max, softmax_sum,
                          problem.q_view(dq, run), dk_view, dv_view, dpse_source, dsink_acc, workspace)
    finally:  # a call that fails keeps no more than one that returns
        workspace.release_above(GRAD_WORKSPACE_BYTES)


def _grad_buffers(problem: AttentionProblem, run: Run) -> dict[str, tuple[int, torch.dtype]]:
    """(elements, dtype) of each buffer `_GradGemms` takes from its workspace."""
    f32, f64 = torch.float32, torch.float64
    entries, width, rows = run.count * problem.heads_kv, KEY_TILE, problem.group * min(BLOCK_Q, run.seq_q)
    keys, values = entries * run.seq_kv * problem.dim_qk, entries * run.seq_kv * problem.dim_v
    tile = entries * rows * width
    q_tile, dy_tile = entries * rows * problem.dim_qk, entries * rows * problem.dim_v
    return {"k": (keys, f32), "kv64": (keys + values, f64), "acc": (keys + values, f32),
            "qdy64": (q_tile + dy_tile, f64), "dyq": (q_tile + dy_tile, f32), "dq": (q_tile, f32),
            "sdp": (2 * tile, f64), "pds": (2 * tile, f32),
            "dvdk": (entries * width * (problem.dim_qk + problem.dim_v), f32),
            "dk": (entries * width * problem.dim_qk, f32)}


def _backward_run(problem: AttentionProblem, pipeline: GradPipeline, run: Run, query, key, value, dy, attention_in,
                  softmax_max, softmax_sum, dq_view, dk_view, dv_view, dpse_source, dsink_acc,
                  scratch: _Workspace) -> None:
    c, n2, heads = run.count, problem.heads_kv, problem.heads_q
    f32 = torch.float32
    device = query.device
    gemms = _GradGemms(problem, run, key, value, scratch)
    q_run, dy_run, o_run = problem.q_view(query, run), problem.q_view(dy, run), problem.q_view(attention_in, run)
    max_all = problem.stat_view(softmax_max, run)[..., 0].to(f32)
    sum_all = problem.stat_view(softmax_sum, run)[..., 0].to(f32)
    pse_grad = pse_grad_target(run, dpse_source)
    d_sum_all = None if dsink_acc is None else torch.empty_like(max_all)
    scale = float(problem.scale)
    fused = _GradScores.applies(run, device)
    for i0 in range(0, run.seq_q, BLOCK_Q):
        i1 = min(i0 + BLOCK_Q, run.seq_q)
        rows = i1 - i0
        dy_t = dy_run[:, :, i0:i1].to(f32)
        gemms.query_tile(group_rows(q_run[:, :, i0:i1].to(f32), n2), group_rows(dy_t, n2))
        d_sum = row_sums(dy_t, o_run[:, :, i0:i1], f32)  # rowsum(dY * O), D
        if d_sum_all is not None:
            d_sum_all[:, :, i0:i1] = d_sum
        stats = [t.contiguous() for t in (max_all[:, :, i0:i1], sum_all[:, :, i0:i1], d_sum)]
        scores = (_GradScores if fused else _TorchGradScores)(problem, pipeline, run, stats, i0, i1, scratch)
        lo, hi = run.mask.key_range(i0, i1)
        # the columns of the key tiles below (whole KEY_TILE steps from the one holding lo)
        columns = run.mask.visible_columns(i0, i1, lo - lo % KEY_TILE, min(run.seq_kv, -(-hi // KEY_TILE) * KEY_TILE))
        for tile_start, tile_end, state in key_tiles(run, i0, i1, KEY_TILE, columns=columns):
            j0, j1 = _visible_columns(run, i0, i1, max(tile_start, lo), min(tile_end, hi), state, columns)
            s, dp = gemms.scores(j0, j1)
            gemms.gradients(*scores.tile(s, dp, gemms.pair_buffer(j1 - j0), j0, j1, state, pse_grad), j0, j1)
        dq_view[:, :, i0:i1] = _rounded_(pipeline.query_outputs, gemms.dq.mul_(scale)).view(c, heads, rows, -1)
    dk_view.copy_(_rounded_(pipeline.outputs, gemms.dk.mul_(scale)).view(dk_view.shape))
    dv_view.copy_(_rounded_(pipeline.outputs, gemms.dv).view(dv_view.shape))
    if dsink_acc is not None:
        terms = sinks.sink_grad_terms_from_rowsum(d_sum_all, max_all, sum_all,
                                                  sinks.head_values(problem.sink, f32, query.device))
        dsink_acc += terms.sum(dim=(0, 2)).to(dsink_acc.dtype)


def _paired(problem: AttentionProblem) -> bool:
    """Whether `_GradGemms` takes its GEMMs in pairs: Q and V of one head dimension."""
    return problem.dim_qk == problem.dim_v


class _GradGemms:
    """The gradient's GEMMs over one run, in `_Workspace` buffers: S = Q K^T and dP = dY V^T as exact sums (float64,
    rounded once: dP - D cancels; K and V widened once per run, Q and dY per query tile), dV += P^T dY, dQ += dS K
    and dK += dS^T Q in fp32 (docs/semantics/precision.md, "Gradients"); each tile's dV and dK products go into a
    buffer added to their rows (a slice's baddbmm_ goes per batch). Where Q and V have one head dimension, the pairs
    (K, V), (Q, dY), (S, dP), (P, dS) and (dV, dK) sit side by side, so that S and dP are one batched GEMM and dV and
    dK another, with one add: each matrix of a batch is the GEMM it was alone (the same bits), with half the calls."""

    def __init__(self, problem: AttentionProblem, run: Run, key, value, scratch: _Workspace) -> None:
        self.scratch = scratch
        self.entries, self.dim = run.count * problem.heads_kv, problem.dim_qk
        self.paired = _paired(problem)
        device = key.device
        f32, f64 = torch.float32, torch.float64
        key_run, value_run = problem.kv_view(key, run), problem.kv_view(value, run)
        e, skv = self.entries, run.seq_kv
        self.k = scratch.take("k", key_run.shape, f32, device).copy_(key_run).view(e, skv, -1)
        kv64 = scratch.take("kv64", (e * skv * (problem.dim_qk + problem.dim_v),), f64, device)
        self.k64 = kv64[: self.k.numel()].view(self.k.shape).copy_(self.k)
        self.v64 = kv64[self.k.numel() :].view(e, skv, -1).copy_(value_run.reshape(e, skv, -1))
        acc = scratch.take("acc", (e * skv * (problem.dim_qk + problem.dim_v),), f32, device).zero_()
        self.dv = acc[: self.v64.numel()].view(self.v64.shape)  # dV first: P's product comes first in the pair
        self.dk = acc[self.v64.numel() :].view(self.k.shape)
        if self.paired:
            self.kv64, self.acc = kv64.view(2 * e, skv, -1), acc.view(2 * e, skv, -1)

    def query_tile(self, q_tile: torch.Tensor, dy_g: torch.Tensor) -> None:
        """The next query tile's Q and dY (fp32, [c * N2, G * rows, D]); dq starts at 0."""
        f32, f64, device = torch.float32, torch.float64, q_tile.device
        shape, n_q, n_dy = q_tile.shape, q_tile.numel(), dy_g.numel()
        qdy64 = self.scratch.take("qdy64", (n_q + n_dy,), f64, device)
        self.q64 = qdy64[:n_q].view(shape).copy_(q_tile)
        self.dy64 = qdy64[n_q:].view(dy_g.shape).copy_(dy_g)
        dyq = self.scratch.take("dyq", (n_q + n_dy,), f32, device)  # dY first, as dV first
        self.dy = dyq[:n_dy].view(dy_g.shape).copy_(dy_g)
        self.q = dyq[n_dy:].view(shape).copy_(q_tile)
        if self.paired:
            self.qdy64, self.dyq = qdy64.view(2 * shape[0], *shape[1:]), dyq.view(2 * shape[0], *shape[1:])
        self.dq = self.scratch.take("dq", (*shape[:-1], self.dim), f32, device).zero_()

    def scores(self, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, dP) of the key tile [j0, j1): float64 [c * N2, G * rows, cols] each."""
        e, rows, cols = self.entries, self.q64.shape[1], j1 - j0
        out = self.scratch.take("sdp", (2 * e, rows, cols), torch.float64, self.k.device)
        if self.paired:
            torch.bmm(self.qdy64, self.kv64[:, j0:j1].transpose(1, 2), out=out)
        else:
            torch.bmm(self.q64, self.k64[:, j0:j1].transpose(1, 2), out=out[:e])
            torch.bmm(self.dy64, self.v64[:, j0:j1].transpose(1, 2), out=out[e:])
        return out[:e], out[e:]

    def gradients(self, p: torch.Tensor, ds: torch.Tensor, j0: int, j1: int) -> None:
        """dV += P^T dY, dQ += dS K, dK += dS^T Q for the key tile [j0, j1); p and ds (fp32 [c * N2, G * rows, cols])
        side by side in `pair_buffer` where the pairs are taken."""
        e, cols = self.entries, j1 - j0
        self.dq.baddbmm_(ds, self.k[:, j0:j1, : self.dim])
        if self.paired:
            pair = self.pair_buffer(cols)
            assert p.data_ptr() == pair[:e].data_ptr() and ds.data_ptr() == pair[e:].data_ptr()
            out = self.scratch.take("dvdk", (2 * e, cols, self.dim), torch.float32, self.k.device)
            self.acc[:, j0:j1].add_(torch.bmm(pair.transpose(1, 2), self.dyq, out=out))
            return
        dv_out = self.scratch.take("dvdk", (e, cols, self.dv.shape[-1]), torch.float32, self.k.device)
        self.dv[:, j0:j1].add_(torch.bmm(p.transpose(1, 2), self.dy, out=dv_out))
        dk_out = self.scratch.take("dk", (e, cols, self.dim), torch.float32, self.k.device)
        self.dk[:, j0:j1].add_(torch.bmm(ds.transpose(1, 2), self.q[..., : self.dim], out=dk_out))

    def pair_buffer(self, cols: int) -> torch.Tensor:
        """[2 * c * N2, G * rows, cols] fp32: P's rows, then dS's, for the tile's scores to fill."""
        return self.scratch.take("pds", (2 * self.entries, self.q64.shape[1], cols), torch.float32, self.k.device)


def _rounded_(cast: Cast, x: torch.Tensor) -> torch.Tensor:
    """`_rounded(cast, x)` for fp32 `x`, into x itself (a contiguous accumulator, no longer needed unrounded)."""
    if cast.dtype != torch.float32 and native.usable(x) and x.is_contiguous():
        return native.npu_round(x, cast.dtype == torch.float16, cast.rounding == HALF_AWAY, out=x)
    return x.copy_(_rounded(cast, x))


class _GradScores:
    """A query tile's rounded P and dS per key tile [c * N2, G * rows, cols] (fp32, for the fp32 GEMMs) from the
    float64 S and dP: one native pass (`native.npu_grad_scores`) forms P (its exponential is the exact mode's, as the
    forward's `softmax_step`), dS = P (dP - D) and both casts at once, reading the mask as the band's bounds and the
    mask tensor's bytes. Runs without pse and dropout, on the CPU with the library."""

    def __init__(self, problem: AttentionProblem, pipeline: GradPipeline, run: Run, stats, i0: int, i1: int,
                 scratch: _Workspace) -> None:
        self.problem, self.run, self.i0, self.i1, self.stats = problem, run, i0, i1, stats
        self.kinds = [native.npu_cast_kind(cast.dtype, cast.rounding == HALF_AWAY)
                      for cast in (pipeline.probabilities, pipeline.score_grad)]
        self.bounds = run.mask.row_bounds(i0, i1, stats[0].device)

    @staticmethod
    def applies(run: Run, device: torch.device) -> bool:
        return run.pse is None and run.dropout is None and device.type == "cpu" and native.library() is not None

    def tile(self, s, dp, out: torch.Tensor, j0: int, j1: int, state: TileState,
             pse_grad) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, dS) of the key tile [j0, j1) into `out` [2 * c * N2, G * rows, cols] (P's rows, then dS's)."""
        p, ds = out[: s.shape[0]], out[s.shape[0] :]
        bounds = mask = None
        if state is TileState.PARTIAL:
            bounds = None if self.bounds is None else (*self.bounds, j0)
            if self.run.mask.explicit is not None:
                mask = self.run.mask.explicit[..., self.i0:self.i1, j0:j1]
                mask = mask if mask.stride(-1) == 1 else mask.contiguous()
        native.npu_grad_scores(s, dp, *self.stats, float(self.problem.scale), self.problem.heads_q,
                               self.i1 - self.i0, p, ds, *self.kinds, bounds=bounds, mask=mask)
        return p, ds


def _exp_shifted(s: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """exp(s - row_max) in place: torch.exp, where `_GradScores` (the native pass) is not taken."""
    return s.sub_(row_max).exp_()


class _TorchGradScores:
    """`_GradScores` in PyTorch ops (no native library, a pse or dropout): the same roundings, torch.exp's
    exponential, the pse gradient from the unrounded dS."""

    def __init__(self, problem: AttentionProblem, pipeline: GradPipeline, run: Run, stats, i0: int, i1: int,
                 scratch: _Workspace) -> None:
        self.problem, self.pipeline, self.run, self.i0, self.i1 = problem, pipeline, run, i0, i1
        self.row_max, self.row_sum, self.d_sum = (t.unsqueeze(-1) for t in stats)

    def tile(self, s, dp, out: torch.Tensor, j0: int, j1: int, state: TileState,
             pse_grad) -> tuple[torch.Tensor, torch.Tensor]:
        f32, problem, run, i0, i1 = torch.float32, self.problem, self.run, self.i0, self.i1
        p_out, ds_out = out[: s.shape[0]], out[s.shape[0] :]
        s = s.to(f32).view(run.count, problem.heads_q, i1 - i0, j1 - j0)
        s.mul_(float(problem.scale))
        if run.pse is not None:
            s.add_(run.pse.tile(i0, i1, j0, j1, s.device, f32))
        if state is TileState.PARTIAL:
            add_mask_bias(s, run.mask.bias_tile(i0, i1, j0, j1, f32, s.device),
                          finite=bool(torch.isfinite(s.sum())), in_place=True)
        p = _exp_shifted(s, self.row_max).div_(self.row_sum)
        dp = dp.to(f32).view(p.shape)
        p_drop = p
        if run.dropout is not None:
            keep = run.dropout.keep_tile(i0, i1, j0, j1, p.device).to(f32) / problem.keep_prob
            p_drop, dp = p * keep, dp * keep
        p_out.copy_(_rounded(self.pipeline.probabilities, p_drop).view(p_out.shape))
        ds = dp.sub_(self.d_sum).mul_(p)
        if pse_grad is not None:
            run.pse.accumulate_grad(pse_grad, i0, i1, j0, j1, ds)
        ds_out.copy_(_rounded(self.pipeline.score_grad, ds).view(ds_out.shape))
        return p_out, ds_out


class _Scratch:
    """Buffers reused from one query tile to the next, by name: a fresh multi-megabyte tensor per tile costs its new
    pages (at DSA shapes the selected rows in float64 are ~150 MB a tile)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        count = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < count or buffer.dtype != dtype:
            buffer = self._buffers[name] = torch.empty(count, dtype=dtype, device=device)
        return buffer[:count].view(shape)


class _Workspace:
    """The gradient's buffers (widened K and V, the dK / dV accumulators, the tiles), cut by name from one block of
    memory per thread and device that is kept from call to call while it is at most GRAD_WORKSPACE_BYTES: memory
    freed at the end of a call goes back to the system, and ~70 MB of new pages per call (B=1 N=8 S=2048 D=128)
    cost ~30 ms of page faults in a ~500 ms gradient. A block larger than glibc's largest mmap threshold (32 MiB) is
    mapped apart from the heap, so keeping it leaves what other kernels' freed memory does as it was."""

    ALIGN = 64

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._block: torch.Tensor | None = None
        self._slots: dict[str, tuple[int, int, torch.dtype]] = {}
        self._views: dict[tuple, torch.Tensor] = {}

    def reserve(self, sizes: dict[str, tuple[int, torch.dtype]]) -> None:
        """Slots for buffers of up to `sizes[name]` = (elements, dtype) each, for the `take` calls that follow."""
        self._slots, self._views, offset = {}, {}, 0
        for name, (count, dtype) in sizes.items():
            self._slots[name] = (offset, count, dtype)
            offset += -(-count * dtype.itemsize // self.ALIGN) * self.ALIGN
        if self._block is None or self._block.numel() < offset:
            self._block = None  # freed before its successor is allocated
            self._block = torch.empty(max(offset, MMAP_BYTES), dtype=torch.uint8, device=self.device)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, tuple(shape))
        view = self._views.get(key)
        if view is None:
            offset, capacity, slot_dtype = self._slots[name]
            count = math.prod(shape)
            assert count <= capacity and dtype == slot_dtype and device == self.device, (name, shape, dtype)
            view = self._views[key] = self._block[offset : offset + count * dtype.itemsize].view(dtype).view(shape)
        return view

    def release_above(self, size: int) -> None:
        """Frees the block where it is larger than `size` bytes (its views too: each would keep it alive)."""
        if self._block is not None and self._block.numel() > size:
            self._block, self._slots, self._views = None, {}, {}


GRAD_WORKSPACE_BYTES = 1 << 28
MMAP_BYTES = (32 << 20) + 4096
_workspaces = threading.local()


def _workspace(device: torch.device) -> _Workspace:
    """This thread's `_Workspace` on `device`."""
    spaces = _workspaces.__dict__.setdefault("by_device", {})
    if device not in spaces:
        spaces[device] = _Workspace(device)
    return spaces[device]


class _WideRows:
    """K (key ++ rope) and V of a sparse sequence widened once per sequence to the dtype their GEMMs sum in
    (`_cube`: float64 for an exact sum, fp32 for one that accumulates in fp32), and the selected rows gathered from
    them into `_Scratch` buffers."""

    def __init__(self, seq, scratch: _Scratch, dtype: torch.dtype) -> None:
        self.dim_v = seq.v.shape[-1]
        self.k = seq.k.to(dtype)
        self.v = None if seq.value_is_key else seq.v.to(dtype)  # None: V is K's first columns
        self.scratch = scratch

    def _gather(self, name: str, source: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.scratch.take(name, (tokens.numel(), source.shape[-1]), source.dtype, source.device)
        torch.index_select(source, 0, tokens.reshape(-1), out=rows)
        return rows.view(*tokens.shape, source.shape[-1])

    def rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [rows, E, D] of the selected `tokens` [rows, E]."""
        keys = self._gather("k", self.k, tokens)
        return keys, keys[..., : self.dim_v] if self.v is None else self._gather("v", self.v, tokens)


def _selected(seq, wide: _WideRows, selection, t0: int, t1: int):
    """Rows [t0, t1) of a sparse sequence: their selection, the query (++ rope) [rows, N1, Dqk] in fp32 and the
    selected keys / values [rows, E, D] in `wide`'s dtype (invalid entries point at token 0 and are masked by the
    caller)."""
    sel = selection.rows(t0, t1)
    q = seq.q[t0:t1].to(torch.float32)
    if seq.q_rope is not None:
        q = torch.cat([q, seq.q_rope[t0:t1].to(torch.float32)], dim=-1)
    return sel, q, *wide.rows(sel.tokens)


@torch.no_grad()
def sparse_forward_sequence(seq, pipeline: AttentionPipeline, scale: float, sparse_mode: int, block_size: int,
                            out: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> None:
    """SparseFlashAttention of one sequence (`sparse_attention.SparseSequence`) rounded as `pipeline` says: out
    [Sq, N1, Dv] (fp32 rows, unrounded, when a sink is merged afterwards; else the output rows), row_max / row_sum
    [Sq, N1]. The selected keys are taken in steps of `SFA_KEY_BLOCK` entries (online softmax), with the AMLA step
    when the pipeline has it."""
    selection = sequence_selection(seq, sparse_mode, block_size)
    exact_sums = pipeline.scores.dtype != torch.float32 or pipeline.products.dtype != torch.float32
    wide = _WideRows(seq, _Scratch(), torch.float64 if exact_sums else torch.float32)
    for t0 in range(0, seq.seq_q, BLOCK_Q):
        t1 = min(t0 + BLOCK_Q, seq.seq_q)
        sel, q, keys, values = _selected(seq, wide, selection, t0, t1)
        scores = _cube(q.to(keys.dtype), keys.transpose(1, 2), pipeline.scores)
        s_all = pipeline.logits(pipeline.scores(scores) * _scale(pipeline, scale))
        s_all.masked_fill_(~sel.valid.unsqueeze(1), float("-inf"))
        m, total, divisor, acc = _sparse_online(pipeline, s_all, values)
        has_keys = m != float("-inf")
        o = acc / pipeline.divisor(torch.where(has_keys, divisor, 1.0)).unsqueeze(-1)
        out[t0:t1] = (o if out.dtype == torch.float32 else pipeline.output(o)).masked_fill_(~has_keys.unsqueeze(-1), 0)
        row_max[t0:t1] = torch.where(has_keys, m, INVALID_MAX)
        row_sum[t0:t1] = torch.where(has_keys, total, 0.0)


def _sparse_online(pipeline: AttentionPipeline, s_all: torch.Tensor, values: torch.Tensor):
    """(row max, row sum, divisor, running output) over the selected entries of logits [rows, N1, E] in steps of
    SFA_KEY_BLOCK; with AMLA the divisor is the sum times the last step's factor, else the sum."""
    rows, heads, entries = s_all.shape
    m = torch.full((rows, heads), float("-inf"))
    total = torch.zeros((rows, heads))
    acc = torch.zeros((rows, heads, values.shape[-1]))
    n = cof = c = None
    for e0 in range(0, entries, SFA_KEY_BLOCK):
        e1 = min(e0 + SFA_KEY_BLOCK, entries)
        s = s_all[..., e0:e1]
        new_m = torch.maximum(m, s.amax(-1))
        shift = torch.where(new_m == float("-inf"), 0.0, new_m)
        p = torch.exp(s - shift.unsqueeze(-1))
        total = total * torch.exp(m - shift) + p.sum(-1)
        if pipeline.amla:
            new_n, c, new_cof = amla_factor(shift, pipeline.probabilities)
            p = p * c.unsqueeze(-1)
            if n is not None:
                acc = amla_rescale_bits(acc, n, new_n, cof, new_cof)
            n, cof = new_n, new_cof
        else:
            acc = acc * torch.exp(m - shift).unsqueeze(-1)
        products = pipeline.products(_cube(pipeline.probabilities(p).to(values.dtype), values[:, e0:e1],
                                           pipeline.products))
        acc = pipeline.accumulator(acc + products)
        m = new_m
    divisor = total * c if c is not None else total
    return m, total, divisor, acc


@torch.no_grad()
def sparse_backward_sequence(seq, pipeline: GradPipeline, d_out, out, row_max, row_sum, scale: float,
                             sparse_mode: int, block_size: int, dq, dk, dv) -> None:
    """SparseFlashAttentionGrad of one sequence: dq [Sq, N1, Dqk] written, dk [Skv, Dqk] / dv [Skv, Dv] (fp32)
    accumulated, dq and dk times the scale; P and dS rounded before their GEMMs as `pipeline` says (the outputs are
    rounded by the caller)."""
    f32 = torch.float32
    selection = sequence_selection(seq, sparse_mode, block_size)
    scratch = _Scratch()
    wide = _WideRows(seq, scratch, torch.float64)
    for t0 in range(0, seq.seq_q, BLOCK_Q):
        t1 = min(t0 + BLOCK_Q, seq.seq_q)
        sel, q, keys, values = _selected(seq, wide, selection, t0, t1)
        valid = sel.valid.unsqueeze(1)
        has_keys = sel.row_has_keys.unsqueeze(-1)
        s = _gemm(q, keys.transpose(1, 2)).to(f32) * scale
        shift = torch.where(has_keys, row_max[t0:t1].to(f32), 0.0).unsqueeze(-1)
        inv_sum = torch.where(has_keys, 1.0 / row_sum[t0:t1].to(f32), 0.0).unsqueeze(-1)
        p = (torch.exp(s - shift) * inv_sum).masked_fill_(~valid, 0.0)
        do = d_out[t0:t1].to(f32)
        d_sum = (do * out[t0:t1].to(f32)).sum(-1, keepdim=True)
        dp = _gemm(do, values.transpose(1, 2)).to(f32)
        ds = pipeline.score_grad((p * (dp - d_sum)).masked_fill_(~valid, 0.0))
        p_cast = pipeline.probabilities(p)
        # S and dP above are exact sums; dQ, dK and dV accumulate in fp32 (docs/semantics/precision.md, "Gradients")
        keys32 = scratch.take("k_fp32", keys.shape, f32, keys.device).copy_(keys)
        dq[t0:t1] = torch.bmm(ds, keys32).mul_(scale)
        dk_sel = torch.bmm(ds.transpose(1, 2), q, out=scratch.take("dk", (*keys.shape[:2], q.shape[-1]), f32,
                                                                   q.device)).mul_(scale)
        dv_sel = torch.bmm(p_cast.transpose(1, 2), do, out=scratch.take("dv", (*keys.shape[:2], do.shape[-1]), f32,
                                                                        do.device))
        dk.index_add_(0, sel.tokens.reshape(-1), dk_sel.flatten(0, 1))
        dv.index_add_(0, sel.tokens.reshape(-1), dv_sel.flatten(0, 1))


def quant_index_scores(pipeline: QuantIndexerPipeline, q_idx: torch.Tensor, k_idx: torch.Tensor,
                       weights: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """[rows, Skv] QuantLightningIndexer scores of int8 query rows q_idx [rows, H, D] against keys k_idx [Skv, D],
    rounded as `pipeline` says (the order of the scores is what the operator returns)."""
    rows, heads, dim = q_idx.shape
    dots = _gemm(q_idx.reshape(1, rows * heads, dim), k_idx.transpose(0, 1).unsqueeze(0)).view(rows, heads, -1)
    dots = pipeline.dots(dots.relu_() * pipeline.dot_scale)
    folded = pipeline.folded(pipeline.folded(weights) * pipeline.folded(q_scale))
    scores = pipeline.scores(_gemm(folded.unsqueeze(1), dots).squeeze(1))
    return scores * k_scale.to(torch.float32).view(1, -1)


def _head_sum(terms: torch.Tensor, group: int) -> torch.Tensor:
    """sum over dim 1 of fp32 `terms` [rows, H, Skv] in LightningIndexer's order (`IndexerPipeline`): later groups
    of `group` heads added into the first group's rows, then a halving tree (each addition one fp32 rounding)."""
    acc = terms[:, :group].clone()
    for h0 in range(group, terms.shape[1], group):
        part = terms[:, h0 : h0 + group]
        acc[:, : part.shape[1]] += part
    count = acc.shape[1]
    if count == 1:
        return acc[:, 0]
    width = count if count <= 2 else 1 << (count.bit_length() - 1)  # the largest power of two <= count
    if count > width:
        acc[:, : count - width] += acc[:, width:count]
    while width > 2:
        width //= 2
        acc[:, :width] += acc[:, width : 2 * width]
    return acc[:, 0] + acc[:, 1]


def index_scores(pipeline: IndexerPipeline, q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor,
                 q_scale=None, k_scale=None) -> torch.Tensor:
    """[rows, Skv] LightningIndexer scores of query rows q_idx [rows, H, D] against keys k_idx [Skv, D], weights
    [rows, H], rounded and summed as `pipeline` says (`indexer.top_k_sequence`'s `npu_scores`; no dequant scales)."""
    rows, heads, dim = q_idx.shape
    dots = _gemm(q_idx.reshape(1, rows * heads, dim), k_idx.transpose(0, 1).unsqueeze(0)).view(rows, heads, -1)
    terms = pipeline.dots(dots.relu_()) * weights.to(torch.float32).unsqueeze(-1)
    return _head_sum(terms, pipeline.head_group)
