"""Cases of the context-parallel tests, run inside spawned process groups (cann_attn.testing.distributed): each
rank builds the whole tensors from a fixed seed, computes the single-process operator on them, runs
`cann_attn.distributed` on its shards and compares its shard of every output and gradient.

fp32: relative 1e-5 (torch.testing with rtol=1e-5, atol=1e-6); bf16: the project's precision rule
(docs/semantics/precision.md) against the single-process fp32 result on the same inputs, with the single-process
bf16 result as the naive reference of the flash-attn rule.
"""

from __future__ import annotations

import time
import traceback
from itertools import accumulate

import torch

import cann_attn
import cann_attn.distributed as cp
from cann_attn.testing.precision import assert_close_to_oracle
from patience import COLLECTIVE_SECONDS

F32, BF16 = torch.float32, torch.bfloat16


# ============================================================================================== FlashAttention
def fa_case(name: str, world: int, **overrides) -> dict:
    """A FlashAttention case with small shapes valid at this world size (lengths multiples of 2P)."""
    case = dict(name=name, layout="BSND", method="ring", load_balance="head_tail", mode="none", pre=4, next=2,
                pse_type=None, q_start=0, kv_start=0, keep_prob=1.0, dtype=F32, batch=2, seq_q=4 * world,
                seq_kv=4 * world, heads=2 * world, heads_kv=2 * world, dim=8, dim_v=8, tnd=None, overlap=True,
                scale=0.35)
    case.update(overrides)
    if case["tnd"] is not None:
        case["layout"] = "TND"
    return case


def fa_matrix(world: int) -> list[dict]:
    """Every supported case: masks, ALiBi, GQA, layouts, TND, dropout, bf16, both methods and load balances."""
    unit = 2 * world  # every length a multiple of 2P
    docs_q = [unit, 3 * unit, 2 * unit]
    return [
        fa_case("ring-BSND-none", world),
        fa_case("ring-BSND-causal2", world, mode=2),
        fa_case("ring-BNSD-causal3-contiguous", world, layout="BNSD", mode=3, load_balance=None),
        fa_case("ring-SBH-band", world, layout="SBH", mode=4, pre=5, next=3),
        fa_case("ring-BSH-band-neg", world, layout="BSH", mode=4, pre=6, next=-2),
        fa_case("ring-BSH-alibi2-causal-gqa", world, layout="BSH", mode=3, pse_type=2, q_start=3, kv_start=1,
                heads_kv=world),
        fa_case("ring-BSND-alibi3-none", world, pse_type=3, q_start=0, kv_start=2),
        fa_case("ring-BSND-cross-causal3", world, mode=3, seq_kv=6 * world, dim_v=4),
        fa_case("ring-BSND-causal3-more-queries", world, mode=3, seq_q=6 * world, seq_kv=4 * world),
        fa_case("ring-TND-causal3", world, tnd=(docs_q, docs_q), mode=3),
        fa_case("ring-TND-cross-causal3", world, tnd=(docs_q, [2 * unit, unit, 3 * unit]), mode=3),
        fa_case("ring-TND-band-alibi2", world, tnd=(docs_q, docs_q), mode=4, pre=3, next=1, pse_type=2, q_start=1),
        fa_case("ring-TND-none-gqa-contiguous", world, tnd=(docs_q, docs_q), heads_kv=1, load_balance=None),
        fa_case("ring-BSND-dropout-causal", world, mode=2, keep_prob=0.8),
        fa_case("ring-TND-dropout-none", world, tnd=(docs_q, docs_q), keep_prob=0.7),
        fa_case("ring-BSND-bf16-causal-gqa", world, mode=3, dtype=BF16, heads_kv=world),
        fa_case("ring-BSND-causal-no-overlap", world, mode=2, overlap=False),
        fa_case("ulysses-BSND-causal2-gqa", world, method="ulysses", mode=2, heads_kv=world),
        fa_case("ulysses-SBH-band-alibi2", world, method="ulysses", layout="SBH", mode=4, pre=3, next=0, pse_type=2,
                kv_start=2),
        fa_case("ulysses-TND-causal3", world, method="ulysses", tnd=(docs_q, docs_q), mode=3),
        fa_case("ulysses-BNSD-dropout-contiguous", world, method="ulysses", layout="BNSD", keep_prob=0.75,
                load_balance=None),
        fa_case("ulysses-BSH-bf16-none", world, method="ulysses", layout="BSH", dtype=BF16),
    ]


def _layout_shape(layout: str, batch: int, seq: int, heads: int, dim: int) -> tuple[int, ...]:
    return {"BSND": (batch, seq, heads, dim), "BNSD": (batch, heads, seq, dim), "BSH": (batch, seq, heads * dim),
            "SBH": (seq, batch, heads * dim), "TND": (seq, heads, dim)}[layout]


def _fa_inputs(case: dict):
    gen = torch.Generator().manual_seed(sum(map(ord, case["name"])))
    layout = case["layout"]
    if case["tnd"] is not None:
        docs_q, docs_kv = case["tnd"]
        seq_q, seq_kv, batch = sum(docs_q), sum(docs_kv), len(docs_q)
    else:
        seq_q, seq_kv, batch = case["seq_q"], case["seq_kv"], case["batch"]

    def rand(seq, heads, dim):
        return torch.randn(_layout_shape(layout, batch, seq, heads, dim), generator=gen).to(case["dtype"])

    q = rand(seq_q, case["heads"], case["dim"])
    k = rand(seq_kv, case["heads_kv"], case["dim"])
    v = rand(seq_kv, case["heads_kv"], case["dim_v"])
    dy = rand(seq_q, case["heads"], case["dim_v"])
    kwargs = dict(scale_value=case["scale"])
    if case["mode"] != "none":
        kwargs.update(sparse_mode=case["mode"], atten_mask=cann_attn.compressed_mask(case["mode"]))
        if case["mode"] == 4:
            kwargs.update(pre_tokens=case["pre"], next_tokens=case["next"])
    if case["pse_type"] is not None:
        slopes = torch.rand(batch, case["heads"], generator=gen) * 0.5 + 0.05
        kwargs.update(pse=slopes, pse_type=case["pse_type"], q_start_idx=[case["q_start"]],
                      kv_start_idx=[case["kv_start"]])
    if case["tnd"] is not None:
        ends = []
        for docs in case["tnd"]:
            total, cum = 0, []
            for n in docs:
                total += n
                cum.append(total)
            ends.append(cum)
        kwargs.update(actual_seq_qlen=ends[0], actual_seq_kvlen=ends[1])
    return q, k, v, dy, kwargs, batch, seq_q, seq_kv


def _single_process(case, q, k, v, dy, kwargs, drop_mask, dtype):
    """Out and gradients of the single-process operators on the whole tensors (in `dtype`)."""
    q, k, v, dy = (t.to(dtype) for t in (q, k, v, dy))
    keep = dict(kwargs, keep_prob=case["keep_prob"], drop_mask=drop_mask)
    fwd = cann_attn.flash_attention_score(q, k, v, case["heads"], case["layout"], **keep)
    grads = cann_attn.flash_attention_score_grad(q, k, v, dy, case["heads"], case["layout"],
                                                 softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
                                                 attention_in=fwd.attention_out, **keep)
    return fwd.attention_out, grads.dq, grads.dk, grads.dv


