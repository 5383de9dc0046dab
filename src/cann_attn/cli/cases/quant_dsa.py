"""The dense indexer pair and the quantised DSA inference operators (DenseLightningIndexerSoftmaxLse,
DenseLightningIndexerGradKLLoss, QuantLightningIndexer, KvQuantSparseFlashAttention): goldens from the float64
oracles of ``cann_attn.testing.dsa_quant_oracle`` and verify cases (docs/operators/dense_lightning_indexer.md,
docs/operators/quant_dsa.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...testing.dsa_quant_oracle import (
    dense_kl_grad_oracle,
    dense_kl_loss_oracle,
    dense_softmax_lse_oracle,
    kv_quant_sparse_attention_oracle,
    quant_lightning_indexer_oracle,
)
from ...testing.paged_oracle import paginate, unpage_dsa
from ._common import (
    BF16,
    F16,
    OPERATORS,
    Call,
    Case,
    Operator,
    Outputs,
    bind,
    by_name,
    cumulative,
    outputs_of,
    randn,
    register,
    register_operator,
    same_dtype,
    without,
)
from .dsa import random_sparse_indices

_WINDOW = "must leave the causal band uncut (the operators refuse a sliding window); sparse_mode decides the mask"
_ONLY_MODE_3 = "3 is the only mode the dense operators accept"
_PAGES = "the pages are gathered into the contiguous keys they stand for (testing/paged_oracle.py)"
_HIFLOAT8 = "names hifloat8 only, which has no torch dtype (the operator refuses it)"
_DENSE_NO_EFFECT = {"sparse_mode": _ONLY_MODE_3, "pre_tokens": _WINDOW, "next_tokens": _WINDOW}
_QUANT_FIXED = "the only value the operator accepts (its page: 仅支持)"
_INDEX_STATS = ("softmax_max_index", "softmax_sum_index")
_HEAD_STATS = ("softmax_max", "softmax_sum")
_LEAVES = ("query_index", "key_index", "weights")


# ====================================================================== dense indexer pair
def _dense_lse_golden(call: Call) -> Outputs:
    named = by_name("dense_lightning_indexer_softmax_lse", call)
    kwargs = without(named, *_LEAVES, *_DENSE_NO_EFFECT)
    smax, ssum = dense_softmax_lse_oracle(named["query_index"], named["key_index"], named["weights"], **kwargs)
    return {"softmax_max_index": smax, "softmax_sum_index": ssum}


def dense_state(named: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The indexer statistics (float64 oracle, as fp32) of a dense KL call whose inputs lack them."""
    kwargs = without(named, *_LEAVES, *_DENSE_NO_EFFECT, "query", "key", "query_rope", "key_rope", "scale_value",
                     *_HEAD_STATS, *_INDEX_STATS)
    smax, ssum = dense_softmax_lse_oracle(named["query_index"], named["key_index"], named["weights"], **kwargs)
    return {"softmax_max_index": smax.float(), "softmax_sum_index": ssum.float()}


def _dense_kl_golden(call: Call) -> Outputs:
    named = by_name("dense_lightning_indexer_grad_kl_loss", call)
    positional = ("query", "key", *_LEAVES, *_HEAD_STATS, *_INDEX_STATS, "scale_value")
    kwargs = without(named, *positional, *_DENSE_NO_EFFECT)
    args = [named[n] for n in positional]
    d_qi, d_ki, d_w = dense_kl_grad_oracle(*args, **kwargs)
    loss = dense_kl_loss_oracle(*args, **kwargs)
    return {"d_query_index": d_qi, "d_key_index": d_ki, "d_weights": d_w, "loss": loss.detach().reshape(1)}


register_operator(Operator(
    "dense_lightning_indexer_softmax_lse", _INDEX_STATS, _dense_lse_golden,
    same_dtype(softmax_max_index="float32", softmax_sum_index="float32"),
    oracle=dense_softmax_lse_oracle, no_effect=_DENSE_NO_EFFECT,
))
register_operator(Operator(
    "dense_lightning_indexer_grad_kl_loss", ("d_query_index", "d_key_index", "d_weights", "loss"), _dense_kl_golden,
    same_dtype(d_query_index="query_index", d_key_index="key_index", d_weights="weights", loss="float32"),
    state=_INDEX_STATS, derive=dense_state, oracle=dense_kl_loss_oracle, no_effect=_DENSE_NO_EFFECT,
))


def _lengths(layout: str, q_lens, kv_lens) -> dict[str, list[int]]:
    if layout == "TND":
        return {"actual_seq_qlen": cumulative(q_lens), "actual_seq_klen": cumulative(kv_lens)}
    return {"actual_seq_qlen": list(q_lens), "actual_seq_klen": list(kv_lens)}


def _dense_named(gen: torch.Generator, layout: str, dtype: torch.dtype, q_lens, kv_lens, *, s1: int = 0,
                 s2: int = 0, heads: int = 4, heads_kv: int = 4, heads_index: int = 4, dim: int = 32,
                 rope: int = 16, dim_index: int = 32) -> dict[str, Any]:
    q_lead = (sum(q_lens),) if layout == "TND" else (len(q_lens), s1)
    kv_lead = (sum(kv_lens),) if layout == "TND" else (len(kv_lens), s2)
    group = heads // heads_kv
    stat_lead = (heads_kv, q_lead[0]) if layout == "TND" else (q_lead[0], heads_kv, q_lead[1])
    named: dict[str, Any] = {
        "query": randn(gen, (*q_lead, heads, dim), dtype), "key": randn(gen, (*kv_lead, heads_kv, dim), dtype),
        "query_index": randn(gen, (*q_lead, heads_index, dim_index), dtype),
        "key_index": randn(gen, (*kv_lead, 1, dim_index), dtype),
        "weights": randn(gen, (*q_lead, heads_index), dtype, std=(heads_index * dim_index) ** -0.5),
        "softmax_max": (torch.rand((*stat_lead, group), generator=gen) * 2 + 1).float(),
        "softmax_sum": (torch.rand((*stat_lead, group), generator=gen) * 8 + 2).float(),
        "scale_value": (dim + rope) ** -0.5, "layout": layout, **_lengths(layout, q_lens, kv_lens),
    }
    if rope:
        named["query_rope"] = randn(gen, (*q_lead, heads, rope), dtype)
        named["key_rope"] = randn(gen, (*kv_lead, heads_kv, rope), dtype)
    return named


def dense_lse_case(name: str, layout: str, dtype: torch.dtype, q_lens, kv_lens, **shape: Any) -> Case:
    op = "dense_lightning_indexer_softmax_lse"

    def build(gen: torch.Generator) -> Call:
        named = _dense_named(gen, layout, dtype, q_lens, kv_lens, **shape)
        return bind(op, {n: named[n] for n in (*_LEAVES, "layout", "actual_seq_qlen", "actual_seq_klen")})

    return Case(op=op, name=name, dtype=dtype, shape=f"{layout} q{list(q_lens)} kv{list(kv_lens)}", build=build,
                run=outputs_of(op, OPERATORS[op].outputs), oracle=OPERATORS[op].golden)


def dense_kl_case(name: str, layout: str, dtype: torch.dtype, q_lens, kv_lens, **shape: Any) -> Case:
    op = "dense_lightning_indexer_grad_kl_loss"

    def build(gen: torch.Generator) -> Call:
        named = _dense_named(gen, layout, dtype, q_lens, kv_lens, **shape)
        named.update(dense_state(named))
        return bind(op, named)

    return Case(op=op, name=name, dtype=dtype, shape=f"{layout} q{list(q_lens)} kv{list(kv_lens)}", build=build,
                run=outputs_of(op, OPERATORS[op].outputs), oracle=OPERATORS[op].golden)


# ====================================================================== QuantLightningIndexer
def _quant_li_golden(call: Call) -> Outputs:
    named = by_name("quant_lightning_indexer", call)
    if named.get("block_table") is not None:
        named = unpage_dsa(named, ("key", "key_dequant_scale"), "actual_seq_lengths_key", "layout_key")
    kwargs = without(named, "query", "key", "weights", "query_dequant_scale", "key_dequant_scale", "block_table",
                     "layout_key", "query_quant_mode", "key_quant_mode", "pre_tokens", "next_tokens")
    indices = quant_lightning_indexer_oracle(named["query"], named["key"], named["weights"],
                                             named["query_dequant_scale"], named["key_dequant_scale"], **kwargs)
    return {"sparse_indices": indices}


register_operator(Operator(
    "quant_lightning_indexer", ("sparse_indices",), _quant_li_golden, same_dtype(sparse_indices="int32"),
    oracle=quant_lightning_indexer_oracle,
    consumed={"block_table": _PAGES, "layout_key": 'the key layout; "PA_BSND": a paged cache (block_table)'},
    no_effect={"query_quant_mode": _QUANT_FIXED, "key_quant_mode": _QUANT_FIXED, "pre_tokens": _QUANT_FIXED,
               "next_tokens": _QUANT_FIXED},
    unsupported={"query_dtype": _HIFLOAT8, "key_dtype": _HIFLOAT8},
))


def _quant_li_named(gen: torch.Generator, layout: str, q_lens, kv_lens, *, s1: int = 0, s2: int = 0,
                    heads: int = 8, dim: int = 128, topk: int = 8, mode: int = 3) -> dict[str, Any]:
    q_lead = (sum(q_lens),) if layout == "TND" else (len(q_lens), s1)
    kv_lead = (sum(kv_lens),) if layout == "TND" else (len(kv_lens), s2)
    lens = ({"actual_seq_lengths_query": cumulative(q_lens), "actual_seq_lengths_key": cumulative(kv_lens)}
            if layout == "TND" else {"actual_seq_lengths_query": list(q_lens), "actual_seq_lengths_key": list(kv_lens)})
    return {
        "query": torch.randint(-127, 128, (*q_lead, heads, dim), generator=gen).to(torch.int8),
        "key": torch.randint(-127, 128, (*kv_lead, 1, dim), generator=gen).to(torch.int8),
        "weights": (torch.rand((*q_lead, heads), generator=gen) / heads).half(),
        "query_dequant_scale": (torch.rand((*q_lead, heads), generator=gen) / 64 + 1e-3).half(),
        "key_dequant_scale": (torch.rand((*kv_lead, 1), generator=gen) / 64 + 1e-3).half(),
        "layout": layout, "sparse_count": topk, "sparse_mode": mode, **lens,
    }


def _paged_keys(named: dict[str, Any], layout: str, kv_lens, caches: tuple[str, ...], lengths_name: str,
                layout_name: str, gen: torch.Generator, block_size: int) -> dict[str, Any]:
    starts = [0, *cumulative(kv_lens)]
    seqs = {n: ([named[n][s:s + k] for s, k in zip(starts, kv_lens, strict=False)] if layout == "TND"
                else [named[n][b, :k] for b, k in enumerate(kv_lens)]) for n in caches}
    paged, table = paginate(seqs, block_size, gen)
    return {**named, **paged, "block_table": table, layout_name: "PA_BSND", lengths_name: list(kv_lens)}


def quant_li_case(name: str, layout: str, q_lens, kv_lens, *, paged: bool = False, **shape: Any) -> Case:
    op = "quant_lightning_indexer"

    def build(gen: torch.Generator) -> Call:
        named = _quant_li_named(gen, layout, q_lens, kv_lens, **shape)
        if paged:
            named = _paged_keys(named, layout, kv_lens, ("key", "key_dequant_scale"), "actual_seq_lengths_key",
                                "layout_key", gen, 16)
        return bind(op, named)

    return Case(op=op, name=name, dtype=torch.int8, shape=f"{layout} q{list(q_lens)} kv{list(kv_lens)}"
                + (" paged" if paged else ""), build=build, run=outputs_of(op, OPERATORS[op].outputs),
                oracle=OPERATORS[op].golden)


# ====================================================================== KvQuantSparseFlashAttention
def _kv_quant_golden(call: Call) -> Outputs:
    named = by_name("kv_quant_sparse_flash_attention", call)
    if named.get("block_table") is not None:
        same = named["value"] is named["key"]
        named = unpage_dsa(named, ("key",) if same else ("key", "value"), "actual_seq_lengths_kv", "layout_kv")
        if same:
            named["value"] = named["key"]
    passed = ("actual_seq_lengths_query", "actual_seq_lengths_kv", "sparse_block_size", "layout", "sparse_mode",
              "sinks")
    out = kv_quant_sparse_attention_oracle(named["query"], named["key"], named["value"], named["sparse_indices"],
                                           named["scale_value"], **{n: named[n] for n in passed if n in named})
    return {"attention_out": out}


register_operator(Operator(
    "kv_quant_sparse_flash_attention", ("attention_out",), _kv_quant_golden, same_dtype(attention_out="query"),
    oracle=kv_quant_sparse_attention_oracle,
    consumed={"block_table": _PAGES, "layout_kv": 'the key layout; "PA_BSND": a paged cache (block_table)'},
    no_effect={n: _QUANT_FIXED for n in ("key_quant_mode", "value_quant_mode", "pre_tokens", "next_tokens",
                                         "attention_mode", "quant_scale_repo_mode", "tile_size", "rope_head_dim")},
    unsupported={"key_dequant_scale": "reserved (the scales live in the key / value rows; the operator refuses it)",
                 "value_dequant_scale": "reserved (the scales live in the key / value rows; the operator refuses "
                                        "it)", "key_dtype": _HIFLOAT8, "value_dtype": _HIFLOAT8},
))


def _combined_rows(gen: torch.Generator, lead: tuple[int, ...], qdtype: torch.dtype) -> torch.Tensor:
    """Combined cache rows [*lead, 1, 656]: int8 latent, rope in the query's dtype, four fp32 tile scales."""
    latent = torch.randint(-127, 128, (*lead, 1, 512), generator=gen).to(torch.int8)
    rope = randn(gen, (*lead, 1, 64), qdtype)
    scales = (torch.rand((*lead, 1, 4), generator=gen) / 64).float()
    parts = [latent.view(torch.uint8), rope.contiguous().view(torch.uint8), scales.view(torch.uint8)]
    return torch.cat(parts, -1).view(torch.int8)


def kv_quant_case(name: str, layout: str, qdtype: torch.dtype, q_lens, kv_lens, *, s1: int = 0, s2: int = 0,
                  heads: int = 4, topk: int = 8, mode: int = 3, sinks: bool = False, paged: bool = False) -> Case:
    op = "kv_quant_sparse_flash_attention"

    def build(gen: torch.Generator) -> Call:
        q_lead = (sum(q_lens),) if layout == "TND" else (len(q_lens), s1)
        kv_lead = (sum(kv_lens),) if layout == "TND" else (len(kv_lens), s2)
        lens = ({"actual_seq_lengths_query": cumulative(q_lens), "actual_seq_lengths_kv": cumulative(kv_lens)}
                if layout == "TND" else {"actual_seq_lengths_query": list(q_lens),
                                         "actual_seq_lengths_kv": list(kv_lens)})
        query = randn(gen, (*q_lead, heads, 576), qdtype)
        key = _combined_rows(gen, kv_lead, qdtype)
        indices = random_sparse_indices(gen, query.shape, (*kv_lead, 1, 576), topk, layout=layout, sparse_mode=mode,
                                        actual_seq_lengths_query=lens["actual_seq_lengths_query"],
                                        actual_seq_lengths_kv=lens["actual_seq_lengths_kv"])
        named = {"query": query, "key": key, "value": key, "sparse_indices": indices, "scale_value": 576 ** -0.5,
                 "layout": layout, "sparse_mode": mode, **lens}
        if sinks:
            named["sinks"] = randn(gen, (heads,), torch.float32, std=2.0)
        if paged:
            named = _paged_keys(named, layout, kv_lens, ("key",), "actual_seq_lengths_kv", "layout_kv", gen, 16)
            named["value"] = named["key"]
        return bind(op, named)

    return Case(op=op, name=name, dtype=qdtype, shape=f"{layout} q{list(q_lens)} kv{list(kv_lens)} N{heads} "
                f"K{topk}" + (" sinks" if sinks else "") + (" paged" if paged else ""), build=build,
                run=outputs_of(op, OPERATORS[op].outputs), oracle=OPERATORS[op].golden)


register(
    dense_lse_case("bsnd", "BSND", BF16, (12, 5), (20, 9), s1=12, s2=20),
    dense_lse_case("tnd", "TND", F16, (6, 0, 9), (10, 4, 9)),
    dense_kl_case("bsnd_rope_mha", "BSND", BF16, (10, 7), (16, 12), s1=10, s2=16),
    dense_kl_case("tnd_gqa", "TND", F16, (5, 8), (9, 8), heads=4, heads_kv=2, rope=0),
    quant_li_case("bsnd", "BSND", (6, 3), (24, 10), s1=6, s2=24),
    quant_li_case("tnd_mode0", "TND", (4, 0, 5), (20, 6, 11), mode=0),
    quant_li_case("paged_bsnd", "BSND", (6, 2), (40, 17), s1=6, s2=40, paged=True),
    kv_quant_case("bsnd", "BSND", BF16, (3, 2), (24, 10), s1=3, s2=24),
    kv_quant_case("tnd_sinks_mode0", "TND", F16, (2, 3), (12, 20), mode=0, sinks=True),
    kv_quant_case("paged_tnd", "TND", BF16, (2, 4), (30, 19), paged=True),
)
