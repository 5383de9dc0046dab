"""Tiled FlashAttention forward over a canonical `AttentionProblem` (docs/semantics/masks.md,
docs/semantics/invalid-rows.md, docs/semantics/pse.md, docs/semantics/dropout.md, docs/semantics/softmax-stats.md).

Online softmax over key tiles of each query tile: never more than one [count, N1, rows, cols] score
tile exists, and its buffer is reused (fresh multi-megabyte allocations cost page faults on every tile).
Tiles the mask structure hides are skipped; fully visible tiles skip the mask. GQA shares K/V across a group
by stacking the group's query rows into one GEMM ([count * N2, G * rows, D]). The softmax scale rides on the
query tile (one small pass per query tile; K is read in place, transposed by the GEMM, so no key-sized copy is
made per call) and, in this PyTorch loop, ALiBi (pse_type 2) on extra GEMM columns wherever `problem.pse` allows it.

On the CPU in fp32 with a BLAS sgemm available, problems run through the fused native loop
(`native.fa_forward_blocks`): every thread takes whole (kv head, row block) items through QK^T, the bias tile, the
online softmax, the dropout bits and PV, instead of every GEMM being split over the threads (B=1 N=8 S=2048 D=128:
0.78 -> 0.89 of SDPA's throughput). ALiBi (types 2/3) is generated there per score block from each row's slope and
position (`alibi_rows`), which also lets 32-row blocks skip key pieces whose terms all flush to 0. Without a pse tensor
and dropout, and with a mask shared by the run, a query tile is one call; otherwise (a per-head bias tile, keep bits
read in place from the packed mask, per-sequence masks) one call per key tile, after the same entry skipping. The
tiling, the bias tiles, the skipping, the keep-bit addresses and the normalisation stay here and in `problem/`.

Exponentials come from `softmax_exp.exp_shifted_` (exp2-based, natural-unit logits, denormals flushed to 0).
"""

from __future__ import annotations

import functools
import math
import os
import time

import torch

from ...problem import sink as sinks
from ...problem.attention import AttentionProblem, Run
from ...problem.mask import TileState, VisibleColumns, add_mask_bias
from ...problem.pse import ALIBI_TYPES
from ...problem.stats import FLT_MAX, accumulation_dtype, value_column_scales
from . import native
from .softmax_exp import EXP2_FLOOR, LOG2E, exp_shifted_

# Score-tile budget in elements (16 MB fp32): it bounds memory whatever the batch and head counts.
TILE_ELEMENTS = 1 << 22
# Unmasked problems keep every key tile and take wide ones (fewer, larger GEMMs): MERGED_WIDTH columns and
# enough rows for DENSE_TILE_ELEMENTS (256 rows at 8 heads, up to 2048 rows for one head). Masked ones take
# 256 x 256 tiles, whose finer grain skips more of the masked area, merged up to MERGED_WIDTH columns where
# consecutive tiles are fully visible.
DENSE_TILE_ELEMENTS = 1 << 21
DENSE_ROWS = (256, 2048)
MASKED_TILE = (256, 256)
MERGED_WIDTH = 1024
MIN_TILE_ROWS = 16
ALIBI_TILE_WIDTH = 512
# The fused native forward (`native.fa_forward_blocks`): rows per work item and key columns per score block. A
# 256 x 512 fp32 score block (512 KB) is the one L2-sized buffer per thread; smaller row blocks re-pack the key
# panel more often (128 rows measured 5% slower, 64 rows 20%), narrower column blocks make more BLAS calls. On a 2 MB-L2
# AVX-512 Xeon (one thread, a C harness of the loop) 512 x 256, 256 x 1024, 512 x 512 and 128 x 1024 blocks measured
# 1.3%, 1.0%, 2.9% and 2.9% slower than 256 x 512.
FUSED_BLOCK_ROWS = 256
FUSED_SUB_COLS = 512
# Query rows per forward tile when every tile is one fused call (`RunKernel.forward_rows`); unmasked runs without
# generated ALiBi take DENSE_FORWARD_ROWS: one call for 2048 query rows packs each key piece once where 1024-row tiles
# packed it twice, and makes one Python pass instead of two (B=1 N=8 S=2048 D=128 fp32, one thread, CPU time,
# alternated in one process: 0.6-2.1% faster, the same bits). With ALiBi the key tiles go nearest each query tile's
# diagonal first, so the tile height sets the order of the online softmax's steps, and with it the floats.
FUSED_FORWARD_ROWS = 1024
DENSE_FORWARD_ROWS = 2048
# Slack (natural-log units) on the bound of an ALiBi tile's logits before it is skipped as underflowing: covers
# the fp32 rounding of the GEMM, of the ALiBi columns and of the exponent's argument many times over.
UNDERFLOW_SLACK = 1.0


