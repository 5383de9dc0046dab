"""LightningIndexer (top-k of the index scores) and SparseLightningIndexerGradKLLoss / `indexer_kl_loss` against
the independent float64 oracle (docs/semantics/layouts.md, docs/operators/lightning_indexer.md,
docs/semantics/errors.md, docs/semantics/precision.md), hypothesis fuzzing, and one error test per
documented constraint of both operators."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cann_attn
from cann_attn.testing import dsa_oracle
from cann_attn.testing.precision import assert_close_to_oracle
from dsa_utils import BF16, DT_IDS, F16, F32, F64, TRITON_MATRIX, IndexerCase
from matrix_sample import fuzz_examples

pytestmark = pytest.mark.usefixtures("single_thread")

RELATIONS = {"s1_lt_s2": (6, 15), "s1_eq_s2": (12, 12), "s1_gt_s2": (14, 9)}
TND_LENGTHS = {"s1_lt_s2": ([6, 3, 0], [15, 7, 4]), "s1_eq_s2": ([12, 5], [12, 5]), "s1_gt_s2": ([14, 4], [9, 2])}


def _case(layout, relation, rng, **kw):
    s1, s2 = RELATIONS[relation]
    if layout == "TND":
        q_lens, kv_lens = TND_LENGTHS[relation]
        return IndexerCase("TND", gen=rng, q_lens=q_lens, kv_lens=kv_lens, **kw)
    return IndexerCase("BSND", gen=rng, s1=s1, s2=s2, **kw)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[rows, K] view of a [B, S1, 1, K] / [T1, 1, K] tensor."""
    return t.reshape(-1, t.shape[-1])


def assert_topk_consistent(indices: torch.Tensor, scores: torch.Tensor, k: int, rel_tol: float) -> None:
    """Top-k SETS (and order) up to rounding: for every row, the first min(K, #allowed) entries are distinct allowed
    keys, the rest -1; no unselected allowed key scores more than a selected one, and the order is non-increasing,
    both up to `rel_tol` * (1 + max |score| of the row) (scores computed in fp32 from fp16/bf16 inputs)."""
    idx_rows = _rows(indices)
    score_rows = scores.reshape(-1, scores.shape[-1])
    for r in range(idx_rows.shape[0]):
        row = score_rows[r]
        allowed = torch.isfinite(row)
        n = min(k, int(allowed.sum()))
        got = idx_rows[r].tolist()
        assert all(i == -1 for i in got[n:]), f"row {r}: expected -1 after {n} entries, got {got}"
        chosen = got[:n]
        assert len(set(chosen)) == n and all(0 <= i < row.numel() and bool(allowed[i]) for i in chosen), (
            f"row {r}: {chosen} are not {n} distinct allowed keys")
        if n == 0:
            continue
        tol = rel_tol * (1.0 + float(row[allowed].abs().max()))
        chosen_scores = row[chosen]
        mask = allowed.clone()
        mask[chosen] = False
        if bool(mask.any()):
            assert float(row[mask].max()) <= float(chosen_scores.min()) + tol, f"row {r}: a better key was left out"
        assert bool((chosen_scores[1:] <= chosen_scores[:-1] + tol).all()), f"row {r}: order not descending"


