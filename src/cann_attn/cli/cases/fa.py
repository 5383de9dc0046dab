"""FlashAttentionScore / FlashAttentionVarLenScore forward: cases and golden (the float64 oracle of
``cann_attn.testing.oracle``), and the FA input builders (`FAConfig`, masks, pse, dropout, sinks) that the grad
cases of ``fa_grad.py`` reuse."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import cann_attn

from ...testing.oracle import fa_forward_oracle
from ._common import (
    BF16,
    COMMON_NO_EFFECT,
    F16,
    F32,
    PRECISION_MODE,
    Call,
    Case,
    Operator,
    Outputs,
    bind,
    by_name,
    cumulative,
    layout_shape,
    outputs_of,
    randn,
    register,
    register_operator,
    same_dtype,
    without,
)


@dataclass(frozen=True)
class FAConfig:
    """Shapes of one FA-family case. TND: `q_lens` / `kv_lens` are per-sequence lengths (not cumulative)."""

    layout: str
    dtype: torch.dtype
    batch: int = 1
    heads_q: int = 2
    heads_kv: int | None = None
    seq_q: int = 128
    seq_kv: int | None = None
    dim: int = 64
    dim_v: int | None = None
    q_lens: tuple[int, ...] | None = None
    kv_lens: tuple[int, ...] | None = None

    @property
    def n2(self) -> int:
        return self.heads_q if self.heads_kv is None else self.heads_kv

    @property
    def skv(self) -> int:
        return self.seq_q if self.seq_kv is None else self.seq_kv

    @property
    def dv(self) -> int:
        return self.dim if self.dim_v is None else self.dim_v

    @property
    def qlens(self) -> tuple[int, ...]:
        return self.q_lens if self.q_lens is not None else (self.seq_q,) * self.batch

    @property
    def kvlens(self) -> tuple[int, ...]:
        if self.kv_lens is not None:
            return self.kv_lens
        return self.q_lens if self.q_lens is not None else (self.skv,) * self.batch

    def summary(self) -> str:
        heads = f"N{self.heads_q}" if self.n2 == self.heads_q else f"N{self.heads_q}/{self.n2}"
        dims = f"D{self.dim}" if self.dv == self.dim else f"D{self.dim}/{self.dv}"
        if self.layout == "TND":
            lens = ",".join(
                f"{q}x{k}" if q != k else str(q) for q, k in zip(self.qlens, self.kvlens, strict=True)
            )
            return f"TND T{sum(self.qlens)} {heads} {dims} [{lens}]"
        seq = f"S{self.seq_q}" if self.skv == self.seq_q else f"S{self.seq_q}x{self.skv}"
        return f"{self.layout} B{self.batch} {heads} {seq} {dims}"






Extras = Callable[[torch.Generator, FAConfig], dict[str, Any]]


def fa_inputs(
    gen: torch.Generator, cfg: FAConfig, kwargs: Mapping[str, Any], extras: Extras | None = None
) -> Call:
    """query, key, value in `cfg.layout` (+ TND cumulative lengths, + tensors from `extras`) as a `Call`."""
    tq, tkv = sum(cfg.qlens), sum(cfg.kvlens)
    q = randn(gen, layout_shape(cfg.layout, cfg.batch, cfg.seq_q, cfg.heads_q, cfg.dim, tq), cfg.dtype)
    k = randn(gen, layout_shape(cfg.layout, cfg.batch, cfg.skv, cfg.n2, cfg.dim, tkv), cfg.dtype)
    v = randn(gen, layout_shape(cfg.layout, cfg.batch, cfg.skv, cfg.n2, cfg.dv, tkv), cfg.dtype)
    kw = dict(kwargs)
    if cfg.layout == "TND":
        kw["actual_seq_qlen"] = cumulative(cfg.qlens)
        kw["actual_seq_kvlen"] = cumulative(cfg.kvlens)
    if extras is not None:
        kw.update(extras(gen, cfg))
    return Call((q, k, v, cfg.heads_q, cfg.layout), kw)


# Parameters of the FA family that do not change the result (reserved, or precision modes we always honour).
FA_NO_EFFECT = {"padding_mask": "reserved by the docs; not read", "inner_precise": PRECISION_MODE,
                "softmax_in": "reserved by the docs; not read", **COMMON_NO_EFFECT}


def fa_oracle(call: Call, same_dtype: bool = False) -> Outputs:
    from ...testing.oracle import fa_forward_oracle, naive_same_dtype_forward

    fn = naive_same_dtype_forward if same_dtype else fa_forward_oracle
    kwargs = {name: value for name, value in call.kwargs.items() if name not in FA_NO_EFFECT}
    out, smax, ssum = fn(*call.args[:5], **kwargs)
    return {"attention_out": out, "softmax_max": smax, "softmax_sum": ssum}


def fa_case(
    name: str,
    cfg: FAConfig,
    *,
    op: str = "flash_attention_score",
    extras: Extras | None = None,
    quick: bool = True,
    **kwargs: Any,
) -> Case:
    """A forward case of `op` (flash_attention_score or flash_attention_var_len_score); `kwargs` are the op's
    scalar keyword arguments, `extras(gen, cfg)` adds tensor keyword arguments (masks, pse, drop_mask)."""
    kwargs.setdefault("scale_value", cfg.dim**-0.5)
    return Case(
        op=op,
        name=name,
        dtype=cfg.dtype,
        shape=cfg.summary(),
        build=functools.partial(fa_inputs, cfg=cfg, kwargs=kwargs, extras=extras),
        run=outputs_of(op, ("attention_out", "softmax_max", "softmax_sum")),
        oracle=fa_oracle,
        quick=quick,
        naive=functools.partial(fa_oracle, same_dtype=True),
    )


# Input builders for the tensor keyword arguments ------------------------------------------------------------
def compressed(mode: int) -> Extras:
    """atten_mask = the compressed mask of `mode` (2048x2048, or [3072, 2048] for mode 6)."""
    return lambda gen, cfg: {"atten_mask": cann_attn.compressed_mask(mode)}


def random_mask(
    shape: str = "B1SS", p: float = 0.2, dtype: torch.dtype = torch.bool, dead_rows: int = 0
) -> Extras:
    """A random full atten_mask (True = masked) of shape SS, 1SS, B1SS, 11SS or BNSS; the first `dead_rows`
    query rows are fully masked (invalid rows: output 0)."""

    def build(gen: torch.Generator, cfg: FAConfig) -> dict[str, Any]:
        sq, skv = max(cfg.qlens), max(cfg.kvlens)
        lead = {
            "SS": (),
            "1SS": (1,),
            "B1SS": (cfg.batch, 1),
            "11SS": (1, 1),
            "BNSS": (cfg.batch, cfg.heads_q),
        }
        m = torch.rand((*lead[shape], sq, skv), generator=gen) < p
        m[..., :dead_rows, :] = True
        return {"atten_mask": m.to(dtype)}

    return build


def prefix_mask(prefix: Sequence[int]) -> Extras:
    """Mode 5: the full [B, 1, Sq, Skv] mask Ascend expects, (j > i + delta) AND (j >= prefix[b])."""

    def build(gen: torch.Generator, cfg: FAConfig) -> dict[str, Any]:
        i = torch.arange(cfg.seq_q).view(-1, 1)
        j = torch.arange(cfg.skv).view(1, -1)
        delta = cfg.skv - cfg.seq_q
        masks = [(j > i + delta) & (j >= p) for p in prefix]
        return {"atten_mask": torch.stack(masks).unsqueeze(1), "prefix": list(prefix)}

    return build


def pse_tensor(rows: str = "S", batch_broadcast: bool = False) -> Extras:
    """pse of the query dtype: [B, N1, Sq, Skv] (rows "S"), [B, N1, 1, Skv] (rows "1") or the compressed
    [B, N1, 1024, Skv] (rows "1024"); leading 1 instead of B when `batch_broadcast`."""

    def build(gen: torch.Generator, cfg: FAConfig) -> dict[str, Any]:
        r = {"S": max(cfg.qlens), "1": 1, "1024": 1024}[rows]
        b = 1 if batch_broadcast else cfg.batch
        return {"pse": randn(gen, (b, cfg.heads_q, r, max(cfg.kvlens)), cfg.dtype)}

    return build


def alibi(per_batch: bool = False, q_start: int = 0, kv_start: int = 0) -> Extras:
    """ALiBi slopes (fp32, [N1] or [B, N1]) for pse_type 2/3, with q/kv start indices."""

    def build(gen: torch.Generator, cfg: FAConfig) -> dict[str, Any]:
        n = cfg.heads_q
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / n) for h in range(n)], dtype=torch.float32)
        if per_batch:
            slopes = slopes * (1.0 + torch.rand(cfg.batch, 1, generator=gen))
        return {"pse": slopes, "q_start_idx": [q_start], "kv_start_idx": [kv_start]}

    return build


def dropout(keep_prob: float) -> Extras:
    """drop_mask from gen_drop_mask (seeded) over the case's [B, N1, Sq, Skv] (TND: per-sequence blocks)."""

    def build(gen: torch.Generator, cfg: FAConfig) -> dict[str, Any]:
        if cfg.layout == "TND":
            numel = cann_attn.drop_mask_numel(
                cfg.heads_q, actual_seq_qlen=cumulative(cfg.qlens), actual_seq_kvlen=cumulative(cfg.kvlens)
            )
        else:
            numel = cann_attn.drop_mask_numel(cfg.heads_q, batch=cfg.batch, seq_q=cfg.seq_q, seq_kv=cfg.skv)
        drop_mask = cann_attn.gen_drop_mask(numel, keep_prob, generator=gen)
        return {"drop_mask": drop_mask, "keep_prob": keep_prob}

    return build


