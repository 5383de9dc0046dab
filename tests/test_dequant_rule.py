"""The one dequantisation rule (docs/semantics/precision.md, "Dequantisation"; problem/dequant.py): (x + offset) *
scale in fp32, rounded once to the target dtype, against float64 arithmetic; FIA's KV antiquant and the kv-quant
sparse attention's tiles both go through it."""

from __future__ import annotations

import pytest
import torch

from cann_attn.problem import antiquant, dequant

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def expected(x, scale, dtype, offset=None):
    """float64 (x + offset) * scale, rounded to fp32 (the fp32 product), then once to `dtype`."""
    y = x.to(torch.float64) + (0 if offset is None else offset.to(torch.float64))
    return (y * scale.to(torch.float64)).to(torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("with_offset", [False, True])
def test_values_against_float64(dtype, xdtype, with_offset):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-128, 128, (4, 3, 64), generator=g, dtype=torch.int8)
    if xdtype != torch.int8:
        x = (x.float() / 8).to(xdtype)
    scale = torch.rand(1, 3, 64, generator=g) * 0.37 + 1e-3
    offset = torch.randint(-9, 9, (1, 3, 64), generator=g).float() if with_offset else None
    got = dequant.dequantize_values(x, scale, dtype, offset)
    want = expected(x, scale, dtype, offset)
    assert got.dtype == dtype and torch.equal(got, want)
    # A scale rounded to the target dtype first (a second rounding) is not the rule.
    if dtype != torch.float32:
        assert not torch.equal(expected(x, scale.to(dtype), dtype, offset), want)


def test_narrow_scale_fast_path_is_the_same_rule():
    """Scales that bf16 holds exactly take the one-pass bf16 multiply: same bits as the fp32 rule."""
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-128, 128, (2, 256), generator=g, dtype=torch.int8)
    scale = (torch.rand(1, 256, generator=g) * 4).to(torch.bfloat16).float()
    assert torch.equal(dequant.dequantize_values(x, scale, torch.bfloat16), expected(x, scale, torch.bfloat16))


def test_antiquant_and_tiles_share_the_rule(monkeypatch):
    """FIA's antiquant and the per-tile dequantisation both call dequantize_values (a changed rule changes both)."""
    calls = []
    original = dequant.dequantize_values

    def counting(*args, **kw):
        calls.append(args[2])
        return original(*args, **kw)

    monkeypatch.setattr(dequant, "dequantize_values", counting)
    x = torch.randint(-128, 128, (1, 2, 5, 128), dtype=torch.int8)
    antiquant.dequantize(x, antiquant.KvFactors(torch.full((1, 2, 1, 128), 0.3), None, 0), torch.float16)
    dequant.dequantize_tiles(x, torch.full((1, 2, 5, 1), 0.3), 128, torch.bfloat16)
    assert calls == [torch.float16, torch.bfloat16]
