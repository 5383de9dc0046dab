"""int8 PromptFlashAttention pipeline, applied literally (docs/operators/prompt_flash_attention.md).

s32 = Q_i8 K_i8^T (exact); s = fp16(s32 * deq1); in fp32: s = s * scale (+ pse_shift), mask; m = the exact row
max, l = sum exp(s - m); p = exp(s - m) unnormalised; p_q = sat_int8(round_half_even(p * quant_scale1));
o = (p_q V_i8)(exact) * deq2 / l; int8 output: sat_int8(round_half_even(o * quant_scale2 + quant_offset2)).

Because p is quantized before normalisation it needs the final row max: the kernel makes two passes over
the key tiles of each query tile (max first, then p and the products). int8 x int8 GEMMs run in fp32, exact
because every partial sum of one tile is an integer below 2^24; tiles are accumulated in float64.
"""

from __future__ import annotations

import torch

from ...problem.attention import AttentionProblem, Run
from ...problem.mask import TileState
from ...problem.precision import PostQuant, round_float
from ...problem.quant import round_to_int8
from .flash_forward import group_rows, key_tiles

# 127 * 128 * 512 < 2^24 for the QK^T product (D <= 512); 128 * 128 * BLOCK_KV < 2^24 for P_q V.
QUANT_BLOCK_Q = 256
QUANT_BLOCK_K = 512


def forward(problem: AttentionProblem, query, key, value, out, plan) -> None:
    """int8 inputs: fill `out` ([B, N, S, D] view, fp16 or int8) for every run."""
    for run in problem.runs:
        if run.seq_q > 0 and run.seq_kv > 0:
            _run(problem, run, query, key, value, problem.q_view(out, run), plan)


def quantize_output(problem: AttentionProblem, dense: torch.Tensor, row_valid: torch.Tensor, out: torch.Tensor,
                    plan, post_quant: PostQuant | None = None) -> None:
    """fp16/bf16 inputs with int8 output: quantize the fp32 attention output (by the exact rule, or as the kernel's
    `post_quant` step rounds in the "npu" precision mode); rows with no visible key (and rows beyond the actual query
    length) stay 0 rather than quant(0) + offset. `row_valid` is [B, N, S]."""
    for run in problem.runs:
        if run.seq_q > 0:
            rows = problem.q_view(dense, run)
            valid = row_valid[run.b0 : run.b0 + run.count, :, : run.seq_q].unsqueeze(-1)
            quantised = _quantize(rows, plan) if post_quant is None else post_quant(
                rows, plan.scale2.to(rows.device), None if plan.offset2 is None else plan.offset2.to(rows.device))
            problem.q_view(out, run).copy_(quantised.masked_fill_(~valid, 0))


def _quantize(o: torch.Tensor, plan) -> torch.Tensor:
    scale = plan.scale2.to(o.device)
    y = o * scale
    if plan.offset2 is not None:
        y = y + plan.offset2.to(o.device)
    return round_to_int8(y)


def _scores(problem, run: Run, q_tile, k_all, plan, i0, i1, j0, j1, state: TileState) -> torch.Tensor:
    c, rows, cols = run.count, i1 - i0, j1 - j0
    s32 = torch.bmm(q_tile, k_all[:, j0:j1].transpose(1, 2))
    # The single fp16 rounding of the dequantized product; s32 * deq1 is exact in float64.
    s = round_float(s32.double() * plan.deq1, torch.float16).to(torch.float32)
    s = s.view(c, problem.heads_q, rows, cols) * problem.scale
    if run.pse is not None:
        s = s + run.pse.tile(i0, i1, j0, j1, s.device, torch.float32)
    if state is TileState.PARTIAL:
        run.mask.exclude_masked_(s, i0, i1, j0, j1)
    return s


def _run(problem: AttentionProblem, run: Run, query, key, value, out_view, plan) -> None:
    c, n2 = run.count, problem.heads_kv
    q_all = problem.q_view(query, run).to(torch.float32)
    k_all = problem.kv_view(key, run).to(torch.float32).reshape(c * n2, run.seq_kv, -1)
    v_all = problem.kv_view(value, run).to(torch.float32).reshape(c * n2, run.seq_kv, -1)
    d = v_all.shape[-1]
    for i0 in range(0, run.seq_q, QUANT_BLOCK_Q):
        i1 = min(i0 + QUANT_BLOCK_Q, run.seq_q)
        rows = i1 - i0
        q_tile = group_rows(q_all[:, :, i0:i1], n2)
        tiles = list(key_tiles(run, i0, i1, QUANT_BLOCK_K))
        row_max = torch.full((c, problem.heads_q, rows), float("-inf"), device=query.device)
        for j0, j1, state in tiles:
            s = _scores(problem, run, q_tile, k_all, plan, i0, i1, j0, j1, state)
            row_max = torch.maximum(row_max, s.amax(-1))
        shift = torch.where(row_max == float("-inf"), 0.0, row_max).unsqueeze(-1)
        row_sum = torch.zeros((c, problem.heads_q, rows), device=query.device)
        acc = torch.zeros((c * n2, q_tile.shape[1], d), dtype=torch.float64, device=query.device)
        for j0, j1, state in tiles:
            s = _scores(problem, run, q_tile, k_all, plan, i0, i1, j0, j1, state)
            p = torch.exp(s - shift)
            row_sum += p.sum(-1)
            p_q = round_to_int8(p * plan.quant1).to(torch.float32)
            acc += torch.bmm(p_q.view(c * n2, -1, j1 - j0), v_all[:, j0:j1]).double()
        valid = row_sum > 0
        o = (acc.to(torch.float32) * plan.deq2).view(c, problem.heads_q, rows, d)
        o = o / torch.where(valid, row_sum, 1.0).unsqueeze(-1)
        result = _quantize(o, plan) if plan.output_dtype == torch.int8 else o.to(plan.output_dtype)
        result.masked_fill_(~valid.unsqueeze(-1), 0)
        out_view[:, :, i0:i1].copy_(result)