def tile_shape(heads: int, seq_q: int, seq_kv: int, dense: bool, alibi: bool = False) -> tuple[int, int, int]:
    """(query rows, key columns, merged key columns) of the score tiles of a run with `heads` = count * N1
    score matrices, shrunk to stay within TILE_ELEMENTS. With ALiBi (`alibi`), key tiles stay ALIBI_TILE_WIDTH
    wide and unmerged: they go nearest the diagonal first, for the underflow skipping, and where ALiBi is folded into
    GEMM columns, wide tiles straddle the diagonal more often, where the bias has to be materialised."""
    width = MERGED_WIDTH
    while width > 128 and heads * MIN_TILE_ROWS * width > TILE_ELEMENTS:
        width //= 2
    if dense:
        block_q, block_k = min(DENSE_ROWS[1], max(DENSE_ROWS[0], DENSE_TILE_ELEMENTS // (heads * width))), width
    else:
        block_q, block_k = MASKED_TILE
    block_k = min(block_k, width, seq_kv)
    width = min(width, max(block_k, seq_kv))
    rows = max(MIN_TILE_ROWS, TILE_ELEMENTS // (heads * width))
    if alibi:
        block_k = width = min(block_k, ALIBI_TILE_WIDTH)
    return min(block_q, seq_q, rows), block_k, width


@torch.no_grad()  # kernels fill preallocated outputs; autograd pairs the ops one level up
def forward(problem: AttentionProblem, query, key, value, out, softmax_max=None, softmax_sum=None) -> None:
    """Fill `out` (query layout, Dv) and, when given, `softmax_max` / `softmax_sum` for every run of `problem`.
    Runs without keys are left alone: the caller's zero-initialised output is their result, and the caller
    prefills their statistics (`stats.allocate`)."""
    _planted_delay()
    for run in problem.runs:
        if run.seq_q > 0 and run.seq_kv > 0:
            max_view = None if softmax_max is None else problem.stat_view(softmax_max, run)
            sum_view = None if softmax_sum is None else problem.stat_view(softmax_sum, run)
            RunKernel(problem, run, query, key, value, forward_only=True).forward(problem.q_view(out, run), max_view,
                                                                                 sum_view)


# Test-only: seconds of CPU time to burn per forward call, a planted slowdown the performance guard's test must
# catch (tests/test_perf_guard.py, benchmarks/perf_guard.py). Read here only; unset in every real use.
PLANTED_DELAY = "CANN_ATTN_TEST_PLANTED_DELAY"


def _planted_delay() -> None:
    delay = os.environ.get(PLANTED_DELAY)
    if delay:
        end = time.thread_time() + float(delay)
        while time.thread_time() < end:  # busy, not sleeping: a slow kernel costs CPU time, which the guard clocks
            pass


def group_rows(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """[c, N1, r, D] -> [c * N2, G * r, D] (a view where the strides allow, else a copy): a GQA group's rows
    share one K/V matrix."""
    c, n1, r, d = t.shape
    return t.reshape(c * heads_kv, (n1 // heads_kv) * r, d)


def key_tiles(run: Run, i0: int, i1: int, block_k: int, max_width: int | None = None,
              columns: VisibleColumns | None = None):
    """(j0, j1, state) of the key tiles rows [i0, i1) may see, in order: block_k-wide tiles, except that runs of
    consecutive fully visible tiles merge into tiles up to `max_width` wide (fewer, larger GEMMs). `columns`: the
    rows' `run.mask.visible_columns`, where the caller has read them."""
    max_width = max_width or block_k
    lo, hi = run.mask.key_range(i0, i1)
    merged: tuple[int, int] | None = None
    for j0 in range(lo - lo % block_k, hi, block_k):
        j1 = min(j0 + block_k, run.seq_kv)
        state = run.mask.tile_state(i0, i1, j0, j1)
        if state is TileState.FULL and merged is not None and j1 - merged[0] <= max_width:
            merged = (merged[0], j1)
            continue
        if merged is not None:
            yield merged[0], merged[1], TileState.FULL
            merged = None
        if state is TileState.FULL:
            merged = (j0, j1)
        elif state is not TileState.EMPTY and not (run.mask.explicit_tile_all_masked(i0, i1, j0, j1) if columns is None
                                                   else columns.all_masked(j0, j1)):
            yield j0, j1, state
    if merged is not None:
        yield merged[0], merged[1], TileState.FULL


def softmax_step(s: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    """Online softmax over one score tile s [..., rows, cols] in place (s becomes the exponentials), updating
    row_max / row_sum [..., rows]; returns the correction e^(old max - new shift) for the accumulated output
    (docs/semantics/softmax-stats.md). A row that has seen nothing visible yet keeps max -inf and is shifted by 0 (no
    inf - inf). The native loop does it in one pass per row (fp32 on the CPU); the PyTorch ops are the same rule in
    six passes over the tile. Shared by the "exact" kernels and the "npu" precision mode's forward."""
    if native.usable(s, row_max, row_sum) and s.is_contiguous() and row_max.is_contiguous() \
            and row_sum.is_contiguous():
        correction = torch.empty_like(row_max)
        native.fa_softmax_step(s, row_max, row_sum, correction, LOG2E, EXP2_FLOOR)
        return correction
    old_max = row_max.clone()
    new_max = torch.maximum(old_max, s.amax(-1))
    shift = torch.where(new_max == float("-inf"), 0.0, new_max)
    exp_shifted_(s, shift.unsqueeze(-1))
    correction = torch.exp(old_max - shift)
    row_sum.mul_(correction).add_(s.sum(-1))
    row_max.copy_(new_max)
    return correction


class RunKernel:
    """Per-run state shared by the forward and backward passes: converted K/V, buffers, score tiles."""

    def __init__(self, problem: AttentionProblem, run: Run, query, key, value, forward_only: bool = False) -> None:
        self.problem, self.run = problem, run
        self.dtype = accumulation_dtype(query.dtype)
        self.device = query.device
        c, n2 = run.count, problem.heads_kv
        self.q_all = problem.q_view(query, run)
        # A forward whose scores will come from bf16 operands without pse columns never reads fp32 keys (see
        # `bf16_scores_only`): they are allocated (shape and strides only) and converted below only if it turns out
        # that the fp32 path runs after all.
        k_view = problem.kv_view(key, run)
        keys_unread = forward_only and run.pse is None and query.dtype == key.dtype == value.dtype == torch.bfloat16 \
            and native.has_bf16_dot()
        k = (torch.empty(k_view.shape, dtype=self.dtype, device=self.device) if keys_unread
             else k_view.to(self.dtype)).reshape(c * n2, run.seq_kv, -1)
        self.v = problem.kv_view(value, run).to(self.dtype).reshape(c * n2, run.seq_kv, -1)
        # The fused native loops: fp32 compute on the CPU with a BLAS sgemm (and a CPU keep mask, read in place).
        alibi = run.pse is not None and run.pse.pse_type in ALIBI_TYPES
        fusable = self.v.stride(-1) == 1 and native.usable(k, self.v) and native.has_sgemm() \
            and (run.dropout is None or (run.dropout.mask.device.type == "cpu" and run.dropout.mask.is_contiguous()))
        if fusable and alibi and k.stride(-1) != 1:
            k = k.contiguous()
        self.fused = fusable and k.stride(-1) == 1
        # There ALiBi (types 2/3) is generated per score block (`alibi_rows`): no feature columns, no bias tiles.
        self.native_alibi = self.fused and alibi
        feats = None if run.pse is None or self.native_alibi else run.pse.linear_key_features(self.device, self.dtype)
        self.linear_pse = feats is not None
        if feats is not None:
            k = torch.cat([k, feats.expand(c * n2, -1, -1)], dim=-1)
        # Read transposed by the score GEMM (NT). A scaled, transposed copy made once per call (NN GEMMs) measured
        # no faster per tile on a 2-core EPYC (MKL, AVX2) and cost a key-sized buffer plus a 3-7 ms strided copy
        # per call; without it fwd+bwd ran 2-14% faster (alternating A/B, B=1 N=8 S=2048 and N=1 S=8192).
        self.k = k
        # ALiBi (types 2/3) of a single sequence: per-head tile skipping, from |logit| <= |scale| |q| |k| + bias.
        # The native loops skip row blocks too (`alibi_rows`), for runs of several sequences as well.
        self.underflow_bound = alibi and c == 1
        if self.underflow_bound:
            self.q_norm = self.q_all.to(self.dtype).norm(dim=-1)[0].mul_(abs(problem.scale))  # [N1, Sq]
        if alibi:
            self.k_norm = k[..., : problem.dim_qk].norm(dim=-1)  # [c * N2, Skv]
        self.skipped_head_tiles = 0
        self.dense = dense = run.mask.lower is None and run.mask.upper is None and run.mask.explicit is None
        self.block_q, self.block_k, self.max_width = tile_shape(c * problem.heads_q, run.seq_q, run.seq_kv, dense,
                                                                alibi)
        rows = c * problem.heads_q * self.block_q * self.max_width
        self._buffer = torch.empty(rows, dtype=self.dtype, device=self.device)
        self._scratch: torch.Tensor | None = None
        # bf16 inputs: the score products from the inputs themselves with AVX512-BF16 dot products (exact products,
        # fp32 sums: the fp32 GEMM of the upcast inputs up to summation order); generated ALiBi is added after them.
        self.k16 = self.v16 = None
        if self.fused and query.dtype == key.dtype == value.dtype == torch.bfloat16 and native.has_bf16_dot():
            k16 = problem.kv_view(key, run).reshape(c * n2, run.seq_kv, -1)
            v16 = problem.kv_view(value, run).reshape(c * n2, run.seq_kv, -1)
            if k16.stride(-1) == 1 and v16.stride(-1) == 1:
                self.k16, self.v16 = k16, v16
        # Then, without ALiBi or linear-pse columns, the forward's scores never read the fp32 query tile (the bf16
        # path must not: tests/test_native_kernels.py hands it NaN there), so it is allocated but not formed.
        self.bf16_scores_only = self.k16 is not None and not self.linear_pse and not self.native_alibi
        if keys_unread and not self.bf16_scores_only:
            self.k = k_view.to(self.dtype).reshape(c * n2, run.seq_kv, -1)

    def scratch(self, shape: torch.Size) -> torch.Tensor:
        """A second reusable tile-sized buffer (the backward's dP), allocated on first use."""
        if self._scratch is None:
            self._scratch = torch.empty_like(self._buffer)
        return self._scratch[: math.prod(shape)].view(shape)

    def query_tile(self, i0: int, i1: int, formed: bool = True) -> torch.Tensor:
        """scale * query rows, grouped for GEMM: [c*N2, G*rows, Dk] (a fresh tensor, the caller's to modify), with
        two zero columns after Dqk for the linear-pse features."""
        src = self.q_all[:, :, i0:i1]
        d_qk = src.shape[-1]
        q = torch.empty((*src.shape[:-1], d_qk + (2 if self.linear_pse else 0)), dtype=self.dtype,
                        device=self.device)
        if not formed:  # only its shape is read (bf16 score operands)
            return group_rows(q, self.problem.heads_kv)
        if src.dtype == q.dtype:  # one pass (not a copy, then a multiply in place): the same products
            torch.mul(src, self.problem.scale, out=q[..., :d_qk])
        else:  # converted first, then scaled: a multiply of fp16/bf16 input would round the product to the input dtype
            q[..., :d_qk] = src
            q[..., :d_qk].mul_(self.problem.scale)
        q[..., d_qk:] = 0.0
        return group_rows(q, self.problem.heads_kv)

    def bf16_scores(self, i0: int, i1: int, dy: torch.Tensor | None = None) -> native.Bf16Scores | None:
        """The bf16 operands of the fused loops' score products for query rows [i0, i1) (the unscaled query rows
        grouped like `query_tile`; with `dy`, the backward's dY rows [c, N1, Sq, Dv] too), or None where the scores
        take the fp32 path."""
        if self.k16 is None or (dy is not None and dy.dtype != torch.bfloat16):
            return None
        n2 = self.problem.heads_kv
        q16 = group_rows(self.q_all[:, :, i0:i1], n2).contiguous()
        dy16 = None if dy is None else group_rows(dy[:, :, i0:i1], n2).contiguous()
        return native.Bf16Scores(q16, self.k16, self.problem.scale, dy16, None if dy is None else self.v16)

    def _linear_query_features(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor | None:
        if not self.linear_pse:
            return None
        return self.run.pse.linear_query_features(i0, i1, j0, j1, self.device, self.dtype)

    def key_tiles(self, i0: int, i1: int) -> list[tuple[int, int, TileState]]:
        """`key_tiles` of the run; with per-head tile skipping nearest the diagonal first, so that the running row
        maxima are already high when the far tiles (those that may underflow) are tested."""
        tiles = list(key_tiles(self.run, i0, i1, self.block_k, self.max_width))
        if self.underflow_bound or self.native_alibi:
            tiles.sort(key=lambda t: self.run.pse.tile_center_distance(i0, i1, t[0], t[1]))
        return tiles

    def entries(self, i0: int, i1: int, j0: int, j1: int, row_max: torch.Tensor) -> slice | None:
        """The GEMM batch entries (the [c*N2] axis) that need the tile, as a slice; None when none does.

        With ALiBi on a single sequence, an entry (a kv head with its query heads) skips the tile when every logit
        s <= |scale| |q_i| max|k_j| + max_j bias(i, j) is more than 126 binary orders below its row's maximum
        `row_max` [c, N1, rows] (the running one in the forward, the given one in the backward): every term
        exp(s - max) would be flushed to exactly 0 (`softmax_exp`), so skipping changes no output bit."""
        n2 = self.problem.heads_kv
        every = slice(0, self.run.count * n2)
        if not self.underflow_bound:
            return every
        group = self.problem.heads_q // n2
        k_max = self.k_norm[:, j0:j1].amax(-1).repeat_interleave(group)  # [N1]
        bound = self.run.pse.tile_bias_bound(i0, i1, j0, j1, self.device, self.dtype)[0]  # [N1, rows]
        bound = bound + self.q_norm[:, i0:i1] * k_max[:, None] + UNDERFLOW_SLACK
        # "not <=": a NaN (NaN input, or NaN statistics given to the backward) counts as reaching the tile.
        reaches = ~((bound - row_max.reshape(bound.shape)) * LOG2E <= EXP2_FLOOR)
        reaches = reaches.any(-1)
        needed = reaches.view(n2, group).any(-1).nonzero().view(-1).tolist()
        if not needed:
            self.skipped_head_tiles += self.problem.heads_q
            return None
        lo, hi = needed[0], needed[-1] + 1
        self.skipped_head_tiles += (n2 - (hi - lo)) * group
        return slice(lo, hi)

    def heads(self, entries: slice) -> slice:
        """The query heads of a range of GEMM batch entries (all heads for runs of several sequences, whose
        entries are always all taken)."""
        group = self.problem.heads_q // self.problem.heads_kv
        if self.run.count > 1:
            return slice(0, self.problem.heads_q)
        return slice(entries.start * group, entries.stop * group)

    def scores(self, q_tile: torch.Tensor, i0: int, i1: int, j0: int, j1: int, state: TileState,
               entries: slice) -> torch.Tensor:
        """Masked logits S = scale * Q K^T + bias of the tile for the GEMM batch `entries` (from `entries()`), as
        [c, heads, rows, cols] (a view of the buffer); masked entries are -inf."""
        run = self.run
        heads = self.heads(entries)
        c, n_heads, rows, cols = run.count, heads.stop - heads.start, i1 - i0, j1 - j0
        out = self._buffer[: c * n_heads * rows * cols].view(entries.stop - entries.start, -1, cols)
        kt = self.k[entries, j0:j1].transpose(1, 2)
        bias = self.pse_tile(q_tile, i0, i1, j0, j1, entries)
        if bias is None:
            torch.bmm(q_tile[entries], kt, out=out)
        else:
            out.view(c, n_heads, rows, cols).copy_(bias.expand(c, n_heads, rows, cols))
            out.baddbmm_(q_tile[entries], kt)
        s = out.view(c, n_heads, rows, cols)
        if state is TileState.PARTIAL:
            add_mask_bias(s, self._mask_bias(i0, i1, j0, j1), finite=self.finite_inputs, in_place=True)
        return s

    @functools.cached_property
    def finite_inputs(self) -> bool:
        """No NaN or inf in the run's query and key rows and pse tensor (then every logit is finite up to fp32
        overflow), tested on sums as `sparse_attention.all_finite` does: an overflowing sum only costs the slower
        form of `add_mask_bias`."""
        pse = self.run.pse
        tensors = (self.q_all, self.k) if pse is None or pse.source is None else (self.q_all, self.k, pse.source)
        return all(bool(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).isfinite())
                   for t in tensors)

    def pse_tile(self, q_tile: torch.Tensor, i0: int, i1: int, j0: int, j1: int, entries: slice) -> torch.Tensor | None:
        """The pse of the tile for the GEMM batch `entries`: None where there is none or where ALiBi's rank-2 form
        applies (then written into the feature columns of q_tile's `entries`, which otherwise are zeroed), else the
        bias [nb or 1, heads, rows, cols] to add."""
        pse = self.run.pse
        if pse is None:
            return None
        heads = self.heads(entries)
        q_e = q_tile[entries]
        if (feats := self._linear_query_features(i0, i1, j0, j1)) is not None:
            feats = feats.expand(self.run.count, self.problem.heads_q, i1 - i0, 2)[:, heads]
            q_e[:, :, -2:] = feats.reshape(q_e.shape[0], -1, 2)
            return None
        if self.linear_pse:
            q_e[:, :, -2:] = 0.0
        return pse.tile(i0, i1, j0, j1, self.device, self.dtype)[:, heads]

    def _mask_bias(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """The tile's mask as a 0 / -inf additive tile (adding it is ~10x faster than masked_fill_ with a mask
        broadcast over heads), shared by tiles and calls with the same pattern (`SequenceMask.bias_tile`): read-only."""
        return self.run.mask.bias_tile(i0, i1, j0, j1, self.dtype, self.device)

    def fused_tiles(self, i0: int, i1: int) -> tuple[list[tuple[int, int]], native.BiasTiles] | None:
        """Every key tile of query rows [i0, i1) with its mask tile, for one call of the fused loops, or None where
        the tiles need per-tile calls (`fused_bias`): with pse (per-tile q features, per-head bias, skipped entries),
        dropout (per-tile keep bits) or a mask that differs between the run's sequences or heads. Generated ALiBi
        (`native_alibi`) rides along in `alibi_rows`."""
        if (self.run.pse is not None and not self.native_alibi) or self.run.dropout is not None:
            return None
        tiles, masks = [], []
        rows = i1 - i0
        for j0, j1, state in self.key_tiles(i0, i1):
            mask = None
            if state is TileState.PARTIAL:
                mask = self._mask_bias(i0, i1, j0, j1)
                if mask.numel() != rows * (j1 - j0):
                    return None
                mask = mask.reshape(rows, j1 - j0)
            tiles.append((j0, j1))
            masks.append(mask)
        return tiles, native.BiasTiles(masks, rows)

    def fused_bias(self, q_tile: torch.Tensor, i0: int, i1: int, j0: int, j1: int, state: TileState,
                   entries: slice) -> native.BiasTiles:
        """The additive bias of one tile for the fused loops (the GEMM batch `entries` only), as `scores` forms it:
        ALiBi's rank-2 form goes into q_tile's feature columns (no bias), else the pse tile plus the mask is
        materialised per head; a mask alone, shared by the run, stays one [rows, cols] tile. Generated ALiBi
        (`alibi_rows`) is no bias tile."""
        run, rows, cols = self.run, i1 - i0, j1 - j0
        heads = self.heads(entries)
        pse_tile = None if self.native_alibi else self.pse_tile(q_tile, i0, i1, j0, j1, entries)
        mask = self._mask_bias(i0, i1, j0, j1) if state is TileState.PARTIAL else None
        if pse_tile is None and (mask is None or mask.numel() == rows * cols):
            return native.BiasTiles([None if mask is None else mask.reshape(rows, cols)], rows)
        # The native loops set -inf where the bias is -inf, which the masked-logit rule needs whatever the pse.
        total = pse_tile if mask is None else mask if pse_tile is None else \
            add_mask_bias(pse_tile, mask, finite=self.finite_inputs, in_place=False)
        total = total.expand(run.count, heads.stop - heads.start, rows, cols).contiguous()
        entry_rows = self.problem.heads_q // self.problem.heads_kv * rows
        return native.BiasTiles([total], entry_rows, entry_rows * cols)

    def fused_keep(self, i0: int, i1: int, j0: int, entries: slice) -> native.KeepBits | None:
        """The dropout of a tile starting at column j0 for the GEMM batch `entries`: the packed mask and the first bit
        of each of their rows, [entries, G * rows] (the layout rule stays in `SequenceDropout.row_starts`)."""
        dropout = self.run.dropout
        if dropout is None:
            return None
        first = dropout.row_starts(i0, i1, j0)[:, self.heads(entries)]
        return native.KeepBits(dropout.mask, first.reshape(entries.stop - entries.start, -1))

    def alibi_rows(self, q_tile: torch.Tensor, i0: int, i1: int) -> native.AlibiRows | None:
        """The generated ALiBi of query rows [i0, i1) for the fused loops, grouped like `query_tile` (q_tile, scaled,
        gives the norms of the underflow skipping), or None without `native_alibi`."""
        if not self.native_alibi:
            return None
        pse, problem, c = self.run.pse, self.problem, self.run.count
        rows, entries = i1 - i0, q_tile.shape[0]
        slope = pse.slopes.to(device=self.device, dtype=torch.float32).expand(c, problem.heads_q)
        slope = slope[:, :, None].expand(c, problem.heads_q, rows).reshape(entries, -1).contiguous()
        pos = pse.relative_row_positions(i0, i1, self.device).expand(entries * (problem.heads_q // problem.heads_kv),
                                                                      rows)
        q_norm = q_tile[..., : problem.dim_qk].norm(dim=-1)
        return native.AlibiRows(slope, pos.reshape(entries, -1).contiguous(), pse.pse_type == 3, q_norm,
                                self.k_norm, UNDERFLOW_SLACK)

    def forward(self, out_view, max_view, sum_view) -> None:
        problem, run = self.problem, self.run
        c, n2 = run.count, problem.heads_kv
        dv = self.v.shape[-1]
        block_q = self.forward_rows()
        sink_heads = None if problem.sink is None else sinks.head_values(problem.sink, self.dtype, self.device)
        for i0 in range(0, run.seq_q, block_q):
            i1 = min(i0 + block_q, run.seq_q)
            rows = i1 - i0
            whole = self.fused_tiles(i0, i1) if self.fused else None
            io = None if whole is None else self.fused_io(i0, i1, out_view, max_view, sum_view, sink_heads is None)
            q_tile = self.query_tile(i0, i1, formed=not (self.bf16_scores_only or (io and io.query is not None)))
            row_max = torch.empty((c, problem.heads_q, rows), dtype=self.dtype, device=self.device)
            row_sum = torch.empty_like(row_max)
            acc = torch.empty((c * n2, q_tile.shape[1], dv), dtype=self.dtype, device=self.device)
            if whole is None:
                row_max.fill_(float("-inf"))
                row_sum.zero_()
            self._accumulate(q_tile, i0, i1, row_max, row_sum, acc, whole, io)
            if io is not None and io.out is not None:
                # The loops finished the rows (`native.ForwardIo`) unless P V overflowed and V can be scaled.
                if not io.non_finite() or not self._scale_values():
                    continue
                io = io.without_out()
                self._accumulate(q_tile, i0, i1, row_max, row_sum, acc, whole, io)
            elif self.value_scales is None and has_non_finite(acc) and self._scale_values():
                # P V overflowed on values near FLT_MAX: again with V scaled by exact powers of two (`stats`).
                row_max.fill_(float("-inf"))
                row_sum.zero_()
                self._accumulate(q_tile, i0, i1, row_max, row_sum, acc, whole, io)
            if sink_heads is not None:
                # The sink joins the finished running statistics before the fp32 output is normalised (and rounded).
                acc.mul_(sinks.merge_into_rows_(row_max, row_sum, sink_heads).view(c * n2, -1, 1))
            # Rows without a visible key have row_sum 0 and acc 0 (their terms are all exactly 0): output 0. "!= 0", not
            # "> 0": a row with a NaN logit has a NaN sum and max and keeps them, with a NaN output, as the formulas
            # give (docs/semantics/invalid-rows.md covers rows without visible keys only); taking it for a row without
            # keys would pass NaN input off as a fully masked row.
            valid = row_sum != 0
            denom = torch.where(valid, row_sum * problem.keep_prob, 1.0).view(c, problem.heads_q, rows, 1)
            if self.value_scales is not None:  # [c, N1, 1, Dv]: acc holds sums of the scaled values
                denom = denom * self.value_scales
            # One pass: divided in fp32 and rounded once on the store into the output's dtype.
            torch.div(acc.view(c, problem.heads_q, rows, dv), denom, out=out_view[:, :, i0:i1])
            if max_view is not None:
                write_stat(max_view[:, :, i0:i1], torch.where(valid, row_max, -FLT_MAX))
                write_stat(sum_view[:, :, i0:i1], torch.where(valid, row_sum, FLT_MAX))

    def _accumulate(self, q_tile, i0: int, i1: int, row_max, row_sum, acc, whole, io) -> None:
        if self.fused:
            self._fused_forward(q_tile, i0, i1, row_max, row_sum, acc, whole, io)
        else:
            self._forward_tiles(q_tile, i0, i1, row_max, row_sum, acc)

    def fused_io(self, i0: int, i1: int, out_view, max_view, sum_view, finish: bool) -> native.ForwardIo | None:
        """The ends of a whole-tile fused call (`native.ForwardIo`), or None: the query rows read in place where the
        fp32 query tile has no other reader (ALiBi's norms, pse features), and with `finish` (no sink), before V is
        scaled, the output (fp32 or fp16) and fp32 statistics written by the loops where their columns are contiguous
        (the normalisation below then has nothing left to do: one pass over the output instead of a division pass, a
        non-finite check and the statistics' passes). bf16 outputs stay with PyTorch's rounding, whose NaN bits
        differ between its vector and scalar loops."""
        q = self.q_all[:, :, i0:i1]
        own_q = not self.native_alibi and not self.linear_pse and q.stride(-1) == 1 and (
            q.dtype in (torch.float32, torch.bfloat16) or (q.dtype == torch.float16 and native.has_f16c()))
        out = out_view[:, :, i0:i1]
        stats = None if max_view is None else (max_view[:, :, i0:i1], sum_view[:, :, i0:i1])
        finish = finish and self.value_scales is None and out.stride(-1) == 1 and (
            out.dtype == torch.float32 or (out.dtype == torch.float16 and native.has_f16c())) and (
            stats is None or all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in stats))
        if not own_q and not finish:
            return None
        if not finish:
            return native.ForwardIo(q, self.problem.scale, self.problem.heads_kv)
        return native.ForwardIo(q if own_q else None, self.problem.scale, self.problem.heads_kv, out,
                                self.problem.keep_prob, *(stats or (None, None)))

    value_scales: torch.Tensor | None = None

    def _scale_values(self) -> bool:
        """Scale V (a copy) per kv head and column by `stats.value_column_scales`; False where no column needs it
        (the non-finite accumulator came from NaN or inf input)."""
        scales = value_column_scales(self.v.abs().amax(dim=1, keepdim=True), self.run.seq_kv)  # [c*N2, 1, Dv]
        if scales is None:
            return False
        self.v = self.v * scales
        group = self.problem.heads_q // self.problem.heads_kv
        self.value_scales = scales.view(self.run.count, self.problem.heads_kv, 1, 1, -1).expand(
            -1, -1, group, 1, -1).reshape(self.run.count, self.problem.heads_q, 1, -1)
        return True

    def forward_rows(self) -> int:
        """Query rows per forward tile. Where every tile is one call of the fused loops (no pse tensor, no dropout)
        the score buffer that bounds `block_q` is not used, so tiles grow to DENSE_FORWARD_ROWS rows (unmasked runs;
        FUSED_FORWARD_ROWS with ALiBi) or MASKED_TILE rows (masked ones), within the [c, N1, rows, Dv] accumulator
        budget: fewer calls and per-tile passes, whose fixed costs dominate when the machine is shared. Inside a call
        the rows still go in FUSED_BLOCK_ROWS blocks, as in any tall tile."""
        if not self.fused or (self.run.pse is not None and not self.native_alibi) or self.run.dropout is not None:
            return self.block_q
        heads = self.run.count * self.problem.heads_q
        budget = max(FUSED_BLOCK_ROWS, TILE_ELEMENTS // max(1, heads * self.v.shape[-1]))
        # A masked run keeps MASKED_TILE's height: taller tiles turn its FULL key tiles (no bias, full-height GEMMs)
        # into PARTIAL ones, materialised and split into masked sub-blocks by the loops (1024 rows measured 25-50%
        # more CPU time than 256 for band and causal masks, B=1 N=8 S=2048 fp32 and PFA fp16 GQA 8/2).
        cap = MASKED_TILE[0] if not self.dense else FUSED_FORWARD_ROWS if self.native_alibi else DENSE_FORWARD_ROWS
        rows = min(cap, budget) // FUSED_BLOCK_ROWS * FUSED_BLOCK_ROWS
        return max(self.block_q, min(rows, self.run.seq_q))

    def _fused_forward(self, q_tile, i0: int, i1: int, row_max, row_sum, acc, whole, io) -> None:
        """The query tile through the fused native loop: one call for all key tiles (`whole`, from `fused_tiles`;
        `io` from `fused_io`) where `fused_tiles` allows, else one call per tile (after the same entry skipping as the
        PyTorch loop)."""
        bf16 = self.bf16_scores(i0, i1)
        alibi = self.alibi_rows(q_tile, i0, i1)
        if whole is not None:
            native.fa_forward_blocks(q_tile, self.k, self.v, *whole, FUSED_BLOCK_ROWS, FUSED_SUB_COLS, LOG2E,
                                     EXP2_FLOOR, row_max, row_sum, acc, bf16=bf16, alibi=alibi, io=io)
            return
        acc.zero_()
        max_rows, sum_rows = row_max.view(acc.shape[0], -1), row_sum.view(acc.shape[0], -1)
        for j0, j1, state in self.key_tiles(i0, i1):
            entries = self.entries(i0, i1, j0, j1, row_max)
            if entries is None:
                continue
            bias = self.fused_bias(q_tile, i0, i1, j0, j1, state, entries)
            native.fa_forward_blocks(q_tile[entries], self.k[entries], self.v[entries], [(j0, j1)], bias,
                                     fused_block_rows(q_tile.shape[1]), FUSED_SUB_COLS, LOG2E, EXP2_FLOOR,
                                     max_rows[entries], sum_rows[entries], acc[entries], init=False,
                                     keep=self.fused_keep(i0, i1, j0, entries),
                                     bf16=None if bf16 is None else bf16.take(entries),
                                     alibi=None if alibi is None else alibi.take(entries))

    def _forward_tiles(self, q_tile, i0: int, i1: int, row_max, row_sum, acc) -> None:
        """The query tile through PyTorch ops, one key tile at a time."""
        run, c, n2 = self.run, self.run.count, self.problem.heads_kv
        first = True
        for j0, j1, state in self.key_tiles(i0, i1):
            entries = self.entries(i0, i1, j0, j1, row_max)
            if entries is None:
                continue
            heads = self.heads(entries)
            s = self.scores(q_tile, i0, i1, j0, j1, state, entries)
            correction = softmax_step(s, row_max[:, heads], row_sum[:, heads])
            if run.dropout is not None:
                s.mul_(run.dropout.keep_tile(i0, i1, j0, j1, s.device)[:, heads])
            n_entries = entries.stop - entries.start
            p = s.view(n_entries, -1, j1 - j0)
            if first and n_entries == c * n2:
                torch.bmm(p, self.v[:, j0:j1], out=acc)
            else:
                if first:  # the first tile skipped some entries: theirs must start from 0
                    acc.zero_()
                acc[entries].mul_(correction.view(n_entries, -1, 1)).baddbmm_(p, self.v[entries, j0:j1])
            first = False
        if first:  # no tile was visible: every row's output is 0
            acc.zero_()


def has_non_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds a NaN or inf. The sum is tested first: any NaN or inf element makes it non-finite, and it
    costs ~0.2 ms on an [8, 1024, 128] fp32 tile where isfinite().all() takes 5-19 ms (one thread; ~6% of a B=1 N=8
    S=2048 forward). Only a non-finite sum, which finite values can reach by overflowing, takes the element test,
    so the answer is isfinite's exactly."""
    return not bool(t.sum().isfinite()) and not bool(torch.isfinite(t).all())


def fused_block_rows(rows: int) -> int:
    """Query rows per work item of a per-tile fused call over entries with `rows` rows each: half of them (within
    [32, FUSED_BLOCK_ROWS]), so that a tile only one entry needs still occupies two threads. It must not depend on
    how many entries the call takes: the row blocks shape the GEMMs, whose rounding then would depend on which
    entries skipped the tile."""
    return max(32, min(FUSED_BLOCK_ROWS, -(-rows // 2)))


def write_stat(view: torch.Tensor, values: torch.Tensor) -> None:
    """Store a per-row statistic repeated over the 8-wide last dim (docs/semantics/softmax-stats.md)."""
    view.copy_(values.unsqueeze(-1).expand_as(view))