def _compare(name: str, actual: torch.Tensor, golden: torch.Tensor, naive: torch.Tensor | None) -> None:
    if actual.dtype == F32:
        torch.testing.assert_close(actual, golden.to(F32), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    else:
        assert_close_to_oracle(actual, golden, naive=naive, name=name)


def run_fa_case(rank: int, world: int, device, case: dict) -> None:
    q, k, v, dy, kwargs, batch, seq_q, seq_kv = _fa_inputs(case)
    seed = 1234 + len(case["name"])
    drop_mask = None
    if case["keep_prob"] < 1.0:
        if case["tnd"] is not None:
            drop_mask = cp.dropout_mask(seed, case["keep_prob"], case["heads"],
                                        actual_seq_qlen=kwargs["actual_seq_qlen"],
                                        actual_seq_kvlen=kwargs["actual_seq_kvlen"])
        else:
            drop_mask = cp.dropout_mask(seed, case["keep_prob"], case["heads"], batch=batch, seq_q=seq_q,
                                        seq_kv=seq_kv)
    golden = _single_process(case, q, k, v, dy, kwargs, drop_mask, F32)
    naive = _single_process(case, q, k, v, dy, kwargs, drop_mask, case["dtype"]) if case["dtype"] != F32 else None
    layout, lb = case["layout"], case["load_balance"]
    dim = cp.seq_dim(layout)
    lens = {"q": kwargs.get("actual_seq_qlen"), "kv": kwargs.get("actual_seq_kvlen")}

    def part(x, which="q"):
        return cp.shard(x, dim, load_balance=lb, actual_seq_len=lens[which]).to(device)

    q_l, k_l, v_l = (part(t, w).requires_grad_() for t, w in ((q, "q"), (k, "kv"), (v, "kv")))
    cp_kwargs = {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in kwargs.items()}
    out = cp.flash_attention(q_l, k_l, v_l, case["heads"], layout, method=case["method"], load_balance=lb,
                             overlap=case["overlap"], keep_prob=case["keep_prob"], dropout_seed=seed,
                             timeout=COLLECTIVE_SECONDS, **cp_kwargs)
    out.backward(part(dy))
    names = ("out", "dq", "dk", "dv")
    actuals = (out, q_l.grad, k_l.grad, v_l.grad)
    for i, (label, actual) in enumerate(zip(names, actuals, strict=True)):
        which = "q" if label in ("out", "dq") else "kv"
        _compare(f"{case['name']} {label}", actual.detach().cpu(), part(golden[i], which).cpu(),
                 None if naive is None else part(naive[i], which).cpu())


def assert_no_failures(results: list[list[tuple[str, str | None, float]]]) -> None:
    """Fails with every rank's failing cases, given `run_group`'s per-rank `run_cases` results."""
    failures = [f"rank {rank} {name}: {failure}" for rank, per_rank in enumerate(results)
                for name, failure, _ in per_rank if failure is not None]
    assert not failures, "\n\n".join(failures)


def run_cases(rank: int, world: int, device, cases: list[dict]) -> list[tuple[str, str | None, float]]:
    """(name, failure or None, seconds) of every case; a failing case does not stop the others."""
    results = []
    for case in cases:
        start = time.perf_counter()
        try:
            CASE_RUNNERS[case.get("kind", "fa")](rank, world, device, case)
            failure = None
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        results.append((case["name"], failure, time.perf_counter() - start))
    return results


def run_fa_error_case(rank: int, world: int, device, case: dict) -> None:
    """A call every rank makes alike that must raise ParamInvalidError on every rank."""
    q, k, v, _, kwargs, *_ = _fa_inputs(case)
    dim = cp.seq_dim(case["layout"])
    # The first 1/P of each tensor stands for a shard (the lengths of "error-length" cannot be sharded).
    q_l, k_l, v_l = (t.narrow(dim, 0, t.shape[dim] // world).to(device) for t in (q, k, v))
    if case.get("full_mask"):
        kwargs.update(sparse_mode=0, atten_mask=torch.zeros(q_l.shape[dim], k_l.shape[dim], dtype=torch.bool))
    try:
        cp.flash_attention(q_l, k_l, v_l, case["heads"], case["layout"], method=case["method"],
                           timeout=COLLECTIVE_SECONDS, **kwargs)
    except cann_attn.ParamInvalidError as exc:
        if case["expect"] not in str(exc):
            raise AssertionError(f"expected {case['expect']!r} in the error, got {exc}") from exc
        return
    raise AssertionError("no error raised")


CASE_RUNNERS = {"fa": run_fa_case, "fa_error": run_fa_error_case}


# ============================================================================================= shard / unshard
def run_shard_case(rank: int, world: int, device, case: dict) -> None:
    """shard gives rank r chunks r and 2P-1-r of 2P (head_tail) or chunk r of P, per sequence; unshard inverts it."""
    lengths = case["lengths"]
    total = sum(lengths)
    x = torch.arange(total * 3, dtype=torch.float32).reshape(3, total)  # sequence on dim 1
    ends = None
    if case["tnd"]:
        ends, acc = [], 0
        for n in lengths:
            acc += n
            ends.append(acc)
    local = cp.shard(x, 1, load_balance=case["load_balance"], actual_seq_len=ends)
    chunks = 2 * world if case["load_balance"] == "head_tail" else world
    ids = (rank, 2 * world - 1 - rank) if case["load_balance"] == "head_tail" else (rank,)
    expected, start = [], 0
    for n in lengths:
        size = n // chunks
        expected += [start + c * size + i for c in ids for i in range(size)]
        start += n
    assert local[0].tolist() == [float(e) for e in expected], (local[0].tolist(), expected)
    whole = cp.unshard(local.to(device), 1, load_balance=case["load_balance"], actual_seq_len=ends)
    assert torch.equal(whole.cpu(), x)


CASE_RUNNERS["shard"] = run_shard_case


def run_shard_mismatch_case(rank: int, world: int, device, case: dict) -> None:
    """A rank whose whole tensor differs (here: one element of the last rank) makes every rank raise, naming it;
    verify=False skips the check."""
    x = torch.arange(3 * 4 * world, dtype=torch.bfloat16).reshape(3, 4 * world)
    changed = x.clone()
    moved = torch.cat([x[:, 1:], x[:, :1]], dim=1)  # the same elements in other places
    changed[1, -1] += 1
    for other in (changed, moved):
        try:
            cp.shard(other if rank == world - 1 else x, 1)
        except cann_attn.ParamInvalidError as exc:
            assert f"ranks [{world - 1}] passed other data than rank 0" in str(exc), str(exc)
        else:
            raise AssertionError("shard accepted different tensors")
    assert cp.shard(changed if rank == world - 1 else x, 1, verify=False).shape == (3, 4)
    assert cp.shard(x, 1).shape == (3, 4)  # the same data on every rank passes


CASE_RUNNERS["shard_mismatch"] = run_shard_mismatch_case


def shard_cases(world: int) -> list[dict]:
    unit = 2 * world
    return [dict(kind="shard", name=f"shard-{lb}-{'tnd' if tnd else 'dense'}", lengths=lengths, tnd=tnd,
                 load_balance=lb)
            for lb in ("head_tail", None) for tnd, lengths in ((False, [4 * unit]), (True, [unit, 3 * unit, unit]))
            ] + [dict(kind="shard_mismatch", name="shard-different-data")]


def error_cases(world: int) -> list[dict]:
    """Bad calls every rank makes alike: each rank raises ParamInvalidError before any computation."""
    return [
        dict(fa_case("error-ulysses-heads", world, method="ulysses", heads=world + 1, heads_kv=1), kind="fa_error",
             expect="divisible"),
        # BNSD keeps N in dim 1: the key/value head count there (here 1), not dim -2 (the sequence), is split.
        dict(fa_case("error-ulysses-kv-heads-BNSD", world, method="ulysses", layout="BNSD", heads_kv=1),
             kind="fa_error", expect="divisible"),
        dict(fa_case("error-full-mask", world), kind="fa_error", full_mask=True,
             expect="context parallelism supports"),
        dict(fa_case("error-length", world, seq_q=3 * world, seq_kv=3 * world), kind="fa_error",
             expect="multiples"),
    ]


# ========================================================================================================= DSA
def dsa_cases(world: int) -> list[dict]:
    return [dict(kind="dsa", name=f"dsa-{'TND' if tnd else 'BSND'}-{lb}-mode{mode}-bs{bs}", load_balance=lb,
                 mode=mode, block=bs, world=world, tnd=tnd)
            for tnd, lb, mode, bs in ((False, "head_tail", 3, 1), (False, None, 3, 8), (False, "head_tail", 0, 1),
                                      (True, "head_tail", 3, 1), (True, None, 0, 8))]


def _dsa_inputs(case: dict, world: int):
    """Whole tensors (BSND [1, S, ...] or TND [T, ...] of three documents), the lengths keyword arguments and K."""
    gen = torch.Generator().manual_seed(7 + case["block"] + case["mode"] + 3 * case["tnd"])
    heads, dim, rope, idx_heads, idx_dim = 2, 16, 8, 2, 8
    unit = 2 * world
    lead = (3 * unit,) if case["tnd"] else (1, 4 * world)

    def rand(*shape, scale=1.0):
        return (torch.randn(*lead, *shape, generator=gen) * scale).to(BF16)

    tensors = dict(query=rand(heads, dim), key=rand(1, dim), query_rope=rand(heads, rope), key_rope=rand(1, rope),
                   query_index=rand(idx_heads, idx_dim), key_index=rand(1, idx_dim),
                   weights=rand(idx_heads, scale=0.3).reshape(*lead, idx_heads))
    ends = list(accumulate([unit, 2 * unit])) if case["tnd"] else None  # two documents
    lengths = {} if ends is None else {"q": ends, "kv": ends}
    count = 6 if case["block"] == 1 else 2
    li_kw = {} if ends is None else dict(actual_seq_lengths_query=ends, actual_seq_lengths_key=ends, layout="TND")
    tensors["sparse_indices"] = cann_attn.lightning_indexer(
        tensors["query_index"], tensors["key_index"], tensors["weights"], sparse_count=count,
        sparse_mode=case["mode"], **li_kw).sparse_indices
    if case["block"] > 1:  # block indices: the token indices' blocks (duplicates and all)
        tensors["sparse_indices"] = torch.where(tensors["sparse_indices"] >= 0,
                                                tensors["sparse_indices"] // case["block"], -1)
    return tensors, count, lengths


def run_dsa_case(rank: int, world: int, device, case: dict) -> None:
    """Checks are collected and raised at the end: a rank whose comparison fails still makes every collective
    call of the case, so that the next case starts in step on every rank."""
    failures: list[str] = []

    def check(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except AssertionError as exc:
            failures.append(str(exc))

    _run_dsa_case(rank, world, device, case, check)
    if failures:
        raise AssertionError("\n".join(failures))


def _run_dsa_case(rank: int, world: int, device, case: dict, check) -> None:
    from cann_attn.testing import dsa_oracle

    t, count, lengths = _dsa_inputs(case, world)
    lb, mode, scale = case["load_balance"], case["mode"], 0.25
    tnd = case["tnd"]
    seq, stat_seq = (0, 1) if tnd else (1, 2)
    layout = {} if not tnd else {"layout": "TND"}
    q_len = {} if not tnd else {"actual_seq_lengths_query": lengths["q"]}

    def part(x, dim=seq):
        return cp.shard(x, dim, load_balance=lb, actual_seq_len=lengths.get("q")).to(device)

    # lightning_indexer: the global top-k, exactly.
    li_kw = dict(sparse_count=count, sparse_mode=mode, **layout, **q_len,
                 **({} if not tnd else {"actual_seq_lengths_key": lengths["kv"]}))
    local = cp.lightning_indexer(part(t["query_index"]), part(t["key_index"]), part(t["weights"]),
                                 load_balance=lb, timeout=COLLECTIVE_SECONDS, **li_kw)
    whole = cann_attn.lightning_indexer(t["query_index"], t["key_index"], t["weights"], **li_kw).sparse_indices
    check(_assert_equal, local.sparse_indices.cpu(), part(whole).cpu(), "lightning_indexer indices")

    # sparse_attention forward and backward (DSA: the latent is key and value).
    sfa_kw = dict(sparse_block_size=case["block"], sparse_mode=mode, **layout, **q_len,
                  **({} if not tnd else {"actual_seq_lengths_kv": lengths["kv"]}))
    d_out = torch.randn(t["query"].shape, generator=torch.Generator().manual_seed(3)).to(BF16)
    golden_in = {k: t[k].double().requires_grad_() for k in ("query", "key", "query_rope", "key_rope")}
    g_out, *_ = dsa_oracle.sparse_attention_oracle(
        golden_in["query"], golden_in["key"], golden_in["key"], t["sparse_indices"], scale,
        query_rope=golden_in["query_rope"], key_rope=golden_in["key_rope"], **sfa_kw)
    g_out.backward(d_out.double())
    naive_in = {k: t[k].clone().requires_grad_() for k in ("query", "key", "query_rope", "key_rope")}
    n_out = cann_attn.sparse_attention(naive_in["query"], naive_in["key"], naive_in["key"], t["sparse_indices"],
                                       scale, query_rope=naive_in["query_rope"], key_rope=naive_in["key_rope"],
                                       **sfa_kw)
    n_out.backward(d_out)
    cp_in = {k: part(t[k]).requires_grad_() for k in ("query", "key", "query_rope", "key_rope")}
    c_out = cp.sparse_attention(cp_in["query"], cp_in["key"], cp_in["key"], part(t["sparse_indices"]), scale,
                                query_rope=cp_in["query_rope"], key_rope=cp_in["key_rope"], load_balance=lb,
                                timeout=COLLECTIVE_SECONDS, **sfa_kw)
    c_out.backward(part(d_out))
    check(assert_close_to_oracle, c_out.detach().cpu(), part(g_out.detach()).cpu(),
          naive=part(n_out.detach()).cpu(), name="sparse_attention out")
    masks = _chunk_masks(case, world, lengths, t["query"].shape[seq])
    partial_abs = {k: 0.0 for k in ("key", "key_rope")}
    for mask in masks:  # each chunk's rows alone: the partial gradient one call of one rank rounds to bf16
        p_in = {k: t[k].clone().requires_grad_() for k in ("query", "key", "query_rope", "key_rope")}
        p_in["value"] = t["key"].clone().requires_grad_()  # apart: d_key and d_value are rounded apart, then added
        p_out = cann_attn.sparse_attention(p_in["query"], p_in["key"], p_in["value"], t["sparse_indices"], scale,
                                           query_rope=p_in["query_rope"], key_rope=p_in["key_rope"], **sfa_kw)
        shape = [1] * d_out.dim()
        shape[seq] = -1
        p_out.backward(d_out * mask.view(shape).to(d_out.dtype))
        d_key, d_value = p_in["key"].grad.double(), p_in["value"].grad.double()
        partial_abs["key"] = partial_abs["key"] + d_key.abs() + d_value.abs() + (d_key + d_value).abs()
        partial_abs["key_rope"] = partial_abs["key_rope"] + p_in["key_rope"].grad.double().abs()
    for k in golden_in:
        if k in GATHERED:
            check(assert_partial_sums_close, cp_in[k].grad.cpu(), part(golden_in[k].grad).cpu(),
                  part(naive_in[k].grad).cpu(), part(partial_abs[k]).cpu(), name=f"sparse_attention d_{k}")
            continue
        check(assert_close_to_oracle, cp_in[k].grad.cpu(), part(golden_in[k].grad).cpu(),
                               naive=part(naive_in[k].grad).cpu(), name=f"sparse_attention d_{k}")

    # indexer_kl_loss with the main attention's statistics (sharded on S1 like the queries).
    stats = cann_attn.sparse_flash_attention(t["query"], t["key"], t["key"], t["sparse_indices"], scale,
                                             query_rope=t["query_rope"], key_rope=t["key_rope"], **sfa_kw)
    if case["block"] != 1 or mode != 3:
        return  # the KL loss takes token indices (block size 1) and sparse_mode 3 only
    for reduction in ("sum", "mean"):
        kl_in = {k: t[k].clone().requires_grad_() for k in ("query_index", "key_index", "weights")}
        kl_kw = dict(query_rope=t["query_rope"], key_rope=t["key_rope"], sparse_mode=mode, **layout, **q_len,
                     **({} if not tnd else {"actual_seq_lengths_key": lengths["kv"]}))
        single_loss = cann_attn.indexer_kl_loss(t["query"], t["key"], kl_in["query_index"], kl_in["key_index"],
                                                kl_in["weights"], t["sparse_indices"], stats.softmax_max,
                                                stats.softmax_sum, scale, reduction=reduction, **kl_kw)
        single_loss.backward()
        g_in = {k: t[k].double().requires_grad_() for k in kl_in}
        oracle = dsa_oracle.indexer_kl_loss_oracle(t["query"], t["key"], g_in["query_index"], g_in["key_index"],
                                                   g_in["weights"], t["sparse_indices"], stats.softmax_max,
                                                   stats.softmax_sum, scale, **kl_kw)
        (oracle.loss / (max(1, oracle.tokens_with_keys) if reduction == "mean" else 1)).backward()
        c_in = {k: part(t[k]).requires_grad_() for k in kl_in}
        loss = cp.indexer_kl_loss(part(t["query"]), part(t["key"]), c_in["query_index"], c_in["key_index"],
                                  c_in["weights"], part(t["sparse_indices"]), part(stats.softmax_max, stat_seq),
                                  part(stats.softmax_sum, stat_seq), scale, query_rope=part(t["query_rope"]),
                                  key_rope=part(t["key_rope"]), reduction=reduction, load_balance=lb,
                                  timeout=COLLECTIVE_SECONDS,
                                  **{k: v for k, v in kl_kw.items() if k not in ("query_rope", "key_rope")})
        loss.backward()
        check(torch.testing.assert_close, loss.detach().cpu(), single_loss.detach(), rtol=1e-5, atol=1e-6,
              msg=lambda m, r=reduction: f"indexer_kl_loss {r}: {m}")
        divisor = max(1, oracle.tokens_with_keys) if reduction == "mean" else 1
        key_index_abs = 0.0
        for mask in masks:  # a chunk's rows alone: the others' indices all -1 (they then add nothing)
            shape = [1] * t["sparse_indices"].dim()
            shape[seq] = -1
            only = torch.where(mask.view(shape), t["sparse_indices"], -1)
            k_index = t["key_index"].clone().requires_grad_()
            cann_attn.indexer_kl_loss(t["query"], t["key"], t["query_index"], k_index, t["weights"], only,
                                      stats.softmax_max, stats.softmax_sum, scale, **kl_kw).backward()
            key_index_abs = key_index_abs + k_index.grad.double().abs() / divisor
        for k in kl_in:
            if k in GATHERED:
                check(assert_partial_sums_close, c_in[k].grad.cpu(), part(g_in[k].grad).cpu(),
                      part(kl_in[k].grad).cpu(), part(key_index_abs).cpu(),
                      name=f"indexer_kl_loss {reduction} d_{k}")
                continue
            check(assert_close_to_oracle, c_in[k].grad.cpu(), part(g_in[k].grad).cpu(), naive=part(kl_in[k].grad).cpu(),
                                   name=f"indexer_kl_loss {reduction} d_{k}")


# Tensors every rank all-gathers: their gradients are sums of one partial gradient per rank and chunk slot, each
# rounded to bf16 by the grad operator (SparseFlashAttentionGrad / SparseLightningIndexerGradKLLoss return the
# input dtype), where the single-process operator rounds its fp32 sum once.
GATHERED = ("key", "key_rope", "key_index")


def assert_partial_sums_close(actual, golden, naive, partial_abs, name: str) -> None:
    """Each rounding to bf16 adds at most half an ulp (2^-8 relative) of the rounded value: the bound is the
    single-process operator's own error, plus 2^-8 of the magnitudes of every rounded partial (`partial_abs`, from
    the single-process operator restricted to each chunk's rows: for the latent, d_key, d_value and their sum, each
    rounded by the grad operator or autograd) and of the result (its final rounding). A wrong gradient (a missing,
    doubled or misplaced partial) is off by a whole partial, far outside it."""
    a, g, n = (t.detach().double() for t in (actual, golden, naive))
    bound = (n - g).abs() + 2.0**-8 * (partial_abs.double() + g.abs()) + 1e-6
    excess = (a - g).abs() - bound
    if bool((excess > 0).any()):
        worst = int(excess.argmax())
        raise AssertionError(f"{name}: |actual - golden| exceeds the partial-sum bound at {worst}: actual "
                             f"{float(a.reshape(-1)[worst])}, golden {float(g.reshape(-1)[worst])}, naive "
                             f"{float(n.reshape(-1)[worst])}, bound {float(bound.reshape(-1)[worst])}")


def _chunk_masks(case: dict, world: int, lengths: dict, total: int) -> list[torch.Tensor]:
    """For each chunk id, the rows (sequence axis of the whole tensor) of that chunk of every sequence."""
    chunks = 2 * world if case["load_balance"] == "head_tail" else world
    docs = [total] if not lengths else [e - b for b, e in zip([0, *lengths["q"][:-1]], lengths["q"], strict=True)]
    masks = []
    for c in range(chunks):
        mask, start = torch.zeros(total, dtype=torch.bool), 0
        for n in docs:
            size = n // chunks
            mask[start + c * size : start + (c + 1) * size] = True
            start += n
        masks.append(mask)
    return masks


def _assert_equal(actual, expected, name):
    assert torch.equal(actual, expected), f"{name}: {actual.tolist()} != {expected.tolist()}"


CASE_RUNNERS["dsa"] = run_dsa_case


# ==================================================================================================== failures
def run_failures(rank: int, world: int, device, timeout: float) -> dict:
    """Each scenario on its own process group (a timed-out gloo group stays broken). Returns, per scenario, what
    this rank raised: (exception type, message, seconds from its call to the raise)."""
    import torch.distributed as dist

    import cann_attn.distributed.ring as ring_module

    groups = {name: dist.new_group(list(range(world))) for name in ("peer_raises", "peer_absent")}
    case = fa_case("failure", world, mode=2)
    q, k, v, dy, kwargs, *_ = _fa_inputs(case)
    q_l, k_l, v_l, dy_l = (cp.shard(x, 1) for x in (q, k, v, dy))
    outcome = {}

    def attempt(name, fn):
        start = time.monotonic()
        try:
            fn()
            outcome[name] = (None, "", time.monotonic() - start)
        except Exception as exc:
            outcome[name] = (type(exc).__name__, str(exc), time.monotonic() - start)

    def call(query, heads=case["heads"], group=None, key=k_l, value=v_l, d_out=dy_l):
        out = cp.flash_attention(query.requires_grad_(), key.clone().requires_grad_(), value.clone().requires_grad_(),
                                 heads, "BSND", group=group, timeout=timeout, **kwargs)
        out.backward(d_out)

    # Up front: another rank's shapes, head count or own validation error.
    attempt("shape", lambda: call(q_l[:, : q_l.shape[1] // 2].clone() if rank == 1 else q_l.clone()))
    half = case["heads"] // 2  # rank 1: a consistent call of its own with half the heads
    attempt("heads", lambda: call(q_l[:, :, :half].clone(), heads=half, key=k_l[:, :, :half],
                                  value=v_l[:, :, :half], d_out=dy_l[:, :, :half]) if rank == 1 else call(q_l.clone()))
    attempt("own_error", lambda: call(q_l.clone().to(torch.float16) if rank == 1 else q_l.clone()))

    # Rank 1 raises inside the ring (after its first hop is posted) and stays alive, as a rank busy with its
    # exception would: the other ranks must raise within `timeout`.
    def peer_raises():
        if rank == 1:
            def broken(*args, **kw):
                raise RuntimeError("injected failure")
            ring_module.block_forward = broken
        call(q_l.clone(), group=groups["peer_raises"])

    attempt("peer_raises", peer_raises)
    if rank == 1:
        time.sleep(timeout + 0.5)

    # Rank 1 never calls (it raised before, in user code) and stays alive.
    def peer_absent():
        if rank == 1:
            raise RuntimeError("user code failed before the call")
        call(q_l.clone(), group=groups["peer_absent"])

    attempt("peer_absent", peer_absent)
    if rank == 1:
        time.sleep(timeout + 0.5)
    return outcome
