"""cann_attn.distributed in real process groups (gloo on 127.0.0.1, torch.multiprocessing spawn), world sizes 2
and 4: every case of tests/cp_cases.py equals the single-process operator on the whole tensors
(docs/guides/context_parallel.md). One spawn per world size runs every case (spawns are the expensive part), and
`run_group` holds a file lock so that xdist workers start one process group at a time."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cp_cases
from cann_attn.library import mix_seed
from cann_attn.problem.context_blocks import Window, block_mask
from cann_attn.problem.dropout import positional_keep
from cann_attn.testing.distributed import run_group
from patience import COLLECTIVE_SECONDS, HANG_SECONDS


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_single_process(world):
    cases = (cp_cases.shard_cases(world) + cp_cases.fa_matrix(world) + cp_cases.error_cases(world)
             + cp_cases.dsa_cases(world))
    results = run_group(world, cp_cases.run_cases, cases, group_timeout=COLLECTIVE_SECONDS, deadline=HANG_SECONDS)
    assert [name for name, _, _ in results[0]] == [c["name"] for c in cases]
    cp_cases.assert_no_failures(results)



def test_ring_of_one_rank_matches_single_process():
    """A ring of one rank computes each whole sequence in one block call (no chunks, no merge): still the
    single-process operator, every ring case of the matrix."""
    cases = [c for c in cp_cases.fa_matrix(1) if c["method"] == "ring"]
    cp_cases.assert_no_failures(run_group(1, cp_cases.run_cases, cases, group_timeout=COLLECTIVE_SECONDS,
                                          deadline=HANG_SECONDS))

# ------------------------------------------------------------------------------------- rules, no process group
@given(lower=st.one_of(st.none(), st.integers(-12, 12)), width=st.one_of(st.none(), st.integers(0, 12)),
       q_offset=st.integers(0, 12), kv_offset=st.integers(0, 12), rows=st.integers(1, 6), cols=st.integers(1, 6))
def test_block_mask_is_the_shifted_window(lower, width, q_offset, kv_offset, rows, cols):
    """Skip / full / band of a block equals the window of the whole sequence evaluated at global positions."""
    upper = None if width is None else (width if lower is None else lower + width)
    window = Window(lower, upper)
    i = torch.arange(rows).view(-1, 1) + q_offset
    j = torch.arange(cols).view(1, -1) + kv_offset
    visible = torch.ones(rows, cols, dtype=torch.bool)
    if lower is not None:
        visible &= j >= i + lower
    if upper is not None:
        visible &= j <= i + upper
    mask = block_mask(window, q_offset, kv_offset, rows, cols)
    if mask.kind == "skip":
        assert not visible.any()
        return
    if mask.kind == "full":
        assert visible.all()
        return
    li, lj = torch.arange(rows).view(-1, 1), torch.arange(cols).view(1, -1)
    delta = cols - rows
    band = (lj >= li + delta - mask.pre_tokens) & (lj <= li + delta + mask.next_tokens)
    assert torch.equal(band, visible)
    assert mask.pre_tokens + mask.next_tokens >= 0


def test_positional_keep_is_splitmix_of_the_element():
    """keep(e) = top 24 bits of mix_seed(seed, e) < ceil(keep_prob * 2^24), whatever tensor the elements come in."""
    seed, keep_prob = 987654321, 0.6
    elements = torch.tensor([0, 1, 7, 8, 2**31 + 5, 2**40 + 3, 123456789012])
    expected = [(mix_seed(seed, int(e)) >> 40) < math.ceil(keep_prob * 2**24) for e in elements]
    assert positional_keep(seed, elements, keep_prob).tolist() == expected
    shuffled = elements.flip(0)
    assert positional_keep(seed, shuffled, keep_prob).tolist() == expected[::-1]


def test_failures_raise_on_every_rank_within_the_timeout():
    """Mismatched shapes / head counts and one rank's own validation error raise ParamInvalidError on every rank
    before any computation; a rank that raises inside the ring, or never calls, makes the others raise
    ContextParallelError within the timeout instead of hanging."""
    timeout = 10.0  # a peer starved of CPU on a busy machine still answers the up-front checks in time
    results = run_group(2, cp_cases.run_failures, timeout, group_timeout=COLLECTIVE_SECONDS, deadline=HANG_SECONDS)
    for rank, outcome in enumerate(results):
        for name in ("shape", "heads", "own_error"):
            kind, message, _ = outcome[name]
            assert kind == "ParamInvalidError", (rank, name, kind, message)
        assert "disagree" in outcome["shape"][1] and "q" in outcome["shape"][1]
        assert "disagree" in outcome["heads"][1] and "head_num" in outcome["heads"][1]
        assert "rank 1" in outcome["own_error"][1] or rank == 1
    kind, message, seconds = results[1]["peer_raises"]
    assert (kind, message) == ("RuntimeError", "injected failure")
    for name in ("peer_raises", "peer_absent"):
        kind, message, seconds = results[0][name]
        assert kind == "ContextParallelError", (name, kind, message)
        assert seconds < 3 * timeout, (name, seconds)
        assert "timed out" in message
