"""Sanity checks of the independent oracle (against PyTorch SDPA in float64) and of the precision rules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import oracle

B, N, SQ, SKV, D = 2, 3, 7, 9, 16


def _qkv(rng, b=B, n1=N, n2=N, sq=SQ, skv=SKV, d=D, dv=None):
    dv = d if dv is None else dv
    q = torch.randn(b, n1, sq, d, generator=rng, dtype=torch.float64)
    k = torch.randn(b, n2, skv, d, generator=rng, dtype=torch.float64)
    v = torch.randn(b, n2, skv, dv, generator=rng, dtype=torch.float64)
    return q, k, v


def _sdpa(q, k, v, scale, mask=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def _stats_ref(q, k, scale, masked=None):
    s = scale * q @ k.transpose(-1, -2)
    if masked is not None:
        s = s.masked_fill(masked, -math.inf)
    m = s.amax(-1)
    return m, torch.exp(s - m.unsqueeze(-1)).sum(-1)


def test_no_mask_matches_sdpa(rng):
    q, k, v = _qkv(rng)
    scale = D**-0.5
    out, smax, ssum = oracle.fa_forward_oracle(q, k, v, N, "BNSD", scale_value=scale)
    torch.testing.assert_close(out, _sdpa(q, k, v, scale), rtol=1e-10, atol=1e-10)
    m, l = _stats_ref(q, k, scale)
    assert smax.shape == (B, N, SQ, 8) and ssum.shape == (B, N, SQ, 8)
    torch.testing.assert_close(smax, m.unsqueeze(-1).expand(-1, -1, -1, 8))
    torch.testing.assert_close(ssum, l.unsqueeze(-1).expand(-1, -1, -1, 8))


def test_causal_mode2_matches_is_causal(rng):
    q, k, v = _qkv(rng, sq=9, skv=9)
    mask = oracle.make_compressed_mask(2)
    out, _, _ = oracle.fa_forward_oracle(q, k, v, N, "BNSD", atten_mask=mask, sparse_mode=2, scale_value=0.3)
    torch.testing.assert_close(out, _sdpa(q, k, v, 0.3, is_causal=True), rtol=1e-10, atol=1e-10)


def test_mode3_bottom_right(rng):
    q, k, v = _qkv(rng, sq=4, skv=9)
    mask = oracle.make_compressed_mask(3)
    out, _, _ = oracle.fa_forward_oracle(q, k, v, N, "BNSD", atten_mask=mask, sparse_mode=3)
    i = torch.arange(4).unsqueeze(1)
    j = torch.arange(9).unsqueeze(0)
    allowed = j <= i + 5
    torch.testing.assert_close(out, _sdpa(q, k, v, 1.0, mask=allowed), rtol=1e-10, atol=1e-10)


def test_gqa_matches_repeat_interleave(rng):
    q, k, v = _qkv(rng, n1=6, n2=2, dv=12)
    out, _, _ = oracle.fa_forward_oracle(q, k, v, 6, "BNSD", scale_value=0.25)
    ref = _sdpa(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "shape", [(SQ, SKV), (1, SQ, SKV), (B, 1, SQ, SKV), (1, 1, SQ, SKV), (B, N, SQ, SKV)]
)
def test_explicit_mask_mode1(rng, shape):
    q, k, v = _qkv(rng)
    masked = torch.rand(shape, generator=rng) < 0.4
    masked[..., 0] = False  # no fully masked row
    out, smax, _ = oracle.fa_forward_oracle(
        q, k, v, N, "BNSD", atten_mask=masked.to(torch.uint8), sparse_mode=1
    )
    full = masked.reshape((1,) * (4 - masked.dim()) + tuple(shape)).expand(B, N, SQ, SKV)
    torch.testing.assert_close(out, _sdpa(q, k, v, 1.0, mask=~full), rtol=1e-10, atol=1e-10)
    m, _ = _stats_ref(q, k, 1.0, full)
    torch.testing.assert_close(smax[..., 0], m)


def test_layouts_agree(rng):
    q, k, v = _qkv(rng, dv=8)
    ref, smax, ssum = oracle.fa_forward_oracle(q, k, v, N, "BNSD")
    to = {
        "BSND": lambda t: t.permute(0, 2, 1, 3),
        "BSH": lambda t: t.permute(0, 2, 1, 3).reshape(t.shape[0], t.shape[2], -1),
        "SBH": lambda t: t.permute(2, 0, 1, 3).reshape(t.shape[2], t.shape[0], -1),
    }
    for layout, f in to.items():
        out, m2, s2 = oracle.fa_forward_oracle(f(q), f(k), f(v), N, layout)
        torch.testing.assert_close(out, f(ref))
        torch.testing.assert_close(m2, smax)
        torch.testing.assert_close(s2, ssum)
    # TND: batch of equal lengths packed
    tq = q.permute(0, 2, 1, 3).reshape(B * SQ, N, D)
    tk = k.permute(0, 2, 1, 3).reshape(B * SKV, N, D)
    tv = v.permute(0, 2, 1, 3).reshape(B * SKV, N, 8)
    out, m3, _ = oracle.fa_forward_oracle(
        tq,
        tk,
        tv,
        N,
        "TND",
        actual_seq_qlen=[SQ, 2 * SQ],
        actual_seq_kvlen=[SKV, 2 * SKV],
        softmax_layout="TND",
    )
    torch.testing.assert_close(out, ref.permute(0, 2, 1, 3).reshape(B * SQ, N, 8))
    torch.testing.assert_close(m3, smax.permute(0, 2, 1, 3).reshape(B * SQ, N, 8))
    _, m4, _ = oracle.fa_forward_oracle(
        tq, tk, tv, N, "TND", actual_seq_qlen=[SQ, 2 * SQ], actual_seq_kvlen=[SKV, 18]
    )
    torch.testing.assert_close(m4.reshape(-1), smax.reshape(-1))  # "" layout = per-sequence [N, Sq, 8] blocks


def test_invalid_rows_are_zero_with_sentinel_stats_and_finite_grads(rng):
    q, k, v = _qkv(rng, sq=5, skv=5)
    q.requires_grad_(True)
    k.requires_grad_(True)
    masked = torch.zeros(5, 5, dtype=torch.bool)
    masked[2] = True  # row 2 fully masked
    out, smax, ssum = oracle.fa_forward_oracle(q, k, v, N, "BNSD", atten_mask=masked, sparse_mode=1)
    assert torch.all(out[:, :, 2] == 0)
    assert torch.all(smax[:, :, 2] == -oracle.FLT_MAX) and torch.all(ssum[:, :, 2] == oracle.FLT_MAX)
    assert float(torch.tensor(oracle.FLT_MAX, dtype=torch.float32)) == oracle.FLT_MAX
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert torch.all(q.grad[:, :, 2] == 0)


def test_gradcheck_with_pse_and_mask(rng):
    q, k, v = _qkv(rng, b=1, n1=2, n2=1, sq=4, skv=5, d=3)
    pse = torch.randn(1, 2, 4, 5, generator=rng, dtype=torch.float64)
    masked = torch.zeros(4, 5, dtype=torch.bool)
    masked[1, 1:] = True
    masked[3] = True  # an invalid row
    for t in (q, k, v, pse):
        t.requires_grad_(True)

    def f(q, k, v, pse):
        return oracle.fa_forward_oracle(
            q, k, v, 2, "BNSD", pse=pse, atten_mask=masked, sparse_mode=1, scale_value=0.7
        )[0]

    assert torch.autograd.gradcheck(f, (q, k, v, pse))


def test_pse_types(rng):
    q, k, v = _qkv(rng, b=2, n1=2, n2=2, sq=6, skv=6)
    pse = torch.randn(2, 2, 6, 6, generator=rng, dtype=torch.float64)
    s = q @ k.transpose(-1, -2)
    out1, m1, _ = oracle.fa_forward_oracle(q, k, v, 2, "BNSD", pse=pse, pse_type=1, scale_value=0.5)
    torch.testing.assert_close(out1, torch.softmax(0.5 * (s + pse), -1) @ v)
    torch.testing.assert_close(m1[..., 0], (0.5 * (s + pse)).amax(-1))
    out0, _, _ = oracle.fa_forward_oracle(q, k, v, 2, "BNSD", pse=pse, pse_type=0, scale_value=0.5)
    torch.testing.assert_close(out0, torch.softmax(0.5 * s + pse, -1) @ v)
    slopes = torch.tensor([[0.5, 0.25], [0.125, 1.0]], dtype=torch.float32)
    i = torch.arange(6).unsqueeze(1) + 3
    j = torch.arange(6).unsqueeze(0) + 1
    dist = (j - i).abs().double()
    for ptype, dd in ((2, dist), (3, dist.sqrt())):
        out, _, _ = oracle.fa_forward_oracle(
            q, k, v, 2, "BNSD", pse=slopes, pse_type=ptype, scale_value=0.5, q_start_idx=[3], kv_start_idx=[1]
        )
        bias = -slopes.double().reshape(2, 2, 1, 1) * dd
        torch.testing.assert_close(out, torch.softmax(0.5 * s + bias, -1) @ v)


def test_compressed_pse_equals_full_toeplitz(rng):
    sq = 1030
    slopes = torch.tensor([0.01, 0.02], dtype=torch.float64)
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sq).unsqueeze(0)
    full = -slopes.reshape(1, 2, 1, 1) * (j - i).abs().double()  # Toeplitz: depends on j - i only
    compressed = full[:, :, -1024:, :].contiguous()
    q, k, v = _qkv(rng, b=1, n1=2, n2=2, sq=sq, skv=sq, d=4)
    mask = oracle.make_compressed_mask(2)
    ref, _, _ = oracle.fa_forward_oracle(q, k, v, 2, "BNSD", pse=full, atten_mask=mask, sparse_mode=2)
    out, _, _ = oracle.fa_forward_oracle(q, k, v, 2, "BNSD", pse=compressed, atten_mask=mask, sparse_mode=2)
    torch.testing.assert_close(out, ref)


def test_dropout_bits_and_scaling(rng):
    q, k, v = _qkv(rng, b=1, n1=2, n2=2, sq=3, skv=5)
    keep = torch.rand(1, 2, 3, 5, generator=rng) < 0.7
    packed = oracle.pack_drop_mask(keep)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(30 / 8)
    # LSB first: element 0 is bit 0 of byte 0
    flat = keep.reshape(-1)
    assert int(packed[0]) & 1 == int(flat[0]) and (int(packed[1]) >> 2) & 1 == int(flat[10])
    assert torch.equal(oracle.unpack_drop_mask(packed, 30), flat)
    out, m, _ = oracle.fa_forward_oracle(q, k, v, 2, "BNSD", drop_mask=packed, keep_prob=0.7)
    p = torch.softmax(q @ k.transpose(-1, -2), -1)
    torch.testing.assert_close(out, (p * keep / 0.7) @ v)
    _, m_nodrop, _ = oracle.fa_forward_oracle(q, k, v, 2, "BNSD")
    torch.testing.assert_close(m, m_nodrop)  # stats before dropout


def test_compressed_masks():
    m = oracle.make_compressed_mask(2)
    assert m.shape == (2048, 2048) and m.dtype == torch.bool
    assert not m[5, 5] and m[5, 6] and not m[6, 5]
    m6 = oracle.make_compressed_mask(6)
    assert m6.shape == (3072, 2048)
    assert torch.equal(m6[:2048], m)
    assert not m6[2048:, :1024].any() and m6[2048:, 1024:].all()


def test_naive_same_dtype_is_close_but_not_exact(rng):
    q, k, v = (t.to(torch.float16) for t in _qkv(rng))
    golden, _, _ = oracle.fa_forward_oracle(q, k, v, N, "BNSD")
    naive, smax, _ = oracle.naive_same_dtype_forward(q, k, v, N, "BNSD")
    assert naive.dtype == torch.float16 and smax.dtype == torch.float32
    err = (naive.double() - golden).abs().max()
    assert 0 < err < 5e-2


# ----------------------------------------------------------------------------------------------- precision.py
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_precision_identical_passes(rng, dtype):
    g = torch.randn(1000, generator=rng, dtype=torch.float64)
    ok, details = oracle.ascend_rule(g.to(dtype), g, dtype)
    assert ok, details
    oracle.assert_close_to_oracle(g.to(dtype), g)
    mere, mare, passed = oracle.mere_mare(g.to(dtype), g, dtype)
    assert passed, (mere, mare)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_precision_injected_errors_fail(rng, dtype):
    g = torch.randn(1000, generator=rng, dtype=torch.float64)
    a = g.to(dtype).clone()
    a[::50] += 0.5  # 20 elements (2%) wrong by far more than any threshold
    ok, details = oracle.ascend_rule(a, g, dtype)
    assert not ok and details["n_rel_fail"] >= 20 and details["n_abs_fail"] >= 20
    with pytest.raises(AssertionError, match="max_abs_err"):
        oracle.assert_close_to_oracle(a, g)
    assert not oracle.mere_mare(a, g, dtype)[2]


def test_precision_few_errors_tolerated_and_nan_detected(rng):
    g = torch.randn(10000, generator=rng, dtype=torch.float64)
    a = g.to(torch.float16).clone()
    a[0] += 1.0  # 1 of 10000 < 1e-3 * numel: tolerated by the Ascend rule
    assert oracle.ascend_rule(a, g, torch.float16)[0]
    a[:20] = float("nan")
    assert not oracle.ascend_rule(a, g, torch.float16)[0]
    b = g.to(torch.float32).clone()
    b[:5] = float("inf")
    assert not oracle.ascend_rule(b, g, torch.float32)[0]
    sentinel = torch.full((4,), -oracle.FLT_MAX, dtype=torch.float64)
    assert oracle.ascend_rule(sentinel.float(), sentinel, torch.float32)[0]


def test_flash_attn_rule(rng):
    g = torch.randn(100, generator=rng, dtype=torch.float64)
    naive = g + 1e-3
    assert oracle.flash_attn_rule(g + 1.5e-3, naive, g)[0]
    assert not oracle.flash_attn_rule(g + 3e-3, naive, g)[0]
    # the Ascend rule fails (every element off by more than 1e-4); the flash-attn rule decides
    oracle.assert_close_to_oracle((g + 1.5e-3).float(), g, naive=naive)
    with pytest.raises(AssertionError, match="flash-attn rule failed"):
        oracle.assert_close_to_oracle((g + 3e-3).float(), g, naive=naive)
