"""Built-in verification cases for ``cann-attn verify``: every operator against its float64 oracle.

A case is a small `Case` record:

- ``op``: the operator's public name in ``cann_attn`` (``verify --op`` filters on it; cases whose operator
  is not importable from ``cann_attn`` yet are skipped, so cases may be registered before the operator lands);
- ``name``: unique within the operator; ``dtype`` and ``shape``: what the results table shows;
- ``build(generator) -> Call``: the inputs, built on the CPU from the given seeded ``torch.Generator`` only
  (``verify`` moves the tensors to ``--device`` for the operator and keeps the CPU copy for the oracle);
- ``run(call) -> {output name: tensor}``: the operator call (timed by ``verify``);
- ``oracle(call) -> {output name: tensor}``: the golden outputs (float64); every output the oracle returns is
  compared with the operator's output of the same name by the Ascend rule of docs/semantics/precision.md, with the
  threshold of the operator output's dtype;
- ``quick``: whether ``verify --quick`` runs it (keep quick cases small: the oracles materialise S x S);
- ``naive(call) -> {output name: tensor}`` (optional): the same computation in the input dtype; an output the
  Ascend rule rejects still passes when the flash-attn rule accepts it against this reference (the secondary
  rule of docs/semantics/precision.md, as in the tests). Only computed when needed.

Adding cases for a new operator (grad, PFA, DSA) takes one function and one ``register`` call::

    def _grad_case(name, cfg, **kwargs) -> Case:
        def build(gen):
            fwd = fa_inputs(gen, cfg, kwargs)              # reuse the FA input builders below
            dy = randn(gen, fwd.args[0].shape, cfg.dtype)
            return Call((*fwd.args[:3], dy, *fwd.args[3:]), fwd.kwargs)

        return Case(
            op="flash_attention_score_grad", name=name, dtype=cfg.dtype, shape=cfg.summary(),
            build=build,
            run=outputs_of("flash_attention_score_grad", ("dq", "dk", "dv")),
            oracle=lambda call: my_grad_oracle(*call.args, **call.kwargs),  # {"dq": .., "dk": .., "dv": ..}
        )

    register(_grad_case("bsh_gqa", FAConfig("BSH", torch.float16, batch=2, heads_q=8, heads_kv=2)))

``outputs_of(op_name, names)`` calls ``cann_attn.<op_name>(*call.args, **call.kwargs)`` and names the elements
of its (NamedTuple or tuple or single tensor) result; ``Call`` holds positional and keyword arguments.

``OPERATORS`` describes every operator for ``cann-attn golden``, by parameter name: its output names, the
float64 golden of a call, the output dtypes, and for grad operators the inputs taken from the forward (derived
with the forward oracle). ``bind(op, named)`` / ``by_name(op, call)`` convert between arguments by name and a
``Call``; the cases of PromptFlashAttention and of the DSA operators are built that way and use these goldens.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import cann_attn

from ..problem.lengths import starts_of

__all__ = [
    "CASES",
    "Call",
    "Case",
    "FAConfig",
    "cases_for",
    "fa_case",
    "fa_inputs",
    "outputs_of",
    "randn",
    "register",
]

Outputs = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Call:
    """Positional and keyword arguments of one operator (and oracle) call."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Call:
        """A copy with `fn` applied to every tensor (also inside lists and tuples)."""
        return Call(tuple(_map(a, fn) for a in self.args), {k: _map(v, fn) for k, v in self.kwargs.items()})


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return value


@dataclass(frozen=True)
class Case:
    """One verification case: see the module docstring."""

    op: str
    name: str
    dtype: torch.dtype
    shape: str
    build: Callable[[torch.Generator], Call]
    run: Callable[[Call], Outputs]
    oracle: Callable[[Call], Outputs]
    quick: bool = True
    naive: Callable[[Call], Outputs] | None = None


CASES: list[Case] = []


def register(*cases: Case) -> None:
    """Add cases to the registry (names must be unique per operator)."""
    for case in cases:
        if any(c.op == case.op and c.name == case.name for c in CASES):
            raise ValueError(f"duplicate verify case {case.op}/{case.name}")
        CASES.append(case)


def cases_for(op: str | None = None, quick: bool = False) -> list[Case]:
    """Registered cases of operator `op` (all operators if None) whose operator exists in ``cann_attn``."""
    return [
        c for c in CASES if (op is None or c.op == op) and (c.quick or not quick) and hasattr(cann_attn, c.op)
    ]


def outputs_of(op_name: str, names: Sequence[str]) -> Callable[[Call], Outputs]:
    """A ``run`` function: call ``cann_attn.<op_name>`` and name the first ``len(names)`` results."""

    def run(call: Call) -> Outputs:
        result = getattr(cann_attn, op_name)(*call.args, **call.kwargs)
        if isinstance(result, torch.Tensor):
            result = (result,)
        return dict(zip(names, result, strict=False))

    return run


def randn(gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype, std: float = 1.0) -> torch.Tensor:
    """Seeded normal values, drawn in fp32 and cast (the same numbers for every dtype)."""
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# FlashAttentionScore / FlashAttentionVarLenScore (forward)
# ----------------------------------------------------------------------------------------------------------
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


def _cumulative(lens: Sequence[int]) -> list[int]:
    ends, total = [], 0
    for n in lens:
        total += n
        ends.append(total)
    return ends


def _layout_shape(layout: str, batch: int, seq: int, heads: int, dim: int, total: int) -> tuple[int, ...]:
    return {
        "BSH": (batch, seq, heads * dim),
        "SBH": (seq, batch, heads * dim),
        "BSND": (batch, seq, heads, dim),
        "BNSD": (batch, heads, seq, dim),
        "TND": (total, heads, dim),
    }[layout]


Extras = Callable[[torch.Generator, FAConfig], dict[str, Any]]


