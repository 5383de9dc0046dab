"""The native CPU loops (`backends/reference/native`): each entry point against a float64 computation written here
from its contract, independence from the thread count, the exponential against softmax_exp, the operators with the
loops on and off, and the fallback when the library cannot be built."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import cann_attn
from cann_attn.backends.reference import native
from cann_attn.backends.reference.softmax_exp import EXP2_FLOOR, LOG2E, exp2_flushed_
from patience import HANG_SECONDS

pytestmark = pytest.mark.skipif(native.library() is None, reason="native loops unavailable (no compiler or no AVX2)")
# Decorators are evaluated at collection, also where the module is skipped: no library, no sgemm_pack.
_HAS_SGEMM_PACK = native.library() is not None and bool(native.library().cann_attn_has_sgemm_pack())


def _entries(gen: torch.Generator, rows: int, width: int, n_keys: int, invalid: float):
    """Token lists with duplicates, a valid mask with about `invalid` of the entries off, one row with none."""
    tokens = torch.randint(0, n_keys, (rows, width), generator=gen)
    tokens[:, -1] = tokens[:, 0]  # a duplicated token in every row, far apart and (below) within one block of 3
    if width > 2:
        tokens[:, 2] = tokens[:, 1]
    valid = torch.rand(rows, width, generator=gen) >= invalid
    if invalid > 0 and rows > 1:
        valid[1] = False
    return tokens, valid


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 sums of hundreds of terms against float64: within 3e-5 of the tensor's largest magnitude."""
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=3e-5 * max(want.abs().max().item(), 1e-30))


def _rows64(q, k, v, tokens, valid):
    """Per row: logits [H, n] over the valid entries, their tokens, in float64."""
    out = []
    for r in range(q.shape[0]):
        sel = tokens[r][valid[r]] if valid is not None else tokens[r]
        out.append((q[r].double() @ k[sel].double().T, sel))
    return out


SHAPES = [  # heads, dqk, dv, width, n_keys
    (1, 8, 8, 1, 5),
    (5, 13, 3, 7, 11),
    (16, 576, 512, 130, 300),
    (3, 40, 24, 64, 64),
]