# ==========================================================================================================
# LightningIndexer
# ==========================================================================================================
@pytest.mark.parametrize("k", [1, 5, 40])
@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("relation", list(RELATIONS))
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_topk_exact_float64(layout, relation, mode, k, rng):
    """float64 inputs: indices (set AND order) equal the oracle's exactly; values are the scores, -inf at -1."""
    case = _case(layout, relation, rng, dtype=F64)
    res = case.indexer(sparse_count=k, sparse_mode=mode, return_value=True)
    idx, vals = case.indexer_oracle(k, mode)
    assert res.sparse_indices.dtype == torch.int32 and tuple(res.sparse_indices.shape) == tuple(idx.shape)
    assert torch.equal(res.sparse_indices, idx), "top-k indices differ from the oracle"
    assert res.sparse_values.dtype == F64
    assert torch.equal(torch.isinf(res.sparse_values), torch.isinf(vals))
    torch.testing.assert_close(res.sparse_values, vals, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, F32, F16, BF16], ids=DT_IDS.get)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_ties_go_to_the_smaller_index(layout, dtype, rng):
    """Integer-valued inputs give exact scores in every dtype, with many ties (zeros included): the order must
    be exactly the oracle's (descending score, ties to the smaller index)."""
    case = _case(layout, "s1_lt_s2", rng, dtype=dtype, integer_valued=True, n_idx=2, d_idx=4)
    scores = case.scores()
    finite = scores[torch.isfinite(scores)]
    assert finite.numel() > torch.unique(finite).numel(), "the case must contain ties"
    for k in (3, 8, 20):
        res = case.indexer(sparse_count=k, return_value=True)
        idx, vals = case.indexer_oracle(k)
        assert torch.equal(res.sparse_indices, idx), f"K={k}: tie order differs from the oracle"
        assert res.sparse_values.dtype == dtype
        torch.testing.assert_close(res.sparse_values, vals.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("s2", [257] if TRITON_MATRIX else [257, 1023])
@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DT_IDS.get)
def test_ties_between_identical_keys(dtype, mode, s2, rng):
    """Realistic head dims (D = 128, Nidx1 = 16): key s is a copy of key s % 8, so the keys of a group score exactly
    alike and the group's selected members must be its smallest allowed indices in increasing order, with bitwise-equal
    values (docs/operators/lightning_indexer.md, "ties to the smaller index"). Key counts that are no multiple of 8 once
    made copies score 1 ulp apart by column position."""
    s1, n_idx, d, groups, k = 70, 16, 128, 8, 64
    qi = torch.randn(1, s1, n_idx, d, generator=rng).to(dtype)
    w = torch.randn(1, s1, n_idx, generator=rng).to(dtype)
    base = torch.randn(1, groups, 1, d, generator=rng).to(dtype)
    ki = base.repeat(1, -(-s2 // groups), 1, 1)[:, :s2].contiguous()
    res = cann_attn.lightning_indexer(qi, ki, w, sparse_count=k, sparse_mode=mode, return_value=True)
    for t in range(s1):
        row, vals = res.sparse_indices[0, t, 0].tolist(), res.sparse_values[0, t, 0]
        allowed = s2 if mode == 0 else s2 - s1 + t + 1
        for g in range(groups):
            picked = [e for e, i in enumerate(row) if i >= 0 and i % groups == g]
            members = [row[e] for e in picked]
            assert members == list(range(g, allowed, groups))[: len(members)], (
                f"row {t}: copies of key {g} selected as {members}, not the smallest indices in order")
            assert len(torch.unique(vals[picked])) <= 1, f"row {t}: copies of key {g} score differently"


@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=DT_IDS.get)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_topk_sets_low_precision(layout, dtype, mode, rng):
    """fp16/bf16/fp32 inputs: sets compared where the scores are not within rounding of each other; values vs
    the oracle's scores at the chosen keys (precision rule of the input dtype)."""
    case = _case(layout, "s1_lt_s2", rng, dtype=dtype)
    k = 6
    res = case.indexer(sparse_count=k, sparse_mode=mode, return_value=True)
    scores = case.scores(mode)
    assert_topk_consistent(res.sparse_indices, scores, k, rel_tol=1e-5)
    picked = torch.full(res.sparse_values.shape, float("-inf"), dtype=F64)
    idx_rows, score_rows = _rows(res.sparse_indices), scores.reshape(-1, scores.shape[-1])
    pick_rows = _rows(picked)
    for r in range(idx_rows.shape[0]):
        for e, i in enumerate(idx_rows[r].tolist()):
            if i >= 0:
                pick_rows[r, e] = score_rows[r, i]
    assert res.sparse_values.dtype == dtype
    assert torch.equal(torch.isinf(res.sparse_values), torch.isinf(picked))
    fin = torch.isfinite(picked)
    assert_close_to_oracle(res.sparse_values[fin], picked[fin], dtype=dtype, name="sparse_values")


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_return_value_false(layout, rng):
    res = _case(layout, "s1_eq_s2", rng).indexer(sparse_count=4)
    assert res.sparse_values is None


@pytest.mark.parametrize("mode", [0, 3])
def test_padding_when_fewer_keys_than_k(mode, rng):
    """Row t holds min(K, #allowed) indices then -1 (K larger than S2 too)."""
    case = IndexerCase("BSND", gen=rng, s1=6, s2=4, dtype=F64)
    k = 7
    res = case.indexer(sparse_count=k, sparse_mode=mode, return_value=True)
    for t in range(6):
        allowed = 4 if mode == 0 else max(0, min(4, 4 - 6 + t + 1))
        row = res.sparse_indices[:, t, 0]
        assert bool((row[:, :allowed] >= 0).all()) and bool((row[:, allowed:] == -1).all()), (t, row)
        assert bool(torch.isinf(res.sparse_values[:, t, 0, allowed:]).all())
        assert bool((res.sparse_values[:, t, 0, allowed:] < 0).all())
    assert torch.equal(res.sparse_indices, case.indexer_oracle(k, mode)[0])


@pytest.mark.parametrize("mode", [0, 3])
def test_bsnd_actual_lengths(mode, rng):
    """Rows beyond Lq are all -1 (values -inf); keys beyond Lk are never selected (they hold NaN here)."""
    q_lens, kv_lens = [5, 0, 8], [11, 6, 14]
    case = IndexerCase("BSND", gen=rng, b=3, s1=8, s2=14, q_lens=q_lens, kv_lens=kv_lens, dtype=F64)
    for b, lk in enumerate(kv_lens):
        case.key_index[b, lk:] = float("nan")
    k = 9
    res = case.indexer(sparse_count=k, sparse_mode=mode, return_value=True)
    idx, vals = case.indexer_oracle(k, mode)
    assert torch.equal(res.sparse_indices, idx)
    torch.testing.assert_close(res.sparse_values, vals, rtol=1e-12, atol=1e-12)
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens, strict=True)):
        assert bool((res.sparse_indices[b, lq:] == -1).all())
        assert bool((res.sparse_indices[b] < lk).all())


