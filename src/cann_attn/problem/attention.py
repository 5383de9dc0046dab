"""The canonical dense-attention problem every FA-family backend computes (docs/design.md, "Layers").

A problem is a list of `Run`s: maximal groups of consecutive sequences that share Sq, Skv and mask structure.
A backend computes one run as a batch ([count, N, S, D] views), so equal-length batches take one batched path
and varlen (TND) batches group whatever sequences they can. Views are taken from the caller's tensors without
copies, whatever their layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import layout as layouts
from . import stats
from .dropout import SequenceDropout
from .mask import SequenceMask
from .pse import SequencePse


@dataclass(frozen=True)
class Run:
    """`count` consecutive sequences starting at batch index b0 (token offsets q_token0 / kv_token0 in TND)."""

    b0: int
    count: int
    seq_q: int
    seq_kv: int
    q_token0: int
    kv_token0: int
    mask: SequenceMask
    pse: SequencePse | None = None
    dropout: SequenceDropout | None = None


@dataclass(frozen=True)
class AttentionProblem:
    layout: str
    batch: int
    heads_q: int
    heads_kv: int
    dim_qk: int
    dim_v: int
    scale: float
    keep_prob: float
    softmax_layout: str
    runs: tuple[Run, ...] = field(default_factory=tuple)
    # One extra softmax logit per query head ([N1], problem/sink.py), or None.
    sink: torch.Tensor | None = None

    @property
    def tnd(self) -> bool:
        return self.layout == "TND"

    @property
    def has_keyless_rows(self) -> bool:
        """Some query row has no key at all (a run with Sq > 0 and Skv = 0: dense layouts only, TND rejects it);
        kernels skip such runs, so their statistics must be filled beforehand (`stats.allocate`)."""
        return any(run.seq_q > 0 and run.seq_kv == 0 for run in self.runs)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def q_view(self, tensor: torch.Tensor, run: Run, heads: int | None = None) -> torch.Tensor:
        """[count, N, Sq, D] view of a tensor laid out like the query (query, attention_out, dy, dq); with
        per-batch actual lengths (PFA) only the first Sq rows of each batch."""
        if self.tnd:
            return layouts.tnd_run(tensor, run.q_token0, run.count, run.seq_q)
        bnsd = layouts.as_bnsd(tensor, self.layout, heads or self.heads_q)
        return bnsd[run.b0 : run.b0 + run.count, :, : run.seq_q]

    def kv_view(self, tensor: torch.Tensor, run: Run) -> torch.Tensor:
        """[count, N2, Skv, D] view of a tensor laid out like the key (key, value, dk, dv)."""
        if self.tnd:
            return layouts.tnd_run(tensor, run.kv_token0, run.count, run.seq_kv)
        bnsd = layouts.as_bnsd(tensor, self.layout, self.heads_kv)
        return bnsd[run.b0 : run.b0 + run.count, :, : run.seq_kv]

    def stat_view(self, tensor: torch.Tensor, run: Run) -> torch.Tensor:
        """[count, N1, Sq, 8] view of softmax_max / softmax_sum."""
        view = stats.run_view(
            tensor, tnd=self.tnd, softmax_layout=self.softmax_layout, b0=run.b0, count=run.count,
            token_start=run.q_token0, seq_q=run.seq_q,
        )
        return view if self.tnd else view[:, :, : run.seq_q]


def mask_runs(seq_masks: list[SequenceMask], one_per_sequence: bool) -> list[tuple[int, int]]:
    """(b0, count) runs of consecutive sequences whose masks share their structure. With `one_per_sequence`
    (each sequence reads its own slice of an explicit mask that no batched view describes) every sequence is
    its own run."""
    return partition_runs([(m.structure, b if one_per_sequence else 0) for b, m in enumerate(seq_masks)])


def partition_runs(keys: list[tuple]) -> list[tuple[int, int]]:
    """(b0, count) of the maximal runs of consecutive sequences with equal keys (lengths + mask structure)."""
    runs: list[tuple[int, int]] = []
    for b, key in enumerate(keys):
        if runs and keys[runs[-1][0]] == key:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs
