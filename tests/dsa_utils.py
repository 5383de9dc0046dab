"""Helpers of the DSA tests (SparseFlashAttention(Grad), LightningIndexer, SparseLightningIndexerGradKLLoss):
random cases, sparse index patterns, and goldens through the float64 oracle of ``cann_attn.testing.dsa_oracle``
(docs/operators/sparse_flash_attention.md, docs/operators/lightning_indexer.md, docs/semantics/precision.md)."""

from __future__ import annotations

import math
import os

import torch

import cann_attn
from cann_attn.testing import dsa_oracle
from cann_attn.testing.precision import assert_close_to_oracle

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DT_IDS = {F16: "fp16", BF16: "bf16", F32: "fp32", F64: "fp64"}
GRAD_NAMES = ("d_query", "d_key", "d_value", "d_query_rope", "d_key_rope")
INPUT_OF_GRAD = dict(zip(GRAD_NAMES, ("query", "key", "value", "query_rope", "key_rope"), strict=True))
INDEX_STYLES = ("topk", "blocks", "random", "dup", "middle")
# The Triton matrix run of `make test` (CANN_ATTN_BACKEND=triton) interprets the kernels on the CPU, ~100x slower
# than the reference: property tests whose layouts run the same kernel code keep one layout (and their smaller
# sizes) there, to hold the suite's time budget.
TRITON_MATRIX = os.environ.get("CANN_ATTN_BACKEND") == "triton"
PROPERTY_LAYOUTS = ["BSND"] if TRITON_MATRIX else ["BSND", "TND"]


def tnd_cum(lengths) -> list[int]:
    """Per-sequence lengths -> cumulative ends without a leading 0."""
    out, total = [], 0
    for n in lengths:
        total += int(n)
        out.append(total)
    return out


def thr_of(mode: int, sq: int, skv: int, t: int) -> int:
    return skv - sq + t + 1 if mode == 3 else skv


def row_indices(style: str, thr: int, k: int, bs: int, gen: torch.Generator, skv: int) -> list[int]:
    """K sparse_indices entries for one row whose keys [0, thr) are visible (block size bs).

    topk:   distinct random allowed blocks, then -1 (what lightning_indexer produces);
    blocks: the allowed blocks in order, then -1 (block-causal patterns shared by neighbouring rows);
    random: uniform in [-1, ceil(Skv/bs) + 1]: -1 anywhere, duplicates, entries beyond thr, straddling blocks;
    dup:    allowed blocks with repeats, then -1;
    middle: allowed blocks with a -1 in the middle followed by more allowed blocks (those must be ignored)."""
    n_allowed = max(0, math.ceil(thr / bs)) if thr > 0 else 0
    if style == "random":
        hi = math.ceil(max(skv, 1) / bs) + 2
        return torch.randint(-1, hi, (k,), generator=gen).tolist()
    if style == "blocks":
        blocks = list(range(min(k, n_allowed)))
    else:
        blocks = torch.randperm(n_allowed, generator=gen)[:k].tolist() if n_allowed else []
    if style == "dup" and blocks:
        blocks = [blocks[int(torch.randint(0, len(blocks), (1,), generator=gen))] for _ in range(k)]
    if style == "middle" and n_allowed:
        cut = int(torch.randint(0, k, (1,), generator=gen))
        tail = torch.randint(0, n_allowed, (k,), generator=gen).tolist()
        blocks = ([*blocks[:cut], -1, *tail])[:k]
    return (blocks + [-1] * k)[:k]


def make_indices(lead: tuple[int, ...], spans, k: int, bs: int, mode: int, style: str, gen: torch.Generator,
                 dtype=torch.int32) -> torch.Tensor:
    """sparse_indices [*lead, 1, K] for every row of every sequence (rows beyond the actual length get random
    entries: they must be ignored)."""
    idx = torch.full((*lead, 1, k), -1, dtype=torch.int64)
    for span in spans:
        rows = lead[1] if span.batch is not None else span.q_len
        for t in range(rows):
            if t < span.q_len:
                entries = row_indices(style, thr_of(mode, span.q_len, span.kv_len, t), k, bs, gen, span.kv_len)
            else:
                entries = torch.randint(-1, 4, (k,), generator=gen).tolist()
            idx[(*span.q_token(t), 0)] = torch.tensor(entries)
    return idx.to(dtype)


