"""cann_attn.distributed on GPUs (docs/guides/context_parallel.md): the same code on NCCL, the same cases as the CPU
tests (tests/cp_cases.py), one process per visible GPU. With one GPU the single-rank group still runs every case
through NCCL and the GPU kernels (the ring and Ulysses degenerate to one block per chunk pair, no hops)."""

from __future__ import annotations

import pytest
import torch

import cp_cases
from cann_attn.testing.distributed import run_group

pytestmark = pytest.mark.gpu


def _cases(world: int) -> list[dict]:
    return cp_cases.shard_cases(world) + cp_cases.fa_matrix(world) + cp_cases.dsa_cases(world)


def test_context_parallel_nccl_every_gpu():
    """One rank per visible GPU (skipped with fewer than 2)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs at least 2 CUDA GPUs")
    world = torch.cuda.device_count()
    cp_cases.assert_no_failures(run_group(world, cp_cases.run_cases, _cases(world), backend="nccl", deadline=900))


def test_context_parallel_nccl_single_rank():
    """A one-rank NCCL group on GPU 0: every case through NCCL collectives and the GPU kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cp_cases.assert_no_failures(run_group(1, cp_cases.run_cases, _cases(1), backend="nccl", deadline=900))
