"""DSA: SparseFlashAttention (+Grad), LightningIndexer, SparseLightningIndexerGradKLLoss: cases and goldens
(float64 oracles of ``cann_attn.testing.dsa_oracle``; the grads by torch.autograd through them)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...testing.dsa_oracle import indexer_kl_loss_oracle, lightning_indexer_oracle, sparse_attention_oracle
from ...testing.paged_oracle import paginate, unpage_dsa
from ._common import (
    BF16,
    F16,
    F32,
    FORWARD_STATE,
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

_DSA_NO_EFFECT_WHY = {
    "pre_tokens": "must be 2**31 - 1 or 2**63 - 1 (the operator refuses other values); sparse_mode decides the mask",
    "next_tokens": "must be 2**31 - 1 or 2**63 - 1 (the operator refuses other values); sparse_mode decides the mask",
    "deterministic": "a scheduling choice of the NPU kernel; the golden is one float64 computation",
}
_DSA_NO_EFFECT = tuple(_DSA_NO_EFFECT_WHY)
_PAGES = "the pages are gathered into the contiguous keys they stand for (testing/paged_oracle.py)"
_SFA_TENSORS = ("query", "key", "value", "query_rope", "key_rope")
_SFA_GRAD_STATE = ("out", "softmax_max", "softmax_sum")
_KL_STATE = ("softmax_max", "softmax_sum")
_KL_LEAVES = ("query_index", "key_index", "weights")


def _causal_allowed(sparse_mode: int, seq_q: int, seq_kv: int, t: int) -> int:
    """thr(t): row t of a sequence may use keys [0, thr) (mode 3: Skv - Sq + t + 1; mode 0: Skv)."""
    return seq_kv - seq_q + t + 1 if sparse_mode == 3 else seq_kv


def random_sparse_indices(
    gen: torch.Generator,
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    topk: int,
    *,
    layout: str = "BSND",
    sparse_block_size: int = 1,
    sparse_mode: int = 3,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """sparse_indices [B, S1, 1, K] / [T1, 1, K] as a top-k producer writes them: for each row, up to K distinct blocks
    it may see (docs/operators/sparse_flash_attention.md), in random order, then -1; rows beyond the actual query length
    all -1."""
    from ...testing.dsa_oracle import sequence_spans

    spans = sequence_spans(layout, query_shape, key_shape, actual_seq_lengths_query, actual_seq_lengths_kv)
    indices = torch.full((*tuple(query_shape)[:-2], 1, topk), -1, dtype=torch.int64)
    for span in spans:
        for t in range(span.q_len):
            thr = _causal_allowed(sparse_mode, span.q_len, span.kv_len, t)
            n_allowed = -(-thr // sparse_block_size) if thr > 0 else 0
            blocks = torch.randperm(n_allowed, generator=gen)[:topk]
            indices[(*span.q_token(t), 0)][: blocks.numel()] = blocks
    return indices.to(dtype)


def _sfa_oracle(named: Mapping[str, Any], compute_dtype: torch.dtype = torch.float64):
    """(out, softmax_max, softmax_sum) of the SFA oracle from SFA or SFA-grad arguments by name."""
    if named.get("block_table") is not None:  # docs/semantics/paged-kv.md: the contiguous keys of the pages
        named = unpage_dsa(named, ("key", "value", "key_rope"), "actual_seq_lengths_kv", "layout_kv")
    skip = (*_SFA_TENSORS, *_SFA_GRAD_STATE, *_DSA_NO_EFFECT, "sparse_indices", "scale_value", "d_out", "block_table",
            "layout_kv")
    kwargs = without(named, *skip)
    return sparse_attention_oracle(
        named["query"],
        named["key"],
        named["value"],
        named["sparse_indices"],
        named["scale_value"],
        query_rope=named.get("query_rope"),
        key_rope=named.get("key_rope"),
        compute_dtype=compute_dtype,
        **kwargs,
    )


def _naive_dtype(named: Mapping[str, Any], naive: bool) -> torch.dtype | None:
    """The compute dtype of the golden (float64) or of the naive reference (fp16/bf16 inputs only, else None)."""
    if not naive:
        return torch.float64
    dtype = named["query"].dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def _sfa_golden(call: Call, naive: bool = False) -> Outputs:
    named = by_name("sparse_flash_attention", call)
    compute = _naive_dtype(named, naive)
    if compute is None:
        return {}
    out, smax, ssum = _sfa_oracle(named, compute)
    return {"attention_out": out, "softmax_max": smax, "softmax_sum": ssum}


def sfa_grad_state(named: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """out (query dtype), softmax_max, softmax_sum (fp32) of the float64 SFA oracle."""
    out, smax, ssum = _sfa_oracle(named)
    return {"out": out.to(named["query"].dtype), "softmax_max": smax.float(), "softmax_sum": ssum.float()}


def _sfa_grad_golden(call: Call, naive: bool = False) -> Outputs:
    """d_query .. d_key_rope: autograd of (out * d_out).sum() through the oracle
    (docs/operators/sparse_flash_attention.md)."""
    named = by_name("sparse_flash_attention_grad", call)
    compute = _naive_dtype(named, naive)
    if compute is None:
        return {}
    leaves = {
        n: named[n].detach().to(compute).requires_grad_()
        for n in (*_SFA_TENSORS, "sinks") if named.get(n) is not None
    }
    out = _sfa_oracle({**named, **leaves}, compute)[0]
    if out.requires_grad:
        grads = torch.autograd.grad(out, list(leaves.values()), named["d_out"].to(compute), allow_unused=True)
    else:  # nothing selected anywhere: the output is a constant 0
        grads = (None,) * len(leaves)
    return {
        f"d_{n}": torch.zeros_like(leaf) if g is None else g for (n, leaf), g in zip(leaves.items(), grads, strict=True)
    }


def _li_golden(call: Call) -> Outputs:
    named = by_name("lightning_indexer", call)
    if named.get("block_table") is not None:  # docs/semantics/paged-kv.md: the contiguous keys of the pages
        named = unpage_dsa(named, ("key_index",), "actual_seq_lengths_key", "layout_key")
    kwargs = without(named, *_KL_LEAVES, "return_value", "block_table", "layout_key")
    indices, values = lightning_indexer_oracle(named["query_index"], named["key_index"], named["weights"], **kwargs)
    out = {"sparse_indices": indices}
    if named.get("return_value"):
        out["sparse_values"] = values
    return out


def kl_state(named: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """softmax_max / softmax_sum (fp32) of the main attention over the entries the KL loss uses (the SFA oracle
    with value = key over those entries moved to the front), so that the target p sums to 1 per row."""
    from ...testing.dsa_oracle import kl_selected_entries, sequence_spans

    layout, mode = named.get("layout", "BSND"), named.get("sparse_mode", 3)
    lengths_q, lengths_kv = named.get("actual_seq_lengths_query"), named.get("actual_seq_lengths_key")
    indices = named["sparse_indices"]
    compact = torch.full_like(indices, -1)
    for span in sequence_spans(layout, named["query"].shape, named["key"].shape, lengths_q, lengths_kv):
        for t in range(span.q_len):
            tok = span.q_token(t)
            entries = kl_selected_entries(indices[(*tok, 0)].tolist(), t, span.q_len, span.kv_len, mode)
            compact[(*tok, 0)][: len(entries)] = torch.tensor(entries, dtype=indices.dtype)
    sfa = {
        "query": named["query"],
        "key": named["key"],
        "value": named["key"],
        "query_rope": named.get("query_rope"),
        "key_rope": named.get("key_rope"),
        "sparse_indices": compact,
        "scale_value": named["scale_value"],
        "actual_seq_lengths_query": lengths_q,
        "actual_seq_lengths_kv": lengths_kv,
        "layout": layout,
        "sparse_mode": mode,
    }
    _, smax, ssum = _sfa_oracle(sfa)
    return {"softmax_max": smax.float(), "softmax_sum": ssum.float()}


def _kl_golden(call: Call) -> Outputs:
    """loss (the oracle's float64 sum, shape [1]) and its documented gradients (docs/operators/lightning_indexer.md)."""
    named = by_name("sparse_lightning_indexer_grad_kl_loss", call)
    leaves = {n: named[n].detach().double().requires_grad_() for n in _KL_LEAVES}
    positional = ("query", "key", *_KL_LEAVES, "sparse_indices", *_KL_STATE, "scale_value")
    kwargs = without(named, *positional, *_DSA_NO_EFFECT)
    res = indexer_kl_loss_oracle(*({**named, **leaves}[n] for n in positional), **kwargs)
    grads = torch.autograd.grad(res.loss, list(leaves.values()), allow_unused=True)
    out = {
        f"d_{n}": torch.zeros_like(leaf) if g is None else g for (n, leaf), g in zip(leaves.items(), grads, strict=True)
    }
    out["loss"] = res.loss.detach().reshape(1)
    return out


register_operator(
    Operator(
        "sparse_flash_attention",
        ("attention_out", "softmax_max", "softmax_sum"),
        _sfa_golden,
        same_dtype(attention_out="query", softmax_max="float32", softmax_sum="float32"),
        oracle=sparse_attention_oracle,
        consumed={"block_table": _PAGES, "layout_kv": 'the key layout; "PA_BSND": a paged cache (block_table)'},
        no_effect=_DSA_NO_EFFECT_WHY,
        naive=functools.partial(_sfa_golden, naive=True),
    )
)
register_operator(
    Operator(
        "sparse_flash_attention_grad",
        (*(f"d_{n}" for n in _SFA_TENSORS), "d_sinks"),
        _sfa_grad_golden,
        same_dtype(**{f"d_{n}": n for n in (*_SFA_TENSORS, "sinks")}),
        state=_SFA_GRAD_STATE,
        derive=sfa_grad_state,
        oracle=sparse_attention_oracle,
        consumed={"d_out": "the gradient of out that autograd through the oracle takes",
                  **dict.fromkeys(_SFA_GRAD_STATE, FORWARD_STATE)},
        no_effect=_DSA_NO_EFFECT_WHY,
        naive=functools.partial(_sfa_grad_golden, naive=True),
    )
)
register_operator(
    Operator(
        "lightning_indexer",
        ("sparse_indices", "sparse_values"),
        _li_golden,
        same_dtype(sparse_indices="int32", sparse_values="query_index"),
        oracle=lightning_indexer_oracle,
        consumed={"return_value": "selects the sparse_values output", "block_table": _PAGES,
                  "layout_key": 'the key layout; "PA_BSND": a paged cache (block_table)'},
    )
)
register_operator(
    Operator(
        "sparse_lightning_indexer_grad_kl_loss",
        ("d_query_index", "d_key_index", "d_weights", "loss"),
        _kl_golden,
        same_dtype(d_query_index="query_index", d_key_index="key_index", d_weights="weights", loss="float32"),
        state=_KL_STATE,
        derive=kl_state,
        oracle=indexer_kl_loss_oracle,
        no_effect=_DSA_NO_EFFECT_WHY,
    )
)


@dataclass(frozen=True)
class DSAConfig:
    """Shapes of one DSA case (N2 = 1). BSND: `q_lens` / `kv_lens` are optional actual lengths; TND: the
    per-sequence lengths (required)."""

    layout: str
    dtype: torch.dtype
    batch: int = 1
    seq_q: int = 32
    seq_kv: int = 64
    heads: int = 4
    dim: int = 64
    rope: int = 16  # 0: no query_rope / key_rope
    topk: int = 16
    block_size: int = 1
    sparse_mode: int = 3
    index_dtype: torch.dtype = torch.int32
    heads_index: int = 4
    dim_index: int = 32
    q_lens: tuple[int, ...] | None = None
    kv_lens: tuple[int, ...] | None = None
    sinks: bool = False  # SFA: one softmax logit per query head (docs/semantics/sinks.md)

    def lead(self, kv: bool = False) -> tuple[int, ...]:
        if self.layout == "TND":
            return (sum(self.kv_lens if kv else self.q_lens),)
        return (self.batch, self.seq_kv if kv else self.seq_q)

    def lengths(self, kv_name: str) -> dict[str, list[int]]:
        """The actual-length arguments (TND: cumulative ends), the kv one named `kv_name`."""
        out = {}
        for name, lens in (("actual_seq_lengths_query", self.q_lens), (kv_name, self.kv_lens)):
            if lens is not None:
                out[name] = cumulative(lens) if self.layout == "TND" else list(lens)
        return out

    def summary(self, indexer: bool = False) -> str:
        if self.layout == "TND":
            lens = ",".join(f"{q}x{k}" for q, k in zip(self.q_lens, self.kv_lens, strict=True))
            seq = f"T{sum(self.q_lens)} [{lens}]"
        else:
            seq = f"B{self.batch} S{self.seq_q}x{self.seq_kv}"
        if indexer:
            return f"{self.layout} {seq} Nidx{self.heads_index} Didx{self.dim_index} K{self.topk}"
        rope = f"+{self.rope}" if self.rope else ""
        sinks = " sinks" if self.sinks else ""
        return f"{self.layout} {seq} N{self.heads} D{self.dim}{rope} K{self.topk} bs{self.block_size}{sinks}"


def _sfa_named(gen: torch.Generator, cfg: DSAConfig) -> dict[str, Any]:
    q_lead, kv_lead = cfg.lead(), cfg.lead(kv=True)
    named: dict[str, Any] = {
        "query": randn(gen, (*q_lead, cfg.heads, cfg.dim), cfg.dtype),
        "key": randn(gen, (*kv_lead, 1, cfg.dim), cfg.dtype),
        "value": randn(gen, (*kv_lead, 1, cfg.dim), cfg.dtype),
        "scale_value": (cfg.dim + cfg.rope) ** -0.5,
        "layout": cfg.layout,
        "sparse_mode": cfg.sparse_mode,
        "sparse_block_size": cfg.block_size,
        **cfg.lengths("actual_seq_lengths_kv"),
    }
    if cfg.rope:
        named["query_rope"] = randn(gen, (*q_lead, cfg.heads, cfg.rope), cfg.dtype)
        named["key_rope"] = randn(gen, (*kv_lead, 1, cfg.rope), cfg.dtype)
    named["sparse_indices"] = random_sparse_indices(
        gen,
        named["query"].shape,
        named["key"].shape,
        cfg.topk,
        layout=cfg.layout,
        sparse_block_size=cfg.block_size,
        sparse_mode=cfg.sparse_mode,
        actual_seq_lengths_query=named.get("actual_seq_lengths_query"),
        actual_seq_lengths_kv=named.get("actual_seq_lengths_kv"),
        dtype=cfg.index_dtype,
    )
    if cfg.sinks:
        named["sinks"] = randn(gen, (cfg.heads,), torch.float32, std=2.0)
    return named


def _indexer_named(gen: torch.Generator, cfg: DSAConfig, kv_name: str) -> dict[str, Any]:
    q_lead, kv_lead = cfg.lead(), cfg.lead(kv=True)
    return {
        "query_index": randn(gen, (*q_lead, cfg.heads_index, cfg.dim_index), cfg.dtype),
        "key_index": randn(gen, (*kv_lead, 1, cfg.dim_index), cfg.dtype),
        "weights": randn(gen, (*q_lead, cfg.heads_index), cfg.dtype, std=(cfg.heads_index * cfg.dim_index) ** -0.5),
        "layout": cfg.layout,
        "sparse_mode": cfg.sparse_mode,
        **cfg.lengths(kv_name),
    }


def _dsa_case(op: str, name: str, cfg: DSAConfig, build: Callable[[torch.Generator], Call], **kw: Any) -> Case:
    return Case(
        op=op,
        name=name,
        dtype=cfg.dtype,
        shape=cfg.summary(indexer=op == "lightning_indexer"),
        build=build,
        run=outputs_of(op, OPERATORS[op].outputs),
        oracle=OPERATORS[op].golden,
        **kw,
    )


def sfa_case(name: str, cfg: DSAConfig, quick: bool = True) -> Case:
    return _dsa_case(
        "sparse_flash_attention",
        name,
        cfg,
        lambda gen: bind("sparse_flash_attention", _sfa_named(gen, cfg)),
        quick=quick,
        naive=functools.partial(_sfa_golden, naive=True),
    )


def sfa_grad_case(name: str, cfg: DSAConfig, quick: bool = True) -> Case:
    def build(gen: torch.Generator) -> Call:
        named = _sfa_named(gen, cfg)
        named["d_out"] = randn(gen, named["query"].shape, cfg.dtype)
        named.update(sfa_grad_state(named))
        return bind("sparse_flash_attention_grad", named)

    return _dsa_case(
        "sparse_flash_attention_grad",
        name,
        cfg,
        build,
        quick=quick,
        naive=functools.partial(_sfa_grad_golden, naive=True),
    )


def li_case(name: str, cfg: DSAConfig, quick: bool = True) -> Case:
    def build(gen: torch.Generator) -> Call:
        named = _indexer_named(gen, cfg, "actual_seq_lengths_key")
        return bind("lightning_indexer", {**named, "sparse_count": cfg.topk, "return_value": True})

    return _dsa_case("lightning_indexer", name, cfg, build, quick=quick)


def kl_case(name: str, cfg: DSAConfig, indices_from_indexer: bool = False, quick: bool = True) -> Case:
    """A sparse_lightning_indexer_grad_kl_loss case: sparse_indices random (or the indexer oracle's top-k),
    statistics from the SFA oracle over the same selection."""
    op = "sparse_lightning_indexer_grad_kl_loss"

    def build(gen: torch.Generator) -> Call:
        sfa = _sfa_named(gen, cfg)
        named = {**_indexer_named(gen, cfg, "actual_seq_lengths_key"), "scale_value": sfa["scale_value"]}
        for n in ("query", "key", "query_rope", "key_rope", "sparse_indices"):
            if n in sfa:
                named[n] = sfa[n]
        if indices_from_indexer:
            kwargs = without(named, *_KL_LEAVES, "query", "key", "query_rope", "key_rope", "sparse_indices")
            kwargs.pop("scale_value")
            named["sparse_indices"] = lightning_indexer_oracle(
                named["query_index"], named["key_index"], named["weights"], sparse_count=cfg.topk, **kwargs
            )[0]
        named.update(kl_state(named))
        return bind(op, named)

    return _dsa_case(op, name, cfg, build, quick=quick)


register(
    sfa_case("bsnd_rope", DSAConfig("BSND", BF16, batch=2, seq_q=32, seq_kv=64, heads=8)),
    sfa_case("bsnd_sinks", DSAConfig("BSND", BF16, batch=2, seq_q=32, seq_kv=64, heads=8, sinks=True,
                                     q_lens=(32, 20))),
    sfa_case("tnd_sinks_block8", DSAConfig("TND", F16, heads=4, topk=4, block_size=8, q_lens=(16, 5),
                                           kv_lens=(40, 64), sinks=True)),
    sfa_case(
        "tnd_block16",
        DSAConfig("TND", F16, heads=4, topk=4, block_size=16, q_lens=(20, 40), kv_lens=(64, 96)),
    ),
    sfa_case(
        "bsnd_actual_len_mode0_int64",
        DSAConfig(
            "BSND",
            F32,
            batch=2,
            seq_q=16,
            seq_kv=48,
            rope=0,
            topk=4,
            block_size=8,
            sparse_mode=0,
            index_dtype=torch.int64,
            q_lens=(16, 9),
            kv_lens=(48, 30),
        ),
    ),
    sfa_case("large_bsnd_d512", DSAConfig("BSND", BF16, seq_q=256, seq_kv=1024, heads=16, dim=512, rope=64,
                                           topk=256), quick=False),
    sfa_grad_case("bsnd_rope", DSAConfig("BSND", BF16, batch=2, seq_q=24, seq_kv=48, heads=4)),
    sfa_grad_case("bsnd_sinks", DSAConfig("BSND", BF16, batch=2, seq_q=24, seq_kv=48, heads=4, sinks=True)),
    sfa_grad_case("tnd_sinks", DSAConfig("TND", F32, heads=4, topk=8, q_lens=(12, 0, 9), kv_lens=(30, 0, 20),
                                         sinks=True)),
    sfa_grad_case("tnd_block8", DSAConfig("TND", F32, heads=2, topk=4, block_size=8, q_lens=(16, 24),
                                          kv_lens=(40, 24))),
    li_case("bsnd_topk", DSAConfig("BSND", BF16, batch=2, seq_q=32, seq_kv=64, topk=16, heads_index=8)),
    li_case("tnd_actual_len", DSAConfig("TND", F16, topk=8, q_lens=(24, 40), kv_lens=(40, 64))),
    kl_case("bsnd_rope", DSAConfig("BSND", BF16, seq_q=32, seq_kv=48, heads=8, topk=16)),
    kl_case("tnd_indexer_topk", DSAConfig("TND", F32, heads=4, topk=8, q_lens=(16, 24), kv_lens=(24, 40)),
            indices_from_indexer=True),
)




def _paged(named: dict[str, Any], cfg: DSAConfig, caches: tuple[str, ...], lengths_name: str, layout_name: str,
           gen: torch.Generator, block_size: int) -> dict[str, Any]:
    """The same call over a "PA_BSND" cache (docs/semantics/paged-kv.md): each sequence's keys scattered over
    shuffled blocks (NaN in every slot nobody reads), plain key lengths, block_table and the key layout."""
    lengths = list(cfg.kv_lens) if cfg.kv_lens is not None else [cfg.seq_kv] * cfg.batch
    starts = [0, *cumulative(lengths)]
    seqs = {}
    for name in caches:
        if named.get(name) is None:
            continue
        t = named[name]
        seqs[name] = ([t[s:s + n] for s, n in zip(starts, lengths, strict=False)] if cfg.layout == "TND"
                      else [t[b, :n] for b, n in enumerate(lengths)])
    paged, table = paginate(seqs, block_size, gen)
    return {**named, **paged, "block_table": table, layout_name: "PA_BSND", lengths_name: lengths}


def sfa_paged_case(name: str, cfg: DSAConfig, block_size: int = 16) -> Case:
    def build(gen: torch.Generator) -> Call:
        named = _sfa_named(gen, cfg)
        named = _paged(named, cfg, ("key", "value", "key_rope"), "actual_seq_lengths_kv", "layout_kv", gen, block_size)
        return bind("sparse_flash_attention", named)

    return _dsa_case("sparse_flash_attention", f"{name}", cfg, build)


def li_paged_case(name: str, cfg: DSAConfig, block_size: int = 16) -> Case:
    def build(gen: torch.Generator) -> Call:
        named = _indexer_named(gen, cfg, "actual_seq_lengths_key")
        named = _paged(named, cfg, ("key_index",), "actual_seq_lengths_key", "layout_key", gen, block_size)
        return bind("lightning_indexer", {**named, "sparse_count": cfg.topk, "return_value": True})

    return _dsa_case("lightning_indexer", name, cfg, build)


register(
    sfa_paged_case("paged_bsnd_rope", DSAConfig("BSND", BF16, batch=2, seq_q=16, seq_kv=64, heads=8, topk=16,
                                                 q_lens=(16, 7), kv_lens=(64, 23))),
    sfa_paged_case("paged_tnd_block8_sinks", DSAConfig("TND", F16, heads=4, topk=4, block_size=8, q_lens=(6, 11),
                                                        kv_lens=(40, 70), sinks=True), block_size=32),
    li_paged_case("paged_bsnd", DSAConfig("BSND", BF16, batch=2, seq_q=16, seq_kv=64, topk=16, q_lens=(16, 9),
                                          kv_lens=(64, 30))),
    li_paged_case("paged_tnd", DSAConfig("TND", F16, topk=8, q_lens=(12, 20), kv_lens=(33, 48))),
)