def fa_inputs(
    gen: torch.Generator, cfg: FAConfig, kwargs: Mapping[str, Any], extras: Extras | None = None
) -> Call:
    """query, key, value in `cfg.layout` (+ TND cumulative lengths, + tensors from `extras`) as a `Call`."""
    tq, tkv = sum(cfg.qlens), sum(cfg.kvlens)
    q = randn(gen, _layout_shape(cfg.layout, cfg.batch, cfg.seq_q, cfg.heads_q, cfg.dim, tq), cfg.dtype)
    k = randn(gen, _layout_shape(cfg.layout, cfg.batch, cfg.skv, cfg.n2, cfg.dim, tkv), cfg.dtype)
    v = randn(gen, _layout_shape(cfg.layout, cfg.batch, cfg.skv, cfg.n2, cfg.dv, tkv), cfg.dtype)
    kw = dict(kwargs)
    if cfg.layout == "TND":
        kw["actual_seq_qlen"] = _cumulative(cfg.qlens)
        kw["actual_seq_kvlen"] = _cumulative(cfg.kvlens)
    if extras is not None:
        kw.update(extras(gen, cfg))
    return Call((q, k, v, cfg.heads_q, cfg.layout), kw)


# Parameters of the FA family that do not change the result (reserved, or precision modes we always honour).
_FA_NO_EFFECT = ("padding_mask", "inner_precise", "softmax_in", "backend")


def _fa_oracle(call: Call, same_dtype: bool = False) -> Outputs:
    from ..testing.oracle import fa_forward_oracle, naive_same_dtype_forward

    fn = naive_same_dtype_forward if same_dtype else fa_forward_oracle
    kwargs = {name: value for name, value in call.kwargs.items() if name not in _FA_NO_EFFECT}
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
        oracle=_fa_oracle,
        quick=quick,
        naive=functools.partial(_fa_oracle, same_dtype=True),
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
                cfg.heads_q, actual_seq_qlen=_cumulative(cfg.qlens), actual_seq_kvlen=_cumulative(cfg.kvlens)
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


F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
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


# ---------------------------------------------------------------------------------------------------------
# FlashAttentionScoreGradV2: golden = torch.autograd through the float64 forward oracle
# ---------------------------------------------------------------------------------------------------------
_GRAD_STATE = ("softmax_max", "softmax_sum", "attention_in")


def _grad_inputs(
    gen: torch.Generator, cfg: FAConfig, kwargs: Mapping[str, Any], extras: Extras | None
) -> Call:
    """Forward inputs, dy, and the forward's softmax_max / softmax_sum / attention_out (from the oracle, cast
    as the operator would produce them) passed on as the grad expects them."""
    fwd = fa_inputs(gen, cfg, kwargs, extras)
    q, k, v, head_num, layout = fwd.args
    named = {"query": q, "key": k, "value": v, "head_num": head_num, "input_layout": layout, **fwd.kwargs}
    state = fa_grad_state(named)
    dy = randn(gen, state["attention_in"].shape, cfg.dtype)
    return Call((q, k, v, dy, head_num, layout), {**fwd.kwargs, **state})


def fa_grad_state(named: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """softmax_max, softmax_sum (fp32) and attention_in (query dtype) of the float64 forward oracle, from the
    grad's arguments by name (dy and any given state are ignored)."""
    skip = (*_GRAD_STATE, *_FA_NO_EFFECT, "dy", "query", "key", "value", "head_num", "input_layout")
    fwd_kwargs = {name: value for name, value in named.items() if name not in skip}
    fwd = Call((named["query"], named["key"], named["value"], named["head_num"], named["input_layout"]), fwd_kwargs)
    golden = _fa_oracle(fwd)
    return {
        "softmax_max": golden["softmax_max"].float(),
        "softmax_sum": golden["softmax_sum"].float(),
        "attention_in": golden["attention_out"].to(named["query"].dtype),
    }


def _grad_oracle(call: Call, same_dtype: bool = False) -> Outputs:
    """Autograd through the float64 oracle (or, `same_dtype`, through its code run in the input dtype)."""
    from ..testing.oracle import fa_forward_oracle, naive_same_dtype_forward

    q, k, v, dy, head_num, layout = call.args[:6]
    kwargs = {name: value for name, value in call.kwargs.items() if name not in (*_GRAD_STATE, *_FA_NO_EFFECT)}

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return (t.detach().clone() if same_dtype else t.detach().to(torch.float64)).requires_grad_()

    leaves = [leaf(t) for t in (q, k, v)]
    names = ["dq", "dk", "dv"]
    pse = kwargs.get("pse")
    if pse is not None and kwargs.get("pse_type", 1) in (0, 1):
        kwargs["pse"] = leaf(pse)
        leaves.append(kwargs["pse"])
        names.append("dpse")
    if kwargs.get("sink") is not None:  # docs/semantics/sinks.md: dsink is the gradient w.r.t. the sink logits
        kwargs["sink"] = leaf(kwargs["sink"])
        leaves.append(kwargs["sink"])
        names.append("dsink")
    fn = naive_same_dtype_forward if same_dtype else fa_forward_oracle
    out = fn(*leaves[:3], head_num, layout, **kwargs)[0]
    grads = torch.autograd.grad(out, leaves, dy.to(out.dtype), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves, strict=True)]
    return dict(zip(names, grads, strict=True))


def fa_grad_case(
    name: str, cfg: FAConfig, *, extras: Extras | None = None, quick: bool = True, **kwargs
) -> Case:
    """A flash_attention_score_grad case: same arguments as `fa_case`; dq, dk, dv (and dpse for a type 0/1
    pse tensor) are compared with autograd through the float64 oracle."""
    kwargs.setdefault("scale_value", cfg.dim**-0.5)
    return Case(
        op="flash_attention_score_grad",
        name=name,
        dtype=cfg.dtype,
        shape=cfg.summary(),
        build=functools.partial(_grad_inputs, cfg=cfg, kwargs=kwargs, extras=extras),
        run=outputs_of("flash_attention_score_grad", ("dq", "dk", "dv", "dpse", "dsink")),
        oracle=_grad_oracle,
        quick=quick,
        naive=functools.partial(_grad_oracle, same_dtype=True),
    )


