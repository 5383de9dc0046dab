"""Tiled FlashAttention forward over a canonical `AttentionProblem` (SEMANTICS.md sections 2-6).

Online softmax over key tiles of each query tile: never more than one [count, N1, BLOCK_Q, BLOCK_K] score
tile exists, and its buffer is reused (fresh multi-megabyte allocations cost page faults on every tile).
Tiles the mask structure hides are skipped; fully visible tiles skip the mask. GQA shares K/V across a group
by stacking the group's query rows into one GEMM ([count * N2, G * rows, D]). The softmax scale is folded
into the query tile and ALiBi (pse_type 2) into extra GEMM columns wherever `problem.pse` allows it.
"""

from __future__ import annotations

import math

import torch

from ...problem.attention import AttentionProblem, Run
from ...problem.mask import TileState
from ...problem.stats import FLT_MAX, accumulation_dtype

BLOCK_Q = 256
BLOCK_K = 256
# Unmasked problems keep every key tile: wider key tiles make both GEMMs more efficient there.
BLOCK_K_DENSE = 512
# exp() of arguments below ~-87 yields fp32 denormals, which the vectorised exp computes ~50x slower; such terms
# are < 1.7e-38 of the row's largest term, far below fp32 resolution, so they are computed as exp(EXP_FLOOR)
# (masked entries are zeroed exactly afterwards).
EXP_FLOOR = -87.0


def forward(problem: AttentionProblem, query, key, value, out, softmax_max=None, softmax_sum=None) -> None:
    """Fill `out` (query layout, Dv) and, when given, `softmax_max` / `softmax_sum` for every run of `problem`.
    Runs without keys are left alone: the caller's zero-initialised output is their result."""
    for run in problem.runs:
        if run.seq_q > 0 and run.seq_kv > 0:
            max_view = None if softmax_max is None else problem.stat_view(softmax_max, run)
            sum_view = None if softmax_sum is None else problem.stat_view(softmax_sum, run)
            RunKernel(problem, run, query, key, value).forward(problem.q_view(out, run), max_view, sum_view)


