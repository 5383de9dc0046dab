"""FlashAttentionScoreGrad: cases and golden (torch.autograd through the float64 forward oracle; the forward's
statistics and output derived with that oracle when a case file does not give them)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ...testing.oracle import fa_forward_oracle
from ._common import (
    BF16,
    F16,
    F32,
    FORWARD_STATE,
    Call,
    Case,
    Operator,
    Outputs,
    outputs_of,
    randn,
    register,
    register_operator,
    same_dtype,
)
from .fa import (
    FA_NO_EFFECT,
    Extras,
    FAConfig,
    alibi,
    both,
    compressed,
    dropout,
    fa_inputs,
    fa_oracle,
    pse_tensor,
    random_mask,
    sink,
)

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
    skip = (*_GRAD_STATE, *FA_NO_EFFECT, "dy", "query", "key", "value", "head_num", "input_layout")
    fwd_kwargs = {name: value for name, value in named.items() if name not in skip}
    fwd = Call((named["query"], named["key"], named["value"], named["head_num"], named["input_layout"]), fwd_kwargs)
    golden = fa_oracle(fwd)
    return {
        "softmax_max": golden["softmax_max"].float(),
        "softmax_sum": golden["softmax_sum"].float(),
        "attention_in": golden["attention_out"].to(named["query"].dtype),
    }


def _grad_oracle(call: Call, same_dtype: bool = False) -> Outputs:
    """Autograd through the float64 oracle (or, `same_dtype`, through its code run in the input dtype)."""
    from ...testing.oracle import fa_forward_oracle, naive_same_dtype_forward

    q, k, v, dy, head_num, layout = call.args[:6]
    kwargs = {name: value for name, value in call.kwargs.items() if name not in (*_GRAD_STATE, *FA_NO_EFFECT)}

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
register_operator(
    Operator(
        "flash_attention_score_grad",
        ("dq", "dk", "dv", "dpse", "dsink"),
        _grad_oracle,
        same_dtype(dq="query", dk="key", dv="value", dpse="pse", dsink="sink"),
        state=_GRAD_STATE,
        derive=fa_grad_state,
        oracle=fa_forward_oracle,
        consumed={"dy": "the gradient of attention_out that autograd through the forward oracle takes",
                  **dict.fromkeys(_GRAD_STATE, FORWARD_STATE)},
        no_effect=FA_NO_EFFECT,
        naive=functools.partial(_grad_oracle, same_dtype=True),
    )
)


