"""ring_attention_update replaying a context-parallel ring (the call pattern of MindSpeed's ring attention,
written from what it calls): the sequence is cut into 2P chunks, rank r holds chunks r and 2P-1-r ("zigzag" load
balance); at step i rank r receives the keys/values of rank j = (r - i) mod P, runs flash_attention_score on them
and folds the result into its running (attn_out, softmax_max, softmax_sum) with ring_attention_update.

Causal rings use one FA call per step as the ring code does: j == r the causal diagonal (sparse_mode 3), j < r all
local queries against the first chunk of rank j (no mask), j > r the second local chunk against all keys of rank j
(no mask; only those rows are updated, the others untouched). Each rank's final result must equal full attention
over the whole sequence, from the float64 oracle (tests/oracle.py), rows of that rank.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cann_attn
import oracle
from cann_attn.testing.merge_oracle import ring_attention_update_oracle

SCALE = 0.3


def assert_ring_close(out, golden, naive, ranks: int, name: str) -> None:
    """The precision rule (docs/semantics/precision.md), or for a ring of P steps the flash-attn rule with P
    roundings: the running attn_out is stored in its dtype after each of the P steps (as on Ascend), so its error
    budget is P times that of one same-dtype computation."""
    try:
        oracle.assert_close_to_oracle(out, golden, naive, name=name)
    except AssertionError:
        err = (out.double() - golden).abs().max().item()
        naive_err = (naive.double() - golden).abs().max().item()
        assert err <= ranks * naive_err + 1e-5, f"{name}: max error {err:.3e} > {ranks} x naive {naive_err:.3e}"


def ring_update(acc, cur, backend, **kwargs):
    return tuple(cann_attn.ring_attention_update(*acc, *cur, backend=backend, **kwargs))


def fa(q, k, v, heads, layout, causal=False, **kwargs):
    mask = dict(atten_mask=cann_attn.compressed_mask(3), sparse_mode=3) if causal else {}
    result = cann_attn.flash_attention_score(q, k, v, heads, layout, scale_value=SCALE, **mask, **kwargs)
    return result.attention_out, result.softmax_max, result.softmax_sum


def zigzag_positions(start: int, length: int, ranks: int, r: int) -> list[int]:
    c = length // (2 * ranks)
    first = list(range(start + r * c, start + (r + 1) * c))
    second = list(range(start + (2 * ranks - 1 - r) * c, start + (2 * ranks - r) * c))
    return first + second


# ------------------------------------------------------------------------------------------------------------- SBH
def sbh_ring_rank(q, k, v, heads, ranks, r, causal, backend):
    s = q.shape[0]
    local = [zigzag_positions(0, s, ranks, j) for j in range(ranks)]
    q_r = q[local[r]]
    half = len(local[r]) // 2
    acc = None
    for step in range(ranks):
        j = (r - step) % ranks
        k_j, v_j = k[local[j]], v[local[j]]
        if not causal:
            cur = fa(q_r, k_j, v_j, heads, "SBH")
            acc = cur if acc is None else ring_update(acc, cur, backend)
        elif j == r:
            acc = fa(q_r, k_j, v_j, heads, "SBH", causal=True)
        elif j < r:
            acc = ring_update(acc, fa(q_r, k_j[:half], v_j[:half], heads, "SBH"), backend)
        else:
            cur = fa(q_r[half:], k_j, v_j, heads, "SBH")
            out, mx, sm = acc
            upd = ring_update((out[half:], mx[:, :, half:], sm[:, :, half:]), cur, backend)
            acc = (torch.cat([out[:half], upd[0]]), torch.cat([mx[:, :, :half], upd[1]], dim=2),
                   torch.cat([sm[:, :, :half], upd[2]], dim=2))
    return acc, local[r]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ranks", [2, 4])
def test_sbh_ring_equals_full_attention(rng, ranks, causal, dtype, backend):
    b, heads, d = 2, 2, 16
    s = 2 * ranks * 3
    q, k, v = (torch.randn(s, b, heads * d, generator=rng).to(dtype) for _ in range(3))
    mask = dict(atten_mask=cann_attn.compressed_mask(3), sparse_mode=3) if causal else {}
    golden = oracle.fa_forward_oracle(q, k, v, heads, "SBH", scale_value=SCALE, **mask)
    naive = oracle.naive_same_dtype_forward(q, k, v, heads, "SBH", scale_value=SCALE, **mask)
    for r in range(ranks):
        (out, mx, sm), rows = sbh_ring_rank(q, k, v, heads, ranks, r, causal, backend)
        assert out.dtype == dtype and mx.dtype == torch.float32 and out.shape == (len(rows), b, heads * d)
        assert_ring_close(out, golden[0][rows], naive[0][rows], ranks, f"attn_out rank {r}")
        torch.testing.assert_close(mx.double(), golden[1][:, :, rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sm.double(), golden[2][:, :, rows], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------- TND
def stat_rows(local_lengths: list[int], heads: int, softmax_layout: str, picks: list[list[int]]) -> list[int]:
    """Rows of a [T*N, 8] statistics view holding, for each sequence b, heads n and its in-sequence positions
    picks[b], in the order the sub-problem made of those tokens lays out its own statistics."""
    rows, start = [], 0
    if softmax_layout == "TND":
        for length, pick in zip(local_lengths, picks, strict=True):
            rows += [(start + i) * heads + n for i in pick for n in range(heads)]
            start += length
        return rows
    for length, pick in zip(local_lengths, picks, strict=True):
        rows += [start * heads + n * length + i for n in range(heads) for i in pick]
        start += length
    return rows


def token_major_rows(local_lengths: list[int], heads: int, softmax_layout: str) -> list[int]:
    """Row of (token t, head n) in a [T*N, 8] statistics view, in (t, n) order."""
    rows, start = [], 0
    for length in local_lengths:
        for i in range(length):
            for n in range(heads):
                rows.append((start + i) * heads + n if softmax_layout == "TND" else start * heads + n * length + i)
        start += length
    return rows


def tnd_ring_rank(q, k, v, heads, lengths, ranks, r, causal, softmax_layout, backend, pad=0):
    """One rank's ring. With `pad`, each rank's local buffers end in `pad` padding tokens (end-of-document form:
    the length lists end before T, with the last end repeated once) whose values must never be read."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    local = [[p for st, n in zip(starts, lengths, strict=True) for p in zigzag_positions(st, n, ranks, j)]
             for j in range(ranks)]
    chunk = [n // (2 * ranks) for n in lengths]
    local_len = [2 * c for c in chunk]
    cum_local = oracle.tnd_cum(local_len)
    seq_q = [0, *cum_local]
    def eod(ends):
        return [*ends, ends[-1]] if pad else ends

    cum_local, seq_q = eod(cum_local), eod(seq_q)
    garbage = torch.full((pad, *q.shape[1:]), 1e3, dtype=q.dtype)
    q_r = torch.cat([q[local[r]], garbage])
    # token indices (inside a rank's local tensor) of each sequence's first / second chunk
    first = [st + i for st, c in zip(seq_q, chunk, strict=False) for i in range(c)]
    second = [st + c + i for st, c in zip(seq_q, chunk, strict=False) for i in range(c)]
    opts = dict(softmax_layout=softmax_layout)
    acc = None
    for step in range(ranks):
        j = (r - step) % ranks
        k_j, v_j = torch.cat([k[local[j]], garbage]), torch.cat([v[local[j]], -garbage])
        if not causal:
            cur = fa(q_r, k_j, v_j, heads, "TND", actual_seq_qlen=cum_local, actual_seq_kvlen=cum_local, **opts)
            acc = cur if acc is None else ring_update(acc, cur, backend, actual_seq_qlen=torch.tensor(seq_q),
                                                      input_layout="TND", input_softmax_layout=softmax_layout)
        elif j == r:
            acc = fa(q_r, k_j, v_j, heads, "TND", causal=True, actual_seq_qlen=cum_local,
                     actual_seq_kvlen=cum_local, **opts)
        elif j < r:
            cur = fa(q_r, k_j[first], v_j[first], heads, "TND", actual_seq_qlen=cum_local,
                     actual_seq_kvlen=eod(oracle.tnd_cum(chunk)), **opts)
            acc = ring_update(acc, cur, backend, actual_seq_qlen=torch.tensor(seq_q), input_layout="TND",
                              input_softmax_layout=softmax_layout)
        else:
            cur = fa(q_r[second], k_j, v_j, heads, "TND", actual_seq_qlen=eod(oracle.tnd_cum(chunk)),
                     actual_seq_kvlen=cum_local, **opts)
            out, mx, sm = acc
            picks = [list(range(c, 2 * c)) for c in chunk]
            rows = torch.tensor(stat_rows(local_len, heads, softmax_layout, picks))
            prev = (out[second], mx.view(-1, 8)[rows].view(-1, heads, 8), sm.view(-1, 8)[rows].view(-1, heads, 8))
            upd = ring_update(prev, cur, backend, actual_seq_qlen=torch.tensor([0, *oracle.tnd_cum(chunk)]),
                              input_layout="TND", input_softmax_layout=softmax_layout)
            out, mx, sm = out.clone(), mx.clone(), sm.clone()
            out[second] = upd[0]
            mx.view(-1, 8)[rows] = upd[1].view(-1, 8)
            sm.view(-1, 8)[rows] = upd[2].view(-1, 8)
            acc = (out, mx, sm)
    return acc, local[r], local_len


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("softmax_layout", ["", "TND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ranks", [2, 4])
def test_tnd_ring_equals_full_attention(rng, ranks, causal, dtype, softmax_layout, backend):
    heads, d = 2, 64
    lengths = [2 * ranks * c for c in (2, 1, 3)]
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, d, generator=rng).to(dtype) for _ in range(3))
    mask = dict(atten_mask=cann_attn.compressed_mask(3), sparse_mode=3) if causal else {}
    cum = oracle.tnd_cum(lengths)
    kwargs = dict(actual_seq_qlen=cum, actual_seq_kvlen=cum, scale_value=SCALE, softmax_layout="TND", **mask)
    golden = oracle.fa_forward_oracle(q, k, v, heads, "TND", **kwargs)
    naive = oracle.naive_same_dtype_forward(q, k, v, heads, "TND", **kwargs)
    for r in range(ranks):
        (out, mx, sm), tokens, local_len = tnd_ring_rank(q, k, v, heads, lengths, ranks, r, causal, softmax_layout,
                                                         backend)
        assert out.dtype == dtype and out.shape == (len(tokens), heads, d)
        assert_ring_close(out, golden[0][tokens], naive[0][tokens], ranks, f"attn_out rank {r}")
        # statistics back to token-major order
        order = torch.tensor(token_major_rows(local_len, heads, softmax_layout))
        for ours, want in ((mx, golden[1]), (sm, golden[2])):
            token_major = ours.reshape(-1, 8)[order].view(-1, heads, 8)
            torch.testing.assert_close(token_major.double(), want[tokens], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- fuzzing against the merge oracle
def random_stats(gen, shape, p_invalid):
    """Statistics with 8 equal lanes; a fraction of rows carry FlashAttentionScore's invalid-row values."""
    mx = torch.randn(shape, generator=gen) * 5
    sm = torch.rand(shape, generator=gen) * 7 + 1
    invalid = torch.rand(shape, generator=gen) < p_invalid
    mx = mx.masked_fill(invalid, -oracle.FLT_MAX)
    sm = sm.masked_fill(invalid, oracle.FLT_MAX)
    return (mx.unsqueeze(-1).expand(*shape, 8).contiguous(), sm.unsqueeze(-1).expand(*shape, 8).contiguous(),
            invalid)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), layout=st.sampled_from(["SBH", "TND"]),
       softmax_layout=st.sampled_from(["", "SBH", "TND"]), lengths=st.lists(st.integers(0, 4), min_size=1, max_size=3),
       padding=st.integers(0, 3), heads=st.integers(1, 3), p_invalid=st.sampled_from([0.0, 0.3, 1.0]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       backend=st.sampled_from(["reference", "triton"]))