def test_bsnd_and_tnd_agree(rng):
    q_lens, kv_lens = [5, 3], [11, 7]
    case = IndexerCase("TND", gen=rng, q_lens=q_lens, kv_lens=kv_lens, dtype=F64)
    tnd = case.indexer(sparse_count=6).sparse_indices

    def pad(t, lens):
        out = torch.zeros(len(lens), max(lens), *t.shape[1:], dtype=t.dtype)
        start = 0
        for b, n in enumerate(lens):
            out[b, :n] = t[start : start + n]
            start += n
        return out

    bsnd = cann_attn.lightning_indexer(pad(case.query_index, q_lens), pad(case.key_index, kv_lens),
                                       pad(case.weights, q_lens), actual_seq_lengths_query=q_lens,
                                       actual_seq_lengths_key=kv_lens, sparse_count=6).sparse_indices
    start = 0
    for b, n in enumerate(q_lens):
        assert torch.equal(bsnd[b, :n], tnd[start : start + n])
        start += n


def test_indexer_feeds_sparse_attention(rng):
    """The DSA pipeline: lightning_indexer's indices (valid first, then -1) drive sparse_flash_attention."""
    case = IndexerCase("TND", gen=rng, q_lens=[7, 4], kv_lens=[12, 6], dtype=F32).kl_inputs(5, style="indexer")
    res = cann_attn.sparse_flash_attention(case.query, case.key, case.key, case.sparse_indices, case.scale,
                                           query_rope=case.query_rope, key_rope=case.key_rope, layout="TND",
                                           actual_seq_lengths_query=case.kw["actual_seq_lengths_query"],
                                           actual_seq_lengths_kv=case.kw["actual_seq_lengths_key"])
    golden = dsa_oracle.sparse_attention_oracle(case.query, case.key, case.key, case.sparse_indices, case.scale,
                                                query_rope=case.query_rope, key_rope=case.key_rope, layout="TND",
                                                actual_seq_lengths_query=case.kw["actual_seq_lengths_query"],
                                                actual_seq_lengths_kv=case.kw["actual_seq_lengths_key"])
    assert_close_to_oracle(res.attention_out, golden[0], name="attention_out")


# ==========================================================================================================
# SparseLightningIndexerGradKLLoss
# ==========================================================================================================
@pytest.mark.parametrize("style", ["indexer", "topk", "random", "middle", "dup"])
@pytest.mark.parametrize("heads", [(8, 8), (16, 4), (1, 1), (4, 16)], ids=lambda h: f"n1_{h[0]}-nidx_{h[1]}")
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_kl_loss_and_grads(layout, heads, style, rng):
    """loss, d_query_index, d_key_index, d_weights vs the oracle (fp32): selections from the indexer itself,
    random top-k, arbitrary entries (-1 anywhere, out of range, duplicates)."""
    n1, n_idx = heads
    case = _case(layout, "s1_lt_s2", rng, n1=n1, n_idx=n_idx).kl_inputs(5, style=style)
    case.check_kl()


@pytest.mark.parametrize("relation", list(RELATIONS))
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_kl_relations(layout, relation, rng):
    _case(layout, relation, rng).kl_inputs(6, style="random").check_kl()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DT_IDS.get)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_kl_half_precision(layout, dtype, rng):
    case = _case(layout, "s1_lt_s2", rng, dtype=dtype).kl_inputs(5, style="indexer")
    res = case.check_kl()
    assert res.d_query_index.dtype == dtype and res.loss.dtype == F32


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_kl_without_rope(layout, rng):
    case = _case(layout, "s1_eq_s2", rng, d_rope=None).kl_inputs(4, style="topk")
    assert case.query_rope is None
    case.check_kl()


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_kl_stats_from_the_sfa_op(layout, rng):
    """Statistics from our own sparse_flash_attention (the training pipeline) instead of the oracle's."""
    _case(layout, "s1_lt_s2", rng).kl_inputs(5, style="indexer", stats_from="op").check_kl()


