"""Lowering of validated DSA problems into flat per-query-row tables for the Triton kernels (docs/semantics/layouts.md,
docs/operators/sparse_flash_attention.md, docs/operators/lightning_indexer.md),
and the reasons a case cannot run on them. No triton import here: `select_backend` asks the `*_unsupported`
functions before any kernel module is loaded.

Every query-side tensor is seen as [R, N, D] rows (R = B*S1 for BSND, T1 for TND) and every key-side tensor as
[R2, D] rows; a query row r then needs three numbers to apply the selection rule of `problem.sparse`:
- kv_start[r]: the flat key row of key 0 of its sequence (BSND: b*S2, TND: the sequence's first key token; a
  paged cache: the offset of the sequence's row in the block table, docs/semantics/paged-kv.md);
- thr[r]: keys [0, thr) of the sequence are visible (causal threshold of `problem.sparse.causal_threshold`,
  clipped to the actual key length; 0 for rows beyond the actual query length or of sequences without keys, so
  those rows select nothing and get zero outputs/gradients);
- scan[r]: how many leading entries are examined (`problem.sparse.scan_lengths`; SFA only).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...problem.sparse import allowed_keys, causal_threshold, scan_lengths

# What the kernels hold per program (register/shared-memory budget on Hopper, see sparse_attention.py).
MAX_SFA_QK_DIM = 512  # latent part of Dqk (query/key), without rope
MAX_SFA_ROPE_DIM = 128
MAX_SFA_V_DIM = 512
MAX_INDEX_HEADS = 128
MAX_INDEX_DIM = 256
HALF_OR_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1): small blocks, fp32 dots (it computes bf16 dots wrongly)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class RowTables:
    """Per-query-row tables (device tensors, int64 except where noted) and loop bounds."""

    rows: int
    kv_start: torch.Tensor  # [R] int64
    thr: torch.Tensor  # [R] int32: keys [0, thr) of the row's sequence are visible / allowed
    scan: torch.Tensor | None  # [R] int32: leading index entries examined (SFA rule), None for the indexer
    max_positions: int  # SFA: max over rows of scan * block_size (key positions a row walks); indexer: max thr


def _flat_rows(problem, threshold: Callable[[int, int, torch.Tensor], torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(kv_start [R], thr [R]) on the CPU from the problem's spans, and R. `problem` is ops' SparseProblem;
    `threshold(Sq, Skv, rows)` is the rule's visible-key count of each row."""
    if problem.layout == "TND":
        total = sum(n for _, _, n in problem.q_spans)
    else:
        total = len(problem.q_spans) * (problem.seq_q[0] if problem.seq_q else 0)
    kv_start = torch.zeros(total, dtype=torch.int64)
    thr = torch.zeros(total, dtype=torch.int64)
    pages = getattr(problem, "pages", None)
    for b, ((_, q0, s_q), (_, kv0, s_kv)) in enumerate(zip(problem.q_spans, problem.kv_spans, strict=True)):
        first = q0 if problem.layout == "TND" else b * s_q
        first_kv = kv0 if problem.layout == "TND" else b * s_kv
        if pages is not None:
            first_kv = b * pages.table.stride(0)  # a paged cache: where the sequence's row of the block table starts
        kv_start[first : first + s_q] = first_kv
        lq, lk = problem.q_lengths[b], problem.kv_lengths[b]
        if lq == 0 or lk == 0:
            continue  # the rows keep thr = 0: nothing selected
        t = torch.arange(lq, dtype=torch.int64)
        thr[first : first + lq] = threshold(lq, lk, t)
    return kv_start, thr, total


def sfa_tables(problem, indices: torch.Tensor, sparse_mode: int, block_size: int) -> RowTables:
    """Tables of a SparseFlashAttention(Grad) problem; `indices` is sparse_indices as [R, K]."""
    kv_start, thr, total = _flat_rows(
        problem, lambda lq, lk, t: causal_threshold(sparse_mode, lq, lk, t).clamp(min=0, max=lk))
    device = indices.device
    thr = thr.to(device)
    scan = scan_lengths(indices, thr, block_size).to(torch.int32) if total else thr.to(torch.int32)
    max_positions = int(scan.max().item()) * block_size if total else 0
    return RowTables(total, kv_start.to(device), thr.to(torch.int32), scan, max_positions)


def indexer_tables(problem, sparse_mode: int, device: torch.device) -> RowTables:
    """Tables of a LightningIndexer / SparseLightningIndexerGradKLLoss problem: thr = number of allowed keys
    (`problem.sparse.allowed_keys`; the KL rule of `indexer_selection` uses the same bound)."""
    kv_start, thr, total = _flat_rows(problem, lambda lq, lk, t: allowed_keys(sparse_mode, lq, lk, t))
    max_positions = int(thr.max().item()) if total else 0
    return RowTables(total, kv_start.to(device), thr.to(device=device, dtype=torch.int32), None, max_positions)


def sparse_unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       query_rope: torch.Tensor | None) -> str | None:
    """Why the Triton SFA kernels cannot compute this case (None when they can)."""
    if query.dtype not in HALF_OR_FLOAT:
        return f"the kernels compute float16/bfloat16/float32 inputs, got {query.dtype}"
    if query.shape[-1] > MAX_SFA_QK_DIM:
        return f"query/key head dim {query.shape[-1]} exceeds the kernels' {MAX_SFA_QK_DIM}"
    if query_rope is not None and query_rope.shape[-1] > MAX_SFA_ROPE_DIM:
        return f"rope head dim {query_rope.shape[-1]} exceeds the kernels' {MAX_SFA_ROPE_DIM}"
    if value.shape[-1] > MAX_SFA_V_DIM:
        return f"value head dim {value.shape[-1]} exceeds the kernels' {MAX_SFA_V_DIM}"
    devices = {t.device for t in (query, key, value)}
    if len(devices) > 1:
        return f"inputs on several devices {sorted(map(str, devices))}"
    return None


def indexer_unsupported(query_index: torch.Tensor, weights: torch.Tensor,
                        query: torch.Tensor | None = None, query_rope: torch.Tensor | None = None) -> str | None:
    """Why the Triton indexer kernels (scores/top-k, KL-loss backward) cannot compute this case."""
    if query_index.dtype not in HALF_OR_FLOAT or weights.dtype not in HALF_OR_FLOAT:
        return f"the kernels compute float16/bfloat16/float32 inputs, got {query_index.dtype}/{weights.dtype}"
    if query_index.shape[-2] > MAX_INDEX_HEADS:
        return f"{query_index.shape[-2]} index heads exceed the kernels' {MAX_INDEX_HEADS}"
    if query_index.shape[-1] > MAX_INDEX_DIM:
        return f"index head dim {query_index.shape[-1]} exceeds the kernels' {MAX_INDEX_DIM}"
    if query is not None:
        if query.shape[-1] > MAX_SFA_QK_DIM:
            return f"query/key head dim {query.shape[-1]} exceeds the kernels' {MAX_SFA_QK_DIM}"
        if query_rope is not None and query_rope.shape[-1] > MAX_SFA_ROPE_DIM:
            return f"rope head dim {query_rope.shape[-1]} exceeds the kernels' {MAX_SFA_ROPE_DIM}"
    return None


def index_rows(sparse_indices: torch.Tensor) -> torch.Tensor:
    """sparse_indices as [R, K] rows (one per query token) with unit stride along K, as the kernels read them."""
    rows = sparse_indices.reshape(-1, sparse_indices.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
