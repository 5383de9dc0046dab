"""Shared helpers of the FusedInferAttentionScore / IncreFlashAttention tests: inputs in any FIA layout and
`check_fia`, which runs the operator and the independent oracle (cann_attn.testing.fia_oracle) and compares them
(docs/semantics/precision.md rules for float outputs; int8 outputs within one rounding step; the log-sum-exp to
fp32 accuracy, with the invalid-row values (+inf, and -3.40e38 for decode batches without keys) exactly where the
oracle has them)."""

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
    empty = torch.isinf(g) | (g <= -3e38)
    assert torch.equal(actual[empty], g[empty].float()), "softmax_lse: invalid-row values differ from the oracle's"
    assert bool(torch.isfinite(a[~empty]).all()), "softmax_lse: non-finite values where the oracle has valid rows"
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


V2_RENAMED = {"actual_seq_lengths": "actual_seq_qlen", "actual_seq_lengths_kv": "actual_seq_kvlen",
              "num_heads": "num_query_heads", "scale": "softmax_scale", "softmax_lse_flag": "return_softmax_lse",
              "key_antiquant_scale": "dequant_scale_key", "value_antiquant_scale": "dequant_scale_value",
              "key_antiquant_mode": "key_quant_mode", "value_antiquant_mode": "value_quant_mode"}


def v2_arguments(kwargs: dict) -> dict:
    """v1 keyword arguments spelled as npu_fused_infer_attention_score_v2 takes them."""
    return {V2_RENAMED.get(name, name): value for name, value in kwargs.items()}


def check_fia(q, k, v, **kwargs):
    """Run fused_infer_attention_score and the oracle with the same arguments; returns (out, lse) of the op."""
    backend = kwargs.pop("backend", "auto")
    sink = kwargs.get("learnable_sink")
    if sink is None:
        out, lse = cann_attn.fused_infer_attention_score(q, k, v, backend=backend, **kwargs)
    else:
        out, lse = cann_attn.fused_infer_attention_score_v2(q, k, v, backend=backend, **v2_arguments(kwargs))
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