def test_kl_bsnd_actual_lengths(rng):
    """Rows beyond Lq contribute nothing and get zero gradients; keys beyond Lk (NaN here) are never read."""
    q_lens, kv_lens = [5, 0, 7], [10, 6, 14]
    case = IndexerCase("BSND", gen=rng, b=3, s1=7, s2=14, q_lens=q_lens, kv_lens=kv_lens).kl_inputs(6, style="random")
    for b, lk in enumerate(kv_lens):
        for t in (case.key, case.key_rope, case.key_index):
            t[b, lk:] = float("nan")
    res = case.check_kl()
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens, strict=True)):
        assert bool((res.d_query_index[b, lq:] == 0).all()) and bool((res.d_weights[b, lq:] == 0).all())
        assert bool((res.d_key_index[b, lk:] == 0).all())


def test_kl_rows_without_entries(rng):
    """Rows with no valid entry (all -1, or every examined entry out of range) contribute nothing."""
    case = IndexerCase("BSND", gen=rng, s1=6, s2=9).kl_inputs(4, style="topk")
    case.sparse_indices[0, 2] = -1
    case.sparse_indices[1, 4] = 100
    case.kl_inputs(4, indices=case.sparse_indices)
    res = case.check_kl()
    for b, t in ((0, 2), (1, 4)):
        assert bool((res.d_query_index[b, t] == 0).all()) and bool((res.d_weights[b, t] == 0).all())


def test_kl_selection_rule_first_k_entries(rng):
    """Only the first k_t = min(K, #allowed) entries count; -1 and out-of-range ones among them are skipped
    (no early stop); what lies beyond k_t is ignored."""
    # S1 = S2 = 4, mode 3: row t allows keys [0, t]; k_t = min(K, t + 1)
    assert dsa_oracle.kl_selected_entries([3, 1, 0, -1], 1, 4, 4) == [1]
    assert dsa_oracle.kl_selected_entries([-1, 2, 0, 1], 3, 4, 4) == [2, 0, 1]
    assert dsa_oracle.kl_selected_entries([0, 0, 1], 2, 4, 4) == [0, 0, 1]
    case = IndexerCase("BSND", gen=rng, b=1, s1=4, s2=4)
    idx = torch.tensor([[0, 3, 2, 1], [3, 1, 0, -1], [-1, 2, 0, 1], [-1, 2, 0, 1]], dtype=torch.int32)
    case.kl_inputs(4, indices=idx.view(1, 4, 1, 4))
    res = case.check_kl()
    changed = idx.clone()
    changed[0, 1:] = torch.tensor([2, 1, 1])  # beyond k_0 = 1
    changed[1, 2:] = torch.tensor([1, 1])  # beyond k_1 = 2
    case.sparse_indices = changed.view(1, 4, 1, 4)
    res2 = case.kl()
    for name in ("d_query_index", "d_key_index", "d_weights", "loss"):
        torch.testing.assert_close(getattr(res2, name), getattr(res, name))


