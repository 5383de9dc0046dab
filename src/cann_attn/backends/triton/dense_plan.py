"""Lowering of a canonical dense `AttentionProblem` to the flat integer tables the Triton kernels read.

The kernels never look at sparse_mode, pre/next tokens, pse shapes or dropout arguments: everything they need
comes from this module, which reads only the canonical problem (`problem/`, docs/design.md "Layers") and the
caller's tensors. Each `Run` is expanded into its `count` sequences; sequence s owns row s of an int64 table
(`DensePlan.table`, columns named by `COLUMNS`) holding

- its lengths and mask structure (docs/semantics/masks.md): visible(i, j) = [lower <= j - i] and ([j - i <= upper] or
  [j < prefix]) and not explicit[i, j], with None bounds replaced by the sentinels `NO_LOWER` / `NO_UPPER` and a
  missing prefix by 0 (j < 0 is never true);
- element offsets of row 0 / head 0 of every tensor it touches (query-like: q, out, dy, dq; key-like: k, v, dk,
  dv); head / sequence / dim strides are per tensor and uniform across sequences (they come from the tensor's layout,
  docs/semantics/layouts.md);
- the explicit-mask offset, the pse offset (row0/col0 folded in) and its compressed flag, the ALiBi slope
  offset (4), the dropout base element (5) and the softmax-statistics offset with its per-sequence head stride
  (6: TND softmax_layout "" stores per-sequence [N1, Sq_b, 8] blocks, so the head stride is 8 * Sq_b).

No triton import here: `dense_unsupported` runs before a backend is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...problem import layout as layouts
from ...problem.attention import AttentionProblem
from ...problem.pse import ALIBI_TYPES

# Band sentinels: |j - i| never reaches 2^30 (sequences are far shorter), and they stay int32-safe in kernels.
NO_LOWER = -(1 << 30)
NO_UPPER = 1 << 30
# The kernels keep head dims in registers; 256 covers every head dim of current models (Dqk 192 / Dv 128 MLA).
MAX_HEAD_DIM = 256
# CUDA grid dims y and z are limited to 65535 (heads on y, sequences on z).
MAX_GRID_YZ = 65535
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

COLUMNS = (
    "seq_q", "seq_kv", "lower", "upper", "prefix",
    "q", "k", "v", "o", "dy", "dq", "dk", "dv",
    "stat", "stat_hs", "delta", "mask", "pse", "dpse", "pse_compressed", "slope", "drop",
)
COL = {name: index for index, name in enumerate(COLUMNS)}
NUM_COLUMNS = len(COLUMNS)
QUERY_LIKE = ("q", "o", "dy", "dq")
KEY_LIKE = ("k", "v", "dk", "dv")


@dataclass
class DensePlan:
    """Everything a dense Triton kernel launch needs besides the data pointers of q/k/v/out (and grads).

    `strides[name]` is (head, seq, dim) in elements for each tensor named in `COLUMNS`; `mask`, `pse`,
    `slopes` are flat views over the whole storage of the caller's tensors (offsets in the table are relative
    to the storage start), `drop` the caller's flat uint8 dropout mask.
    """

    table: torch.Tensor
    num_seq: int
    max_seq_q: int
    max_seq_kv: int
    total_q: int  # sum of Sq over sequences: rows of the backward's delta buffer per head
    strides: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    block_strides: dict[str, int] = field(default_factory=dict)  # paged k / v caches: elements between blocks
    stat_row_stride: int = 8
    mask: torch.Tensor | None = None
    mask_strides: tuple[int, int, int] = (0, 0, 0)  # head, row, col
    pse_kind: int = 0  # 0 none, 1 tensor (types 0/1), 2 ALiBi |d|, 3 ALiBi sqrt|d|
    pse: torch.Tensor | None = None
    pse_strides: tuple[int, int, int] = (0, 0, 0)  # head, row (0 = row broadcast), col
    dpse_strides: tuple[int, int, int] = (0, 0, 0)
    pse_multiplier: float = 1.0  # type 1: bias = scale * pse; type 0: pse; ALiBi: the generated value
    pse_compressed: bool = False
    dpse_reduces: bool = False  # several (sequence, i, j) share one dpse element: atomics needed
    slopes: torch.Tensor | None = None
    slope_head_stride: int = 0
    banded: bool = False  # some sequence has a band or prefix bound (decided on the host: no device sync)
    # Largest power of two (at most 16) dividing every q/k/v/o/dy/dq/dk/dv offset of the table: the kernels' alignment
    # hint for those offsets, without which the compiler can neither vectorise nor pipeline the tile loads.
    offset_align: int = 16
    q_start: int = 0
    kv_start: int = 0
    drop: torch.Tensor | None = None


def _sequences(problem: AttentionProblem):
    """(run, idx, b, q_token0, kv_token0) of every sequence, in batch order."""
    for run in problem.runs:
        for idx in range(run.count):
            yield run, idx, run.b0 + idx, run.q_token0 + idx * run.seq_q, run.kv_token0 + idx * run.seq_kv


def _layout_strides(problem: AttentionProblem, t: torch.Tensor, heads: int) -> tuple[int, tuple[int, int, int]]:
    """(stride of one batch / token, (head, seq, dim) strides) of a tensor in the problem's layout."""
    if problem.tnd:
        st, sh, sd = t.stride()
        return st, (sh, st, sd)
    sb, sh, ss, sd = layouts.as_bnsd(t, problem.layout, heads).stride()
    return sb, (sh, ss, sd)