def group_rows(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """[c, N1, r, D] -> [c * N2, G * r, D] (contiguous): a GQA group's rows share one K/V matrix."""
    c, n1, r, d = t.shape
    return t.reshape(c * heads_kv, (n1 // heads_kv) * r, d)


def key_tiles(run: Run, i0: int, i1: int, block_k: int):
    """(j0, j1, state) of the key tiles rows [i0, i1) may see, in order."""
    lo, hi = run.mask.key_range(i0, i1)
    for j0 in range(lo - lo % block_k, hi, block_k):
        j1 = min(j0 + block_k, run.seq_kv)
        state = run.mask.tile_state(i0, i1, j0, j1)
        if state is TileState.EMPTY or run.mask.explicit_tile_all_masked(i0, i1, j0, j1):
            continue
        yield j0, j1, state


class RunKernel:
    """Per-run state shared by the forward and backward passes: converted K/V, buffers, score tiles."""

    def __init__(self, problem: AttentionProblem, run: Run, query, key, value) -> None:
        self.problem, self.run = problem, run
        self.dtype = accumulation_dtype(query.dtype)
        self.device = query.device
        c, n2 = run.count, problem.heads_kv
        self.q_all = problem.q_view(query, run)
        k = problem.kv_view(key, run).to(self.dtype).reshape(c * n2, run.seq_kv, -1)
        self.v = problem.kv_view(value, run).to(self.dtype).reshape(c * n2, run.seq_kv, -1)
        feats = None if run.pse is None else run.pse.linear_key_features(self.device, self.dtype)
        self.linear_pse = feats is not None
        if feats is not None:
            k = torch.cat([k, feats.expand(c * n2, -1, -1)], dim=-1)
        self.k = k
        # [c*N2, Dk, Skv]: Q K^T as a plain (NN) GEMM, ~14% faster than reading K transposed in every tile.
        self.k_t = k.transpose(1, 2).contiguous()
        dense = run.mask.lower is None and run.mask.upper is None and run.mask.explicit is None
        self.block_k = BLOCK_K_DENSE if dense else BLOCK_K
        rows = c * problem.heads_q * min(BLOCK_Q, run.seq_q) * min(self.block_k, run.seq_kv)
        self._buffer = torch.empty(rows, dtype=self.dtype, device=self.device)
        self._scratch: torch.Tensor | None = None

    def scratch(self, shape: torch.Size) -> torch.Tensor:
        """A second reusable tile-sized buffer (the backward's dP), allocated on first use."""
        if self._scratch is None:
            self._scratch = torch.empty_like(self._buffer)
        return self._scratch[: math.prod(shape)].view(shape)

    def query_tile(self, i0: int, i1: int) -> torch.Tensor:
        """Scaled query rows grouped for GEMM, with room for the linear-pse columns: [c*N2, G*rows, Dk]."""
        q = self.q_all[:, :, i0:i1].to(self.dtype) * self.problem.scale
        if self.linear_pse:
            q = torch.cat([q, q.new_zeros(*q.shape[:-1], 2)], dim=-1)
        return group_rows(q, self.problem.heads_kv)

    def _linear_query_features(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor | None:
        if not self.linear_pse:
            return None
        return self.run.pse.linear_query_features(i0, i1, j0, j1, self.device, self.dtype)

    def scores(
        self, q_tile: torch.Tensor, i0: int, i1: int, j0: int, j1: int, state: TileState
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Masked logits S = scale * Q K^T + bias of the tile, [c, N1, rows, cols] (a view of the buffer), and the
        tile's mask (True = masked) when it has one."""
        problem, run = self.problem, self.run
        c, rows, cols = run.count, i1 - i0, j1 - j0
        out = self._buffer[: c * problem.heads_q * rows * cols].view(q_tile.shape[0], -1, cols)
        kt = self.k_t[:, :, j0:j1]
        pse = run.pse
        if pse is None:
            torch.bmm(q_tile, kt, out=out)
        elif (feats := self._linear_query_features(i0, i1, j0, j1)) is not None:
            d = q_tile.shape[-1]
            feats = feats.expand(c, problem.heads_q, rows, 2)
            q_tile[:, :, d - 2 :] = group_rows(feats, problem.heads_kv)
            torch.bmm(q_tile, kt, out=out)
        else:
            if self.linear_pse:
                q_tile[:, :, -2:] = 0.0
            bias = pse.tile(i0, i1, j0, j1, self.device, self.dtype)
            out.view(c, problem.heads_q, rows, cols).copy_(bias.expand(c, problem.heads_q, rows, cols))
            out.baddbmm_(q_tile, kt)
        s = out.view(c, problem.heads_q, rows, cols)
        masked = None
        if state is TileState.PARTIAL:
            masked = run.mask.masked_tile(i0, i1, j0, j1, s.device)
            s.masked_fill_(masked, float("-inf"))
        return s, masked

    @staticmethod
    def exp_shifted_(s: torch.Tensor, shift: torch.Tensor, masked: torch.Tensor | None) -> torch.Tensor:
        """In place: s <- exp(s - shift) with masked entries exactly 0 (shift is [c, N1, rows, 1])."""
        s.sub_(shift).clamp_(min=EXP_FLOOR).exp_()
        if masked is not None:
            s.masked_fill_(masked, 0.0)
        return s

    def forward(self, out_view, max_view, sum_view) -> None:
        problem, run = self.problem, self.run
        c, n2 = run.count, problem.heads_kv
        dv = self.v.shape[-1]
        for i0 in range(0, run.seq_q, BLOCK_Q):
            i1 = min(i0 + BLOCK_Q, run.seq_q)
            rows = i1 - i0
            q_tile = self.query_tile(i0, i1)
            row_max = torch.full((c, problem.heads_q, rows), float("-inf"), dtype=self.dtype, device=self.device)
            row_sum = torch.zeros_like(row_max)
            acc = torch.zeros((c * n2, q_tile.shape[1], dv), dtype=self.dtype, device=self.device)
            for j0, j1, state in key_tiles(run, i0, i1, self.block_k):
                s, masked = self.scores(q_tile, i0, i1, j0, j1, state)
                new_max = torch.maximum(row_max, s.amax(-1))
                # A row that has seen nothing visible yet keeps max -inf; shift it by 0 to avoid inf - inf.
                shift = torch.where(new_max == float("-inf"), 0.0, new_max)
                self.exp_shifted_(s, shift.unsqueeze(-1), masked)
                correction = torch.exp(row_max - shift)
                row_sum.mul_(correction).add_(s.sum(-1))
                row_max = new_max
                if run.dropout is not None:
                    s.mul_(run.dropout.keep_tile(i0, i1, j0, j1, s.device))
                acc.mul_(correction.view(c * n2, -1, 1))
                acc.baddbmm_(s.view(c * n2, -1, j1 - j0), self.v[:, j0:j1])
            valid = row_sum > 0
            denom = torch.where(valid, row_sum * problem.keep_prob, 1.0).view(c * n2, -1, 1)
            result = (acc / denom).view(c, problem.heads_q, rows, dv)
            result.masked_fill_(~valid.unsqueeze(-1), 0.0)
            out_view[:, :, i0:i1].copy_(result)
            if max_view is not None:
                write_stat(max_view[:, :, i0:i1], torch.where(valid, row_max, -FLT_MAX))
                write_stat(sum_view[:, :, i0:i1], torch.where(valid, row_sum, FLT_MAX))


def write_stat(view: torch.Tensor, values: torch.Tensor) -> None:
    """Store a per-row statistic repeated over the 8-wide last dim (SEMANTICS.md section 6)."""
    view.copy_(values.unsqueeze(-1).expand_as(view))