def test_kl_gradient_is_the_documented_one(rng):
    """dI = Softmax(I) - p (docs/operators/lightning_indexer.md), not the autograd of the clamped loss: with large
    index scores some q_j < 1e-8, where the two differ. The op must match the documented gradient."""
    case = IndexerCase("BSND", gen=rng, b=1, s1=6, s2=10, n_idx=4, dtype=F64).kl_inputs(6, style="topk")
    case.weights = case.weights * 40  # float64: large scores are ill-conditioned in fp32
    res = case.check_kl()
    # the literal clamped loss differentiated by autograd gives something else here
    leaves = [t.detach().double().requires_grad_() for t in (case.query_index, case.key_index, case.weights)]
    lit = torch.zeros((), dtype=F64)
    for t in range(6):
        entries = dsa_oracle.kl_selected_entries(case.sparse_indices[0, t, 0].tolist(), t, 6, 10)
        if not entries:
            continue
        pos = torch.tensor(entries)
        qm = torch.cat([case.query[0, t], case.query_rope[0, t]], -1).double()
        km = torch.cat([case.key[0, pos, 0], case.key_rope[0, pos, 0]], -1).double()
        z = case.scale * (qm[:, None, :] * km[None]).sum(-1)
        p = (torch.exp(z - case.softmax_max[0, 0, t, :, None].double()) / case.softmax_sum[0, 0, t, :, None]).mean(0)
        scores = (leaves[2][0, t, :, None] * torch.relu((leaves[0][0, t, :, None, :] * leaves[1][0, pos, 0][None])
                                                      .sum(-1))).sum(0)
        q = torch.softmax(scores, -1)
        pc, qc = p.clamp_min(1e-8), q.clamp_min(1e-8)
        lit = lit + (pc * (pc.log() - qc.log())).sum()
    lit_grads = torch.autograd.grad(lit, leaves)
    assert not torch.allclose(lit_grads[2], res.d_weights, rtol=1e-3, atol=1e-4), (
        "the case must discriminate the documented gradient from the literal one")


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_kl_deterministic(layout, rng):
    case = _case(layout, "s1_eq_s2", rng).kl_inputs(5, style="dup")
    runs = [case.kl(deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(other, runs[0], strict=True):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------------
# indexer_kl_loss (autograd)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_indexer_kl_loss_autograd(layout, reduction, rng):
    """sum: the op's loss and gradients; mean: divided by the number of query tokens with at least one valid
    selected key. Upstream gradients scale; no gradient reaches query/key/rope."""
    case = _case(layout, "s1_gt_s2", rng).kl_inputs(5, style="random")
    loss_ref, golden, count = case.kl_oracle()
    assert count > 0
    divisor = count if reduction == "mean" else 1
    leaves = [t.detach().clone().requires_grad_() for t in (case.query_index, case.key_index, case.weights)]
    query = case.query.detach().clone().requires_grad_()
    loss = cann_attn.indexer_kl_loss(query, case.key, *leaves, case.sparse_indices, case.softmax_max,
                                     case.softmax_sum, case.scale, query_rope=case.query_rope,
                                     key_rope=case.key_rope, reduction=reduction, **case.kw)
    assert loss.dim() == 0
    assert_close_to_oracle(loss.detach(), loss_ref / divisor, name="loss")
    (loss * 3.0).backward()
    for leaf, name in zip(leaves, ("d_query_index", "d_key_index", "d_weights"), strict=True):
        assert_close_to_oracle(leaf.grad, golden[name] * (3.0 / divisor), name=name)
    assert query.grad is None


def test_indexer_kl_loss_mean_counts_tokens_with_keys(rng):
    case = IndexerCase("BSND", gen=rng, s1=6, s2=8).kl_inputs(3, style="topk")
    case.sparse_indices[0, :3] = -1
    case.kl_inputs(3, indices=case.sparse_indices)
    _, _, count = case.kl_oracle()
    assert count == 12 - 3
    args = case.kl_args()
    total = cann_attn.indexer_kl_loss(*args, reduction="sum", **case.kl_kwargs())
    mean = cann_attn.indexer_kl_loss(*args, reduction="mean", **case.kl_kwargs())
    torch.testing.assert_close(mean, total / count)


# ----------------------------------------------------------------------------------------------------------
# Hypothesis
# ----------------------------------------------------------------------------------------------------------
@st.composite
def indexer_configs(draw):
    layout = draw(st.sampled_from(["BSND", "TND"]))
    if layout == "TND":
        n_seq = draw(st.integers(1, 3))
        q_lens = draw(st.lists(st.integers(0, 6), min_size=n_seq, max_size=n_seq))
        kv_lens = [draw(st.integers(1 if q else 0, 10)) for q in q_lens]
        shape = dict(q_lens=q_lens, kv_lens=kv_lens)
    else:
        b, s1, s2 = draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 10))
        shape = dict(b=b, s1=s1, s2=s2)
        if draw(st.booleans()):
            shape["q_lens"] = draw(st.lists(st.integers(0, s1), min_size=b, max_size=b))
            shape["kv_lens"] = draw(st.lists(st.integers(1, s2), min_size=b, max_size=b))
    return dict(layout=layout, shape=shape, n1=draw(st.sampled_from([1, 2, 4])),
                n_idx=draw(st.sampled_from([1, 2, 4])), d_idx=draw(st.sampled_from([2, 4, 8])),
                d_rope=draw(st.sampled_from([None, 4])), k=draw(st.integers(1, 8)),
                integer_valued=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=fuzz_examples(200), deadline=None)
@given(indexer_configs(), st.sampled_from([0, 3]))
def test_lightning_indexer_random_configs(cfg, mode):
    gen = torch.Generator().manual_seed(cfg["seed"])
    case = IndexerCase(cfg["layout"], gen=gen, n_idx=cfg["n_idx"], d_idx=cfg["d_idx"], dtype=F64,
                       integer_valued=cfg["integer_valued"], **cfg["shape"])
    res = case.indexer(sparse_count=cfg["k"], sparse_mode=mode, return_value=True)
    idx, vals = case.indexer_oracle(cfg["k"], mode)
    assert torch.equal(res.sparse_indices, idx)
    torch.testing.assert_close(res.sparse_values, vals, rtol=1e-12, atol=1e-12)