class SFACase:
    """Random inputs of one SparseFlashAttention configuration (tensors in `inputs`, options in `kw`)."""

    def __init__(self, layout: str = "BSND", *, gen: torch.Generator, b: int = 2, s1: int = 8, s2: int = 12,
                 q_lens=None, kv_lens=None, n1: int = 4, d: int = 16, d_rope: int | None = 8, d_v: int | None = None,
                 value_is_key: bool = False, k: int = 4, block_size: int = 1, mode: int = 3, dtype=F32,
                 index_dtype=torch.int32, style: str = "topk", nan_beyond_kv: bool = False, indices=None,
                 sinks: torch.Tensor | None = None):
        self.layout, self.dtype, self.gen = layout, dtype, gen
        # One softmax logit per query head (docs/semantics/sinks.md); None: no sinks.
        self.sinks = sinks
        d_v = d if value_is_key or d_v is None else d_v
        if layout == "TND":
            q_lens = [s1, max(1, s1 // 2)] if q_lens is None else list(q_lens)
            kv_lens = [s2, max(1, s2 // 2 + 1)] if kv_lens is None else list(kv_lens)
            q_lead, kv_lead = (sum(q_lens),), (sum(kv_lens),)
        else:
            q_lead, kv_lead = (b, s1), (b, s2)

        def rnd(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        query, key = rnd(*q_lead, n1, d), rnd(*kv_lead, 1, d)
        value = key if value_is_key else rnd(*kv_lead, 1, d_v)
        self.inputs = {"query": query, "key": key, "value": value, "query_rope": None, "key_rope": None}
        if d_rope:
            self.inputs["query_rope"] = rnd(*q_lead, n1, d_rope)
            self.inputs["key_rope"] = rnd(*kv_lead, 1, d_rope)
        self.kw: dict = {"scale_value": (d + (d_rope or 0)) ** -0.5, "sparse_block_size": block_size,
                         "layout": layout, "sparse_mode": mode}
        if layout == "TND":
            self.kw.update(actual_seq_lengths_query=tnd_cum(q_lens), actual_seq_lengths_kv=tnd_cum(kv_lens))
        else:
            if q_lens is not None:
                self.kw["actual_seq_lengths_query"] = list(q_lens)
            if kv_lens is not None:
                self.kw["actual_seq_lengths_kv"] = list(kv_lens)
        self.spans = dsa_oracle.sequence_spans(layout, query.shape, key.shape, self.kw.get("actual_seq_lengths_query"),
                                               self.kw.get("actual_seq_lengths_kv"))
        if nan_beyond_kv:
            self._poison_keys()
        if indices is None:
            indices = make_indices(q_lead, self.spans, k, block_size, mode, style, gen, index_dtype)
        self.inputs["sparse_indices"] = indices.to(index_dtype)
        self.d_out = rnd(*q_lead, n1, d_v)

    def _poison_keys(self) -> None:
        """NaN in every key-side row beyond the actual key length (BSND): those rows must never be read."""
        done = set()
        for name in ("key", "value", "key_rope"):
            t = self.inputs[name]
            if t is None or id(t) in done:
                continue
            done.add(id(t))
            for span in self.spans:
                t[span.batch, span.kv_len :] = float("nan")

    @property
    def tensors(self) -> dict:
        return {k: v for k, v in self.inputs.items() if k != "sparse_indices"}

    # ------------------------------------------------------------------------------------------ calls
    def forward(self, **kw):
        i = self.inputs
        return cann_attn.sparse_flash_attention(i["query"], i["key"], i["value"], i["sparse_indices"],
                                                query_rope=i["query_rope"], key_rope=i["key_rope"],
                                                **self._sink_kw(), **{**self.kw, **kw})

    def _sink_kw(self) -> dict:
        return {} if self.sinks is None else {"sinks": self.sinks}

    def grad(self, fwd=None, **kw):
        fwd = self.forward() if fwd is None else fwd
        # what the grad's Dl = rowsum(dO * out) reads (docs/operators/sparse_flash_attention.md)
        self.given_out = fwd.attention_out
        i = self.inputs
        kw = {**self.kw, **kw}
        scale = kw.pop("scale_value")
        return cann_attn.sparse_flash_attention_grad(
            i["query"], i["key"], i["value"], i["sparse_indices"], self.d_out, fwd.attention_out, fwd.softmax_max,
            fwd.softmax_sum, scale, query_rope=i["query_rope"], key_rope=i["key_rope"], **self._sink_kw(), **kw)

    def oracle(self, compute_dtype=F64, requires_grad: bool = False, return_lse: bool = False):
        """(inputs used, (out, max, sum[, lse])): the oracle on leaf copies of the inputs (separate leaves for key
        and value even when they are one tensor, so that d_key and d_value are separate like the op's)."""
        leaves = {}
        tensors = {**self.tensors, **({} if self.sinks is None else {"sinks": self.sinks})}
        for name, t in tensors.items():
            leaves[name] = None if t is None else t.detach().to(compute_dtype).requires_grad_(requires_grad)
        res = dsa_oracle.sparse_attention_oracle(
            leaves["query"], leaves["key"], leaves["value"], self.inputs["sparse_indices"],
            query_rope=leaves["query_rope"], key_rope=leaves["key_rope"], compute_dtype=compute_dtype,
            return_lse=return_lse, sinks=leaves.get("sinks"), **self.kw)
        return leaves, res

    def oracle_grads(self, compute_dtype=F64, given_out: torch.Tensor | None = None) -> dict:
        """Gradients by autograd through the oracle. With `given_out` (the attention_out handed to the grad op), the
        golden of the grad as docs/operators/sparse_flash_attention.md defines it: Dl = rowsum(dO * given_out), not the
        exact forward's. A loss term c * lse with c = rowsum(dO * (O_exact - given_out)) (a constant) moves dS = P (dP -
        Dl) by exactly P * c, since d lse / dz = P."""
        leaves, (out, _, _, lse) = self.oracle(compute_dtype, requires_grad=True, return_lse=True)
        names = [n for n, t in leaves.items() if t is not None]
        if out.requires_grad:
            d_out = self.d_out.to(compute_dtype)
            loss = (out * d_out).sum()
            if given_out is not None and lse.requires_grad:
                c = (d_out * (out.detach() - given_out.to(compute_dtype))).sum(-1)
                loss = loss + (c * lse).sum()
            grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        else:  # nothing selected anywhere: the output is a constant 0
            grads = [None] * len(names)
        result = {g: None for g in GRAD_NAMES}
        for name, g in zip(names, grads, strict=True):
            result["d_" + name] = torch.zeros_like(leaves[name]) if g is None else g
        return result

    def naive_dtype(self):
        """Same-dtype reference for the flash-attn rule (fp16/bf16 only)."""
        return self.dtype if self.dtype in (F16, BF16) else None

    # ------------------------------------------------------------------------------------------ checks
    def check_forward(self, fwd=None):
        fwd = self.forward() if fwd is None else fwd
        _, (g_out, g_max, g_sum) = self.oracle()
        naive = None
        if self.naive_dtype() is not None:
            naive = self.oracle(self.naive_dtype())[1][0]
        out = fwd.attention_out
        assert out.dtype == self.dtype, f"attention_out dtype {out.dtype} != {self.dtype}"
        assert bool(torch.isfinite(out).all()), "attention_out has non-finite values"
        assert_close_to_oracle(out, g_out, naive, dtype=self.dtype, name="attention_out")
        for name, actual, golden in (("softmax_max", fwd.softmax_max, g_max), ("softmax_sum", fwd.softmax_sum, g_sum)):
            assert actual.dtype == (F64 if self.dtype == F64 else F32), f"{name} dtype {actual.dtype}"
            assert tuple(actual.shape) == tuple(golden.shape), f"{name} shape {tuple(actual.shape)}"
            assert_close_to_oracle(actual, golden, dtype=actual.dtype, name=name)
        invalid = g_sum == 0
        assert bool((fwd.softmax_max[invalid] == torch.tensor(dsa_oracle.INVALID_MAX, dtype=g_max.dtype)
                     .to(fwd.softmax_max.dtype)).all()), "softmax_max of rows with nothing selected must be -2e38"
        assert bool((fwd.softmax_sum[invalid] == 0).all()), "softmax_sum of rows with nothing selected must be 0"
        return fwd

    def check_grads(self, res=None):
        res = self.grad() if res is None else res
        golden = self.oracle_grads(given_out=getattr(self, "given_out", None))
        naive = self.oracle_grads(self.naive_dtype()) if self.naive_dtype() is not None else None
        for name in GRAD_NAMES:
            actual, g = getattr(res, name), golden[name]
            src = self.inputs[INPUT_OF_GRAD[name]]
            if src is None:
                assert actual is None, f"{name}: expected None without rope, got a tensor"
                continue
            assert actual is not None, f"{name}: got None"
            assert actual.dtype == src.dtype and tuple(actual.shape) == tuple(src.shape), (
                f"{name}: {actual.dtype} {tuple(actual.shape)} vs input {src.dtype} {tuple(src.shape)}")
            assert bool(torch.isfinite(actual).all()), f"{name}: non-finite values"
            assert_close_to_oracle(actual, g, None if naive is None else naive[name], dtype=actual.dtype, name=name)
        if self.sinks is None:
            assert res.d_sinks is None, "d_sinks: expected None without sinks"
            return res
        assert res.d_sinks is not None and res.d_sinks.dtype == torch.float32 and res.d_sinks.shape == self.sinks.shape
        assert bool(torch.isfinite(res.d_sinks).all()), "d_sinks: non-finite values"
        # The threshold of the inputs' dtype: d_sinks sums rowsum(dO * out) of the given (rounded) output.
        assert_close_to_oracle(res.d_sinks, golden["d_sinks"], None if naive is None else naive["d_sinks"].float(),
                               dtype=self.dtype, name="d_sinks")
        return res

    def check(self):
        fwd = self.check_forward()
        return fwd, self.check_grads(self.grad(fwd))


# ------------------------------------------------------------------------------------------------------
# Indexer cases
# ------------------------------------------------------------------------------------------------------
class IndexerCase:
    """Random inputs of LightningIndexer / SparseLightningIndexerGradKLLoss. `kl_inputs()` builds the main
    attention tensors and the SFA statistics (from the oracle forward over the same selection, so sum_j p_j = 1
    for rows whose -1 entries are trailing)."""

    def __init__(self, layout: str = "BSND", *, gen: torch.Generator, b: int = 2, s1: int = 8, s2: int = 12,
                 q_lens=None, kv_lens=None, n1: int = 8, n_idx: int = 4, d: int = 16, d_rope: int | None = 8,
                 d_idx: int = 16, dtype=F32, integer_valued: bool = False):
        self.layout, self.dtype, self.gen = layout, dtype, gen
        if layout == "TND":
            q_lens = [s1, max(1, s1 // 2)] if q_lens is None else list(q_lens)
            kv_lens = [s2, max(1, s2 // 2 + 1)] if kv_lens is None else list(kv_lens)
            self.q_lead, self.kv_lead = (sum(q_lens),), (sum(kv_lens),)
        else:
            self.q_lead, self.kv_lead = (b, s1), (b, s2)
        self.n1, self.d, self.d_rope = n1, d, d_rope
        if integer_valued:
            def rnd(*shape):
                return torch.randint(-2, 3, shape, generator=gen).to(dtype)
        else:
            def rnd(*shape):
                return torch.randn(*shape, generator=gen).to(dtype)
        self.rnd = rnd
        self.query_index = rnd(*self.q_lead, n_idx, d_idx)
        self.key_index = rnd(*self.kv_lead, 1, d_idx)
        self.weights = rnd(*self.q_lead, n_idx)
        self.kw: dict = {"layout": layout}
        if layout == "TND":
            self.kw.update(actual_seq_lengths_query=tnd_cum(q_lens), actual_seq_lengths_key=tnd_cum(kv_lens))
        else:
            if q_lens is not None:
                self.kw["actual_seq_lengths_query"] = list(q_lens)
            if kv_lens is not None:
                self.kw["actual_seq_lengths_key"] = list(kv_lens)
        self.spans = dsa_oracle.sequence_spans(layout, self.query_index.shape, self.key_index.shape,
                                               self.kw.get("actual_seq_lengths_query"),
                                               self.kw.get("actual_seq_lengths_key"))

    def indexer(self, **kw):
        return cann_attn.lightning_indexer(self.query_index, self.key_index, self.weights, **{**self.kw, **kw})

    def indexer_oracle(self, sparse_count: int, sparse_mode: int = 3):
        return dsa_oracle.lightning_indexer_oracle(self.query_index, self.key_index, self.weights,
                                                   sparse_count=sparse_count, sparse_mode=sparse_mode, **self.kw)

    def scores(self, sparse_mode: int = 3):
        return dsa_oracle.indexer_score_matrix(self.query_index, self.key_index, self.weights,
                                               sparse_mode=sparse_mode, **self.kw)

    # ------------------------------------------------------------------------------------------ KL loss
    def kl_inputs(self, k: int, *, style: str = "topk", indices=None, stats_from: str = "oracle"):
        """Main-attention query/key/rope, sparse_indices [*, 1, K] and SFA statistics of that selection."""
        rnd = self.rnd
        self.query = rnd(*self.q_lead, self.n1, self.d)
        self.key = rnd(*self.kv_lead, 1, self.d)
        self.query_rope = rnd(*self.q_lead, self.n1, self.d_rope) if self.d_rope else None
        self.key_rope = rnd(*self.kv_lead, 1, self.d_rope) if self.d_rope else None
        if indices is None:
            if style == "indexer":
                indices = self.indexer(sparse_count=k, sparse_mode=3).sparse_indices
            else:
                indices = make_indices(self.q_lead, self.spans, k, 1, 3, style, self.gen)
        self.sparse_indices = indices
        self.scale = (self.d + (self.d_rope or 0)) ** -0.5
        sfa_kw = {"layout": self.layout, "sparse_mode": 3, "sparse_block_size": 1,
                  "actual_seq_lengths_query": self.kw.get("actual_seq_lengths_query"),
                  "actual_seq_lengths_kv": self.kw.get("actual_seq_lengths_key")}
        stats_indices = self.kl_compacted(indices)
        if stats_from == "oracle":
            _, m, s = dsa_oracle.sparse_attention_oracle(self.query, self.key, self.key, stats_indices, self.scale,
                                                         query_rope=self.query_rope, key_rope=self.key_rope, **sfa_kw)
            self.softmax_max, self.softmax_sum = m.float(), s.float()
        else:
            fwd = cann_attn.sparse_flash_attention(self.query, self.key, self.key, stats_indices, self.scale,
                                                   query_rope=self.query_rope, key_rope=self.key_rope, **sfa_kw)
            self.softmax_max, self.softmax_sum = fwd.softmax_max, fwd.softmax_sum
        return self

    def kl_compacted(self, indices: torch.Tensor) -> torch.Tensor:
        """The entries the KL rule uses (docs/operators/lightning_indexer.md: -1 / out-of-range skipped, no early stop)
        moved to the front, then -1: the SFA forward over these gives statistics with sum_j p_j = 1 over the KL
        selection."""
        out = torch.full_like(indices, -1)
        for span in self.spans:
            for t in range(span.q_len):
                tok = span.q_token(t)
                entries = dsa_oracle.kl_selected_entries(indices[(*tok, 0)].tolist(), t, span.q_len, span.kv_len)
                if entries:
                    out[(*tok, 0)][: len(entries)] = torch.tensor(entries, dtype=indices.dtype)
        return out

    def kl_args(self):
        return (self.query, self.key, self.query_index, self.key_index, self.weights, self.sparse_indices,
                self.softmax_max, self.softmax_sum, self.scale)

    def kl_kwargs(self, **kw):
        return {"query_rope": self.query_rope, "key_rope": self.key_rope, "sparse_mode": 3, **self.kw, **kw}

    def kl(self, **kw):
        return cann_attn.sparse_lightning_indexer_grad_kl_loss(*self.kl_args(), **self.kl_kwargs(**kw))

    def kl_oracle(self):
        """(loss float64 scalar, {d_query_index, d_key_index, d_weights} float64, tokens_with_keys)."""
        leaves = [t.detach().double().requires_grad_() for t in (self.query_index, self.key_index, self.weights)]
        args = list(self.kl_args())
        args[2:5] = leaves
        res = dsa_oracle.indexer_kl_loss_oracle(*args, **self.kl_kwargs())
        grads = torch.autograd.grad(res.loss, leaves, allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves, strict=True)]
        return res.loss.detach(), dict(zip(("d_query_index", "d_key_index", "d_weights"), grads, strict=True)), \
            res.tokens_with_keys

    def check_kl(self, res=None):
        res = self.kl() if res is None else res
        loss, golden, _ = self.kl_oracle()
        assert res.loss.dtype == (F64 if self.dtype == F64 else F32), f"loss dtype {res.loss.dtype}"
        assert tuple(res.loss.shape) == (1,), f"loss shape {tuple(res.loss.shape)}"
        assert_close_to_oracle(res.loss, loss.reshape(1), dtype=res.loss.dtype, name="loss")
        for name, src in (("d_query_index", self.query_index), ("d_key_index", self.key_index),
                          ("d_weights", self.weights)):
            actual = getattr(res, name)
            assert actual.dtype == src.dtype and tuple(actual.shape) == tuple(src.shape), (
                f"{name}: {actual.dtype} {tuple(actual.shape)} vs {src.dtype} {tuple(src.shape)}")
            assert bool(torch.isfinite(actual).all()), f"{name}: non-finite values"
            assert_close_to_oracle(actual, golden[name], dtype=actual.dtype, name=name)
        return res