register(
    fa_grad_case("bsh_gqa", FAConfig("BSH", F32, batch=2, heads_q=4, heads_kv=2, seq_q=96)),
    fa_grad_case("sbh_cross", FAConfig("SBH", F16, batch=2, heads_q=2, seq_q=64, seq_kv=80)),
    fa_grad_case(
        "bnsd_causal_mode3",
        FAConfig("BNSD", BF16, heads_q=4, heads_kv=1, seq_q=96, seq_kv=128),
        extras=compressed(3),
        sparse_mode=3,
    ),
    fa_grad_case(
        "bsnd_band_mode4",
        FAConfig("BSND", F32, heads_q=2, seq_q=128),
        extras=compressed(4),
        sparse_mode=4,
        pre_tokens=32,
        next_tokens=8,
    ),
    fa_grad_case(
        "mode1_dead_rows",
        FAConfig("BNSD", F32, heads_q=2, seq_q=48, seq_kv=64),
        extras=random_mask("B1SS", p=0.3, dead_rows=2),
        sparse_mode=1,
    ),
    fa_grad_case(
        "pse1_dpse", FAConfig("BNSD", F32, batch=2, heads_q=2, seq_q=64), extras=pse_tensor("S"), pse_type=1
    ),
    fa_grad_case(
        "pse0_dpse_broadcast",
        FAConfig("BSH", F16, batch=2, heads_q=2, seq_q=48, seq_kv=64),
        extras=pse_tensor("1", batch_broadcast=True),
        pse_type=0,
    ),
    fa_grad_case("alibi", FAConfig("BSND", BF16, heads_q=4, seq_q=64), extras=alibi(q_start=2), pse_type=2),
    fa_grad_case("dropout", FAConfig("BNSD", F16, heads_q=2, seq_q=96), extras=dropout(0.85)),
    fa_grad_case(
        "sink_band_mode4_gqa",
        FAConfig("BSND", BF16, heads_q=8, heads_kv=2, seq_q=128),
        extras=both(compressed(4), sink()),
        sparse_mode=4,
        pre_tokens=32,
        next_tokens=0,
    ),
    fa_grad_case("sink_dropout_dead_rows", FAConfig("BNSD", F32, heads_q=2, seq_q=48, seq_kv=64),
                 extras=both(random_mask("B1SS", p=0.3, dead_rows=2), dropout(0.8), sink()), sparse_mode=1),
    fa_grad_case("sink_tnd", FAConfig("TND", F32, heads_q=4, heads_kv=2, q_lens=(30, 0, 17)),
                 extras=sink()),
    fa_grad_case(
        "tnd_mode8_zero_len",
        FAConfig("TND", F32, heads_q=2, heads_kv=1, q_lens=(0, 40, 56), kv_lens=(0, 60, 56)),
        extras=compressed(8),
        sparse_mode=8,
        next_tokens=4,
    ),
    fa_grad_case(
        "large_bnsd_causal",
        FAConfig("BNSD", BF16, heads_q=2, seq_q=1024, dim=128),
        extras=compressed(2),
        sparse_mode=2,
        quick=False,
    ),
)


# ---------------------------------------------------------------------------------------------------------
# Arguments by name (the operators' signatures; used by the cases below and by ``cann-attn golden``)
# ---------------------------------------------------------------------------------------------------------
@functools.cache
def op_signature(op: str) -> inspect.Signature:
    """The signature of ``cann_attn.<op>``."""
    return inspect.signature(getattr(cann_attn, op))


def tensor_parameters(op: str) -> tuple[str, ...]:
    """The parameters of `op` annotated as tensors, in signature order."""
    return tuple(n for n, p in op_signature(op).parameters.items() if "Tensor" in str(p.annotation))


def bind(op: str, named: Mapping[str, Any]) -> Call:
    """The `Call` of `op` for arguments given by name: the parameters before ``*`` positionally (their defaults
    filled in), the keyword-only ones as given. Raises TypeError for an unknown or missing argument."""
    params = op_signature(op).parameters
    unknown = sorted(set(named) - set(params))
    if unknown:
        raise TypeError(f"{op}: unknown argument {unknown[0]!r}")
    args, kwargs = [], {}
    for name, p in params.items():
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            if name in named:
                args.append(named[name])
            elif p.default is not inspect.Parameter.empty:
                args.append(p.default)
            else:
                raise TypeError(f"{op}: missing required argument {name!r}")
        elif name in named:
            kwargs[name] = named[name]
    return Call(tuple(args), kwargs)


def by_name(op: str, call: Call) -> dict[str, Any]:
    """The arguments of a `Call` of `op` by parameter name (the inverse of `bind`)."""
    return dict(op_signature(op).bind(*call.args, **call.kwargs).arguments)