def test_ring_attention_update_matches_the_merge_oracle(seed, layout, softmax_layout, lengths, padding, heads,
                                                        p_invalid, dtype, backend):
    """Random statistics (invalid rows in one, both or neither input), every layout, TND end-of-document padding
    (tokens past the last cumulative length) in the per-sequence softmax layout, both backends."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "SBH":
        s, b, d = sum(lengths) + padding, 2, 8
        attn_shape, stat_shape, kwargs = (s, b, heads * d), (b, heads, s), {}
    else:
        t, d = sum(lengths) + padding, 64
        attn_shape, stat_shape = (t, heads, d), (t, heads)
        kwargs = dict(input_layout="TND", input_softmax_layout=softmax_layout,
                      actual_seq_qlen=torch.tensor([0, *oracle.tnd_cum(lengths)]))
    prev = (torch.randn(attn_shape, generator=gen).to(dtype), *random_stats(gen, stat_shape, p_invalid)[:2])
    cur = (torch.randn(attn_shape, generator=gen).to(dtype), *random_stats(gen, stat_shape, p_invalid)[:2])
    got = cann_attn.ring_attention_update(*prev, *cur, backend=backend, **kwargs)
    want = ring_attention_update_oracle(*prev, *cur, **kwargs)
    assert got.attn_out.dtype == dtype and got.softmax_max.dtype == torch.float32
    for name in ("attn_out", "softmax_max", "softmax_sum"):
        actual, golden = getattr(got, name), want[name]
        assert actual.shape == golden.shape
        tol = dict(rtol=1e-5, atol=1e-5) if actual.dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
        torch.testing.assert_close(actual.double(), golden.to(actual.dtype).double(), **tol)


def test_tnd_padding_rows_pair_with_their_own_statistics():
    """End-of-document padding in the per-sequence layout: tokens past the last cumulative length form one more
    [N, pad] block; a valid padding row merged with an invalid one is unchanged, wherever it sits."""
    heads, t = 2, 5
    attn = torch.arange(t * heads * 64, dtype=torch.float32).view(t, heads, 64)
    mx, sm = torch.zeros(t, heads, 8), torch.ones(t, heads, 8)
    inv_mx, inv_sm = torch.full((t, heads, 8), -oracle.FLT_MAX), torch.full((t, heads, 8), oracle.FLT_MAX)
    out = cann_attn.ring_attention_update(attn, mx, sm, torch.zeros_like(attn), inv_mx, inv_sm,
                                          actual_seq_qlen=[0, 2], input_layout="TND")
    assert torch.equal(out.attn_out, attn)
    # only the padding block's statistics (rows 2..4 of memory for tokens 2..4) marked invalid in prev
    mx_p, sm_p = mx.clone(), sm.clone()
    flat_mx, flat_sm = mx_p.view(-1, 8), sm_p.view(-1, 8)
    flat_mx[2 * heads:], flat_sm[2 * heads:] = -oracle.FLT_MAX, oracle.FLT_MAX
    cur = torch.full_like(attn, 3.0)
    out = cann_attn.ring_attention_update(attn, mx_p, sm_p, cur, mx, sm, actual_seq_qlen=[0, 2], input_layout="TND")
    assert torch.equal(out.attn_out[2:], cur[2:])
    torch.testing.assert_close(out.attn_out[:2], (attn[:2] + 3.0) / 2)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("softmax_layout", ["", "TND"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ranks", [2, 4])
def test_tnd_end_of_document_ring_equals_full_attention(rng, ranks, causal, softmax_layout, backend):
    """Each rank's local TND buffers end in padding tokens (the end-of-document padded form of FlashAttentionScore:
    length lists ending before T): the real tokens equal full attention, the padding rows stay 0 with invalid-row
    statistics through every merge, and the padding keys (1e3) are never read."""
    heads, d, pad = 2, 64, 3
    lengths = [2 * ranks * c for c in (1, 2)]
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, d, generator=rng) for _ in range(3))
    mask = dict(atten_mask=cann_attn.compressed_mask(3), sparse_mode=3) if causal else {}
    cum = oracle.tnd_cum(lengths)
    golden = oracle.fa_forward_oracle(q, k, v, heads, "TND", actual_seq_qlen=cum, actual_seq_kvlen=cum,
                                      scale_value=SCALE, softmax_layout="TND", **mask)
    for r in range(ranks):
        (out, mx, sm), tokens, local_len = tnd_ring_rank(q, k, v, heads, lengths, ranks, r, causal, softmax_layout,
                                                         backend, pad=pad)
        real = sum(local_len)
        assert out.shape == (real + pad, heads, d)
        oracle.assert_close_to_oracle(out[:real], golden[0][tokens], name=f"attn_out rank {r}")
        assert torch.equal(out[real:], torch.zeros(pad, heads, d))
        order = torch.tensor(token_major_rows(local_len, heads, softmax_layout))
        for ours, want in ((mx, golden[1]), (sm, golden[2])):
            torch.testing.assert_close(ours.reshape(-1, 8)[order].view(-1, heads, 8).double(), want[tokens],
                                       rtol=1e-4, atol=1e-5)
        assert torch.all(mx.reshape(-1, 8)[real * heads:] == -oracle.FLT_MAX)
        assert torch.all(sm.reshape(-1, 8)[real * heads:] == oracle.FLT_MAX)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_nan_statistics_propagate_on_both_backends(backend):
    s, b, n, d = 3, 1, 1, 8
    attn = torch.ones(s, b, n * d)
    mx, sm = torch.zeros(b, n, s, 8), torch.ones(b, n, s, 8)
    nan_mx = mx.clone()
    nan_mx[0, 0, 1] = float("nan")
    out = cann_attn.ring_attention_update(attn, nan_mx, sm, attn * 2, mx, sm, backend=backend)
    assert torch.isnan(out.attn_out[1]).all() and torch.isnan(out.softmax_max[0, 0, 1]).all()
    assert not torch.isnan(out.attn_out[[0, 2]]).any()
    lse = cann_attn.attention_update([torch.tensor([0.0, float("nan")]), torch.zeros(2)],
                                     [torch.ones(2, 8), torch.ones(2, 8)], 1, backend=backend)
    assert torch.isnan(lse.lse_out[1]) and torch.isnan(lse.out[1]).all() and not torch.isnan(lse.out[0]).any()


def test_cann_attn_golden_and_compare_for_ring_attention_update(tmp_path, capsys):
    """`cann-attn golden --inputs` writes the merge oracle's goldens for given partial results, and `compare` passes
    the operator's own outputs against them (an Ascend test's workflow)."""
    import json

    import numpy as np

    from cann_attn.cli import main as cli_main

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(8, 1, 32, generator=gen) for _ in range(3))
    # top-left causal over keys 0..2, bottom-right causal over keys 3..7 (rows 0..2 see none of them): together causal
    first = fa(q, k[:3], v[:3], 2, "SBH", atten_mask=cann_attn.compressed_mask(2), sparse_mode=2)
    second = fa(q, k[3:], v[3:], 2, "SBH", causal=True)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    names = ("prev_attn_out", "prev_softmax_max", "prev_softmax_sum", "cur_attn_out", "cur_softmax_max",
             "cur_softmax_sum")
    for name, t in zip(names, (*first, *second), strict=True):
        np.save(inputs / f"{name}.npy", t.numpy())
    case = tmp_path / "case.json"
    case.write_text(json.dumps({"op": "ring_attention_update", "seed": 0, "inputs": {}, "params": {}}))
    assert cli_main.main(["golden", "--case", str(case), "--inputs", str(inputs), "--out", str(tmp_path / "golden"),
                     "--actual", str(tmp_path / "actual")]) == 0
    assert cli_main.main(["compare", str(tmp_path / "actual"), str(tmp_path / "golden")]) == 0
    golden_sum = np.load(tmp_path / "golden" / "softmax_sum.npy")
    full = fa(q, k, v, 2, "SBH", causal=True)
    torch.testing.assert_close(torch.from_numpy(golden_sum), full[2].double().float(), rtol=1e-5, atol=1e-5)
    capsys.readouterr()