@settings(max_examples=fuzz_examples(200), deadline=None)
@given(indexer_configs(), st.data())
def test_kl_random_configs(cfg, data):
    gen = torch.Generator().manual_seed(cfg["seed"])
    case = IndexerCase(cfg["layout"], gen=gen, n1=cfg["n1"], n_idx=cfg["n_idx"], d=4, d_idx=cfg["d_idx"],
                       d_rope=cfg["d_rope"], dtype=F32, **cfg["shape"])
    k = cfg["k"]
    rows = case.query_index.shape[0] * (case.query_index.shape[1] if cfg["layout"] == "BSND" else 1)
    hi = max(s.kv_len for s in case.spans) + 1
    entries = data.draw(st.lists(st.lists(st.integers(-1, hi), min_size=k, max_size=k), min_size=rows,
                                 max_size=rows))
    lead = tuple(case.query_index.shape[:-2])
    indices = torch.tensor(entries, dtype=torch.int32).reshape(*lead, 1, k) if rows else torch.zeros(
        *lead, 1, k, dtype=torch.int32)
    case.kl_inputs(k, indices=indices).check_kl()


# ==========================================================================================================
# Errors (docs/semantics/errors.md; 参数说明 / 约束说明 of aclnnSparseLightningIndexerGradKLLoss documentation)
# ==========================================================================================================
def expect_error(param_pattern: str, fn, *, nullptr: bool = False, **overrides):
    exc_type = cann_attn.ParamNullptrError if nullptr else cann_attn.ParamInvalidError
    with pytest.raises(exc_type) as info:
        fn(**overrides)
    err = info.value
    assert isinstance(err, cann_attn.AclnnError)
    assert err.status_code == (161001 if nullptr else 161002)
    assert re.search(param_pattern, str(err)), f"message {str(err)!r} does not name {param_pattern!r}"


def li_args(layout="BSND"):
    gen = torch.Generator().manual_seed(0)
    case = IndexerCase(layout, gen=gen, s1=4, s2=6, q_lens=[4, 2] if layout == "TND" else None,
                       kv_lens=[6, 3] if layout == "TND" else None)
    return {"query_index": case.query_index, "key_index": case.key_index, "weights": case.weights,
            "sparse_count": 3, **case.kw}


def li_call(**overrides):
    layout = overrides.pop("_layout", "BSND")
    return cann_attn.lightning_indexer(**{**li_args(layout), **overrides})


def kl_args(layout="BSND"):
    gen = torch.Generator().manual_seed(0)
    case = IndexerCase(layout, gen=gen, s1=4, s2=6, q_lens=[4, 2] if layout == "TND" else None,
                       kv_lens=[6, 3] if layout == "TND" else None).kl_inputs(3, style="topk")
    names = ("query", "key", "query_index", "key_index", "weights", "sparse_indices", "softmax_max", "softmax_sum",
             "scale_value")
    return {**dict(zip(names, case.kl_args(), strict=True)), **case.kl_kwargs()}


def kl_call(**overrides):
    layout = overrides.pop("_layout", "BSND")
    return cann_attn.sparse_lightning_indexer_grad_kl_loss(**{**kl_args(layout), **overrides})


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_error_base_arguments_are_valid(layout):
    li_call(_layout=layout)
    kl_call(_layout=layout)


# ------------------------------------------------------------------------------------------ lightning_indexer
@pytest.mark.parametrize("name", ["query_index", "key_index", "weights"])
def test_li_missing_tensor(name):
    expect_error(name, li_call, nullptr=True, **{name: None})


def test_li_query_index_dtype():
    a = li_args()
    expect_error("query_index", li_call, query_index=a["query_index"].int(), key_index=a["key_index"].int())


def test_li_key_index_dtype_must_match():
    expect_error("key_index", li_call, key_index=li_args()["key_index"].to(F16))


def test_li_weights_dtype():
    expect_error("weights", li_call, weights=li_args()["weights"].int())


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "tnd"])
def test_li_layout(layout):
    expect_error("layout", li_call, layout=layout)


@pytest.mark.parametrize("mode", [1, 2, 4, 5, 8])
def test_li_sparse_mode(mode):
    expect_error("sparse_mode", li_call, sparse_mode=mode)


@pytest.mark.parametrize("count", [0, -1, 2.0, True, None])
def test_li_sparse_count(count):
    expect_error("sparse_count", li_call, sparse_count=count)


def test_li_sparse_count_accepts_a_numpy_integer():
    """Like the other integer parameters, a NumPy integer is an int (errors.require_int)."""
    ref = li_call(sparse_count=3)
    res = li_call(sparse_count=np.int64(3))
    assert torch.equal(res.sparse_indices, ref.sparse_indices)


def test_li_rank():
    expect_error("query_index", li_call, query_index=li_args()["query_index"][0])


def test_li_key_heads_must_be_1():
    k = li_args()["key_index"]
    expect_error("key_index", li_call, key_index=torch.cat([k, k], dim=-2))


