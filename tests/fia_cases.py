"""Shared helpers of the FusedInferAttentionScore / IncreFlashAttention tests: inputs in any FIA layout and
`check_fia`, which runs the operator and the independent oracle (cann_attn.testing.fia_oracle) and compares them
(docs/semantics/precision.md rules for float outputs; int8 outputs within one rounding step; the log-sum-exp to
fp32 accuracy with -inf exactly where a row sees no key)."""

from __future__ import annotations

import torch

import cann_attn
from cann_attn.testing.fia_oracle import fia_oracle
from cann_attn.testing.precision import assert_close_to_oracle


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N, S, D] -> BSH / BSND / BNSD (the query/key layout of an input_layout), contiguous."""
    b, n, s, d = x.shape
    base = layout.split("_")[0]
    if base == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    if base == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    return x.contiguous()


def rand(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int64).to(torch.int8)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def make_qkv(layout, gen, *, b=2, n=4, nkv=None, sq=8, skv=None, d=16, dtype=torch.float32, kv_dtype=None,
             dv=None):
    nkv = n if nkv is None else nkv
    skv = sq if skv is None else skv
    kv_dtype = kv_dtype or dtype
    q = rand((b, n, sq, d), dtype, gen)
    k = rand((b, nkv, skv, d), kv_dtype, gen)
    v = rand((b, nkv, skv, dv or d), kv_dtype, gen)
    return to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)


def check_lse(actual: torch.Tensor, golden: torch.Tensor) -> None:
    assert actual.dtype == torch.float32
    assert tuple(actual.shape) == tuple(golden.shape), f"lse shape {tuple(actual.shape)} != {tuple(golden.shape)}"
    a, g = actual.double(), golden
    empty = torch.isneginf(g)
    assert torch.equal(torch.isneginf(a), empty), "softmax_lse: -inf rows differ from the oracle's"
    err = (a - g)[~empty].abs()
    bound = 2e-3 + 2e-3 * g[~empty].abs()
    assert bool((err <= bound).all()), f"softmax_lse: max abs error {err.max().item() if err.numel() else 0}"


def compare(actual: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype, f"output dtype {actual.dtype}, expected {dtype}"
    assert tuple(actual.shape) == tuple(golden.shape), f"output shape {tuple(actual.shape)} != {tuple(golden.shape)}"
    if dtype == torch.int8:
        diff = (actual.to(torch.int32) - golden.to(torch.int32)).abs()
        assert int(diff.max()) <= 1 if diff.numel() else True, "int8 output off by more than one step"
        assert float((diff > 0).float().mean()) < 0.05 if diff.numel() else True, "too many int8 rounding steps"
        return
    assert_close_to_oracle(actual, golden, dtype=dtype, name="attention_out")


def check_fia(q, k, v, **kwargs):
    """Run fused_infer_attention_score and the oracle with the same arguments; returns (out, lse) of the op."""
    backend = kwargs.pop("backend", "auto")
    out, lse = cann_attn.fused_infer_attention_score(q, k, v, backend=backend, **kwargs)
    golden, golden_lse = fia_oracle(q, k, v, **kwargs)
    if kwargs.get("quant_scale2") is not None:
        dtype = torch.int8
    else:
        dtype = torch.float16 if q.dtype == torch.int8 else q.dtype
    compare(out, golden, dtype)
    if kwargs.get("softmax_lse_flag"):
        check_lse(lse, golden_lse)
    else:
        assert tuple(lse.shape) == (1,) and float(lse[0]) == 0.0
    return out, lse