@pytest.mark.parametrize("invalid", [0.0, 0.3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_rows(shape, invalid):
    heads, dqk, dv, width, n_keys = shape
    gen = torch.Generator().manual_seed(sum(shape))
    rows = 6
    q = torch.randn(rows, heads, dqk, generator=gen) * dqk**-0.5
    k = torch.randn(n_keys, dqk, generator=gen)
    v = torch.randn(n_keys, dv, generator=gen)
    tokens, valid = _entries(gen, rows, width, n_keys, invalid)
    o, m, l = torch.empty(rows, heads, dv), torch.empty(rows, heads), torch.empty(rows, heads)
    native.sfa_forward(q, k, v, tokens, valid if invalid else None, LOG2E, EXP2_FLOOR, o, m, l)
    for r, (s, sel) in enumerate(_rows64(q, k, v, tokens, valid if invalid else None)):
        if sel.numel() == 0:
            assert torch.all(m[r] == -math.inf) and torch.all(l[r] == 0) and torch.all(o[r] == 0)
            continue
        mx = s.amax(-1, keepdim=True)
        e = torch.exp(s - mx)
        torch.testing.assert_close(m[r].double(), mx.squeeze(-1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(l[r].double(), e.sum(-1), rtol=1e-5, atol=0)
        _assert_close(o[r], e @ v[sel].double())


@pytest.mark.parametrize("invalid", [0.0, 0.3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_rows(shape, invalid):
    heads, dqk, dv, width, n_keys = shape
    gen = torch.Generator().manual_seed(7 + sum(shape))
    rows, scale = 5, 0.37
    q = torch.randn(rows, heads, dqk, generator=gen) * dqk**-0.5
    k = torch.randn(n_keys, dqk, generator=gen)
    v = torch.randn(n_keys, dv, generator=gen)
    d_out = torch.randn(rows, heads, dv, generator=gen)
    d_sum = torch.randn(rows, heads, generator=gen)
    shift = torch.randn(rows, heads, generator=gen)
    inv_sum = torch.rand(rows, heads, generator=gen) + 0.1
    tokens, valid = _entries(gen, rows, width, n_keys, invalid)
    dq = torch.empty(rows, heads, dqk)
    dk, dvv = torch.zeros(n_keys, dqk), torch.zeros(n_keys, dv)
    native.sfa_backward(q, d_out, d_sum, shift, inv_sum, k, v, tokens, valid if invalid else None, LOG2E, EXP2_FLOOR,
                        scale, dq, dk, dvv)
    dk64, dv64 = torch.zeros(n_keys, dqk, dtype=torch.float64), torch.zeros(n_keys, dv, dtype=torch.float64)
    for r, (s, sel) in enumerate(_rows64(q, k, v, tokens, valid if invalid else None)):
        p = torch.exp(s - shift[r].double().unsqueeze(-1)) * inv_sum[r].double().unsqueeze(-1)
        dp = d_out[r].double() @ v[sel].double().T
        ds = p * (dp - d_sum[r].double().unsqueeze(-1))
        _assert_close(dq[r], scale * ds @ k[sel].double())
        dk64.index_add_(0, sel, ds.T @ q[r].double())
        dv64.index_add_(0, sel, p.T @ d_out[r].double())
    _assert_close(dk, dk64)
    _assert_close(dvv, dv64)


@pytest.mark.parametrize("invalid", [0.0, 0.3])
def test_kl_target_rows(invalid):
    gen = torch.Generator().manual_seed(3)
    rows, heads, dqk, width, n_keys = 4, 6, 21, 37, 50
    q = torch.randn(rows, heads, dqk, generator=gen) * 0.3
    k = torch.randn(n_keys, dqk, generator=gen)
    shift = torch.randn(rows, heads, generator=gen) + 3.0
    tokens, valid = _entries(gen, rows, width, n_keys, invalid)
    out = torch.full((rows, width), 7.0)
    native.kl_target(q, k, tokens, valid if invalid else None, shift, EXP2_FLOOR, out)
    s = torch.einsum("rhd,rjd->rhj", q.double(), k[tokens].double())
    want = torch.exp2(s - shift.double().unsqueeze(-1)).mean(1)
    if invalid:
        want = want.masked_fill(~valid, 0.0)
        assert torch.all(out[~valid] == 0)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-7)


def _on_one_and_two_threads(run):
    """run() with torch's thread pool at 1 and then 2 threads (restored afterwards): (first result, second result)."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        return one, run()
    finally:
        torch.set_num_threads(previous)


def test_results_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(11)
    rows, heads, dqk, dv, width, n_keys = 37, 16, 72, 64, 96, 200
    q = torch.randn(rows, heads, dqk, generator=gen) * 0.1
    k = torch.randn(n_keys, dqk, generator=gen)
    tokens, valid = _entries(gen, rows, width, n_keys, 0.2)
    d_out = torch.randn(rows, heads, dv, generator=gen)

    def run():
        o, m, l = torch.empty(rows, heads, dv), torch.empty(rows, heads), torch.empty(rows, heads)
        native.sfa_forward(q, k, k[:, :dv], tokens, valid, LOG2E, EXP2_FLOOR, o, m, l)
        dq, dk, dv_ = torch.empty(rows, heads, dqk), torch.zeros(n_keys, dqk), torch.zeros(n_keys, dv)
        native.sfa_backward(q, d_out, m.nan_to_num(0.0), m.clamp_min(0.0), torch.ones(rows, heads), k, k[:, :dv],
                            tokens, valid, LOG2E, EXP2_FLOOR, 0.5, dq, dk, dv_)
        return o, m, l, dq, dk, dv_

    one, two = _on_one_and_two_threads(run)
    again = run()
    for a, b, c in zip(one, two, again, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_exp2_matches_softmax_exp():
    """Within 2 ulp of PyTorch's exp2 on (floor, 128), exactly 0 at or below the floor (the flush boundary
    included), inf from 128 on, NaN kept."""
    x = torch.cat([torch.linspace(-130.0, 130.0, 200_001), torch.tensor([EXP2_FLOOR, -126.0 + 2**-17, 127.99, 128.0,
                                                                          -math.inf, math.inf, math.nan, 0.0])])
    got = native.exp2_flushed(x, EXP2_FLOOR)
    want = exp2_flushed_(x.clone())
    assert torch.equal(got == 0, want == 0)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(torch.isnan(got), torch.isnan(want))
    finite = torch.isfinite(want) & (want != 0)
    rel = ((got[finite].double() - want[finite].double()) / want[finite].double()).abs().max().item()
    assert rel <= 2 * 2**-23, rel


def _sfa_inputs(gen, s1=40, s2=90, n1=4, d=24, dr=8, k=20):
    q = torch.randn(1, s1, n1, d, generator=gen)
    latent = torch.randn(1, s2, 1, d, generator=gen)
    q_rope, k_rope = torch.randn(1, s1, n1, dr, generator=gen), torch.randn(1, s2, 1, dr, generator=gen)
    idx = torch.randint(-1, s2, (1, s1, 1, k), generator=gen, dtype=torch.int32)
    return q, latent, q_rope, k_rope, idx


def _sfa_run(q, key, value, q_rope, k_rope, idx, d_out):
    fwd = cann_attn.sparse_flash_attention(q, key, value, idx, 0.2, query_rope=q_rope, key_rope=k_rope)
    grads = cann_attn.sparse_flash_attention_grad(q, key, value, idx, d_out, fwd.attention_out, fwd.softmax_max,
                                                  fwd.softmax_sum, 0.2, query_rope=q_rope, key_rope=k_rope)
    return (*fwd, *grads)


@pytest.fixture
def loops_off(monkeypatch):
    """Run the operators with the native loops switched off (CANN_ATTN_NATIVE=0): the PyTorch path."""

    def switch(off: bool):
        if off:
            monkeypatch.setenv(native.ENV_SWITCH, "0")
        else:
            monkeypatch.delenv(native.ENV_SWITCH, raising=False)

    return switch


@pytest.mark.parametrize("value_is_key", [True, False])
@pytest.mark.parametrize("poison", [None, "nan_key", "inf_value"])
def test_operators_agree_with_the_pytorch_path(loops_off, value_is_key, poison):
    """SFA forward and grad with the loops on and off, including a non-finite key or value that no row selects
    (it must not reach any row) and padding (-1) entries."""
    gen = torch.Generator().manual_seed(5)
    q, latent, q_rope, k_rope, idx = _sfa_inputs(gen)
    value = latent if value_is_key else torch.randn(latent.shape, generator=gen)
    if poison is not None:
        never = 89  # a key no row selects
        idx = torch.where(idx == never, 0, idx)
        (latent if poison == "nan_key" else value)[0, never, 0, 3] = math.nan if poison == "nan_key" else math.inf
    d_out = torch.randn(*q.shape[:-1], value.shape[-1], generator=gen)
    loops_off(False)
    on = _sfa_run(q, latent, value, q_rope, k_rope, idx, d_out)
    loops_off(True)
    assert native.library() is None
    off = _sfa_run(q, latent, value, q_rope, k_rope, idx, d_out)
    for a, b in zip(on, off, strict=True):
        if a is None:
            assert b is None
            continue
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_kl_loss_agrees_with_the_pytorch_path(loops_off):
    gen = torch.Generator().manual_seed(9)
    q, latent, q_rope, k_rope, idx = _sfa_inputs(gen)
    idx[..., 0] = 0  # every row keeps a valid entry (padding elsewhere): finite SFA statistics, finite gradients
    q_idx, k_idx = torch.randn(1, 40, 3, 16, generator=gen), torch.randn(1, 90, 1, 16, generator=gen)
    weights = torch.randn(1, 40, 3, generator=gen)
    stats = cann_attn.sparse_flash_attention(q, latent, latent, idx, 0.2, query_rope=q_rope, key_rope=k_rope)

    def run():
        return cann_attn.sparse_lightning_indexer_grad_kl_loss(
            q, latent, q_idx, k_idx, weights, idx, stats.softmax_max, stats.softmax_sum, 0.2, query_rope=q_rope,
            key_rope=k_rope)

    loops_off(False)
    on = run()
    loops_off(True)
    off = run()
    for a, b in zip(on, off, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_strided_key_columns():
    """K with a non-unit column stride is copied to unit stride, not read wrongly."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, 8, generator=gen)
    k = torch.randn(8, 10, generator=gen).T  # [10, 8], column stride 10
    tokens = torch.randint(0, 10, (3, 4), generator=gen)
    o, m, l = torch.empty(3, 2, 8), torch.empty(3, 2), torch.empty(3, 2)
    native.sfa_forward(q, k, k, tokens, None, LOG2E, EXP2_FLOOR, o, m, l)
    o2, m2, l2 = torch.empty(3, 2, 8), torch.empty(3, 2), torch.empty(3, 2)
    native.sfa_forward(q, k.contiguous(), k.contiguous(), tokens, None, LOG2E, EXP2_FLOOR, o2, m2, l2)
    assert torch.equal(o, o2) and torch.equal(m, m2) and torch.equal(l, l2)


def test_switch_and_build_failure(monkeypatch, tmp_path):
    """CANN_ATTN_NATIVE=0 switches the loops off; a failing compiler gives one RuntimeWarning naming the switch and
    the operators still run (PyTorch path)."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.library() is None
    monkeypatch.delenv(native.ENV_SWITCH)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CANN_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.warns(RuntimeWarning, match=native.ENV_SWITCH):
        assert native.library() is None
    assert native.library() is None  # remembered: no second attempt, no second warning
    assert not list(tmp_path.glob("*.so"))
    gen = torch.Generator().manual_seed(1)
    q, latent, q_rope, k_rope, idx = _sfa_inputs(gen, s1=5, s2=9, k=4)
    out = cann_attn.sparse_flash_attention(q, latent, latent, idx, 0.2, query_rope=q_rope, key_rope=k_rope)
    assert torch.isfinite(out.attention_out).all()


@pytest.mark.parametrize("shape", [(1, 8, 1, 4), (8, 128, 37, 60), (5, 13, 7, 9)], ids=lambda s: "x".join(map(str, s)))
def test_plain_row_products(shape):
    """rows_dot / rows_combine / rows_scatter (the KL op's indexer products) over every entry, duplicates included."""
    heads, dim, width, n_keys = shape
    gen = torch.Generator().manual_seed(sum(shape))
    rows = 5
    a = torch.randn(rows, heads, dim, generator=gen)
    b = torch.randn(n_keys, dim, generator=gen)
    wt = torch.randn(rows, heads, width, generator=gen)
    tokens, _ = _entries(gen, rows, width, n_keys, 0.0)
    got = native.rows_dot(a, b, tokens, torch.empty(rows, heads, width))
    _assert_close(got, torch.einsum("rhd,rjd->rhj", a.double(), b[tokens].double()))
    got = native.rows_combine(wt, b, tokens, torch.empty(rows, heads, dim))
    _assert_close(got, torch.einsum("rhj,rjd->rhd", wt.double(), b[tokens].double()))
    target = torch.randn(n_keys, dim, generator=gen)
    want = target.double().index_add(0, tokens.reshape(-1),
                                     torch.einsum("rhj,rhd->rjd", wt.double(), a.double()).reshape(-1, dim))
    native.rows_scatter(wt, a, tokens, target)
    _assert_close(target, want)


def test_dense_softmax_step_matches_the_pytorch_rule():
    """fa_softmax_step against the flash forward's PyTorch ops: rows that have seen only -inf so far (max stays
    -inf, shift 0, correction 0), a row whose max grows, a NaN logit (propagated), fully masked tiles."""
    gen = torch.Generator().manual_seed(4)
    rows, cols = 7, 45
    s = torch.randn(rows, cols, generator=gen) * 30
    s[0] = -math.inf
    s[1, :10] = -math.inf
    s[2, 3] = math.nan
    old_max = torch.tensor([-math.inf, -math.inf, 1.0, 100.0, -5.0, 2.0, -math.inf])
    old_sum = torch.tensor([0.0, 0.0, 3.0, 2.0, 1.5, 1.0, 0.0])
    m, l, corr = old_max.clone(), old_sum.clone(), torch.empty(rows)
    got = s.clone()
    native.fa_softmax_step(got, m, l, corr, LOG2E, EXP2_FLOOR)
    new_max = torch.maximum(old_max, s.amax(-1))
    shift = torch.where(new_max == -math.inf, 0.0, new_max)
    want = exp2_flushed_((s - shift.unsqueeze(-1)) * LOG2E)
    want_corr = torch.exp(old_max - shift)
    torch.testing.assert_close(got, want, rtol=4e-7, atol=0, equal_nan=True)
    torch.testing.assert_close(m, new_max, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(corr, want_corr, rtol=2e-7, atol=0, equal_nan=True)
    torch.testing.assert_close(l, old_sum * want_corr + want.sum(-1), rtol=2e-6, atol=0, equal_nan=True)
    assert m[0] == -math.inf and corr[0] == 0 and l[0] == 0 and torch.all(got[0] == 0)


def _ordered_max(row: list[float]) -> float:
    """The row maximum in the loops' order: per lane l < 8 of the full 8-column blocks, m = m > x ? m : x (x wins a
    tie: the last of equal zeros), then the lanes and the tail left to right with a strict >."""
    full = len(row) // 8 * 8
    lanes = [-math.inf] * 8
    for j in range(full):
        lanes[j % 8] = lanes[j % 8] if lanes[j % 8] > row[j] else row[j]
    best = lanes[0]
    for x in lanes[1:] + row[full:]:
        best = x if x > best else best
    return best


@pytest.mark.parametrize("cols", [7, 40, 77, 300])
def test_row_maximum_keeps_the_ordered_sign_of_a_zero(cols):
    """The row maximum (several running maxima per lane for speed) gives the bits of one maximum per lane taken in
    order, the sign of a zero maximum included (-0 and +0 compare equal; which one is kept depends on the order)."""
    gen = torch.Generator().manual_seed(cols)
    s = -torch.rand(6, cols, generator=gen) - 1.0
    signs = torch.rand(6, cols, generator=gen) < 0.5
    zeros = torch.rand(6, cols, generator=gen) < 0.3
    s[zeros] = torch.where(signs[zeros], -0.0, 0.0)
    s[5, 3] = 2.0  # a positive maximum
    want = torch.tensor([_ordered_max(r.tolist()) for r in s])
    m, l, corr = torch.full((6,), -math.inf), torch.zeros(6), torch.empty(6)
    native.fa_softmax_step(s.clone(), m, l, corr, LOG2E, EXP2_FLOOR)
    assert torch.equal(m.view(torch.int32), want.view(torch.int32))
    assert torch.signbit(want[:5]).any() and not torch.signbit(want[:5]).all()  # both signs occur


@pytest.mark.skipif(not native.set_avx512(True), reason="no AVX-512F on this CPU")
@pytest.mark.parametrize("cols", [5, 16, 45, 131])
def test_avx512_exponential_pass_is_bitwise_the_avx2_one(cols):
    """The AVX-512 steps of the exponential pass (row_exp) give the AVX2 loop's bits: every exponential (across the
    flush floor, overflow to inf, NaN, -inf, signed zeros) and the row sums, in both the forward's softmax step and
    the backward's probabilities (a factor != 1)."""
    gen = torch.Generator().manual_seed(7)
    rows = 6
    s = torch.randn(rows, cols, generator=gen) * 4
    s[5] *= 30
    s[0] = torch.linspace(-200.0, 200.0, cols)
    s[1, ::3] = -math.inf
    s[2, cols // 2] = math.nan
    s[3, ::2] = -0.0
    s[4, -1] = math.inf
    shift = torch.tensor([0.0, 1.0, -3.0, 0.0, 2.0, 100.0])
    factor = torch.rand(rows, generator=gen) + 0.5
    m0, l0 = torch.tensor([-math.inf, 5.0, 1.0, -math.inf, 0.0, 200.0]), torch.rand(rows, generator=gen)

    def run(avx512: bool) -> list[torch.Tensor]:
        assert native.set_avx512(avx512) == avx512
        p, e = s.clone(), s.clone()
        m, l, corr = m0.clone(), l0.clone(), torch.empty(rows)
        native.fa_exp_rows(p, shift, factor, LOG2E, EXP2_FLOOR)
        native.fa_softmax_step(e, m, l, corr, LOG2E, EXP2_FLOOR)
        return [t.view(torch.int32) for t in (p, e, m, l, corr)]

    _assert_same_bits_both_ways(run)


@pytest.mark.skipif(not native.set_avx512(True), reason="no AVX-512F on this CPU")
@pytest.mark.parametrize("heads, dim, width", [(17, 101, 400), (16, 48, 20), (3, 40, 9), (8, 5, 30)])
def test_avx512_gathered_products_are_bitwise_the_avx2_ones(heads, dim, width):
    """The AVX-512 steps of the gathered products give the AVX2 bits: the dot products (row_dots: blocks of 8 heads,
    the rest by the AVX2 blocks; a partial last 8 columns) and the weighted sums (row_combine: 48 columns, the rest by
    the AVX2 blocks), alone (rows_dot, rows_combine) and in the gathered forward, whose keys past the first chunk of
    128 rescale the earlier sums (`keep`)."""
    gen = torch.Generator().manual_seed(heads * dim + width)
    rows, n_keys = 4, 200
    wt = torch.randn(rows, heads, width, generator=gen)
    b = torch.randn(n_keys, dim, generator=gen)
    q = torch.randn(rows, heads, dim, generator=gen)
    tokens, valid = _entries(gen, rows, width, n_keys, 0.2)

    def run(avx512: bool) -> list[torch.Tensor]:
        assert native.set_avx512(avx512) == avx512
        out, m, l = torch.empty(rows, heads, dim), torch.empty(rows, heads), torch.empty(rows, heads)
        native.sfa_forward(q, b, b, tokens, valid, LOG2E, EXP2_FLOOR, out, m, l)
        combined = native.rows_combine(wt, b, tokens, torch.empty(rows, heads, dim), alpha=0.7)
        dots = native.rows_dot(q, b, tokens, torch.empty(rows, heads, width))
        return [t.view(torch.int32) for t in (out, m, l, combined, dots)]

    _assert_same_bits_both_ways(run)


def _assert_same_bits_both_ways(run) -> None:
    try:
        wide, narrow = run(True), run(False)
    finally:
        native.set_avx512(not native._switched_off(native.AVX512_SWITCH))
    for a, b in zip(wide, narrow, strict=True):
        assert torch.equal(a, b)


def test_dense_backward_rows():
    gen = torch.Generator().manual_seed(6)
    s = torch.randn(3, 4, 37, generator=gen) * 5
    shift, factor = s.amax(-1) + 0.5, torch.rand(3, 4, generator=gen) + 0.2
    got = s.clone()
    native.fa_exp_rows(got, shift, factor, LOG2E, EXP2_FLOOR)
    torch.testing.assert_close(got, exp2_flushed_((s - shift.unsqueeze(-1)) * LOG2E) * factor.unsqueeze(-1),
                               rtol=4e-7, atol=0)
    dp, d_sum = torch.randn(3, 4, 37, generator=gen), torch.randn(3, 4, generator=gen)
    want = (dp - d_sum.unsqueeze(-1)) * got
    torch.testing.assert_close(native.fa_ds_rows(dp, got, d_sum), want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", [0, 2, 3])
def test_dense_operators_agree_with_the_pytorch_path(loops_off, mode):
    """flash_attention_score and its grad with the loops on and off (forward statistics included)."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, 70, 16, generator=gen) for _ in range(3))
    dy = torch.randn(2, 3, 70, 16, generator=gen)
    mask = None if mode == 0 else torch.ones(2048, 2048, dtype=torch.bool).triu(1)

    def run():
        fwd = cann_attn.flash_attention_score(q, k, v, 3, "BNSD", scale_value=0.25, sparse_mode=mode, atten_mask=mask)
        grads = cann_attn.flash_attention_score_grad(q, k, v, dy, 3, "BNSD", scale_value=0.25, sparse_mode=mode,
                                                     atten_mask=mask, softmax_max=fwd.softmax_max,
                                                     softmax_sum=fwd.softmax_sum, attention_in=fwd.attention_out)
        return [t for t in (*fwd, *grads) if isinstance(t, torch.Tensor)]

    loops_off(False)
    on = run()
    loops_off(True)
    off = run()
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def _blocks64(q, k, v, tiles, biases, head_rows):
    """float64 row_max, row_sum and unnormalised output of q [E, R, Dk] over the key tiles (keys outside every tile
    are not seen), with each tile's [head_rows, width] additive mask shared by the entries and read at row r %
    head_rows."""
    r = q.shape[1]
    cols = torch.cat([torch.arange(j0, j1) for j0, j1 in tiles])
    s = torch.einsum("erd,ejd->erj", q.double(), k[:, cols].double())
    rows = torch.arange(r) % head_rows
    s += torch.cat([torch.zeros(head_rows, j1 - j0, dtype=torch.float64) if b is None else b.double()
                    for b, (j0, j1) in zip(biases, tiles, strict=True)], dim=1)[rows]
    m = s.amax(-1)
    p = torch.exp(s - torch.where(m == -math.inf, 0.0, m).unsqueeze(-1))
    return m, p.sum(-1), torch.einsum("erj,ejd->erd", p, v[:, cols].double())


FUSED_CASES = [  # entries, group, head_rows, dk, dv, n_keys, tiles, block_rows, sub_cols
    (3, 1, 37, 16, 16, 90, [(0, 90)], 256, 512),
    (2, 4, 13, 40, 24, 130, [(0, 64), (64, 100), (110, 130)], 7, 16),
    (1, 2, 70, 130, 8, 300, [(256, 300), (0, 256)], 64, 100),
    (2, 1, 20, 13, 7, 40, [(0, 40)], 8, 24),  # odd head dims (the bf16 path's half pair)
    (1, 1, 300, 32, 24, 600, [(0, 600)], 64, 512),  # the backward's fp32 S and dP from packed pieces (sgemm_pack)
]


def _fused_inputs(case, seed: int):
    """(generator, rows, q [E, R, Dk], k [E, Skv, Dk], v [E, Skv, Dv]) of a FUSED_CASES case, k and v strided as the
    heads of a BSND tensor."""
    entries, group, head_rows, dk, dv, n_keys = case[:6]
    gen = torch.Generator().manual_seed(seed)
    rows = group * head_rows
    # Values bf16 holds exactly: the float64 reference of the fp32 inputs is then also that of the bf16 score path.
    q = (torch.randn(entries, rows, dk, generator=gen) * 0.3).bfloat16().float()
    kv = torch.randn(n_keys, entries, dk + dv, generator=gen).bfloat16().float()
    return gen, rows, q, kv[..., :dk].transpose(0, 1), kv[..., dk:].transpose(0, 1)


SCORES = ["fp32", pytest.param("bf16", marks=pytest.mark.skipif(not native.has_bf16_dot(),
                                                                  reason="no AVX512-BF16 on this CPU"))]


def _bf16_scores(scores: str, q, k, v=None, dy=None) -> native.Bf16Scores | None:
    """For the bf16 score path: the operands in bf16, keys and values with the fp32 ones' strides, the query doubled
    and the scale 1/2 (both exact), so that the scale is applied."""
    if scores == "fp32":
        return None

    def same_strides(t):
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16).copy_(t)

    return native.Bf16Scores((2 * q).bfloat16(), same_strides(k), 0.5, None if dy is None else dy.bfloat16(),
                             same_strides(v))


@pytest.mark.parametrize("scores", SCORES)
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"E{c[0]}G{c[1]}r{c[2]}d{c[3]}")
def test_fused_dense_forward_blocks(case, scores):
    """fa_forward_blocks against float64: tiles in any order with gaps between them, mask tiles that hide whole rows
    of one tile or of every tile, GQA rows reading the mask at r % head_rows, row blocks and column pieces that do
    not divide the rows and tiles, keys and values strided as in a BSND tensor, and no dependence on the thread
    count; with the scores from fp32 sgemm and from bf16 dot products."""
    entries, _, head_rows, _, dv, _, tiles, block_rows, sub_cols = case
    gen, rows, q, k, v = _fused_inputs(case, seed=12)
    biases = []
    for t, (j0, j1) in enumerate(tiles):
        if t == 1:
            biases.append(None)
            continue
        hidden = torch.rand(head_rows, j1 - j0, generator=gen) < 0.4
        hidden[0] = True  # row 0 sees no key in any tile but the unmasked one
        hidden[1, : (j1 - j0) // 2] = True
        biases.append(torch.zeros(head_rows, j1 - j0).masked_fill_(hidden, -math.inf))
    if len(tiles) == 1:
        biases[0][0] = -math.inf  # ... and with a single tile, nothing at all

    def run():
        m, l, acc = torch.empty(entries, rows), torch.empty(entries, rows), torch.empty(entries, rows, dv)
        # With bf16 operands the fp32 q must not be read at all (NaN here): the scores come from the bf16 dots alone.
        native.fa_forward_blocks(q if bf16 is None else torch.full_like(q, math.nan), k, v, tiles,
                                 native.BiasTiles(biases, head_rows), block_rows, sub_cols, LOG2E, EXP2_FLOOR, m, l,
                                 acc, bf16=bf16)
        return m, l, acc

    bf16 = _bf16_scores(scores, q, k)

    one, two = _on_one_and_two_threads(run)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
    m, l, acc = two
    want_m, want_l, want_acc = _blocks64(q, k, v, tiles, biases, head_rows)
    torch.testing.assert_close(m.double(), want_m, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l.double(), want_l, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc.double(), want_acc, rtol=1e-5, atol=1e-5)
    blind = want_m == -math.inf
    if len(tiles) == 1:
        assert blind[:, 0].all()
    assert torch.all(m[blind] == -math.inf) and torch.all(l[blind] == 0) and torch.all(acc[blind] == 0)


def test_fused_dense_forward_propagates_nan():
    """A NaN logit makes its row's statistics and output NaN, as in the PyTorch loop; other rows are untouched."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = torch.randn(1, 5, 8, generator=gen), torch.randn(1, 20, 8, generator=gen), torch.randn(1, 20, 8)
    q[0, 2, 3] = math.nan
    m, l, acc = torch.empty(1, 5), torch.empty(1, 5), torch.empty(1, 5, 8)
    native.fa_forward_blocks(q, k, v, [(0, 20)], native.BiasTiles([None], 5), 256, 512, LOG2E, EXP2_FLOOR, m, l, acc)
    assert m[0, 2].isnan() and l[0, 2].isnan() and acc[0, 2].isnan().all()
    assert torch.isfinite(acc[0, [0, 1, 3, 4]]).all()


@pytest.mark.parametrize("kind", ["plain", "causal", "gqa_tnd", "explicit_batch", "alibi", "dropout"])
def test_dense_operators_take_the_fused_loops_where_they_apply(monkeypatch, kind):
    """The fused forward and backward run for every fp32 problem (masks shared by the run or not, pse, dropout, GQA,
    varlen) and give what the PyTorch loops give with sgemm unavailable."""
    gen = torch.Generator().manual_seed(14)
    kw: dict = {}
    layout, n1, n2, b, s = "BNSD", 4, 4, 2, 150
    if kind == "causal":
        kw = dict(sparse_mode=3, atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    elif kind == "explicit_batch":
        kw = dict(sparse_mode=0, atten_mask=torch.rand(b, 1, s, s, generator=gen) < 0.3)
    elif kind == "alibi":
        kw = dict(pse=torch.rand(n1, generator=gen), pse_type=2)
    elif kind == "dropout":
        kw = dict(keep_prob=0.8, drop_mask=torch.randint(0, 256, (b, n1, s, s // 8 + 1), generator=gen,
                                                         dtype=torch.uint8))
    if kind == "gqa_tnd":
        layout, n2 = "TND", 2
        kw = dict(actual_seq_qlen=[70, 150], actual_seq_kvlen=[60, 150], sparse_mode=3,
                  atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1))
        q, dy = torch.randn(s, n1, 32, generator=gen), torch.randn(s, n1, 32, generator=gen)
        k, v = torch.randn(s, n2, 32, generator=gen), torch.randn(s, n2, 32, generator=gen)
    else:
        q, k, v, dy = (torch.randn(b, n, s, 32, generator=gen) for n in (n1, n2, n2, n1))

    calls: list[str] = []
    def counting(name: str):
        real = getattr(native, name)

        def counted(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return counted

    for name in ("fa_forward_blocks", "fa_backward_blocks"):
        monkeypatch.setattr(native, name, counting(name))

    def run():
        fwd = cann_attn.flash_attention_score(q, k, v, n1, layout, scale_value=0.2, **kw)
        grads = cann_attn.flash_attention_score_grad(q, k, v, dy, n1, layout, scale_value=0.2,
                                                     softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
                                                     attention_in=fwd.attention_out, **kw)
        return [t for t in (*fwd, *grads) if isinstance(t, torch.Tensor)]

    fused = run()
    assert set(calls) == {"fa_forward_blocks", "fa_backward_blocks"}, (kind, calls)
    monkeypatch.setattr(native, "has_sgemm", lambda: False)
    calls.clear()
    plain = run()
    assert not calls
    for a, c in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, c, rtol=2e-5, atol=2e-6)


def _backward64(q, k, v, dy, d_sum, shift, factor, tiles, biases, head_rows):
    """float64 dq, dk, dv of the fused backward's contract (keys outside every tile get no gradient)."""
    cols = torch.cat([torch.arange(j0, j1) for j0, j1 in tiles])
    rows = torch.arange(q.shape[1]) % head_rows
    s = torch.einsum("erd,ejd->erj", q.double(), k[:, cols].double())
    s += torch.cat([torch.zeros(head_rows, j1 - j0, dtype=torch.float64) if b is None else b.double()
                    for b, (j0, j1) in zip(biases, tiles, strict=True)], dim=1)[rows]
    p = torch.exp(s - shift.double().unsqueeze(-1)) * factor.double().unsqueeze(-1)
    dp = torch.einsum("erd,ejd->erj", dy.double(), v[:, cols].double())
    ds = p * (dp - d_sum.double().unsqueeze(-1))
    dk, dv = torch.zeros(k.shape, dtype=torch.float64), torch.zeros(v.shape, dtype=torch.float64)
    dk[:, cols] = torch.einsum("erj,erd->ejd", ds, q.double())
    dv[:, cols] = torch.einsum("erj,erd->ejd", p, dy.double())
    return torch.einsum("erj,ejd->erd", ds, k[:, cols].double()), dk, dv


@pytest.mark.parametrize("scores", SCORES)
@pytest.mark.parametrize("min_items", [1, 8])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"E{c[0]}G{c[1]}r{c[2]}d{c[3]}")
def test_fused_dense_backward_blocks(case, min_items, scores):
    """fa_backward_blocks against float64, accumulating into strided gradients that already hold values, with one
    work item per entry (dQ written in place) and with an entry's key pieces split over several items (dQ through
    private buffers); bitwise equal for 1 and 2 threads; with S and dP from fp32 sgemm and from bf16 dot products."""
    entries, _, head_rows, dk, dv, n_keys, tiles, block_rows, sub_cols = case
    gen, rows, q, k, v = _fused_inputs(case, seed=15)
    dy = torch.randn(entries, rows, dv, generator=gen).bfloat16().float()
    bf16 = _bf16_scores(scores, q, k, v, dy)
    biases = [None if t == 1 else torch.zeros(head_rows, j1 - j0).masked_fill_(
        torch.rand(head_rows, j1 - j0, generator=gen) < 0.4, -math.inf) for t, (j0, j1) in enumerate(tiles)]
    # The statistics the forward gives (rows without a visible key get -FLT_MAX / FLT_MAX), perturbed a little.
    m, total, _ = _blocks64(q, k, v, tiles, biases, head_rows)
    blind = m == -math.inf
    shift = torch.where(blind, -3.4e38, m).float() + 0.1 * torch.rand(entries, rows, generator=gen)
    factor = torch.where(blind, 1 / 3.4e38, 1 / total.clamp_min(1e-30)).float()
    d_sum = torch.randn(entries, rows, generator=gen)
    start = [torch.randn(*shape, generator=gen) for shape in ((rows, entries, dk), (n_keys, entries, dk),
                                                              (n_keys, entries, dv))]

    def run():
        dq, dk_, dv_ = (t.clone().transpose(0, 1) for t in start)  # strided: [E, R, D] views of [R, E, D]
        # With bf16 operands dP = dY V^T comes from the bf16 dots: the fp32 values must not be read (NaN here).
        native.fa_backward_blocks(q, dy, d_sum, shift, factor, k, v if bf16 is None else torch.full_like(v, math.nan),
                                  tiles, native.BiasTiles(biases, head_rows), block_rows, sub_cols, min_items, LOG2E,
                                  EXP2_FLOOR, dq, dk_, dv_, bf16=bf16)
        return dq, dk_, dv_

    one, two = _on_one_and_two_threads(run)
    want = _backward64(q, k, v, dy, d_sum, shift, factor, tiles, biases, head_rows)
    for a, b, w, s0 in zip(one, two, want, start, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), w + s0.transpose(0, 1).double(), rtol=1e-4, atol=5e-5)


@pytest.mark.skipif(not native.has_sgemm(), reason="no BLAS sgemm found: the fused loops are off")
def test_fused_loops_do_not_depend_on_the_thread_count_on_mkl_avx2_kernels(tmp_path):
    """The fused forward and backward's 1- vs 2-thread checks again, in a child process with MKL held to its AVX2
    kernels (those of AVX2-only CPUs): there sgemm picks other kernels when it may use 2 threads than 1, even inside
    the loops' parallel region, unless each call's MKL thread count is 1 (attention_loops.c, ON_ONE_THREAD). Without
    MKL the variable does nothing and the checks run as above."""
    env = dict(os.environ, MKL_ENABLE_INSTRUCTIONS="AVX2", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([str(Path(cann_attn.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    env.pop("MKL_CBWR", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                          "test_fused_dense_forward_blocks or test_fused_dense_backward_blocks", __file__],
                         env=env, capture_output=True, text=True, timeout=HANG_SECONDS, cwd=tmp_path)
    assert run.returncode == 0 and " passed" in run.stdout, (run.stdout + run.stderr)[-4000:]


@pytest.mark.parametrize("scores", SCORES)
def test_fused_loops_with_per_entry_bias_continuation_and_feature_columns(scores):
    """Per-tile calls as the pse path makes them: a bias block per entry (entry stride = its size), the forward
    continued over a second call (init=False), and q / k with two trailing feature columns that enter the scores
    but not dq / dk (with bf16 scores: added in fp32 after the bf16 products of the other columns)."""
    gen = torch.Generator().manual_seed(16)
    entries, rows, dg, dv, n_keys = 2, 30, 8, 6, 70
    tiles = [(0, 40), (40, 70)]
    q = torch.randn(entries, rows, dg + 2, generator=gen)
    k, v = torch.randn(entries, n_keys, dg + 2, generator=gen), torch.randn(entries, n_keys, dv, generator=gen)
    q[..., :dg], k[..., :dg], v = q[..., :dg].bfloat16().float(), k[..., :dg].bfloat16().float(), v.bfloat16().float()
    bf16 = _bf16_scores(scores, q[..., :dg], k[..., :dg], v)
    biases = [torch.randn(entries, rows, j1 - j0, generator=gen).masked_fill_(
        torch.rand(entries, rows, j1 - j0, generator=gen) < 0.3, -math.inf) for j0, j1 in tiles]
    cols = torch.arange(n_keys)
    s = torch.einsum("erd,ejd->erj", q.double(), k.double()) + torch.cat(biases, dim=2).double()
    m = s.amax(-1)
    p = torch.exp(s - m.unsqueeze(-1))
    want_l, want_acc = p.sum(-1), torch.einsum("erj,ejd->erd", p, v.double())

    m_got, l_got, acc = torch.empty(entries, rows), torch.empty(entries, rows), torch.empty(entries, rows, dv)
    for t, tile in enumerate(tiles):
        native.fa_forward_blocks(q, k, v, [tile], native.BiasTiles([biases[t]], rows, rows * (tile[1] - tile[0])), 8,
                                 16, LOG2E, EXP2_FLOOR, m_got, l_got, acc, init=t == 0, bf16=bf16)
    torch.testing.assert_close(m_got.double(), m, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l_got.double(), want_l, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc.double(), want_acc, rtol=1e-5, atol=1e-5)

    dy = torch.randn(entries, rows, dv, generator=gen).bfloat16().float()
    d_sum = torch.randn(entries, rows, generator=gen)
    bf16 = _bf16_scores(scores, q[..., :dg], k[..., :dg], v, dy)
    factor = (1 / want_l).float()
    prob = p * factor.double().unsqueeze(-1)
    ds = prob * (torch.einsum("erd,ejd->erj", dy.double(), v.double()) - d_sum.double().unsqueeze(-1))
    dq, dk, dv_ = torch.zeros(entries, rows, dg), torch.zeros(entries, n_keys, dg), torch.zeros(entries, n_keys, dv)
    for t, tile in enumerate(tiles):
        native.fa_backward_blocks(q, dy, d_sum, m_got, factor, k, v, [tile],
                                  native.BiasTiles([biases[t]], rows, rows * (tile[1] - tile[0])), 8, 16, 4, LOG2E,
                                  EXP2_FLOOR, dq, dk, dv_, bf16=bf16)
    torch.testing.assert_close(dq.double(), torch.einsum("erj,ejd->erd", ds, k[..., :dg].double()), rtol=1e-4,
                               atol=1e-5)
    torch.testing.assert_close(dk.double(), torch.einsum("erj,erd->ejd", ds, q[..., :dg].double())[:, cols],
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dv_.double(), torch.einsum("erj,erd->ejd", prob, dy.double()), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not _HAS_SGEMM_PACK, reason="the BLAS has no sgemm_pack")
def test_fused_backward_from_packed_pieces_is_bitwise_sgemm():
    """The fused backward's S and dP from key / value pieces packed once for their row blocks (MKL's sgemm_pack and
    sgemm_compute: whole 128-row blocks of pieces at least 256 keys wide) are the floats of plain sgemm calls."""
    gen = torch.Generator().manual_seed(17)
    q, k, v, dy = (torch.randn(1, 2, 700, 64, generator=gen) for _ in range(4))
    lib = native.library()

    def run():
        fwd = cann_attn.flash_attention_score(q, k, v, 2, "BNSD", scale_value=0.125)
        return cann_attn.flash_attention_score_grad(q, k, v, dy, 2, "BNSD", scale_value=0.125,
                                                    softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
                                                    attention_in=fwd.attention_out)[:3]

    packed = run()
    try:
        lib.cann_attn_set_sgemm_pack(None, None, None)
        assert not lib.cann_attn_has_sgemm_pack()
        plain = run()
    finally:
        lib.cann_attn_set_sgemm_pack(*(native._torch_cpu_symbol((name,)) for name in native.SGEMM_PACK_NAMES))
    assert lib.cann_attn_has_sgemm_pack()
    for a, b in zip(packed, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not _HAS_SGEMM_PACK, reason="the BLAS has no sgemm_pack")
@pytest.mark.parametrize("dtype, heads_kv, alibi", [(torch.float32, 2, False), (torch.float16, 1, False),
                                                    (torch.float32, 2, True)])
def test_fused_forward_from_packed_pieces_is_bitwise_sgemm(dtype, heads_kv, alibi):
    """The fused forward's scores from key pieces packed once per call (a call of 1024 rows: four 256-row blocks;
    pieces of at least 256 keys, here 512 of 700 and not the last 188) are the floats of plain sgemm calls, for whole
    blocks and beside the plain ones (the 76 rows of the second call, the narrow piece, ALiBi's skipped runs)."""
    gen = torch.Generator().manual_seed(19)
    q = torch.randn(1, 2, 1100, 64, generator=gen).to(dtype)
    k, v = (torch.randn(1, heads_kv, 700, 64, generator=gen).to(dtype) for _ in range(2))
    pse = {"pse": torch.tensor([0.5, 0.125]), "pse_type": 2} if alibi else {}
    lib = native.library()

    def run():
        fwd = cann_attn.flash_attention_score(q, k, v, 2, "BNSD", scale_value=0.125, **pse)
        return fwd.attention_out, fwd.softmax_max, fwd.softmax_sum

    lib.cann_attn_forward_packed_gemms()
    packed = run()
    assert lib.cann_attn_forward_packed_gemms() > 0  # the packed path was taken
    try:
        lib.cann_attn_set_sgemm_pack(None, None, None)
        plain = run()
        assert lib.cann_attn_forward_packed_gemms() == 0
    finally:
        lib.cann_attn_set_sgemm_pack(*(native._torch_cpu_symbol((name,)) for name in native.SGEMM_PACK_NAMES))
    for a, b in zip(packed, plain, strict=True):
        assert torch.equal(a, b)


def test_unmasked_forward_tiles_are_one_call_with_the_same_floats(monkeypatch):
    """Unmasked runs take DENSE_FORWARD_ROWS-row tiles (2048 query rows: one fused call, each key piece packed once)
    and give the floats of FUSED_FORWARD_ROWS-row ones (the same pieces in the same order for every row); ALiBi runs
    keep FUSED_FORWARD_ROWS, where the key tiles go nearest each query tile's diagonal first, so that a taller tile
    would change the order of the online softmax's steps."""
    from cann_attn.backends.reference import flash_forward

    gen = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(1, 8, 2048, 16, generator=gen) for _ in range(3))
    calls = []
    fused = native.fa_forward_blocks
    monkeypatch.setattr(native, "fa_forward_blocks", lambda *a, **kw: calls.append(a[0].shape[1]) or fused(*a, **kw))

    def run(**pse):
        fwd = cann_attn.flash_attention_score(q, k, v, 8, "BNSD", scale_value=0.25, **pse)
        return fwd.attention_out, fwd.softmax_max, fwd.softmax_sum

    alibi = {"pse": torch.rand(8, generator=gen), "pse_type": 2}
    tall, tall_alibi = run(), run(**alibi)
    assert calls == [2048, 1024, 1024]  # (rows of each call) the unmasked run in one call, ALiBi in two
    monkeypatch.setattr(flash_forward, "DENSE_FORWARD_ROWS", flash_forward.FUSED_FORWARD_ROWS)
    for a, b in zip(tall + tall_alibi, run() + run(**alibi), strict=True):
        assert torch.equal(a, b)


def test_blas_switch(monkeypatch):
    assert native.has_sgemm()
    monkeypatch.setenv(native.BLAS_SWITCH, "0")
    assert not native.has_sgemm()
    assert not native.has_bf16_dot()  # the bf16 scores live inside the fused loops


def test_bf16_switch(monkeypatch):
    available = bool(native.library().cann_attn_has_bf16_dot())
    assert native.has_bf16_dot() == available
    monkeypatch.setenv(native.BF16_SWITCH, "0")
    assert not native.has_bf16_dot()


@pytest.mark.parametrize("sub_cols", [16, 512])
def test_fused_loops_read_dropout_bits_in_place(sub_cols):
    """KeepBits: each row's keep bits start at its own bit (any offset within a byte) and run on through the tile, in
    the forward (dropped terms count in the sum, not in the output) and the backward (dV from P keep / keep_prob, dP
    scaled the same), with column pieces narrower than the tile."""
    gen = torch.Generator().manual_seed(17)
    entries, rows, d, n_keys, keep_prob = 2, 12, 8, 50, 0.7
    tile = (3, 50)
    width = tile[1] - tile[0]
    q, k, v = (torch.randn(entries, n, d, generator=gen) for n in (rows, n_keys, n_keys))
    mask = torch.randint(0, 256, (200,), dtype=torch.uint8, generator=gen)
    first = torch.randint(0, 8 * 200 - width, (entries, rows), generator=gen)
    bits = torch.from_numpy(np.unpackbits(mask.numpy(), bitorder="little")).double()
    keep = bits[first.unsqueeze(-1) + torch.arange(width)]  # [E, R, width]
    s = torch.einsum("erd,ejd->erj", q.double(), k[:, tile[0] : tile[1]].double())
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    m_got, l_got, acc = torch.empty(entries, rows), torch.empty(entries, rows), torch.empty(entries, rows, d)
    no_bias = native.BiasTiles([None], rows)
    native.fa_forward_blocks(q, k, v, [tile], no_bias, 8, sub_cols, LOG2E, EXP2_FLOOR, m_got, l_got, acc,
                             keep=native.KeepBits(mask, first))
    torch.testing.assert_close(l_got.double(), p.sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc.double(), torch.einsum("erj,ejd->erd", p * keep, v[:, tile[0] : tile[1]].double()),
                               rtol=1e-5, atol=1e-5)

    dy, d_sum = torch.randn(entries, rows, d, generator=gen), torch.randn(entries, rows, generator=gen)
    factor = (1 / p.sum(-1)).float()
    prob = p * factor.double().unsqueeze(-1)
    dp = torch.einsum("erd,ejd->erj", dy.double(), v[:, tile[0] : tile[1]].double()) * keep / keep_prob
    ds = prob * (dp - d_sum.double().unsqueeze(-1))
    dq, dk, dv = torch.zeros(entries, rows, d), torch.zeros(entries, n_keys, d), torch.zeros(entries, n_keys, d)
    native.fa_backward_blocks(q, dy, d_sum, m_got, factor, k, v, [tile], no_bias, 8, sub_cols, 4, LOG2E, EXP2_FLOOR,
                              dq, dk, dv, keep=native.KeepBits(mask, first), keep_prob=keep_prob)
    torch.testing.assert_close(dq.double(), torch.einsum("erj,ejd->erd", ds, k[:, tile[0] : tile[1]].double()),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dk[:, tile[0] : tile[1]].double(), torch.einsum("erj,erd->ejd", ds, q.double()),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dv[:, tile[0] : tile[1]].double(),
                               torch.einsum("erj,erd->ejd", prob * keep / keep_prob, dy.double()), rtol=1e-4,
                               atol=1e-5)
    assert torch.all(dk[:, : tile[0]] == 0) and torch.all(dv[:, : tile[0]] == 0)


def _structured_mask(pattern: str, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] 0 / -inf masks whose hidden part covers whole 64-row sub-blocks' column ranges: causal (j > i
    hidden), a band of +-40 around the diagonal, columns >= 100 hidden from every row below 130, and causal with the
    first 64 rows seeing no column at all."""
    i, j = torch.arange(rows).view(-1, 1), torch.arange(cols).view(1, -1)
    hidden = {"causal": j > i, "band": (j - i).abs() > 40, "left": (j >= 100) & (i < 130),
              "late": (j > i) | (i < 64)}[pattern]
    return torch.zeros(rows, cols).masked_fill_(hidden, -math.inf)


@pytest.mark.parametrize("scores", SCORES)
@pytest.mark.parametrize("pattern", ["causal", "band", "left", "late"])
def test_fused_loops_never_form_columns_no_row_of_a_sub_block_sees(pattern, scores):
    """Where a mask tile hides columns from every row of a 64-row sub-block, the fused loops do not compute them
    (live_columns): results match float64, and a NaN key and a NaN value in column 203 leave finite and exact every
    row whose 64-row sub-block cannot see that column (a row that cannot see it but shares a sub-block with one
    that can still takes 0 x NaN there, as the dense kernels do anywhere)."""
    entries, rows, n_keys, dk, dv = 2, 256, 300, 24, 16
    gen = torch.Generator().manual_seed(21)
    q = (torch.randn(entries, rows, dk, generator=gen) * 0.3).bfloat16().float()  # bf16 values: both score paths
    k, v = (torch.randn(entries, n_keys, d, generator=gen).bfloat16().float() for d in (dk, dv))
    tiles = [(0, 256), (256, 300)]
    biases = [_structured_mask(pattern, rows, 256), None]
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, 203, 5] = math.nan
    poisoned_v[:, 203, 3] = math.nan
    sees = (biases[0][:, 203] == 0).view(-1, 64).any(dim=1).repeat_interleave(64)  # per row: its sub-block sees 203
    want_m, want_l, want_acc = _blocks64(q, k, v, tiles, biases, rows)
    m, l, acc = torch.empty(entries, rows), torch.empty(entries, rows), torch.empty(entries, rows, dv)
    native.fa_forward_blocks(q, poisoned_k, poisoned_v, tiles, native.BiasTiles(biases, rows), 256, 512, LOG2E,
                             EXP2_FLOOR, m, l, acc, bf16=_bf16_scores(scores, q, poisoned_k))
    assert (~sees).sum() >= 64, "no sub-block is blind to the poisoned column: the case does not test the skipping"
    torch.testing.assert_close(m[:, ~sees].double(), want_m[:, ~sees], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l[:, ~sees].double(), want_l[:, ~sees], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc[:, ~sees].double(), want_acc[:, ~sees], rtol=1e-5, atol=1e-5)
    assert acc[:, sees].isnan().any(), "rows that see the NaN value must show it"

    shift, factor = want_m.float(), (1 / want_l).float()
    dy = torch.randn(entries, rows, dv, generator=gen).bfloat16().float()
    d_sum = torch.randn(entries, rows, generator=gen)
    want_dq, want_dk, want_dv = _backward64(q, k, v, dy, d_sum, shift, factor, tiles, biases, rows)
    dq, dk_, dv_ = torch.zeros(entries, rows, dk), torch.zeros(k.shape), torch.zeros(v.shape)
    native.fa_backward_blocks(q, dy, d_sum, shift, factor, poisoned_k, poisoned_v, tiles,
                              native.BiasTiles(biases, rows), 128, 512, 1, LOG2E, EXP2_FLOOR, dq, dk_, dv_,
                              bf16=_bf16_scores(scores, q, poisoned_k, poisoned_v, dy))
    torch.testing.assert_close(dq[:, ~sees].double(), want_dq[:, ~sees], rtol=1e-4, atol=5e-5)
    assert dq[:, sees].isnan().any()
    clean = torch.arange(n_keys) != 203  # only the poisoned key's own gradients take its NaN
    torch.testing.assert_close(dk_[:, clean].double(), want_dk[:, clean], rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(dv_[:, clean].double(), want_dv[:, clean], rtol=1e-4, atol=5e-5)


@pytest.mark.skipif(not native.has_bf16_dot(), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("kind", ["plain", "causal_gqa", "pse_dropout", "alibi"])
def test_bf16_operators_form_scores_with_bf16_dot_products(monkeypatch, kind):
    """bf16 FA forward and backward take the bf16 score path wherever the fused loops run (ALiBi's fp32 feature
    columns added after the bf16 products), and agree with the fp32 score path (CANN_ATTN_NATIVE_BF16=0) to fp32
    rounding of the scores: the products are exact either way, only the order of the sums differs."""
    gen = torch.Generator().manual_seed(23)
    b, n1, n2, s, d = 2, 4, 4, 140, 40
    kw: dict = {}
    if kind == "causal_gqa":
        n2 = 2
        kw = dict(sparse_mode=3, atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    elif kind == "pse_dropout":
        kw = dict(pse=torch.randn(b, n1, s, s, generator=gen).bfloat16(), pse_type=1, keep_prob=0.8,
                  drop_mask=torch.randint(0, 256, (b, n1, s, s // 8 + 1), generator=gen, dtype=torch.uint8))
    elif kind == "alibi":
        kw = dict(pse=torch.rand(n1, generator=gen), pse_type=2)
    q, k, v, dy = (torch.randn(b, n, s, d, generator=gen).bfloat16() for n in (n1, n2, n2, n1))
    seen: list[bool] = []

    def spying(name: str):
        real = getattr(native, name)

        def spy(*args, bf16=None, **kwargs):
            seen.append(bf16 is not None)
            return real(*args, bf16=bf16, **kwargs)

        return spy

    for name in ("fa_forward_blocks", "fa_backward_blocks"):
        monkeypatch.setattr(native, name, spying(name))

    def run():
        fwd = cann_attn.flash_attention_score(q, k, v, n1, "BNSD", scale_value=0.3, **kw)
        grads = cann_attn.flash_attention_score_grad(q, k, v, dy, n1, "BNSD", scale_value=0.3,
                                                     softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
                                                     attention_in=fwd.attention_out, **kw)
        return [t.float() for t in (*fwd, *grads) if isinstance(t, torch.Tensor)]

    dots = run()
    assert seen and all(seen), (kind, seen)
    monkeypatch.setenv(native.BF16_SWITCH, "0")
    seen.clear()
    sgemm = run()
    assert seen and not any(seen)
    for a, c in zip(dots, sgemm, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-2, atol=1e-2)  # bf16 outputs: one bf16 ulp apart at most


def _fused_forward_cases() -> list[dict]:
    """flash_attention_score inputs through the fused forward: fp32 / fp16 / bf16, BNSD and BSND (strided rows), GQA,
    an unmasked run, a causal one (masked sub-blocks) and a band, with NaN and -inf logits and a row of zeros."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q = torch.randn(2, 4, 300, 64, generator=gen) * 3
        k, v = torch.randn(2, 2, 333, 64, generator=gen) * 3, torch.randn(2, 2, 333, 64, generator=gen)
        q[1, 2, 17] = math.nan
        k[0, 1, 5] = -math.inf
        q[0, 0, 3] = 0.0
        q, k, v = (t.to(dtype) for t in (q, k, v))
        for layout in ("BNSD", "BSND"):
            args = (q, k, v) if layout == "BNSD" else tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))
            for extra in ({}, {"atten_mask": cann_attn.compressed_mask(3), "sparse_mode": 3},
                          {"atten_mask": cann_attn.compressed_mask(4), "sparse_mode": 4, "pre_tokens": 40,
                           "next_tokens": 20}):
                cases.append({"args": args, "layout": layout, **extra})
    return cases


def _fused_forward_bits() -> list[torch.Tensor]:
    out = []
    for case in _fused_forward_cases():
        kw = {key: val for key, val in case.items() if key not in ("args", "layout")}
        r = cann_attn.flash_attention_score(*case["args"], 4, case["layout"], scale_value=0.125, **kw)
        out += [t.contiguous().view(torch.uint8) for t in (r.attention_out, r.softmax_max, r.softmax_sum)]
    return out


@pytest.mark.skipif(not native.has_sgemm(), reason="no BLAS sgemm: the fused forward does not run")
def test_fused_forward_ends_are_bitwise_the_python_ones(monkeypatch):
    """The query rows read and scaled in the loops and the rows finished there (`native.ForwardIo`: output division
    rounded to fp32 or fp16, statistics, the non-finite check) give the bits of the Python query tile and
    normalisation."""
    from cann_attn.backends.reference import flash_forward

    in_loops = _fused_forward_bits()
    monkeypatch.setattr(flash_forward.RunKernel, "fused_io", lambda *args: None)
    in_python = _fused_forward_bits()
    for a, b in zip(in_loops, in_python, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not native.has_sgemm() or not native.set_avx512(True), reason="no sgemm or no AVX-512F")
def test_avx512_fused_forward_is_bitwise_the_avx2_one():
    """The fused forward's AVX-512 steps (row_max16, row_exp_max without exp2's clamps and with VREDUCEPS, the query
    rows' scaling) give the AVX2 loops' bits."""
    def run(avx512: bool) -> list[torch.Tensor]:
        assert native.set_avx512(avx512) == avx512
        return _fused_forward_bits()

    _assert_same_bits_both_ways(run)