def test_li_head_dim_mismatch():
    expect_error("key_index", li_call, key_index=li_args()["key_index"][..., :8])


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_li_index_heads_at_least_one(layout):
    """Nidx1 = 0 with query tokens: no score to rank (any Nidx1 >= 1 is accepted, not only the documented 8..64)."""
    a = li_args(layout)
    expect_error("query_index.*Nidx1", li_call, _layout=layout, query_index=a["query_index"][..., :0, :],
                 weights=a["weights"][..., :0])


def test_li_weights_shape():
    expect_error("weights", li_call, weights=li_args()["weights"][..., :-1])


def test_li_batch_mismatch():
    expect_error("key_index", li_call, key_index=li_args()["key_index"][:1])


@pytest.mark.parametrize("name", ["actual_seq_lengths_query", "actual_seq_lengths_key"])
def test_li_tnd_lengths_required(name):
    expect_error(name, li_call, nullptr=True, _layout="TND", **{name: None})


@pytest.mark.parametrize("name,value", [("actual_seq_lengths_query", [4, 5]), ("actual_seq_lengths_key", [6, 10]),
                                        ("actual_seq_lengths_query", [5, 4, 6])])
def test_li_tnd_lengths(name, value):
    expect_error(name, li_call, _layout="TND", **{name: value})


@pytest.mark.parametrize("name,value", [("actual_seq_lengths_query", [5, 1]), ("actual_seq_lengths_key", [7, 1]),
                                        ("actual_seq_lengths_query", [-1, 1])])
def test_li_bsnd_lengths(name, value):
    expect_error(name, li_call, **{name: value})


# ------------------------------------------------------------------------------------------ KL loss
@pytest.mark.parametrize("name", ["query", "key", "query_index", "key_index", "weights", "sparse_indices",
                                  "softmax_max", "softmax_sum"])
def test_kl_missing_tensor(name):
    expect_error(name, kl_call, nullptr=True, **{name: None})


@pytest.mark.parametrize("mode", [0, 1, 2, 4])
def test_kl_sparse_mode_3_only(mode):
    expect_error("sparse_mode", kl_call, sparse_mode=mode)


@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_kl_layout(layout):
    expect_error("layout", kl_call, layout=layout)


@pytest.mark.parametrize("name", ["query", "key", "key_index", "query_rope", "key_rope"])
def test_kl_dtype_must_match(name):
    expect_error(name, kl_call, **{name: kl_args()[name].to(F16)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bool])
def test_kl_index_dtype(dtype):
    expect_error("sparse_indices", kl_call, sparse_indices=kl_args()["sparse_indices"].to(dtype))


def test_kl_index_shape():
    idx = kl_args()["sparse_indices"]
    expect_error("sparse_indices", kl_call, sparse_indices=idx[:, :-1])
    expect_error("sparse_indices", kl_call, sparse_indices=torch.cat([idx, idx], dim=-2))


def test_kl_key_heads_must_be_1():
    a = kl_args()
    expect_error("key", kl_call, key=torch.cat([a["key"]] * 2, dim=-2), key_rope=torch.cat([a["key_rope"]] * 2, -2))


def test_kl_key_index_heads_must_be_1():
    k = kl_args()["key_index"]
    expect_error("key_index", kl_call, key_index=torch.cat([k, k], dim=-2))


def test_kl_head_dims():
    a = kl_args()
    expect_error("key", kl_call, key=a["key"][..., :8])
    expect_error("key_index", kl_call, key_index=a["key_index"][..., :8])


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_kl_heads_at_least_one(layout):
    """N1 = 0 (the 1/N1 head mean is undefined) and Nidx1 = 0 with query tokens are rejected by name."""
    a = kl_args(layout)
    expect_error("query.*N1", kl_call, _layout=layout, query=a["query"][..., :0, :],
                 query_rope=a["query_rope"][..., :0, :], softmax_max=a["softmax_max"][..., :0],
                 softmax_sum=a["softmax_sum"][..., :0])
    expect_error("query_index.*Nidx1", kl_call, _layout=layout, query_index=a["query_index"][..., :0, :],
                 weights=a["weights"][..., :0])


