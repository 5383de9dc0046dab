"""PromptFlashAttention (V2; float and int8): cases and golden (``cann_attn.testing.pfa_oracle``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

import cann_attn

from ...testing.pfa_oracle import pfa_oracle
from ._common import (
    BF16,
    F16,
    I8,
    Call,
    Case,
    Operator,
    Outputs,
    by_name,
    int8_values,
    layout_shape,
    outputs_of,
    randn,
    register,
    register_operator,
    without,
)


def _pfa_golden(call: Call, naive: bool = False) -> Outputs:
    named = without(by_name("prompt_flash_attention", call))
    q, k, v = named.pop("query"), named.pop("key"), named.pop("value")
    if naive:
        if q.dtype not in (torch.float16, torch.bfloat16) or named.get("quant_scale2") is not None:
            return {}
        named["naive_dtype"] = q.dtype
    return {"attention_out": pfa_oracle(q, k, v, **named)}


def _pfa_dtypes(named: Mapping[str, Any]) -> dict[str, torch.dtype]:
    from ...testing.pfa_oracle import output_dtype

    return {"attention_out": output_dtype(named["query"].dtype, named.get("quant_scale2"))}


register_operator(Operator("prompt_flash_attention", ("attention_out",), _pfa_golden, _pfa_dtypes, oracle=pfa_oracle,
                           naive=functools.partial(_pfa_golden, naive=True)))


def _pfa_shape(layout: str, b: int, n: int, s: int, d: int) -> tuple[int, ...]:
    return layout_shape("BNSD" if layout == "BNSD_BSND" else layout, b, s, n, d, b * s)


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
            return int8_values(gen, shape) if dtype == torch.int8 else randn(gen, shape, dtype)

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


