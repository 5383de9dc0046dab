"""Which path a block selection of SparseFlashAttention takes on the CPU, and that the paths agree
(docs/operators/sparse_flash_attention.md, docs/guides/backends.md "Native CPU loops"): rows that select different
blocks (the union of a tile's blocks much larger than each row's selection) take the native per-row loops, rows that
share their blocks keep the union path's dense GEMMs; both match the float64 oracle and each other, and the native
rows do not depend on the thread count."""

from __future__ import annotations

import pytest
import torch

from cann_attn.backends.reference import native
from cann_attn.backends.reference import sparse_attention as sfa
from dsa_utils import GRAD_NAMES, SFACase

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(native.library() is None, reason="needs the native loops")]

BLOCK = 8


@pytest.fixture
def native_calls(monkeypatch) -> dict[str, int]:
    """Counts the native forward / backward calls of the sparse attention kernels."""
    calls = {"forward": 0, "backward": 0}
    forward, backward = native.sfa_forward, native.sfa_backward

    def counted_forward(*args, **kwargs):
        calls["forward"] += 1
        return forward(*args, **kwargs)

    def counted_backward(*args, **kwargs):
        calls["backward"] += 1
        return backward(*args, **kwargs)

    monkeypatch.setattr(native, "sfa_forward", counted_forward)
    monkeypatch.setattr(native, "sfa_backward", counted_backward)
    return calls


def _dispersed_case(rng: torch.Generator, layout: str = "BSND", **kw) -> SFACase:
    """64 rows (two union tiles) of block-8 selections of 3 random blocks out of 32: the union of a tile's blocks
    is nearly all 32, ~10x each row's selection."""
    return SFACase(layout, gen=rng, b=1, s1=64, s2=32 * BLOCK, n1=4, d=16, d_rope=8, block_size=BLOCK, k=3, mode=0,
                   style="topk", **kw)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("value_is_key", [False, True], ids=["kv", "latent"])
def test_dispersed_blocks_take_the_native_rows(layout, value_is_key, native_calls, rng):
    case = _dispersed_case(rng, layout, value_is_key=value_is_key)
    case.check()
    assert native_calls == {"forward": 1 if layout == "BSND" else 2, "backward": 1 if layout == "BSND" else 2}


def test_shared_blocks_keep_the_union_path(native_calls, rng):
    """Every row the allowed blocks in order (a block-causal pattern): the union is each row's own selection."""
    case = SFACase("BSND", gen=rng, b=1, s1=64, s2=16 * BLOCK, n1=4, d=16, d_rope=8, block_size=BLOCK, k=16,
                   mode=3, style="blocks")
    case.check()
    assert native_calls == {"forward": 0, "backward": 0}


def test_native_rows_match_the_union_path(monkeypatch, rng):
    """The same case forced through both paths: equal to fp32 rounding (the order of the sums differs)."""
    case = _dispersed_case(rng, value_is_key=True)
    native_fwd = case.forward()
    native_grads = case.grad(native_fwd)
    monkeypatch.setattr(sfa, "NATIVE_UNION_RATIO", float("inf"))
    union_fwd = case.forward()
    union_grads = case.grad(union_fwd)
    for name in ("attention_out", "softmax_max", "softmax_sum"):
        torch.testing.assert_close(getattr(native_fwd, name), getattr(union_fwd, name), rtol=2e-5, atol=2e-6)
    for name in GRAD_NAMES:
        a, b = getattr(native_grads, name), getattr(union_grads, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_native_rows_do_not_depend_on_the_thread_count(rng):
    case = _dispersed_case(rng)

    def run():
        fwd = case.forward()
        grads = case.grad(fwd)
        return [fwd.attention_out, fwd.softmax_max, fwd.softmax_sum,
                *(getattr(grads, n) for n in GRAD_NAMES if getattr(grads, n) is not None)]

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows_per_block_set, expected", [(1, True), (4, True), (32, False)])
def test_dispersed_measures_the_union_against_the_selection(rows_per_block_set, expected):
    """64 rows of 2 blocks each, `rows_per_block_set` neighbouring rows sharing a pair of blocks: tiles of 32 rows
    hold 32 / rows_per_block_set distinct pairs, a union of that many times the pair (capped at 16 blocks)."""
    rows, width = 64, 2
    pair = torch.arange(rows) // rows_per_block_set
    blocks = torch.stack([2 * pair % 16, (2 * pair + 1) % 16], 1)
    selection = sfa.RowSelection(blocks, torch.ones(rows, width, dtype=torch.bool), blocks, torch.ones_like(blocks,
                                 dtype=torch.bool), 1, torch.full((rows,), width))
    assert sfa._dispersed(selection, 32, 16) is expected