def _storage_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the whole storage behind `t` (offsets from `storage_offset()` index it); bool as uint8."""
    flat = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return flat.view(torch.uint8) if flat.dtype == torch.bool else flat


def _uniform(values: list[tuple[int, ...]], what: str) -> tuple[int, ...]:
    """The one stride tuple every sequence shares (entries None = size-1 dim, any stride fits)."""
    merged: list[int | None] = [None] * len(values[0]) if values else []
    for v in values:
        for k, s in enumerate(v):
            if s is None:
                continue
            if merged[k] is not None and merged[k] != s:
                raise _Unsupported(f"{what} strides differ between sequences")
            merged[k] = s
    return tuple(0 if s is None else s for s in merged)


class _Unsupported(Exception):
    """Raised while planning a case the kernels cannot describe with uniform strides."""


def dense_unsupported(problem: AttentionProblem, dtype: torch.dtype, *, output_dtype: torch.dtype | None = None,
                      tensors: dict[str, torch.Tensor] | None = None) -> str | None:
    """Why the dense Triton kernels cannot compute `problem` (None when they can). docs/semantics/layouts.md,
    docs/semantics/masks.md, docs/semantics/invalid-rows.md, docs/semantics/pse.md, docs/semantics/dropout.md,
    docs/semantics/softmax-stats.md.

    `tensors` (the caller's q/k/v by table name) adds the layout checks: offsets inside one sequence must fit
    in int32 (the kernels index a sequence with 32-bit arithmetic from a 64-bit base), and explicit masks /
    pse views must be describable with strides shared by every sequence.
    """
    if dtype == torch.int8 or output_dtype == torch.int8:
        return "int8 (quantised) attention stays on the reference backend"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not supported by the Triton kernels (float16, bfloat16, float32)"
    if output_dtype is not None and output_dtype not in SUPPORTED_DTYPES:
        return f"output dtype {output_dtype} is not supported by the Triton kernels"
    if max(problem.dim_qk, problem.dim_v) > MAX_HEAD_DIM:
        return f"head dim {max(problem.dim_qk, problem.dim_v)} > {MAX_HEAD_DIM}"
    if problem.heads_q > MAX_GRID_YZ or sum(run.count for run in problem.runs) > MAX_GRID_YZ:
        return f"more than {MAX_GRID_YZ} heads or sequences (CUDA grid limit)"
    if problem.heads_kv <= 0 or problem.heads_q % problem.heads_kv:
        return "query heads must be a multiple of key/value heads"
    if tensors is None:
        return None
    max_q = max((run.seq_q for run in problem.runs), default=0)
    max_kv = max((run.seq_kv for run in problem.runs), default=0)
    for name, t in tensors.items():
        heads, seq = (problem.heads_q, max_q) if name in QUERY_LIKE else (problem.heads_kv, max_kv)
        _, (sh, ss, sd) = _layout_strides(problem, t, heads)
        extent = (heads - 1) * abs(sh) + max(seq - 1, 0) * abs(ss) + (t.shape[-1] - 1) * abs(sd)
        if extent >= 1 << 31:
            return f"{name}: one sequence spans more than 2^31 elements"
    if any(run.mask.explicit is not None or run.pse is not None for run in problem.runs):
        try:
            build_plan(problem, tensors)
        except _Unsupported as exc:
            return str(exc)
    return None


def build_plan(problem: AttentionProblem, tensors: dict[str, torch.Tensor], *,
               stats: torch.Tensor | None = None, dpse: torch.Tensor | None = None,
               block_table: torch.Tensor | None = None) -> DensePlan:
    """Lower `problem` with the caller's tensors (keys from `COLUMNS`: q, k, v, o, dy, dq, dk, dv; any subset)
    to a `DensePlan` on their device. `stats` is softmax_max (softmax_sum shares its layout,
    docs/semantics/softmax-stats.md); `dpse`
    the fp32 gradient buffer of a type 0/1 pse (the pse's own shape). With `block_table` (paged caches,
    docs/semantics/paged-kv.md) k and v are [block_num, N2, block_size, D] cache views: their table column holds
    the offset of the sequence's row in the block table and `plan.block_strides` their block strides."""
    device = tensors["q"].device
    seqs = list(_sequences(problem))
    rows = [[0] * NUM_COLUMNS for _ in seqs]
    plan = DensePlan(table=torch.empty(0), num_seq=len(seqs), max_seq_q=max((r.seq_q for r, *_ in seqs), default=0),
                     max_seq_kv=max((r.seq_kv for r, *_ in seqs), default=0), total_q=0)

    for name, t in tensors.items():
        query_like = name in QUERY_LIKE
        heads = problem.heads_q if query_like else problem.heads_kv
        if block_table is not None and name in ("k", "v"):
            plan.strides[name] = (t.stride(1), t.stride(2), t.stride(3))
            plan.block_strides[name] = t.stride(0)
            for row, (_, _, b, _, _) in zip(rows, seqs, strict=True):
                row[COL[name]] = b * block_table.stride(0)
            continue
        unit, plan.strides[name] = _layout_strides(problem, t, heads)
        for row, (_, _, b, q_tok, kv_tok) in zip(rows, seqs, strict=True):
            row[COL[name]] = unit * ((q_tok if query_like else kv_tok) if problem.tnd else b)

    offsets = math.gcd(*(row[COL[name]] for row in rows for name in tensors))
    plan.offset_align = 16 if offsets == 0 else min(16, offsets & -offsets)

    delta = 0
    for row, (run, _, _, _, _) in zip(rows, seqs, strict=True):
        m = run.mask
        row[COL["seq_q"]], row[COL["seq_kv"]] = run.seq_q, run.seq_kv
        # Both sides clamped: the kernels read the bounds as int32, and beyond +-2**30 a bound hides or shows every
        # key of any sequence alike.
        row[COL["lower"]] = NO_LOWER if m.lower is None else min(max(m.lower, NO_LOWER), NO_UPPER)
        row[COL["upper"]] = NO_UPPER if m.upper is None else min(max(m.upper, NO_LOWER), NO_UPPER)
        row[COL["prefix"]] = 0 if m.prefix is None else m.prefix
        row[COL["delta"]] = delta
        delta += problem.heads_q * run.seq_q
    plan.total_q = delta

    if stats is not None:
        _plan_stats(problem, plan, rows, seqs, stats)
    _plan_mask(plan, rows, seqs)
    _plan_pse(problem, plan, rows, seqs, dpse)
    _plan_dropout(problem, plan, rows, seqs)
    table = torch.tensor(rows, dtype=torch.int64).reshape(len(seqs), NUM_COLUMNS)
    plan.banded = bool(((table[:, COL["lower"]] != NO_LOWER) | (table[:, COL["upper"]] != NO_UPPER)
                        | (table[:, COL["prefix"]] != 0)).any()) if len(seqs) else False
    plan.table = table.to(device)
    return plan


def _plan_stats(problem: AttentionProblem, plan: DensePlan, rows, seqs, stats: torch.Tensor) -> None:
    row_strides = []
    views: dict[int, torch.Tensor] = {}
    for row, (run, idx, *_rest) in zip(rows, seqs, strict=True):
        if run.seq_q == 0:
            continue
        view = views.get(id(run))
        if view is None:
            view = views[id(run)] = problem.stat_view(stats, run)
        row[COL["stat"]] = view.storage_offset() - stats.storage_offset() + idx * view.stride(0)
        row[COL["stat_hs"]] = view.stride(1)
        row_strides.append((view.stride(2) if run.seq_q > 1 else None, view.stride(3)))
    if row_strides:
        row_stride, last = _uniform(row_strides, "softmax statistics")
        if last not in (0, 1):
            raise _Unsupported("softmax statistics must be contiguous in their last dim")
        plan.stat_row_stride = row_stride


def _plan_mask(plan: DensePlan, rows, seqs) -> None:
    strides, storages = [], set()
    for row, (run, idx, *_rest) in zip(rows, seqs, strict=True):
        ex = run.mask.explicit
        if ex is None or run.seq_q == 0 or run.seq_kv == 0:
            continue
        if plan.mask is None:
            plan.mask = _storage_flat(ex)
        storages.add(ex.untyped_storage().data_ptr())
        row[COL["mask"]] = ex.storage_offset() + (idx * ex.stride(0) if ex.shape[0] > 1 else 0)
        strides.append((ex.stride(1) if ex.shape[1] > 1 else 0, ex.stride(2) if ex.shape[2] > 1 else None,
                        ex.stride(3) if ex.shape[3] > 1 else None))
    if len(storages) > 1:
        raise _Unsupported("explicit masks of different sequences live in different tensors")
    if strides:
        plan.mask_strides = _uniform(strides, "atten_mask")


def _plan_pse(problem: AttentionProblem, plan: DensePlan, rows, seqs, dpse: torch.Tensor | None) -> None:
    pse_strides, storages, shared_rows = [], set(), 0
    for row, (run, idx, b, *_rest) in zip(rows, seqs, strict=True):
        p = run.pse
        if p is None or run.seq_q == 0:
            continue
        if p.pse_type in ALIBI_TYPES:
            plan.pse_kind = p.pse_type
            plan.q_start, plan.kv_start = p.q_start, p.kv_start
            if plan.slopes is None:
                plan.slopes = _storage_flat(p.slopes)
            storages.add(p.slopes.untyped_storage().data_ptr())
            row[COL["slope"]] = p.slopes.storage_offset() + (idx * p.slopes.stride(0) if p.slopes.shape[0] > 1 else 0)
            plan.slope_head_stride = p.slopes.stride(1)
            continue
        src = p.source
        plan.pse_kind = 1
        plan.pse_multiplier = p.scale if p.pse_type == 1 else 1.0
        if plan.pse is None:
            plan.pse = _storage_flat(src)
        storages.add(src.untyped_storage().data_ptr())
        broadcast_rows = src.shape[2] == 1 and not p.compressed
        row_stride = 0 if broadcast_rows else src.stride(2)
        row[COL["pse"]] = (src.storage_offset() + (idx * src.stride(0) if src.shape[0] > 1 else 0)
                           + p.row0 * row_stride + p.col0 * src.stride(3))
        row[COL["pse_compressed"]] = int(p.compressed)
        plan.pse_compressed |= p.compressed
        pse_strides.append((src.stride(1) if src.shape[1] > 1 else None, row_stride, src.stride(3)))
        # dpse: the pse's own shape, contiguous; logical batch 0 when the pse is batch-broadcast (pse.py).
        if dpse is not None:
            pb = 0 if dpse.shape[0] == 1 else b
            d_row = 0 if broadcast_rows else dpse.stride(2)
            row[COL["dpse"]] = pb * dpse.stride(0) + p.row0 * d_row + p.col0 * dpse.stride(3)
            plan.dpse_strides = (dpse.stride(1), d_row, dpse.stride(3))
            shared_rows += dpse.shape[0] == 1
            plan.dpse_reduces |= broadcast_rows or p.compressed
    plan.dpse_reduces |= shared_rows > 1
    if len(storages) > 1:
        raise _Unsupported("pse views of different sequences live in different tensors")
    if pse_strides:
        plan.pse_strides = _uniform(pse_strides, "pse")


def _plan_dropout(problem: AttentionProblem, plan: DensePlan, rows, seqs) -> None:
    for row, (run, idx, *_rest) in zip(rows, seqs, strict=True):
        if run.dropout is None:
            continue
        if plan.drop is None:
            plan.drop = run.dropout.mask
        elif run.dropout.mask.data_ptr() != plan.drop.data_ptr():
            raise _Unsupported("dropout masks of different sequences live in different tensors")
        row[COL["drop"]] = run.dropout.base + idx * problem.heads_q * run.seq_q * run.seq_kv