@pytest.mark.parametrize("heads", [(3, 5), (0, 0)], ids=["heads", "no_heads"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_empty_query_gives_empty_results(layout, heads):
    """A query without tokens returns empty indices, zero loss and empty gradients, whatever its head count
    (docs/semantics/errors.md)."""
    n1, n_idx = heads
    lead, stats = ((1, 0), (1, 1, 0, n1)) if layout == "BSND" else ((0,), (1, 0, n1))
    kv_lead = (1, 6) if layout == "BSND" else (6,)
    kw = {"layout": layout}
    if layout == "TND":
        kw.update(actual_seq_lengths_query=[0], actual_seq_lengths_key=[6])
    qi, w = torch.randn(*lead, n_idx, 4), torch.randn(*lead, n_idx)
    ki = torch.randn(*kv_lead, 1, 4)
    li = cann_attn.lightning_indexer(qi, ki, w, sparse_count=3, return_value=True, **kw)
    assert tuple(li.sparse_indices.shape) == (*lead, 1, 3) and tuple(li.sparse_values.shape) == (*lead, 1, 3)
    res = cann_attn.sparse_lightning_indexer_grad_kl_loss(
        torch.randn(*lead, n1, 8), torch.randn(*kv_lead, 1, 8), qi, ki, w, li.sparse_indices, torch.zeros(stats),
        torch.ones(stats), 0.5, query_rope=torch.randn(*lead, n1, 2), key_rope=torch.randn(*kv_lead, 1, 2), **kw)
    assert res.loss.tolist() == [0.0]
    assert res.d_query_index.shape == qi.shape and res.d_weights.shape == w.shape
    assert res.d_key_index.shape == ki.shape and not bool(res.d_key_index.any())


def test_kl_weights_shape():
    expect_error("weights", kl_call, weights=kl_args()["weights"][..., :-1])


def test_kl_query_tokens_must_match_query_index():
    a = kl_args()
    expect_error("query", kl_call, query=a["query"][:, :-1], query_rope=a["query_rope"][:, :-1])


def test_kl_key_tokens_must_match_key_index():
    a = kl_args()
    expect_error("key", kl_call, key=a["key"][:, :-1], key_rope=a["key_rope"][:, :-1])


@pytest.mark.parametrize("missing", ["query_rope", "key_rope"])
def test_kl_rope_one_side(missing):
    expect_error(missing, kl_call, **{missing: None})


def test_kl_rope_leading_dims():
    a = kl_args()
    expect_error("query_rope", kl_call, query_rope=a["query_rope"][:, :, :2])
    expect_error("key_rope", kl_call, key_rope=a["key_rope"][:, :-1])


@pytest.mark.parametrize("dims", [(1, 8), (8, 1), (2, 8)], ids=lambda d: f"q{d[0]}-k{d[1]}")
def test_kl_rope_dims_must_match(dims):
    """query_rope and key_rope share Dr (Q = [query ; query_rope], K = [key ; key_rope],
    docs/operators/lightning_indexer.md); Dr 1 vs 8
    used to broadcast into a wrong loss, other pairs to crash."""
    a = kl_args()
    assert a["query_rope"].shape[-1] == a["key_rope"].shape[-1] == 8
    expect_error("key_rope", kl_call, query_rope=a["query_rope"][..., : dims[0]],
                 key_rope=a["key_rope"][..., : dims[1]])


@pytest.mark.parametrize("name", ["softmax_max", "softmax_sum"])
def test_kl_statistics(name):
    stat = kl_args()[name]
    expect_error(name, kl_call, **{name: stat[..., :-1]})
    expect_error(name, kl_call, **{name: stat.to(F16)})


@pytest.mark.parametrize("scale", ["1", None])
def test_kl_scale_value(scale):
    expect_error("scale_value", kl_call, scale_value=scale)


@pytest.mark.parametrize("name", ["actual_seq_lengths_query", "actual_seq_lengths_key"])
def test_kl_tnd_lengths_required(name):
    expect_error(name, kl_call, nullptr=True, _layout="TND", **{name: None})


@pytest.mark.parametrize("name,value", [("actual_seq_lengths_query", [4, 5]), ("actual_seq_lengths_key", [6, 10])])
def test_kl_tnd_lengths(name, value):
    expect_error(name, kl_call, _layout="TND", **{name: value})


def test_li_tnd_query_without_keys_rejected():
    """Sq_b > 0 with Skv_b = 0 is rejected (docs/semantics/layouts.md)."""
    expect_error("actual_seq_lengths", li_call, _layout="TND", actual_seq_lengths_key=[9, 9])


def test_kl_tnd_query_without_keys_rejected():
    """Sq_b > 0 with Skv_b = 0 is rejected (docs/semantics/layouts.md)."""
    expect_error("actual_seq_lengths", kl_call, _layout="TND", actual_seq_lengths_key=[9, 9])


@pytest.mark.parametrize("name,value", [("actual_seq_lengths_query", [5, 1]), ("actual_seq_lengths_key", [7, 1])])
def test_kl_bsnd_lengths(name, value):
    expect_error(name, kl_call, **{name: value})


@pytest.mark.parametrize("reduction", ["none", "avg", None])
def test_indexer_kl_loss_reduction(reduction):
    a = kl_args()
    args = [a.pop(n) for n in ("query", "key", "query_index", "key_index", "weights", "sparse_indices", "softmax_max",
                               "softmax_sum", "scale_value")]
    expect_error("reduction", lambda **kw: cann_attn.indexer_kl_loss(*args, **kw), reduction=reduction, **a)

