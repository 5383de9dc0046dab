"""Helpers of the FlashAttentionScoreGradV2 tests: random cases, masks of every sparse mode, and the golden gradients
(torch.autograd through the float64 oracle; docs/semantics/dropout.md, docs/semantics/softmax-stats.md,
docs/semantics/precision.md)."""

from __future__ import annotations

import torch

import cann_attn
import oracle
from oracle import assert_close_to_oracle, fa_forward_oracle, full_mask, make_compressed_mask, tnd_cum

NON_TND = ("BSH", "SBH", "BSND", "BNSD")
LAYOUTS = (*NON_TND, "TND")
DT_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
# Keyword arguments of the op that the oracle does not take.
_OP_ONLY = ("padding_mask", "inner_precise", "backend")


def valid_grad_modes(layout: str) -> tuple[int, ...]:
    """GradV2 supports 0..8; 5 (prefix, full mask) not in TND, 7/8 only in TND (docs/semantics/masks.md)."""
    return (0, 1, 2, 3, 4, 6, 7, 8) if layout == "TND" else (0, 1, 2, 3, 4, 5, 6)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class GradCase:
    """Random q/k/v (and dy) of one configuration plus the keyword arguments every call shares."""

    def __init__(
        self,
        layout: str,
        gen: torch.Generator,
        *,
        b: int = 2,
        n1: int = 2,
        n2: int | None = None,
        sq: int = 12,
        skv: int | None = None,
        d: int = 16,
        dv: int | None = None,
        dtype: torch.dtype = torch.float32,
        q_lens=None,
        kv_lens=None,
    ):
        skv = sq if skv is None else skv
        self.layout, self.n1, self.dtype, self.gen = layout, n1, dtype, gen
        self.n2 = n1 if n2 is None else n2
        self.d, self.dv = d, d if dv is None else dv
        self.tnd = layout == "TND"
        if self.tnd:
            self.q_lens = [sq, max(1, sq // 2 - 1)] if q_lens is None else list(q_lens)
            self.kv_lens = [skv, max(1, skv // 2 + 3)] if kv_lens is None else list(kv_lens)
        else:
            self.q_lens, self.kv_lens = [sq] * b, [skv] * b
        self.b = len(self.q_lens)
        self.max_sq, self.max_skv = max(self.q_lens, default=0), max(self.kv_lens, default=0)
        self.q, self.k, self.v = oracle.make_qkv(
            layout,
            gen=gen,
            b=b,
            n1=n1,
            n2=self.n2,
            sq=sq,
            skv=skv,
            d=d,
            dv=self.dv,
            dtype=dtype,
            q_lens=self.q_lens,
            kv_lens=self.kv_lens,
        )
        self.kw: dict = {"scale_value": d**-0.5}
        if self.tnd:
            self.kw.update(actual_seq_qlen=tnd_cum(self.q_lens), actual_seq_kvlen=tnd_cum(self.kv_lens))

    # ---------------------------------------------------------------------------------------- inputs
    @property
    def drop_numel(self) -> int:
        return self.n1 * sum(a * c for a, c in zip(self.q_lens, self.kv_lens, strict=True))

    def randn(self, *shape, dtype=None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype if dtype is None else dtype)

    def pse_full(self, batch: int | None = None, rows: int | None = None) -> torch.Tensor:
        """Type 0/1 pse [B or 1, N1, Sq or 1, Skv] (TND: [B or 1, N1, maxSq, maxSkv])."""
        return self.randn(
            self.b if batch is None else batch, self.n1, self.max_sq if rows is None else rows, self.max_skv
        )

    def slopes(self, per_batch: bool = False) -> torch.Tensor:
        n = torch.arange(1, self.n1 + 1, dtype=torch.float32)
        s = 2.0 ** (-8.0 * n / self.n1)
        return (s.unsqueeze(0) * torch.linspace(0.5, 1.5, self.b).unsqueeze(1)) if per_batch else s

    def drop_mask(self, keep_prob: float = 0.8, ascend_padding: bool = False) -> torch.Tensor:
        return oracle.keep_drop_mask(self.drop_numel, gen=self.gen, keep_prob=keep_prob, ascend_padding=ascend_padding)[
            1
        ]

    def prefix(self, fractions=(0.3, 0.7, 0.5, 0.9)) -> list[int]:
        """A valid prefix per sequence: Sq > Skv -> [0, Skv], else [Skv - Sq, Skv]."""
        out = []
        for b, (sq, skv) in enumerate(zip(self.q_lens, self.kv_lens, strict=True)):
            lo = 0 if sq > skv else skv - sq
            out.append(lo + round((skv - lo) * fractions[b % len(fractions)]))
        return out

    def prefix_full_mask(self, prefix, heads: int = 1) -> torch.Tensor:
        """Mode 5's full mask [B, heads, Sq, Skv]: (j > i + delta) & (j >= prefix[b])."""
        sq, skv = self.max_sq, self.max_skv
        i = torch.arange(sq).unsqueeze(1)
        j = torch.arange(skv).unsqueeze(0)
        return torch.stack([((j > i + (skv - sq)) & (j >= p)).expand(heads, sq, skv) for p in prefix])

    def mode_kwargs(self, mode: int, p: float = 0.3) -> dict:
        """Mask / prefix / pre / next arguments that make ``mode`` meaningful for this case."""
        if mode in (0, 1):
            kw: dict = {"atten_mask": full_mask((self.max_sq, self.max_skv), gen=self.gen, p=p)}
            if mode == 0:
                kw.update(pre_tokens=6, next_tokens=3)
            return kw
        if mode == 5:
            prefix = self.prefix()
            return {"atten_mask": self.prefix_full_mask(prefix, heads=self.n1), "prefix": prefix}
        if mode == 6:
            return {"atten_mask": make_compressed_mask(6), "prefix": self.prefix()}
        kw = {"atten_mask": make_compressed_mask(mode)}
        if mode == 4:
            kw.update(pre_tokens=4, next_tokens=2)
        if mode in (7, 8):
            kw.update(next_tokens=2)
        return kw

    # ---------------------------------------------------------------------------------------- checks
    def forward(self, **kw):
        return cann_attn.flash_attention_score(self.q, self.k, self.v, self.n1, self.layout, **{**self.kw, **kw})

    def check(self, *, stats=(True, False), naive: bool | None = None, **kw):
        """Run forward, then the grad with the forward's statistics (True) and/or without them (False, the
        recomputation path); compare dq/dk/dv/dpse with autograd through the float64 oracle.

        Returns (list of grad results in the order of ``stats``, golden dict, dy)."""
        kw = {**self.kw, **kw}
        fwd = cann_attn.flash_attention_score(self.q, self.k, self.v, self.n1, self.layout, **kw)
        dy = self.randn(*fwd.attention_out.shape)
        golden = oracle_grads(self.q, self.k, self.v, dy, self.n1, self.layout, **kw)
        naive_grads = None
        if naive if naive is not None else self.dtype in (torch.float16, torch.bfloat16):
            naive_grads = oracle_grads(self.q, self.k, self.v, dy, self.n1, self.layout, same_dtype=True, **kw)
        results = []
        for with_stats in stats:
            extra = {}
            if with_stats:
                extra = {
                    "softmax_max": fwd.softmax_max,
                    "softmax_sum": fwd.softmax_sum,
                    "attention_in": fwd.attention_out,
                }
            res = cann_attn.flash_attention_score_grad(self.q, self.k, self.v, dy, self.n1, self.layout, **kw, **extra)
            for name, src in (("dq", self.q), ("dk", self.k), ("dv", self.v)):
                assert getattr(res, name).dtype == src.dtype, f"{name}: dtype {getattr(res, name).dtype}"
            compare_grads(
                res,
                golden,
                naive_grads,
                kw.get("pse"),
                kw.get("pse_type", 1),
                tag="with stats" if with_stats else "recomputed stats",
            )
            results.append(res)
        return results, golden, dy


def oracle_grads(query, key, value, dy, head_num, layout, *, same_dtype: bool = False, **kw) -> dict:
    """dq, dk, dv (and dpse for a type 0/1 pse tensor) by torch.autograd through the oracle.

    Float64 golden by default (on the given, possibly rounded, inputs); ``same_dtype=True`` runs the oracle's
    code in the input dtype: the "naive same-dtype" reference of the flash-attn rule."""
    kw = {k: v for k, v in kw.items() if k not in _OP_ONLY}
    to = (lambda t: t.detach().clone()) if same_dtype else (lambda t: t.detach().to(torch.float64))
    inputs = [to(t).requires_grad_() for t in (query, key, value)]
    pse = kw.get("pse")
    has_pse_grad = pse is not None and kw.get("pse_type", 1) in (0, 1)
    if has_pse_grad:
        kw["pse"] = to(pse).requires_grad_()
        inputs.append(kw["pse"])
    has_sink = kw.get("sink") is not None
    if has_sink:  # docs/semantics/sinks.md: the sink is one more differentiable input of the formula
        kw["sink"] = to(kw["sink"]).requires_grad_()
        inputs.append(kw["sink"])
    fn = oracle.naive_same_dtype_forward if same_dtype else fa_forward_oracle
    out = fn(*inputs[:3], head_num, layout, **kw)[0]
    grads = torch.autograd.grad(out, inputs, to(dy), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)]
    return {"dq": grads[0], "dk": grads[1], "dv": grads[2], "dpse": grads[3] if has_pse_grad else None,
            "dsink": grads[-1] if has_sink else None}


def compare_grads(res, golden: dict, naive: dict | None, pse, pse_type: int, tag: str = "") -> None:
    """docs/semantics/precision.md on each gradient; dtypes, shapes and finiteness checked first."""
    for name, inp_golden in (("dq", golden["dq"]), ("dk", golden["dk"]), ("dv", golden["dv"])):
        actual = getattr(res, name)
        assert tuple(actual.shape) == tuple(inp_golden.shape), f"{name} ({tag}): shape {tuple(actual.shape)}"
        assert bool(torch.isfinite(actual).all()), f"{name} ({tag}): non-finite values"
        assert_close_to_oracle(
            actual, inp_golden, None if naive is None else naive[name], dtype=actual.dtype, name=f"{name} ({tag})"
        )
    if pse is not None and pse_type in (0, 1):
        assert res.dpse is not None, f"dpse ({tag}): expected a gradient for a type {pse_type} pse, got None"
        assert tuple(res.dpse.shape) == tuple(pse.shape), f"dpse ({tag}): shape {tuple(res.dpse.shape)}"
        assert res.dpse.dtype == pse.dtype, f"dpse ({tag}): dtype {res.dpse.dtype} != pse dtype {pse.dtype}"
        assert bool(torch.isfinite(res.dpse).all()), f"dpse ({tag}): non-finite values"
        assert_close_to_oracle(
            res.dpse,
            golden["dpse"],
            None if naive is None else naive["dpse"],
            dtype=res.dpse.dtype,
            name=f"dpse ({tag})",
        )
    else:
        assert res.dpse is None, f"dpse ({tag}): expected None (pse_type {pse_type}, pse given: {pse is not None})"
    if golden.get("dsink") is None:
        assert res.dsink is None, f"dsink ({tag}): expected None without a sink"
        return
    assert res.dsink is not None and res.dsink.dtype == torch.float32 and res.dsink.shape == golden["dsink"].shape, (
        f"dsink ({tag}): expected float32 {tuple(golden['dsink'].shape)}, got {res.dsink}")
    assert bool(torch.isfinite(res.dsink).all()), f"dsink ({tag}): non-finite values"
    # Ascend threshold of the inputs' dtype: dsink sums rowsum(dY * O) of the rounded output.
    assert_close_to_oracle(res.dsink, golden["dsink"], None if naive is None else naive["dsink"].float(),
                           dtype=res.dq.dtype, name=f"dsink ({tag})")
