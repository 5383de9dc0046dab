"""Shared helpers of the prompt_flash_attention tests: random inputs in any PFA layout, int8 scales, per-channel quant
tensors, and `check_pfa`, which runs the op and the independent oracle (cann_attn.testing.pfa_oracle) and compares them
(float outputs: docs/semantics/precision.md rules; int8 outputs: exact but for near-tie rounding steps)."""

from __future__ import annotations

import math

import torch

import cann_attn
from cann_attn.testing.pfa_oracle import assert_int8_matches, output_dtype, pfa_oracle
from cann_attn.testing.precision import assert_close_to_oracle

INT_MAX = 2147483647
LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND")
DT_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "int8", torch.float32: "fp32"}


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N, S, D] -> the given input layout (BNSD_BSND inputs are BNSD), contiguous."""
    b, n, s, d = x.shape
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    return x.contiguous()


def rand_bnsd(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int64).to(torch.int8)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def make_qkv(layout, gen, *, b=2, n=2, nkv=None, sq=16, skv=None, d=16, dtype=torch.float16):
    nkv = n if nkv is None else nkv
    skv = sq if skv is None else skv
    q = rand_bnsd((b, n, sq, d), dtype, gen)
    k = rand_bnsd((b, nkv, skv, d), dtype, gen)
    v = rand_bnsd((b, nkv, skv, d), dtype, gen)
    return to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)


def int8_scales(d: int, gen: torch.Generator, *, uint64: bool = False) -> dict:
    """deq_scale1 / quant_scale1 / deq_scale2 that keep logits O(1) and outputs O(1) for random int8 inputs.

    The values carry low mantissa bits (so truncation by trans_quant_param changes them). With `uint64` the deq
    scales are passed as trans_quant_param words (int64 tensors)."""
    jitter = torch.rand(3, generator=gen, dtype=torch.float64) * 0.4 + 0.8
    deq1 = float(2.5 / (math.sqrt(d) * 5376.0) * jitter[0]) * (1 + 2**-20)
    quant1 = float(127.0 * jitter[1]) if jitter[1] < 1.0 else 127.0
    deq2 = float(1.0 / (127.0 * 40.0) * jitter[2]) * (1 + 3 * 2**-21)
    deq_scale1 = torch.tensor([deq1], dtype=torch.float32)
    deq_scale2 = torch.tensor([deq2], dtype=torch.float32)
    if uint64:
        deq_scale1 = cann_attn.trans_quant_param(deq_scale1)
        deq_scale2 = cann_attn.trans_quant_param(deq_scale2)
    return {
        "deq_scale1": deq_scale1,
        "quant_scale1": torch.tensor([quant1], dtype=torch.float32),
        "deq_scale2": deq_scale2,
    }


def channel_tensor(kind: str, n: int, d: int, gen, *, lo: float, hi: float, dtype=torch.float32) -> torch.Tensor:
    """quant_scale2 / quant_offset2 values in a documented shape: 'tensor' ([1]), 'H' ([H]), '11H' ([1,1,H]),
    'ND' ([N,D]), '1N1D' ([1,N,1,D]), '11ND' ([1,1,N,D])."""
    shapes = {
        "tensor": (1,),
        "H": (n * d,),
        "11H": (1, 1, n * d),
        "ND": (n, d),
        "1N1D": (1, n, 1, d),
        "11ND": (1, 1, n, d),
    }
    shape = shapes[kind]
    values = lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)
    return values.to(dtype)


def check_pfa(q, k, v, *, naive: bool = True, **kwargs) -> torch.Tensor:
    """Run prompt_flash_attention and the oracle with the same arguments; assert dtype, shape and values.

    Returns the op's output."""
    actual = cann_attn.prompt_flash_attention(q, k, v, **kwargs)
    golden, prequant = pfa_oracle(q, k, v, return_prequant=True, **kwargs)
    expected_dtype = output_dtype(q.dtype, kwargs.get("quant_scale2"))
    assert actual.dtype == expected_dtype, f"output dtype {actual.dtype}, expected {expected_dtype}"
    assert tuple(actual.shape) == tuple(golden.shape), f"output shape {tuple(actual.shape)} != {tuple(golden.shape)}"
    if expected_dtype == torch.int8:
        assert_int8_matches(actual, golden, prequant)
        return actual
    naive_out = None
    if naive and q.dtype in (torch.float16, torch.bfloat16):
        naive_out = pfa_oracle(q, k, v, naive_dtype=q.dtype, **kwargs).to(expected_dtype)
    assert_close_to_oracle(actual, golden, naive_out, dtype=expected_dtype, name="attention_out")
    return actual


def output_rows(out: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """Output in [B, N, S, D] whatever the output layout."""
    if layout == "BSH":
        b, s, h = out.shape
        return out.reshape(b, s, heads, h // heads).permute(0, 2, 1, 3)
    if layout in ("BSND", "BNSD_BSND"):
        return out.permute(0, 2, 1, 3)
    return out