def _without(named: Mapping[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in named.items() if k not in names and k != "backend"}


# ---------------------------------------------------------------------------------------------------------
# Operators: output names, output dtypes, golden, and the inputs a grad op takes from its forward
# ---------------------------------------------------------------------------------------------------------
DTypes = Callable[[Mapping[str, Any]], dict[str, torch.dtype]]


@dataclass(frozen=True)
class Operator:
    """What ``cann-attn golden`` needs to know about an operator beyond its signature.

    - ``outputs``: names of the results, in order (``outputs_of``);
    - ``golden(call) -> {name: tensor}``: float64 goldens (integer outputs as integers) of the outputs the
      reference defines for this call (e.g. no ``dpse`` without a pse tensor);
    - ``output_dtypes(named) -> {name: dtype}``: the dtype of each output (goldens are cast to it);
    - ``state`` / ``derive(named) -> {name: tensor}``: the inputs a grad op takes from its forward (softmax
      statistics, forward output), computed with the float64 forward oracle when not given.
    """

    name: str
    outputs: tuple[str, ...]
    golden: Callable[[Call], Outputs]
    output_dtypes: DTypes
    state: tuple[str, ...] = ()
    derive: Callable[[Mapping[str, Any]], dict[str, torch.Tensor]] | None = None


OPERATORS: dict[str, Operator] = {}


def _register_operator(op: Operator) -> None:
    OPERATORS[op.name] = op


def _same_dtype(**pairs: str) -> DTypes:
    """Output dtypes: output name -> the input whose dtype it has, or a fixed dtype name ("float32", "int32")."""

    def dtypes(named: Mapping[str, Any]) -> dict[str, torch.dtype]:
        out = {}
        for output, source in pairs.items():
            fixed = getattr(torch, source, None)
            if isinstance(fixed, torch.dtype):
                out[output] = fixed
            elif isinstance(named.get(source), torch.Tensor):
                out[output] = named[source].dtype
        return out

    return dtypes


def _fa_golden(op: str) -> Callable[[Call], Outputs]:
    return lambda call: _fa_oracle(bind(op, _without(by_name(op, call))))


for _op in ("flash_attention_score", "flash_attention_var_len_score"):
    _register_operator(
        Operator(
            _op,
            ("attention_out", "softmax_max", "softmax_sum", "softmax_out"),
            _fa_golden(_op),
            _same_dtype(attention_out="query", softmax_max="float32", softmax_sum="float32"),
        )
    )
_register_operator(
    Operator(
        "flash_attention_score_grad",
        ("dq", "dk", "dv", "dpse", "dsink"),
        lambda call: _grad_oracle(call),
        _same_dtype(dq="query", dk="key", dv="value", dpse="pse", dsink="sink"),
        state=_GRAD_STATE,
        derive=fa_grad_state,
    )
)


# ---------------------------------------------------------------------------------------------------------
# PromptFlashAttentionV2 (float and int8)
# ---------------------------------------------------------------------------------------------------------
def _pfa_golden(call: Call, naive: bool = False) -> Outputs:
    from ..testing.pfa_oracle import pfa_oracle

    named = _without(by_name("prompt_flash_attention", call))
    q, k, v = named.pop("query"), named.pop("key"), named.pop("value")
    if naive:
        if q.dtype not in (torch.float16, torch.bfloat16) or named.get("quant_scale2") is not None:
            return {}
        named["naive_dtype"] = q.dtype
    return {"attention_out": pfa_oracle(q, k, v, **named)}


def _pfa_dtypes(named: Mapping[str, Any]) -> dict[str, torch.dtype]:
    from ..testing.pfa_oracle import output_dtype

    return {"attention_out": output_dtype(named["query"].dtype, named.get("quant_scale2"))}


_register_operator(Operator("prompt_flash_attention", ("attention_out",), _pfa_golden, _pfa_dtypes))


def _int8(gen: torch.Generator, shape: Sequence[int]) -> torch.Tensor:
    return torch.randint(-127, 128, tuple(shape), generator=gen, dtype=torch.int64).to(torch.int8)


def _pfa_shape(layout: str, b: int, n: int, s: int, d: int) -> tuple[int, ...]:
    return _layout_shape("BNSD" if layout == "BNSD_BSND" else layout, b, s, n, d, b * s)


def pfa_case(
    name: str,
    *,
    layout: str,
    dtype: torch.dtype,
    b: int = 1,
    n: int = 2,
    n_kv: int | None = None,
    sq: int = 64,
    skv: int | None = None,
    d: int = 64,
    extras: Callable[[torch.Generator], dict[str, Any]] | None = None,
    quick: bool = True,
    **kwargs: Any,
) -> Case:
    """A prompt_flash_attention case: random query/key/value (int8: uniform in [-127, 127]) in `layout`,
    `extras(gen)` adds tensor keyword arguments (masks, quantization scales), `kwargs` the scalar ones."""
    n_kv = n if n_kv is None else n_kv
    skv = sq if skv is None else skv
    kwargs = {"num_heads": n, "input_layout": layout, **kwargs}
    if n_kv != n:
        kwargs["num_key_value_heads"] = n_kv
    kwargs.setdefault("scale_value", 1.0 if dtype == torch.int8 else d**-0.5)

    def build(gen: torch.Generator) -> Call:
        def draw(heads: int, seq: int) -> torch.Tensor:
            shape = _pfa_shape(layout, b, heads, seq, d)
            return _int8(gen, shape) if dtype == torch.int8 else randn(gen, shape, dtype)

        q, k, v = draw(n, sq), draw(n_kv, skv), draw(n_kv, skv)
        return Call((q, k, v), {**kwargs, **(extras(gen) if extras else {})})

    heads = f"N{n}" if n_kv == n else f"N{n}/{n_kv}"
    seq = f"S{sq}" if skv == sq else f"S{sq}x{skv}"
    return Case(
        op="prompt_flash_attention",
        name=name,
        dtype=dtype,
        shape=f"{layout} B{b} {heads} {seq} D{d}",
        build=build,
        run=outputs_of("prompt_flash_attention", ("attention_out",)),
        oracle=_pfa_golden,
        quick=quick,
        naive=functools.partial(_pfa_golden, naive=True),
    )


# int8 scales for random int8 inputs with D = 64: logits s32 * deq1 of std ~2.5, p_q = p * 127, outputs O(1).
_DEQ1, _QUANT1, _DEQ2 = 2.5 / (8 * 5376.0) * (1 + 2**-20), 127.0, 1.0 / (127.0 * 40.0) * (1 + 3 * 2**-21)


def _int8_scales(uint64: bool = False, quant_scale2: float | None = None, quant_offset2: float | None = None):
    def build(gen: torch.Generator) -> dict[str, Any]:
        f32 = functools.partial(torch.tensor, dtype=torch.float32)
        deq1, deq2 = f32([_DEQ1]), f32([_DEQ2])
        if uint64:
            deq1, deq2 = cann_attn.trans_quant_param(deq1), cann_attn.trans_quant_param(deq2)
        out = {"deq_scale1": deq1, "quant_scale1": f32([_QUANT1]), "deq_scale2": deq2}
        if quant_scale2 is not None:
            out["quant_scale2"] = f32([quant_scale2])
        if quant_offset2 is not None:
            out["quant_offset2"] = f32([quant_offset2])
        return out

    return build


def _per_channel_quant(n: int, d: int, *, lo: float = 20.0, hi: float = 40.0):
    """quant_scale2 / quant_offset2 per channel, [N, D] (fp16/bf16 in, int8 out)."""

    def build(gen: torch.Generator) -> dict[str, Any]:
        scale = lo + (hi - lo) * torch.rand(n, d, generator=gen)
        return {"quant_scale2": scale, "quant_offset2": torch.randint(-3, 4, (n, d), generator=gen).float()}

    return build


I8 = torch.int8
_ALL = 2147483647  # pre/next_tokens: no band limit
register(
    pfa_case("bsh_gqa", layout="BSH", dtype=F16, b=2, n=8, n_kv=2, sq=128, next_tokens=_ALL),
    pfa_case(
        "bnsd_causal_mode3_actual_len",
        layout="BNSD",
        dtype=BF16,
        b=2,
        n=4,
        n_kv=1,
        sq=96,
        skv=160,
        extras=lambda gen: {"atten_mask": cann_attn.compressed_mask(3)},
        sparse_mode=3,
        actual_seq_lengths=[96, 70],
        actual_seq_lengths_kv=[160, 100],
    ),
    pfa_case(
        "bnsd_bsnd_band_mode4",
        layout="BNSD_BSND",
        dtype=F16,
        n=4,
        sq=128,
        extras=lambda gen: {"atten_mask": cann_attn.compressed_mask(4)},
        sparse_mode=4,
        pre_tokens=48,
        next_tokens=8,
    ),
    pfa_case(
        "int8_in_int8_out",
        layout="BNSD",
        dtype=I8,
        b=2,
        n=2,
        sq=64,
        skv=96,
        extras=_int8_scales(quant_scale2=30.0, quant_offset2=2.0),
        next_tokens=_ALL,
    ),
    pfa_case(
        "int8_in_fp16_out_uint64_causal",
        layout="BSH",
        dtype=I8,
        n=4,
        n_kv=2,
        sq=80,
        extras=lambda gen: {**_int8_scales(uint64=True)(gen), "atten_mask": cann_attn.compressed_mask(2)},
        sparse_mode=2,
    ),
    pfa_case(
        "fp16_in_int8_out_per_channel",
        layout="BSND",
        dtype=F16,
        n=2,
        sq=64,
        extras=_per_channel_quant(2, 64),
        next_tokens=_ALL,
    ),
    pfa_case("large_bsh_fp16", layout="BSH", dtype=F16, n=8, sq=1024, d=128, quick=False),
)


# ---------------------------------------------------------------------------------------------------------
# DSA: SparseFlashAttention(+Grad), LightningIndexer, SparseLightningIndexerGradKLLoss (float64 oracles of
# cann_attn.testing.dsa_oracle; the grads by torch.autograd through them)
# ---------------------------------------------------------------------------------------------------------
_DSA_NO_EFFECT = ("pre_tokens", "next_tokens", "deterministic")
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
    from ..testing.dsa_oracle import sequence_spans

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
    from ..testing.dsa_oracle import sparse_attention_oracle

    skip = (*_SFA_TENSORS, *_SFA_GRAD_STATE, *_DSA_NO_EFFECT, "sparse_indices", "scale_value", "d_out")
    kwargs = _without(named, *skip)
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
    from ..testing.dsa_oracle import lightning_indexer_oracle

    named = by_name("lightning_indexer", call)
    kwargs = _without(named, *_KL_LEAVES, "return_value")
    indices, values = lightning_indexer_oracle(named["query_index"], named["key_index"], named["weights"], **kwargs)
    out = {"sparse_indices": indices}
    if named.get("return_value"):
        out["sparse_values"] = values
    return out


def kl_state(named: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """softmax_max / softmax_sum (fp32) of the main attention over the entries the KL loss uses (the SFA oracle
    with value = key over those entries moved to the front), so that the target p sums to 1 per row."""
    from ..testing.dsa_oracle import kl_selected_entries, sequence_spans

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
    from ..testing.dsa_oracle import indexer_kl_loss_oracle

    named = by_name("sparse_lightning_indexer_grad_kl_loss", call)
    leaves = {n: named[n].detach().double().requires_grad_() for n in _KL_LEAVES}
    positional = ("query", "key", *_KL_LEAVES, "sparse_indices", *_KL_STATE, "scale_value")
    kwargs = _without(named, *positional, *_DSA_NO_EFFECT)
    res = indexer_kl_loss_oracle(*({**named, **leaves}[n] for n in positional), **kwargs)
    grads = torch.autograd.grad(res.loss, list(leaves.values()), allow_unused=True)
    out = {
        f"d_{n}": torch.zeros_like(leaf) if g is None else g for (n, leaf), g in zip(leaves.items(), grads, strict=True)
    }
    out["loss"] = res.loss.detach().reshape(1)
    return out


_register_operator(
    Operator(
        "sparse_flash_attention",
        ("attention_out", "softmax_max", "softmax_sum"),
        _sfa_golden,
        _same_dtype(attention_out="query", softmax_max="float32", softmax_sum="float32"),
    )
)
_register_operator(
    Operator(
        "sparse_flash_attention_grad",
        (*(f"d_{n}" for n in _SFA_TENSORS), "d_sinks"),
        _sfa_grad_golden,
        _same_dtype(**{f"d_{n}": n for n in (*_SFA_TENSORS, "sinks")}),
        state=_SFA_GRAD_STATE,
        derive=sfa_grad_state,
    )
)
_register_operator(
    Operator(
        "lightning_indexer",
        ("sparse_indices", "sparse_values"),
        _li_golden,
        _same_dtype(sparse_indices="int32", sparse_values="query_index"),
    )
)
_register_operator(
    Operator(
        "sparse_lightning_indexer_grad_kl_loss",
        ("d_query_index", "d_key_index", "d_weights", "loss"),
        _kl_golden,
        _same_dtype(d_query_index="query_index", d_key_index="key_index", d_weights="weights", loss="float32"),
        state=_KL_STATE,
        derive=kl_state,
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
                out[name] = _cumulative(lens) if self.layout == "TND" else list(lens)
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
        from ..testing.dsa_oracle import lightning_indexer_oracle

        sfa = _sfa_named(gen, cfg)
        named = {**_indexer_named(gen, cfg, "actual_seq_lengths_key"), "scale_value": sfa["scale_value"]}
        for n in ("query", "key", "query_rope", "key_rope", "sparse_indices"):
            if n in sfa:
                named[n] = sfa[n]
        if indices_from_indexer:
            kwargs = _without(named, *_KL_LEAVES, "query", "key", "query_rope", "key_rope", "sparse_indices")
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


# ---------------------------------------------------------------------------------------------------------
# RingAttentionUpdate and AttentionUpdate: inputs are FlashAttentionScore oracle results over two (or K) key
# blocks of the same queries, as a context-parallel ring or a decode split produces them; the golden is the float64
# merge oracle of cann_attn.testing.merge_oracle (merging a causal split also yields invalid rows in one block).
# ---------------------------------------------------------------------------------------------------------
def _ring_named(gen: torch.Generator, layout: str, dtype: torch.dtype, heads: int, dim: int,
                lengths: Sequence[int], batch: int = 1, softmax_layout: str = "") -> dict[str, Any]:
    from ..testing.oracle import fa_forward_oracle

    def partial(keys, values, mode, q_lens, kv_lens):
        kw: dict[str, Any] = {"atten_mask": cann_attn.compressed_mask(mode), "sparse_mode": mode,
                              "scale_value": dim ** -0.5}
        if layout == "TND":
            kw.update(actual_seq_qlen=_cumulative(q_lens), actual_seq_kvlen=_cumulative(kv_lens),
                      softmax_layout=softmax_layout)
        out, smax, ssum = fa_forward_oracle(query, keys, values, heads, layout, **kw)
        return out.to(dtype), smax.float(), ssum.float()

    if layout == "SBH":
        (seq,) = lengths
        shape: tuple[int, ...] = (seq, batch, heads * dim)
    else:
        shape = (sum(lengths), heads, dim)
    query, key, value = (randn(gen, shape, dtype) for _ in range(3))
    # the first half of every sequence's keys (top-left causal, mode 2) and the second half (bottom-right, mode 3):
    # together exactly causal attention; the rows before the second half see none of its keys (invalid rows).
    halves = [n // 2 for n in lengths]
    starts = starts_of(lengths)
    first = [p for st, h in zip(starts, halves, strict=True) for p in range(st, st + h)]
    second = [p for st, n, h in zip(starts, lengths, halves, strict=True) for p in range(st + h, st + n)]
    prev = partial(key[first], value[first], 2, lengths, halves)
    cur = partial(key[second], value[second], 3, lengths, [n - h for n, h in zip(lengths, halves, strict=True)])
    named = dict(zip(("prev_attn_out", "prev_softmax_max", "prev_softmax_sum"), prev, strict=True))
    named.update(zip(("cur_attn_out", "cur_softmax_max", "cur_softmax_sum"), cur, strict=True))
    named["input_layout"] = layout
    if layout == "TND":
        named["actual_seq_qlen"] = torch.tensor([0, *_cumulative(lengths)], dtype=torch.int64)
        named["input_softmax_layout"] = softmax_layout
    return named


def _ring_golden(call: Call) -> Outputs:
    from ..testing.merge_oracle import ring_attention_update_oracle

    return ring_attention_update_oracle(**_without(by_name("ring_attention_update", call)))


def ring_update_case(name: str, layout: str, dtype: torch.dtype, heads: int, dim: int, lengths: Sequence[int],
                     batch: int = 1, softmax_layout: str = "") -> Case:
    shape = (f"S={lengths[0]} B={batch} N={heads} D={dim}" if layout == "SBH"
             else f"TND lens={list(lengths)} N={heads} D={dim} softmax_layout={softmax_layout!r}")
    return Case(
        op="ring_attention_update", name=name, dtype=dtype, shape=shape,
        build=lambda gen: bind("ring_attention_update", _ring_named(gen, layout, dtype, heads, dim, lengths, batch,
                                                                     softmax_layout)),
        run=outputs_of("ring_attention_update", ("attn_out", "softmax_max", "softmax_sum")),
        oracle=_ring_golden,
    )


def attention_update_case(name: str, dtype: torch.dtype, parts: int, heads: int, dim: int, seq_kv: int,
                          batch: int = 2, update_type: int = 1, empty_part: bool = False) -> Case:
    """Decode (one query token) over a KV cache cut into `parts` shards; lse = softmax_max + log(softmax_sum);
    rows ordered (batch, token, head). With `empty_part` the last shard holds no keys (lse -inf, output 0)."""

    def build(gen: torch.Generator) -> Call:
        from ..testing.oracle import fa_forward_oracle

        query = randn(gen, (batch, heads, 1, dim), dtype)
        key, value = randn(gen, (batch, heads, seq_kv, dim), dtype), randn(gen, (batch, heads, seq_kv, dim), dtype)
        live = parts - 1 if empty_part else parts
        cuts = [round(i * seq_kv / live) for i in range(live + 1)]
        lse, outs = [], []
        for lo, hi in itertools.pairwise(cuts):
            out, smax, ssum = fa_forward_oracle(query, key[:, :, lo:hi], value[:, :, lo:hi], heads, "BNSD",
                                                scale_value=dim ** -0.5)
            lse.append((smax[..., 0] + torch.log(ssum[..., 0])).permute(0, 2, 1).reshape(-1).float())
            outs.append(out.permute(0, 2, 1, 3).reshape(-1, dim).to(dtype))
        if empty_part:
            lse.append(torch.full((batch * heads,), float("-inf")))
            outs.append(torch.zeros(batch * heads, dim, dtype=dtype))
        return Call((lse, outs, update_type))

    def golden(call: Call) -> Outputs:
        from ..testing.merge_oracle import attention_update_oracle

        return attention_update_oracle(*call.args)

    return Case(
        op="attention_update", name=name, dtype=dtype,
        shape=f"sp={parts} rows={batch * heads} D={dim} update_type={update_type}",
        build=build, run=outputs_of("attention_update", ("out", "lse_out")), oracle=golden,
    )


register(
    ring_update_case("sbh_causal_split", "SBH", F16, heads=4, dim=32, lengths=(64,), batch=2),
    ring_update_case("tnd_causal_split", "TND", BF16, heads=2, dim=64, lengths=(24, 40, 16)),
    ring_update_case("tnd_causal_split_tnd_softmax", "TND", F32, heads=2, dim=128, lengths=(32, 8),
                     softmax_layout="TND"),
    attention_update_case("decode_sp4", F32, parts=4, heads=8, dim=128, seq_kv=96),
    attention_update_case("decode_sp3_empty_shard", BF16, parts=3, heads=4, dim=64, seq_kv=40, update_type=0,
                          empty_part=True),
)
_register_operator(
    Operator(
        "ring_attention_update",
        ("attn_out", "softmax_max", "softmax_sum"),
        _ring_golden,
        _same_dtype(attn_out="prev_attn_out", softmax_max="float32", softmax_sum="float32"),
    )
)


# ---------------------------------------------------------------------------------------------------------
# FusedInferAttentionScore (v1, v2) and IncreFlashAttention
# ---------------------------------------------------------------------------------------------------------
# v2 / IFA parameter -> FIA v1 parameter of the oracle.
_V2_TO_V1 = {"actual_seq_qlen": "actual_seq_lengths", "actual_seq_kvlen": "actual_seq_lengths_kv",
             "dequant_scale_key": "key_antiquant_scale", "dequant_offset_key": "key_antiquant_offset",
             "dequant_scale_value": "value_antiquant_scale", "dequant_offset_value": "value_antiquant_offset",
             "quant_scale_out": "quant_scale2", "quant_offset_out": "quant_offset2", "num_query_heads": "num_heads",
             "softmax_scale": "scale", "return_softmax_lse": "softmax_lse_flag", "key_quant_mode": "key_antiquant_mode",
             "value_quant_mode": "value_antiquant_mode"}
_IFA_TO_V1 = {"actual_seq_lengths": "actual_seq_lengths_kv", "scale_value": "scale"}


def _fia_golden(op: str) -> Callable[[Call], Outputs]:
    def golden(call: Call) -> Outputs:
        from ..testing.fia_oracle import fia_oracle

        named = _without(by_name(op, call))
        renames = {"fused_infer_attention_score_v2": _V2_TO_V1, "incre_flash_attention": _IFA_TO_V1}.get(op, {})
        named = {renames.get(k, k): v for k, v in named.items()}
        accepted = inspect.signature(fia_oracle).parameters
        q, k, v = named.pop("query"), named.pop("key"), named.pop("value")
        out, lse = fia_oracle(q, k, v, **{k_: v_ for k_, v_ in named.items() if k_ in accepted})
        result = {"attention_out": out}
        if lse is not None:
            result["softmax_lse"] = lse
        return result

    return golden


def _fia_dtypes(scale2: str) -> DTypes:
    def dtypes(named: Mapping[str, Any]) -> dict[str, torch.dtype]:
        q = named["query"].dtype
        out = torch.int8 if named.get(scale2) is not None else torch.float16 if q == torch.int8 else q
        return {"attention_out": out, "softmax_lse": torch.float32}

    return dtypes


_register_operator(Operator("fused_infer_attention_score", ("attention_out", "softmax_lse"),
                            _fia_golden("fused_infer_attention_score"), _fia_dtypes("quant_scale2")))
_register_operator(Operator("fused_infer_attention_score_v2", ("attention_out", "softmax_lse"),
                            _fia_golden("fused_infer_attention_score_v2"), _fia_dtypes("quant_scale_out")))
_register_operator(Operator("incre_flash_attention", ("attention_out",), _fia_golden("incre_flash_attention"),
                            _fia_dtypes("quant_scale2")))


def fia_case(name: str, op: str = "fused_infer_attention_score", *, layout: str, dtype: torch.dtype, b: int = 1,
             n: int = 4, n_kv: int | None = None, sq: int = 64, skv: int | None = None, d: int = 64,
             kv_dtype: torch.dtype | None = None, extras: Callable[[torch.Generator], dict[str, Any]] | None = None,
             **kwargs: Any) -> Case:
    """A FusedInferAttentionScore / v2 / IncreFlashAttention case: random inputs in a dense `layout`; `extras(gen)`
    adds tensor keyword arguments, `kwargs` the scalar ones (in the operator's own spelling)."""
    n_kv = n if n_kv is None else n_kv
    skv = sq if skv is None else skv
    heads_name = {"fused_infer_attention_score_v2": "num_query_heads"}.get(op, "num_heads")
    scale_name = {"fused_infer_attention_score_v2": "softmax_scale", "incre_flash_attention": "scale_value"}.get(
        op, "scale")
    kwargs = {heads_name: n, "input_layout": layout, "num_key_value_heads": n_kv, scale_name: d**-0.5, **kwargs}
    base = layout.split("_")[0]

    def build(gen: torch.Generator) -> Call:
        def draw(heads: int, seq: int, dt: torch.dtype) -> torch.Tensor:
            shape = _layout_shape(base, b, seq, heads, d, b * seq)
            return _int8(gen, shape) if dt == torch.int8 else randn(gen, shape, dt)

        q = draw(n, sq, dtype)
        k, v = draw(n_kv, skv, kv_dtype or dtype), draw(n_kv, skv, kv_dtype or dtype)
        return Call((q, k, v), {**kwargs, **(extras(gen) if extras else {})})

    heads = f"N{n}" if n_kv == n else f"N{n}/{n_kv}"
    outputs = ("attention_out",) if op == "incre_flash_attention" else ("attention_out", "softmax_lse")
    return Case(op=op, name=name, dtype=dtype, shape=f"{layout} B{b} {heads} S{sq}x{skv} D{d}", build=build,
                run=outputs_of(op, outputs), oracle=_fia_golden(op))


def _kv_scales(shape: tuple[int, ...], dtype: torch.dtype, *, separate: str = "", offset: bool = False):
    """Anti-quantisation factors in [0.01, 0.03] (int8 keys of std ~70 -> O(1) values): combined
    `antiquant_scale` (and offset), or with `separate` = "v1" / "v2" the key/value parameters of that spelling."""

    def build(gen: torch.Generator) -> dict[str, Any]:
        def factor() -> torch.Tensor:
            return (0.01 + 0.02 * torch.rand(shape, generator=gen)).to(dtype)

        if not separate:
            out = {"antiquant_scale": factor()}
            if offset:
                out["antiquant_offset"] = torch.randn(shape, generator=gen).to(dtype)
            return out
        names = ("key_antiquant_scale", "value_antiquant_scale") if separate == "v1" else (
            "dequant_scale_key", "dequant_scale_value")
        return {names[0]: factor(), names[1]: factor()}

    return build


register(
    fia_case("bnsd_gqa_lse", layout="BNSD", dtype=F16, b=2, n=8, n_kv=2, sq=64, skv=96, softmax_lse_flag=True),
    fia_case("bsh_causal_mode3_lse", layout="BSH", dtype=BF16, b=2, n=4, n_kv=1, sq=48, skv=80, sparse_mode=3,
             extras=lambda gen: {"atten_mask": cann_attn.compressed_mask(3)}, softmax_lse_flag=True),
    fia_case("bsnd_decode_actual_kv", layout="BSND", dtype=F16, b=4, n=8, n_kv=2, sq=1, skv=160,
             actual_seq_lengths_kv=[160, 7, 99, 31], softmax_lse_flag=True),
    fia_case("bnsd_nbsd_out", layout="BNSD_NBSD", dtype=F32, b=2, n=4, sq=12, skv=40),
    fia_case("decode_antiquant_per_token", layout="BSH", dtype=F16, b=2, n=4, n_kv=2, sq=1, skv=64, d=64,
             kv_dtype=torch.int8, extras=_kv_scales((1, 2, 64), F32, separate="v1"), key_antiquant_mode=1,
             value_antiquant_mode=1),
    fia_case("prefill_antiquant_per_channel", layout="BNSD", dtype=F16, b=1, n=4, sq=32, skv=48,
             kv_dtype=torch.int8, extras=_kv_scales((2, 4, 1, 64), F16, offset=True)),
    fia_case("shared_prefix_decode", layout="BNSD", dtype=F16, b=3, n=4, sq=1, skv=24, actual_seq_lengths_kv=[24, 5, 0],
             extras=lambda gen: {"key_shared_prefix": randn(gen, (1, 4, 40, 64), F16),
                                 "value_shared_prefix": randn(gen, (1, 4, 40, 64), F16)},
             actual_shared_prefix_len=[33], softmax_lse_flag=True),
    fia_case("mla_rope_d512_decode", layout="BSND", dtype=BF16, b=2, n=8, n_kv=1, sq=1, skv=64, d=512,
             extras=lambda gen: {"query_rope": randn(gen, (2, 1, 8, 64), BF16),
                                 "key_rope": randn(gen, (2, 64, 1, 64), BF16)}),
    fia_case("int8_out_left_padding", layout="BSND", dtype=F16, b=2, n=2, sq=24, skv=40,
             actual_seq_lengths=[16, 20], actual_seq_lengths_kv=[30, 36], sparse_mode=3,
             extras=lambda gen: {"atten_mask": cann_attn.compressed_mask(3), "quant_scale2": torch.tensor([40.0]),
                                 "query_padding_size": torch.tensor([3]), "kv_padding_size": torch.tensor([2])}),
    fia_case("v2_decode_antiquant", op="fused_infer_attention_score_v2", layout="BNSD", dtype=BF16, b=2, n=4,
             n_kv=2, sq=1, skv=48, kv_dtype=torch.int8, extras=_kv_scales((2, 64), BF16, separate="v2"),
             actual_seq_kvlen=[48, 13], return_softmax_lse=True),
    fia_case("ifa_bsh_gqa", op="incre_flash_attention", layout="BSH", dtype=F16, b=4, n=8, n_kv=2, sq=1, skv=96,
             actual_seq_lengths=[96, 1, 50, 77]),
    fia_case("ifa_antiquant_mask", op="incre_flash_attention", layout="BNSD", dtype=F16, b=2, n=4, sq=1, skv=64,
             kv_dtype=torch.int8, extras=lambda gen: {**_kv_scales((2, 4, 1, 64), F16, offset=True)(gen),
                                                      "atten_mask": torch.rand(2, 64, generator=gen) < 0.2}),
)
