"""SparseFlashAttention forward / SparseFlashAttentionGrad and the differentiable `sparse_attention` against the
independent float64 oracle (docs/semantics/layouts.md, docs/semantics/invalid-rows.md,
docs/operators/sparse_flash_attention.md, docs/semantics/precision.md)."""

from __future__ import annotations

import math

import pytest
import torch

import cann_attn
from cann_attn.testing import dsa_oracle
from cann_attn.testing.precision import assert_close_to_oracle
from dsa_utils import BF16, DT_IDS, F16, F32, F64, GRAD_NAMES, PROPERTY_LAYOUTS, SFACase

pytestmark = pytest.mark.usefixtures("single_thread")
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
RELATIONS = ("s1_lt_s2", "s1_eq_s2", "s1_gt_s2")


def _sizes(bs: int, relation: str) -> tuple[int, int]:
    """(S1, S2) with a few blocks per sequence and a straddling last block (S2 not a multiple of bs)."""
    s2 = max(13, 2 * bs + bs // 2 + 3) if bs <= 16 else bs + bs // 2 + 3
    if relation == "s1_lt_s2":
        return max(3, min(s2 // 3, 12)), s2
    if relation == "s1_eq_s2":
        return s2, s2
    return s2 + 5, s2


def _tnd_lengths(bs: int, relation: str) -> tuple[list[int], list[int]]:
    s1, s2 = _sizes(bs, relation)
    if relation == "s1_lt_s2":
        return [s1, 2, 0], [s2, bs + 3, 4]
    if relation == "s1_eq_s2":
        return [s2, bs + 1], [s2, bs + 1]
    return [s1, 6], [s2, 3]


# ----------------------------------------------------------------------------------------------------------
# Forward and gradients over layouts, block sizes, modes and S1/S2 relations
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("relation", RELATIONS)
@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_forward_and_grads(layout, bs, mode, relation, rng):
    """attention_out, softmax_max/sum and all five gradients vs the oracle. Large blocks use B=1 and few rows
    per sequence beyond the first block to keep the float64 per-row oracle fast."""
    s1, s2 = _sizes(bs, relation)
    style = "random" if (bs + mode) % 2 else "topk"
    kw = dict(gen=rng, block_size=bs, mode=mode, k=3, n1=2, d=8, d_rope=4, style=style)
    if layout == "TND":
        q_lens, kv_lens = _tnd_lengths(bs, relation)
        case = SFACase("TND", q_lens=q_lens, kv_lens=kv_lens, **kw)
    else:
        case = SFACase("BSND", b=1 if bs >= 64 else 2, s1=s1, s2=s2, **kw)
    case.check()


@pytest.mark.parametrize("bs", [1, 64])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_block_causal_pattern(layout, bs, rng):
    """Every row selects the allowed blocks in order (neighbouring rows share blocks: the kernel's union path),
    more than 32 rows (several row tiles)."""
    s2 = 2 * bs + 7 if bs > 1 else 50
    q_lens, kv_lens = ([40, 9], [s2, s2 // 2]) if layout == "TND" else (None, None)
    case = SFACase(layout, gen=rng, b=1, s1=40, s2=s2, q_lens=q_lens, kv_lens=kv_lens, block_size=bs, k=8,
                   n1=2, d=8, d_rope=4, style="blocks")
    case.check()


@pytest.mark.parametrize("style", ["topk", "random", "dup", "middle"])
@pytest.mark.parametrize("value_is_key", [False, True], ids=["v_ne_k", "v_is_k"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=DT_IDS.get)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_dtypes(layout, dtype, value_is_key, style, rng):
    """fp16/bf16/fp32 inputs: outputs in the input dtype, statistics fp32, precision rule of
    docs/semantics/precision.md."""
    case = SFACase(layout, gen=rng, s1=9, s2=20, block_size=8 if style == "middle" else 1, k=5, n1=4, d=16,
                   d_rope=8, d_v=12, value_is_key=value_is_key, dtype=dtype, style=style)
    case.check()


@pytest.mark.parametrize("n1", [1, 4, 16])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_head_counts(layout, n1, rng):
    SFACase(layout, gen=rng, s1=6, s2=14, n1=n1, k=4, style="random").check()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_index_dtypes(layout, index_dtype, rng):
    case = SFACase(layout, gen=rng, s1=7, s2=16, k=5, style="random", index_dtype=index_dtype)
    fwd, _grads = case.check()
    other = case.inputs["sparse_indices"].to(torch.int64 if index_dtype == torch.int32 else torch.int32)
    fwd2 = cann_attn.sparse_flash_attention(case.inputs["query"], case.inputs["key"], case.inputs["value"], other,
                                            query_rope=case.inputs["query_rope"], key_rope=case.inputs["key_rope"],
                                            **case.kw)
    torch.testing.assert_close(fwd2.attention_out, fwd.attention_out, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_without_rope(layout, rng):
    """No query_rope/key_rope: Q = query, K = key; d_query_rope and d_key_rope are None."""
    case = SFACase(layout, gen=rng, s1=6, s2=14, d_rope=None, k=4, style="random")
    _, grads = case.check()
    assert grads.d_query_rope is None and grads.d_key_rope is None


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_value_smaller_than_key(layout, rng):
    SFACase(layout, gen=rng, s1=6, s2=14, d=16, d_v=8, k=4, style="dup").check()


# ----------------------------------------------------------------------------------------------------------
# The selection rule on hand-written rows (independent of the oracle's selection code)
# ----------------------------------------------------------------------------------------------------------
def _manual_row(q_row, k_seq, v_seq, tokens, scale):
    """softmax over the listed key positions (duplicates count twice), float64: ([N1, Dv], max [N1], sum [N1])."""
    pos = torch.tensor(tokens, dtype=torch.int64)
    z = scale * (q_row.double()[:, None, :] * k_seq.double()[pos][None]).sum(-1)
    m = z.amax(-1)
    e = torch.exp(z - m[:, None])
    p = e / e.sum(-1, keepdim=True)
    return (p[:, :, None] * v_seq.double()[pos][None]).sum(1), m, e.sum(-1)


# (mode, S1, S2, bs, row t, entries, expected key positions; None = row with nothing selected)
HAND_ROWS = [
    # thr = 10 - 4 + 0 + 1 = 7, n = 7: 9 >= thr skipped, scanning stops at the first -1 (4 ignored)
    (3, 4, 10, 1, 0, [3, 9, 1, -1, 4, 5, 6, 2], [3, 1]),
    # thr = 17, n = ceil(17/8) = 3: block 2 clipped to [16, 17), blocks 0 and 1 whole; entry 4 (0) not examined
    (3, 4, 20, 8, 0, [2, 0, 1, 0], [16, *range(8), *range(8, 16)]),
    # block starting at 24 >= thr 17 is skipped, the next entry still counts
    (3, 4, 20, 8, 0, [3, 1, -1, 0], list(range(8, 16))),
    # mode 0: thr = Skv = 20; the duplicated straddling block [16, 20) counts twice
    (0, 4, 20, 8, 2, [2, 2, 0], [16, 17, 18, 19, 16, 17, 18, 19, *range(8)]),
    # S1 > S2 mode 3: thr(0) = 3 - 6 + 0 + 1 <= 0: nothing, whatever the entries
    (3, 6, 3, 1, 0, [0, 1, 2], None),
    # thr(3) = 1, n = 1: only the first entry is examined; 2 >= thr is skipped, so 0 (2nd entry) never counts
    (3, 6, 3, 1, 3, [2, 0], None),
    # first entry -1: nothing
    (0, 2, 5, 1, 1, [-1, 0, 1], None),
    # K larger than n: only n = min(K, ceil(thr/bs)) entries examined (thr = 2 -> n = 2)
    (3, 3, 4, 1, 0, [0, 1, 1, 0], [0, 1]),
]


@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("case_id", range(len(HAND_ROWS)))
def test_selection_rule_hand_rows(case_id, layout, rng):
    mode, s1, s2, bs, t, entries, expected = HAND_ROWS[case_id]
    k = len(entries)
    n1, d = 2, 8
    lead_q, lead_kv = ((s1,), (s2,)) if layout == "TND" else ((1, s1), (1, s2))
    q = torch.randn(*lead_q, n1, d, generator=rng, dtype=F64)
    key = torch.randn(*lead_kv, 1, d, generator=rng, dtype=F64)
    value = torch.randn(*lead_kv, 1, 6, generator=rng, dtype=F64)
    idx = torch.full((*lead_q, 1, k), -1, dtype=torch.int32)
    row = (t,) if layout == "TND" else (0, t)
    idx[(*row, 0)] = torch.tensor(entries, dtype=torch.int32)
    kw = {"sparse_block_size": bs, "sparse_mode": mode, "layout": layout}
    if layout == "TND":
        kw.update(actual_seq_lengths_query=[s1], actual_seq_lengths_kv=[s2])
    res = cann_attn.sparse_flash_attention(q, key, value, idx, 0.5, **kw)
    stat_row = (0, t) if layout == "TND" else (0, 0, t)
    out, m, s = res.attention_out[row], res.softmax_max[stat_row], res.softmax_sum[stat_row]
    if expected is None:
        assert bool((out == 0).all()), f"row {t}: expected a zero output, got {out}"
        assert bool((m == -2e38).all()) and bool((s == 0).all()), f"row {t}: stats {m}, {s}"
    else:
        k_seq, v_seq = key.reshape(s2, d), value.reshape(s2, 6)
        e_out, e_m, e_s = _manual_row(q[row], k_seq, v_seq, expected, 0.5)
        torch.testing.assert_close(out, e_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m, e_m, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s, e_s, rtol=1e-12, atol=1e-12)
    # the oracle's own selection agrees with the hand-written list
    got = dsa_oracle.sfa_selected_tokens(entries, t, s1, s2, mode, bs)
    assert got == (expected or []), f"oracle selection {got} != hand list {expected}"


# ----------------------------------------------------------------------------------------------------------
# Padding, duplicates, entries beyond thr, rows without keys
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_entries_after_first_padding_are_ignored(layout, bs, rng):
    """Scanning stops at the first -1: changing the entries after it changes nothing."""
    case = SFACase(layout, gen=rng, s1=10, s2=30, block_size=bs, k=6, style="middle")
    fwd, grads = case.check()
    idx = case.inputs["sparse_indices"].clone()
    after = torch.cumsum((idx == -1).int(), dim=-1) > 0
    after &= idx != -1
    garbage = torch.randint(0, 4, idx.shape, generator=rng, dtype=idx.dtype)
    assert bool(after.any()), "the case must have entries after a -1"
    case.inputs["sparse_indices"] = torch.where(after, garbage, idx)
    fwd2 = case.forward()
    grads2 = case.grad(fwd2)
    for a, b in zip(fwd2, fwd, strict=True):
        torch.testing.assert_close(a, b)
    for name in GRAD_NAMES:
        torch.testing.assert_close(getattr(grads2, name), getattr(grads, name))


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_duplicated_indices_count_twice(layout, bs, rng):
    """Duplicates are gathered twice (no dedup): the result differs from the deduplicated selection and
    matches the oracle; their gradients add up."""
    case = SFACase(layout, gen=rng, s1=8, s2=3 * bs + 5, block_size=bs, k=6, style="dup")
    fwd, _ = case.check()
    idx = case.inputs["sparse_indices"]
    dedup = idx.clone()
    flat = dedup.view(-1, idx.shape[-1])
    for r in range(flat.shape[0]):
        seen, row = set(), []
        for e in flat[r].tolist():
            if e != -1 and e not in seen:
                seen.add(e)
                row.append(e)
        flat[r] = torch.tensor((row + [-1] * idx.shape[-1])[: idx.shape[-1]])
    case.inputs["sparse_indices"] = dedup
    fwd_dedup = case.forward()
    assert not torch.allclose(fwd_dedup.attention_out, fwd.attention_out), "duplicates must change the output"


@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_entries_beyond_threshold_skipped(layout, mode, rng):
    """Entries whose block starts at or beyond thr (including huge ones) are skipped, the scan goes on."""
    case = SFACase(layout, gen=rng, s1=8, s2=24, block_size=8, k=4, mode=mode, style="topk")
    idx = case.inputs["sparse_indices"]
    huge = torch.full_like(idx[..., :1], 2**30)
    case.inputs["sparse_indices"] = torch.cat([huge, idx[..., :-1]], dim=-1)
    case.check()


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_rows_without_valid_keys(layout, rng):
    """Rows whose first entry is -1, whose entries all lie beyond thr, or with thr <= 0 output exactly 0, with
    softmax_max = -2e38, softmax_sum = 0 and zero gradients (docs/semantics/invalid-rows.md)."""
    case = SFACase(layout, gen=rng, s1=10, s2=6, q_lens=[10, 4] if layout == "TND" else None,
                   kv_lens=[6, 5] if layout == "TND" else None, k=3, style="topk", mode=3)
    idx = case.inputs["sparse_indices"]
    dead = torch.zeros(idx.shape[:-2], dtype=torch.bool)
    dead.view(-1)[1::3] = True
    idx[dead] = -1
    far = torch.zeros_like(dead)
    far.view(-1)[2::5] = True
    far &= ~dead
    idx[far] = 10**6
    fwd, grads = case.check()
    no_keys = fwd.softmax_sum.reshape(-1, fwd.softmax_sum.shape[-1])[:, 0] == 0
    flat_dead = (dead | far).reshape(-1) | no_keys
    assert bool(flat_dead.any())
    out = fwd.attention_out.reshape(-1, *fwd.attention_out.shape[-2:])
    assert bool((out[flat_dead] == 0).all())
    dq = grads.d_query.reshape(-1, *grads.d_query.shape[-2:])
    assert bool((dq[flat_dead] == 0).all())
    assert bool((grads.d_query_rope.reshape(-1, *grads.d_query_rope.shape[-2:])[flat_dead] == 0).all())


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_all_rows_without_keys_give_zero_gradients(layout, rng):
    case = SFACase(layout, gen=rng, s1=5, s2=9, k=3)
    case.inputs["sparse_indices"].fill_(-1)
    fwd, grads = case.check()
    assert bool((fwd.attention_out == 0).all()) and bool((fwd.softmax_max == -2e38).all())
    for name in GRAD_NAMES:
        assert bool((getattr(grads, name) == 0).all()), name


@pytest.mark.parametrize("bs,idx_dtype,huge", [
    (8, torch.int64, 2**61),  # 2**61 * 8 wraps to 0 in int64: block 0 again
    (8, torch.int64, 2**61 + 1),  # wraps to 8: block 1
    (128, torch.int64, 2**57),
    (1, torch.int64, 2**63 - 1),
    (64, torch.int32, 2**31 - 1),
])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_huge_indices_are_skipped(layout, bs, idx_dtype, huge, rng):
    """Entries so large that idx * bs overflows int64 start beyond thr like any other: skipped, the scan goes on
    (docs/operators/sparse_flash_attention.md)."""
    case = SFACase(layout, gen=rng, s1=6, s2=2 * bs + 3, block_size=bs, k=4, mode=0, style="topk",
                   index_dtype=idx_dtype)
    idx = case.inputs["sparse_indices"]
    case.inputs["sparse_indices"] = torch.cat([torch.full_like(idx[..., :1], huge), idx[..., :-1]], dim=-1)
    fwd, grads = case.check()
    case.inputs["sparse_indices"] = torch.cat([torch.full_like(idx[..., :1], 10**6), idx[..., :-1]], dim=-1)
    fwd2 = case.forward()
    grads2 = case.grad(fwd2)
    for a, b in zip(fwd, fwd2, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name in GRAD_NAMES:
        torch.testing.assert_close(getattr(grads, name), getattr(grads2, name), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------- Non-finite
# keys / values: only the selected ones reach a row (docs/operators/sparse_flash_attention.md: P is the softmax over the
# selected set)
# ----------------------------------------------------------------------------------------------------------
NONFINITE_TARGETS = {"key": "key", "value": "value", "key_rope": "key_rope", "latent": "key"}


def _poison_token(case: SFACase, target: str, token_of) -> list[int]:
    """NaN in the whole row of token `token_of(span)` of every sequence of `target` (a key-side tensor); returns
    the tokens."""
    tokens = []
    for span in case.spans:
        p = token_of(span)
        tokens.append(p)
        if p is not None:
            span.kv_rows(case.inputs[NONFINITE_TARGETS[target]])[p] = float("nan")
    return tokens


def _unselect(case: SFACase, tokens: list[int]) -> None:
    """Make every row that selects the poisoned token of its sequence stop before it (an entry -1 in place of
    the first entry that selects it), so that no row selects it; blocks holding it beyond thr stay selected."""
    idx = case.inputs["sparse_indices"]
    mode, bs = case.kw["sparse_mode"], case.kw["sparse_block_size"]
    for span, p in zip(case.spans, tokens, strict=True):
        for t in range(span.q_len):
            row = idx[(*span.q_token(t), 0)]
            for e in range(row.numel()):
                if p in dsa_oracle.sfa_selected_tokens(row[: e + 1].tolist(), t, span.q_len, span.kv_len, mode, bs):
                    row[e] = -1
                    break
            assert p not in dsa_oracle.sfa_selected_tokens(row.tolist(), t, span.q_len, span.kv_len, mode, bs)


NONFINITE_SCENARIOS = {
    # top-k tokens with -1 padding: padding entries gather token 0 (and a union path would read it)
    "token0_padding": dict(block_size=1, mode=3, style="topk", k=6, token=lambda span: 0),
    # a token no row selects, in the middle of the sequence (a control: no path reads it)
    "unselected": dict(block_size=1, mode=0, style="random", k=4, token=lambda span: span.kv_len // 2),
    # the last token: inside blocks that rows select, but beyond their causal limit (the block is clipped)
    "beyond_thr_bs8": dict(block_size=8, mode=3, style="blocks", k=4, token=lambda span: span.kv_len - 1),
    # the same with 64-token blocks shared by many rows (the union path when everything is finite)
    "beyond_thr_bs64": dict(block_size=64, mode=3, style="blocks", k=3, token=lambda span: span.kv_len - 1),
}


@pytest.mark.parametrize("target", list(NONFINITE_TARGETS))
@pytest.mark.parametrize("scenario", list(NONFINITE_SCENARIOS))
@pytest.mark.parametrize("layout", PROPERTY_LAYOUTS)
def test_nonfinite_unselected_keys_do_not_leak(layout, scenario, target, rng):
    """NaN in a key / value / key_rope row that no row selects changes nothing: outputs, statistics and all five
    gradients match the oracle and are finite."""
    cfg = dict(NONFINITE_SCENARIOS[scenario])
    token_of = cfg.pop("token")
    bs = cfg["block_size"]
    s2 = 2 * bs + 5 if bs > 1 else 17
    q_lens, kv_lens = ([36, 5], [s2, bs + 4]) if layout == "TND" else (None, None)
    case = SFACase(layout, gen=rng, b=1 if bs == 64 else 2, s1=36, s2=s2, q_lens=q_lens, kv_lens=kv_lens, n1=2,
                   d=8, d_rope=4, value_is_key=target == "latent", **cfg)
    tokens = _poison_token(case, target, token_of)
    _unselect(case, tokens)
    case.check()


@pytest.mark.parametrize("target", ["key", "value", "latent"])
@pytest.mark.parametrize("bs,style", [(1, "topk"), (8, "blocks"), (64, "blocks")])
@pytest.mark.parametrize("layout", PROPERTY_LAYOUTS)
def test_nonfinite_selected_key_poisons_only_its_rows(layout, bs, style, target, rng):
    """Rows that select a NaN key (or value) row get NaN outputs; every other row, and every gradient the oracle
    gives as finite, matches the oracle (NaN exactly where the oracle has NaN). "blocks": neighbouring rows share
    the NaN token's block, most of them with the token beyond their causal limit (the union path when finite)."""
    s2 = 3 * bs + 5
    q_lens, kv_lens = ([12, 5], [s2, bs + 4]) if layout == "TND" else (None, None)
    case = SFACase(layout, gen=rng, b=1 if bs == 64 else 2, s1=12, s2=s2, q_lens=q_lens, kv_lens=kv_lens, n1=2,
                   d=8, d_rope=4, block_size=bs, k=4, mode=3, style=style, value_is_key=target == "latent")
    tokens = _poison_token(case, target, lambda span: span.kv_len - 2)
    idx = case.inputs["sparse_indices"]
    for span, p in zip(case.spans, tokens, strict=True):  # the last row (thr = Skv) selects it
        idx[(*span.q_token(span.q_len - 1), 0, 0)] = p // bs
    fwd = case.forward()
    _, (g_out, _, _) = case.oracle()
    mode = case.kw["sparse_mode"]
    poisoned_rows = torch.zeros(fwd.attention_out.shape[:-2], dtype=torch.bool)
    for span, p in zip(case.spans, tokens, strict=True):
        for t in range(span.q_len):
            row = idx[(*span.q_token(t), 0)].tolist()
            poisoned_rows[span.q_token(t)] = p in dsa_oracle.sfa_selected_tokens(row, t, span.q_len, span.kv_len,
                                                                                mode, bs)
    assert bool(poisoned_rows.any()) and not bool(poisoned_rows.all())
    out_nan = fwd.attention_out.isnan().all(-1).all(-1)
    assert torch.equal(out_nan, poisoned_rows), "NaN rows must be exactly the rows that select the NaN token"
    assert not bool(fwd.attention_out[~poisoned_rows].isnan().any())
    assert_close_to_oracle(fwd.attention_out[~poisoned_rows], g_out[~poisoned_rows], name="attention_out")
    grads = case.grad(fwd)
    golden = case.oracle_grads(given_out=fwd.attention_out)
    for name in GRAD_NAMES:
        actual, g = getattr(grads, name), golden[name]
        assert torch.equal(actual.isnan(), g.isnan()), f"{name}: NaN pattern differs from the oracle's"
        assert_close_to_oracle(actual.nan_to_num(0.0), g.nan_to_num(0.0).to(actual.dtype), name=name)


@pytest.mark.parametrize("target", ["query", "query_rope", "d_out"])
@pytest.mark.parametrize("bs,style", [(1, "random"), (64, "blocks")])
@pytest.mark.parametrize("layout", PROPERTY_LAYOUTS)
def test_nonfinite_query_side_row_reaches_only_its_selected_keys(layout, bs, style, target, rng):
    """A NaN query / query_rope / d_out row poisons that row and the d_key / d_value rows of the keys it selects,
    nothing else: unused (-1 padded) entries, which gather token 0, and block-union columns the row did not select
    add exact zeros (NaN pattern and finite values match the oracle)."""
    s2 = 2 * bs + 5 if bs > 1 else 17
    q_lens, kv_lens = ([12, 5], [s2, bs + 4]) if layout == "TND" else (None, None)
    case = SFACase(layout, gen=rng, b=1 if bs == 64 else 2, s1=12, s2=s2, q_lens=q_lens, kv_lens=kv_lens, n1=2,
                   d=8, d_rope=4, block_size=bs, k=4, mode=3, style=style, value_is_key=True)
    idx = case.inputs["sparse_indices"]
    span = case.spans[0]
    row = (*span.q_token(span.q_len // 2), 0)
    if bs == 1:
        idx[row][2:] = -1  # padding entries: they gather token 0, which this row does not select
        idx[row][:2] = torch.tensor([1, 2])
    poisoned = case.d_out if target == "d_out" else case.inputs[target]
    poisoned[row[:-1]] = float("nan")
    fwd = case.forward()
    grads = case.grad(fwd)
    golden = case.oracle_grads(given_out=fwd.attention_out)
    for name in GRAD_NAMES:
        actual, g = getattr(grads, name), golden[name]
        if g is None:
            continue
        assert torch.equal(actual.isnan(), g.isnan()), f"{name}: NaN pattern differs from the oracle's"
        assert_close_to_oracle(actual.nan_to_num(0.0), g.nan_to_num(0.0).to(actual.dtype), name=name)
    assert bool(golden["d_key"].isnan().any()) and not bool(golden["d_key"].isnan().all())


# ----------------------------------------------------------------------------------------------------------
# Actual lengths
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value_is_key", [False, True], ids=["v_ne_k", "v_is_k"])
@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("mode", [0, 3])
def test_bsnd_actual_lengths(mode, bs, value_is_key, rng):
    """Rows t >= Lq_b output 0 with zero gradients; keys beyond Lk_b are never read (they hold NaN here) and get
    zero gradients; blocks straddling Lk_b are clipped."""
    q_lens, kv_lens = [5, 0, 8], [13, 7, 20]
    case = SFACase("BSND", gen=rng, b=3, s1=8, s2=20, q_lens=q_lens, kv_lens=kv_lens, block_size=bs, k=5,
                   mode=mode, style="random", value_is_key=value_is_key, nan_beyond_kv=True)
    fwd, grads = case.check()
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens, strict=True)):
        assert bool((fwd.attention_out[b, lq:] == 0).all())
        assert bool((fwd.softmax_sum[b, 0, lq:] == 0).all())
        assert bool((grads.d_query[b, lq:] == 0).all()) and bool((grads.d_query_rope[b, lq:] == 0).all())
        for name in ("d_key", "d_value", "d_key_rope"):
            assert bool((getattr(grads, name)[b, lk:] == 0).all()), f"{name} beyond Lk of batch {b}"


def test_bsnd_actual_length_forms(rng):
    """One value applies to every batch; tensors are accepted like lists (docs/semantics/layouts.md)."""
    case = SFACase("BSND", gen=rng, b=2, s1=6, s2=12, k=4, style="random")
    ref = case.forward(actual_seq_lengths_query=[4, 4], actual_seq_lengths_kv=[9, 9])
    for q_l, kv_l in (([4], [9]), (torch.tensor([4, 4]), torch.tensor([9, 9])), (4, 9)):
        got = case.forward(actual_seq_lengths_query=q_l, actual_seq_lengths_kv=kv_l)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    case.kw.update(actual_seq_lengths_query=[4], actual_seq_lengths_kv=[9])
    case.check()


def test_tnd_zero_length_sequences(rng):
    """Sequences with Sq_b = 0 and trailing empty sequences are allowed (docs/semantics/layouts.md)."""
    SFACase("TND", gen=rng, q_lens=[4, 0, 6, 0, 0], kv_lens=[7, 3, 9, 0, 0], k=4, style="random").check()


@pytest.mark.parametrize("empty", ["tokens", "heads", "head_dim"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_empty_query(layout, empty):
    """Empty query (no tokens, N1 = 0 or D = 0): outputs of the documented shapes (0 / -2e38 / 0), zero
    gradients, no error (docs/semantics/errors.md; "query为空Tensor：直接返回")."""
    s1, n1, d = {"tokens": (0, 2, 8), "heads": (3, 0, 8), "head_dim": (3, 2, 0)}[empty]
    if layout == "TND":
        q, idx = torch.zeros(s1, n1, d), torch.zeros(s1, 1, 3, dtype=torch.int32)
        qr, k, v, kr = torch.zeros(s1, n1, 4), torch.randn(5, 1, d), torch.randn(5, 1, 6), torch.randn(5, 1, 4)
        kw = {"layout": "TND", "actual_seq_lengths_query": [s1], "actual_seq_lengths_kv": [5]}
    else:
        q, idx = torch.zeros(1, s1, n1, d), torch.zeros(1, s1, 1, 3, dtype=torch.int32)
        qr, k, v, kr = (torch.zeros(1, s1, n1, 4), torch.randn(1, 5, 1, d), torch.randn(1, 5, 1, 6),
                        torch.randn(1, 5, 1, 4))
        kw = {}
    for rope in ({}, {"query_rope": qr, "key_rope": kr}):
        res = cann_attn.sparse_flash_attention(q, k, v, idx, 0.3, **kw, **rope)
        assert tuple(res.attention_out.shape) == (*q.shape[:-1], 6)
        assert bool((res.attention_out == 0).all())
        stat_shape = (1, s1, n1) if layout == "TND" else (1, 1, s1, n1)
        assert tuple(res.softmax_max.shape) == stat_shape and tuple(res.softmax_sum.shape) == stat_shape
        assert bool((res.softmax_max == -2e38).all()) and bool((res.softmax_sum == 0).all())
        g = cann_attn.sparse_flash_attention_grad(q, k, v, idx, res.attention_out, res.attention_out,
                                                  res.softmax_max, res.softmax_sum, 0.3, **kw, **rope)
        for name, src in (("d_query", q), ("d_key", k), ("d_value", v)):
            grad = getattr(g, name)
            assert tuple(grad.shape) == tuple(src.shape) and bool((grad == 0).all()), name
        if rope:
            assert tuple(g.d_query_rope.shape) == tuple(qr.shape) and bool((g.d_key_rope == 0).all())
        else:
            assert g.d_query_rope is None and g.d_key_rope is None


# ----------------------------------------------------------------------------------------------------------
# Grad-specific semantics, determinism
# ----------------------------------------------------------------------------------------------------------
def test_grad_uses_the_given_statistics(rng):
    """The grad recomputes P = exp(z - max) / sum from the given statistics (no renormalisation): doubling
    softmax_sum halves P and so every gradient (Dl comes from the given out, unchanged)."""
    case = SFACase("BSND", gen=rng, s1=6, s2=12, k=4, dtype=F64)
    fwd = case.forward()
    base = case.grad(fwd)
    doubled = case.grad(fwd._replace(softmax_sum=fwd.softmax_sum * 2))
    for name in GRAD_NAMES:
        torch.testing.assert_close(getattr(doubled, name), getattr(base, name) * 0.5, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_deterministic_is_bitwise_reproducible(layout, rng):
    case = SFACase(layout, gen=rng, s1=36, s2=48, block_size=8, k=6, style="dup")
    fwd = case.forward()
    runs = [case.grad(fwd, deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for name in GRAD_NAMES:
            assert torch.equal(getattr(other, name), getattr(runs[0], name)), name
    again = case.forward()
    for a, b in zip(again, fwd, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("deterministic", [False, True])
def test_grad_restores_the_global_deterministic_setting(deterministic, rng):
    """The grad's deterministic guard restores torch's global setting whole, warn_only included."""
    case = SFACase("BSND", gen=rng, s1=4, s2=8, k=3)
    fwd = case.forward()
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        for enabled, warn_only in ((True, True), (True, False), (False, False)):
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
            case.grad(fwd, deterministic=deterministic)
            assert torch.are_deterministic_algorithms_enabled() == enabled
            assert torch.is_deterministic_algorithms_warn_only_enabled() == warn_only
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


# ----------------------------------------------------------------------------------------------------------
# Differentiable sparse_attention
# ----------------------------------------------------------------------------------------------------------
def _autograd_inputs(case, dtype=None):
    leaves = {}
    for name, t in case.tensors.items():
        if t is not None:
            leaves[name] = t.detach().clone().to(dtype or t.dtype).requires_grad_()
    return leaves


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sparse_attention_autograd_matches_oracle(layout, rng):
    case = SFACase(layout, gen=rng, s1=7, s2=18, block_size=8, k=3, style="random", d_v=12)
    leaves = _autograd_inputs(case)
    out = cann_attn.sparse_attention(leaves["query"], leaves["key"], leaves["value"], case.inputs["sparse_indices"],
                                     query_rope=leaves["query_rope"], key_rope=leaves["key_rope"], **case.kw)
    golden_out = case.oracle()[1][0]
    assert_close_to_oracle(out.detach(), golden_out, name="attention_out")
    out.backward(case.d_out)
    golden = case.oracle_grads()
    for name in GRAD_NAMES:
        src = name[2:]
        assert_close_to_oracle(leaves[src].grad, golden[name], name=name)


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no_rope"])
@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sparse_attention_gradcheck(layout, bs, rope, rng):
    """torch.autograd.gradcheck in float64 on tiny shapes (finite differences vs SparseFlashAttentionGrad)."""
    q_lens, kv_lens = ([3, 2], [2 * bs + 1, bs + 1]) if layout == "TND" else (None, None)
    case = SFACase(layout, gen=rng, b=1, s1=3, s2=2 * bs + 1, q_lens=q_lens, kv_lens=kv_lens, n1=2, d=3,
                   d_rope=2 if rope else None, d_v=2, block_size=bs, k=3, mode=3, style="dup", dtype=F64)
    leaves = _autograd_inputs(case)
    names = list(leaves)
    idx = case.inputs["sparse_indices"]

    def fn(*tensors):
        t = dict(zip(names, tensors, strict=True))
        return cann_attn.sparse_attention(t["query"], t["key"], t["value"], idx, query_rope=t.get("query_rope"),
                                          key_rope=t.get("key_rope"), **case.kw)

    assert torch.autograd.gradcheck(fn, tuple(leaves[n] for n in names), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sparse_attention_same_tensor_as_key_and_value(layout, rng):
    """DSA passes one latent as key and value: autograd adds d_key and d_value into its gradient."""
    case = SFACase(layout, gen=rng, s1=6, s2=15, k=4, style="dup", value_is_key=True)
    latent = case.inputs["key"].detach().clone().requires_grad_()
    q = case.inputs["query"].detach().clone().requires_grad_()
    out = cann_attn.sparse_attention(q, latent, latent, case.inputs["sparse_indices"],
                                     query_rope=case.inputs["query_rope"], key_rope=case.inputs["key_rope"],
                                     **case.kw)
    out.backward(case.d_out)
    golden = case.oracle_grads()
    assert_close_to_oracle(latent.grad, golden["d_key"] + golden["d_value"], name="d_latent")
    assert not torch.allclose(golden["d_key"] + golden["d_value"], golden["d_key"]), "d_value must contribute"
    assert_close_to_oracle(q.grad, golden["d_query"], name="d_query")


def test_sparse_attention_deterministic_flag(rng):
    case = SFACase("TND", gen=rng, s1=8, s2=20, k=4, style="dup")
    grads = []
    for _ in range(2):
        leaves = _autograd_inputs(case)
        out = cann_attn.sparse_attention(leaves["query"], leaves["key"], leaves["value"],
                                         case.inputs["sparse_indices"], query_rope=leaves["query_rope"],
                                         key_rope=leaves["key_rope"], deterministic=True, **case.kw)
        out.backward(case.d_out)
        grads.append([leaves[n].grad for n in leaves])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_oracle_selection_counts_match_formula():
    """Self-check of the oracle's selection: n = min(K, ceil(thr / bs)) entries examined."""
    for thr_extra in range(0, 5):
        s1, s2, bs = 4, 16 + thr_extra, 8
        t = 0
        thr = s2 - s1 + t + 1
        n = min(10, math.ceil(thr / bs))
        entries = list(range(10))
        got = dsa_oracle.sfa_selected_tokens(entries, t, s1, s2, 3, bs)
        expected = [p for b in range(n) for p in range(b * bs, min(b * bs + bs, thr))]
        assert got == expected


def test_tnd_bsnd_agree(rng):
    """The same sequences packed as TND or padded as BSND give the same rows."""
    q_lens, kv_lens = [5, 3], [11, 7]
    case = SFACase("TND", gen=rng, q_lens=q_lens, kv_lens=kv_lens, k=4, style="random")
    fwd = case.forward()
    i = case.inputs
    s1, s2 = max(q_lens), max(kv_lens)

    def pad(t, lens, s):
        if t is None:
            return None
        out = torch.zeros(len(lens), s, *t.shape[1:], dtype=t.dtype)
        start = 0
        for b, n in enumerate(lens):
            out[b, :n] = t[start : start + n]
            start += n
        return out

    res = cann_attn.sparse_flash_attention(
        pad(i["query"], q_lens, s1), pad(i["key"], kv_lens, s2), pad(i["value"], kv_lens, s2),
        pad(i["sparse_indices"], q_lens, s1), case.kw["scale_value"], query_rope=pad(i["query_rope"], q_lens, s1),
        key_rope=pad(i["key_rope"], kv_lens, s2), actual_seq_lengths_query=q_lens, actual_seq_lengths_kv=kv_lens,
        sparse_block_size=1, sparse_mode=3, layout="BSND")
    start = 0
    for b, n in enumerate(q_lens):
        torch.testing.assert_close(res.attention_out[b, :n], fwd.attention_out[start : start + n])
        start += n


@pytest.mark.parametrize("mode", [0, 3])
def test_bsnd_zero_kv_length(mode, rng):
    """BSND batch with Lk_b = 0 and Lq_b > 0: every row has thr <= 0, so (docs/operators/sparse_flash_attention.md) the
    rows output 0 with softmax_max = -2e38 / softmax_sum = 0 -- or the call is rejected as a documented
    ParamInvalidError naming actual_seq_lengths_kv. Any other exception (IndexError...) is a bug."""
    case = SFACase("BSND", gen=rng, b=2, s1=4, s2=6, q_lens=[4, 3], kv_lens=[0, 6], k=3, mode=mode, style="random")
    try:
        fwd = case.forward()
    except cann_attn.ParamInvalidError as err:
        assert "actual_seq_lengths_kv" in str(err)
        return
    assert bool((fwd.attention_out[0] == 0).all()) and bool((fwd.softmax_sum[0] == 0).all())
    case.check()


def test_non_contiguous_inputs(rng):
    """Non-contiguous tensors are accepted (参数说明: 非连续Tensor supported) and give the same results."""
    case = SFACase("BSND", gen=rng, s1=6, s2=14, k=4, style="random")
    fwd, grads = case.check()
    nc = {}
    for name, t in case.tensors.items():
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        nc[name] = wide[..., ::2]
        assert not nc[name].is_contiguous()
    idx = case.inputs["sparse_indices"]
    idx_nc = torch.cat([idx, idx], dim=-1)[..., : idx.shape[-1]]
    res = cann_attn.sparse_flash_attention(nc["query"], nc["key"], nc["value"], idx_nc, query_rope=nc["query_rope"],
                                           key_rope=nc["key_rope"], **case.kw)
    for a, b in zip(res, fwd, strict=True):
        torch.testing.assert_close(a, b)
    kw = {k: v for k, v in case.kw.items() if k != "scale_value"}
    g = cann_attn.sparse_flash_attention_grad(nc["query"], nc["key"], nc["value"], idx_nc, case.d_out.transpose(
        -1, -2).contiguous().transpose(-1, -2), fwd.attention_out, fwd.softmax_max, fwd.softmax_sum,
        case.kw["scale_value"], query_rope=nc["query_rope"], key_rope=nc["key_rope"], **kw)
    for name in GRAD_NAMES:
        torch.testing.assert_close(getattr(g, name), getattr(grads, name))