def sink(spread: float = 2.0) -> Extras:
    """sink: one float32 softmax logit per query head (docs/semantics/sinks.md), spread around 0."""
    return lambda gen, cfg: {"sink": randn(gen, (cfg.heads_q,), torch.float32, std=spread)}


def both(*builders: Extras) -> Extras:
    """Several extras builders, applied in order."""

    def build(gen: torch.Generator, cfg: FAConfig) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for b in builders:
            out.update(b(gen, cfg))
        return out

    return build


_DOC_EXAMPLE = FAConfig("TND", F16, heads_q=1, dim=128, q_lens=(256,), kv_lens=(256,))
_DOC_KW = {"scale_value": 0.088388, "pre_tokens": 65536, "next_tokens": 65536, "sparse_mode": 0}


def _doc_zero_mask(gen: torch.Generator, cfg: FAConfig) -> dict[str, Any]:
    return {"atten_mask": torch.zeros(256, 256, dtype=torch.uint8)}


register(
    # The documented aclnnFlashAttentionVarLenScore example (TND, T=256, N=1, D=128, fp16), random data.
    fa_case("doc_example", _DOC_EXAMPLE, **_DOC_KW),
    fa_case("doc_example", _DOC_EXAMPLE, op="flash_attention_var_len_score", **_DOC_KW),
    fa_case(
        "doc_example_zero_mask",
        _DOC_EXAMPLE,
        op="flash_attention_var_len_score",
        extras=_doc_zero_mask,
        **_DOC_KW,
    ),
    # Layouts, GQA / MQA, cross attention, Dv < Dqk.
    fa_case("bsh_gqa", FAConfig("BSH", F16, batch=2, heads_q=8, heads_kv=2, seq_q=128)),
    fa_case("sbh_gqa", FAConfig("SBH", BF16, batch=2, heads_q=4, heads_kv=2, seq_q=97)),
    fa_case("bsnd_gqa_cross", FAConfig("BSND", F32, batch=2, heads_q=6, heads_kv=3, seq_q=100, seq_kv=160)),
    fa_case("bnsd_mqa", FAConfig("BNSD", F16, heads_q=4, heads_kv=1, seq_q=200, dim=128)),
    fa_case("bnsd_dv_lt_dqk", FAConfig("BNSD", BF16, batch=2, heads_q=2, seq_q=96, dim=128, dim_v=64)),
    fa_case(
        "tnd_gqa_softmax_tnd",
        FAConfig("TND", F32, heads_q=4, heads_kv=2, q_lens=(33, 64, 7)),
        softmax_layout="TND",
    ),
    # Masks.
    fa_case(
        "mode0_mask_band",
        FAConfig("BSND", F32, batch=2, heads_q=2, seq_q=96, seq_kv=128),
        extras=random_mask("B1SS", p=0.1),
        pre_tokens=40,
        next_tokens=8,
    ),
    fa_case(
        "mode1_dead_rows",
        FAConfig("BSH", F16, heads_q=2, seq_q=64, seq_kv=80),
        extras=random_mask("SS", p=0.3, dtype=torch.uint8, dead_rows=3),
        sparse_mode=1,
    ),
    fa_case(
        "causal_mode2",
        FAConfig("BNSD", F16, batch=2, heads_q=4, heads_kv=2, seq_q=192, seq_kv=256),
        extras=compressed(2),
        sparse_mode=2,
    ),
    fa_case(
        "causal_mode3",
        FAConfig("BSND", BF16, batch=2, heads_q=4, heads_kv=2, seq_q=192, seq_kv=256),
        extras=compressed(3),
        sparse_mode=3,
    ),
    fa_case(
        "band_mode4",
        FAConfig("BSH", F16, heads_q=4, seq_q=256),
        extras=compressed(4),
        sparse_mode=4,
        pre_tokens=64,
        next_tokens=16,
    ),
    fa_case(
        "band_mode4_cross",
        FAConfig("BNSD", F32, heads_q=2, seq_q=100, seq_kv=180),
        extras=compressed(4),
        sparse_mode=4,
        pre_tokens=30,
        next_tokens=-5,
    ),
    # Attention sinks (gpt-oss: sliding window, GQA), fully masked rows with a sink, TND.
    fa_case(
        "sink_band_mode4_gqa",
        FAConfig("BSND", BF16, heads_q=8, heads_kv=2, seq_q=160),
        extras=both(compressed(4), sink()),
        sparse_mode=4,
        pre_tokens=48,
        next_tokens=0,
    ),
    fa_case(
        "sink_dead_rows",
        FAConfig("BNSD", F32, heads_q=2, seq_q=64, seq_kv=80),
        extras=both(random_mask("SS", p=0.3, dead_rows=3), sink()),
        sparse_mode=1,
    ),
    fa_case("sink_tnd_causal", FAConfig("TND", F16, heads_q=4, heads_kv=1, q_lens=(40, 9, 64)),
            extras=both(compressed(3), sink()), sparse_mode=3),
    fa_case(
        "prefix_mode5",
        FAConfig("BNSD", F16, batch=2, heads_q=2, seq_q=128),
        extras=prefix_mask((40, 100)),
        sparse_mode=5,
    ),
    fa_case(
        "prefix_mode6",
        FAConfig("BNSD", F16, batch=2, heads_q=2, seq_q=128),
        extras=both(compressed(6), lambda gen, cfg: {"prefix": [40, 100]}),
        sparse_mode=6,
    ),
    fa_case(
        "tnd_mode7_zero_len",
        FAConfig("TND", F16, heads_q=2, q_lens=(64, 0, 100, 30, 0), kv_lens=(80, 0, 100, 50, 0)),
        extras=compressed(7),
        sparse_mode=7,
        next_tokens=8,
    ),
    fa_case(
        "tnd_mode8_zero_len",
        FAConfig("TND", BF16, heads_q=2, heads_kv=1, q_lens=(0, 50, 70, 40), kv_lens=(0, 90, 70, 40)),
        extras=compressed(8),
        sparse_mode=8,
        next_tokens=4,
    ),
    fa_case(
        "tnd_mode7_zero_len",
        FAConfig("TND", F16, heads_q=2, q_lens=(64, 0, 100, 30), kv_lens=(80, 0, 100, 50)),
        op="flash_attention_var_len_score",
        extras=compressed(7),
        sparse_mode=7,
        next_tokens=8,
    ),
    fa_case(
        "tnd_mode3_short_kv",
        FAConfig("TND", F32, heads_q=2, q_lens=(40, 24), kv_lens=(30, 64)),
        extras=compressed(3),
        sparse_mode=3,
    ),
    # pse.
    fa_case(
        "pse1_full",
        FAConfig("BNSD", F16, batch=2, heads_q=2, seq_q=96, seq_kv=128),
        extras=pse_tensor("S"),
        pse_type=1,
    ),
    fa_case(
        "pse0_row_broadcast",
        FAConfig("BSH", F32, batch=2, heads_q=2, seq_q=80, seq_kv=96),
        extras=pse_tensor("1", batch_broadcast=True),
        pse_type=0,
    ),
    fa_case(
        "pse2_alibi",
        FAConfig("BSND", F16, batch=2, heads_q=4, heads_kv=2, seq_q=128),
        extras=alibi(q_start=3),
        pse_type=2,
    ),
    fa_case(
        "pse2_alibi_causal",
        FAConfig("BNSD", BF16, heads_q=8, seq_q=128),
        extras=both(alibi(), compressed(2)),
        pse_type=2,
        sparse_mode=2,
    ),
    fa_case(
        "pse3_sqrt_alibi",
        FAConfig("BSH", F32, batch=2, heads_q=2, seq_q=64, seq_kv=96),
        extras=alibi(per_batch=True, kv_start=5),
        pse_type=3,
    ),
    fa_case(
        "tnd_pse1",
        FAConfig("TND", F16, heads_q=2, q_lens=(30, 64), kv_lens=(50, 64)),
        extras=pse_tensor("S"),
        pse_type=1,
    ),
    # Dropout.
    fa_case("dropout_bsnd", FAConfig("BSND", F16, batch=2, heads_q=4, seq_q=128), extras=dropout(0.9)),
    fa_case(
        "dropout_tnd_causal",
        FAConfig("TND", BF16, heads_q=2, q_lens=(50, 0, 70), kv_lens=(60, 0, 70)),
        extras=both(dropout(0.8), compressed(3)),
        sparse_mode=3,
    ),
    # Larger cases (skipped by --quick).
    fa_case("large_bnsd_fp16", FAConfig("BNSD", F16, heads_q=2, seq_q=2048, dim=128), quick=False),
    fa_case(
        "large_causal_bf16",
        FAConfig("BSND", BF16, heads_q=4, heads_kv=1, seq_q=1024, dim=128),
        extras=compressed(3),
        sparse_mode=3,
        quick=False,
    ),
    fa_case(
        "large_compressed_pse",
        FAConfig("BNSD", F32, heads_q=2, seq_q=1152, dim=64),
        extras=both(pse_tensor("1024"), compressed(2)),
        sparse_mode=2,
        pse_type=1,
        quick=False,
    ),
    fa_case(
        "large_tnd_band_dropout",
        FAConfig("TND", F16, heads_q=2, q_lens=(1024, 300, 700)),
        extras=both(dropout(0.9), compressed(4)),
        sparse_mode=4,
        pre_tokens=128,
        next_tokens=0,
        quick=False,
    ),
)


def _fa_golden(op: str, same_dtype: bool = False) -> Callable[[Call], Outputs]:
    return lambda call: fa_oracle(bind(op, without(by_name(op, call))), same_dtype=same_dtype)


for _op in ("flash_attention_score", "flash_attention_var_len_score"):
    register_operator(
        Operator(
            _op,
            ("attention_out", "softmax_max", "softmax_sum", "softmax_out"),
            _fa_golden(_op),
            same_dtype(attention_out="query", softmax_max="float32", softmax_sum="float32"),
            oracle=fa_forward_oracle,
            no_effect=FA_NO_EFFECT,
            naive=_fa_golden(_op, same_dtype=True),
        )
    )
