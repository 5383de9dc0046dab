"""Precision rules of docs/semantics/precision.md, for tests (independent of the library's own ``compare``).

- Ascend rule (primary gate, torch_npu ``assertRtolEqual`` "double thousandth"): threshold t = 1e-3
  (fp16), 4e-3 (bf16), 1e-4 (fp32 and float64); rel = |a - g| / (max(|a|, |g|) + eps) with eps = ``EPS`` =
  1e-12 (a tiny positive number that only guards 0/0: two exact zeros give rel 0). A tensor passes unless BOTH
  more than t*numel elements have rel > t AND more than t*numel elements have |a - g| > t.
- flash-attn rule (secondary): max|ours - ref| <= 2 * max|naive_same_dtype - ref| + 1e-5.
- MERE / MARE (reported): rel = |a - g| / (|g| + 1e-7) over the elements with |g| >= 2^-11 (fp16) /
  2^-8 (bf16) / 2^-14 (fp32, float64); MERE = mean rel < T, MARE = max rel < 10 T; T = 2^-10 fp16,
  2^-7 bf16, 2^-13 fp32/fp64.

Every comparison first casts the golden to the actual (output) dtype, then both to float64. Non-finite values
count as errors unless both tensors hold the same value there (same infinity, or both NaN).
"""

from __future__ import annotations

import torch

__all__ = [
    "ASCEND_THRESHOLDS",
    "EPS",
    "ascend_rule",
    "assert_close_to_oracle",
    "flash_attn_rule",
    "mere_mare",
]

EPS = 1e-12
ASCEND_THRESHOLDS = {
    torch.float16: 1e-3,
    torch.bfloat16: 4e-3,
    torch.float32: 1e-4,
    torch.float64: 1e-4,
}
_MERE_SMALL = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 2.0**-14,
    torch.float64: 2.0**-14,
}
_MERE_T = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-13, torch.float64: 2.0**-13}


def _pair(actual: torch.Tensor, golden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Golden cast to the actual dtype, then both to float64 on the CPU."""
    if tuple(actual.shape) != tuple(golden.shape):
        raise AssertionError(f"shape mismatch: actual {tuple(actual.shape)} vs golden {tuple(golden.shape)}")
    a = actual.detach().to("cpu").to(torch.float64)
    g = golden.detach().to("cpu").to(actual.dtype).to(torch.float64)
    return a, g


def _errors(a: torch.Tensor, g: torch.Tensor, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute and Ascend-relative errors; mismatching non-finite values give +inf in both."""
    same = (a == g) | (torch.isnan(a) & torch.isnan(g))
    abs_err = torch.where(same, torch.zeros_like(a), (a - g).abs())
    rel_err = torch.where(same, torch.zeros_like(a), abs_err / (torch.maximum(a.abs(), g.abs()) + eps))
    inf = torch.full_like(a, float("inf"))
    abs_err = torch.where(torch.isnan(abs_err), inf, abs_err)
    rel_err = torch.where(torch.isnan(rel_err), inf, rel_err)
    return abs_err, rel_err


def ascend_rule(actual: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype | None = None):
    """Ascend "double thousandth" rule. ``dtype`` picks the threshold (default: the actual dtype).

    Returns ``(passed, details)``; details has threshold, numel, allowed (t*numel), n_rel_fail, n_abs_fail,
    max_abs_err, max_rel_err and worst_index (flat index of the largest absolute error).
    """
    dtype = actual.dtype if dtype is None else dtype
    t = ASCEND_THRESHOLDS[dtype]
    a, g = _pair(actual, golden)
    numel = a.numel()
    details = {"rule": "ascend", "threshold": t, "numel": numel, "allowed": t * numel}
    if numel == 0:
        details.update(n_rel_fail=0, n_abs_fail=0, max_abs_err=0.0, max_rel_err=0.0, worst_index=None)
        return True, details
    abs_err, rel_err = _errors(a, g)
    n_rel = int((rel_err > t).sum())
    n_abs = int((abs_err > t).sum())
    worst = int(abs_err.reshape(-1).argmax())
    details.update(
        n_rel_fail=n_rel,
        n_abs_fail=n_abs,
        max_abs_err=float(abs_err.max()),
        max_rel_err=float(rel_err.max()),
        worst_index=worst,
        worst_actual=float(a.reshape(-1)[worst]),
        worst_golden=float(g.reshape(-1)[worst]),
    )
    passed = not (n_rel > t * numel and n_abs > t * numel)
    return passed, details


def flash_attn_rule(actual: torch.Tensor, naive: torch.Tensor, golden: torch.Tensor):
    """flash-attn rule: max|actual - golden| <= 2 * max|naive - golden| + 1e-5 (golden cast to actual dtype).

    Returns ``(passed, details)``.
    """
    a, g = _pair(actual, golden)
    n = naive.detach().to("cpu").to(torch.float64)
    if tuple(n.shape) != tuple(g.shape):
        raise AssertionError(f"shape mismatch: naive {tuple(n.shape)} vs golden {tuple(g.shape)}")
    if a.numel() == 0:
        return True, {"rule": "flash_attn", "max_abs_err": 0.0, "naive_max_abs_err": 0.0, "bound": 1e-5}
    err = float(_errors(a, g)[0].max())
    naive_err = float(_errors(n, g)[0].max())
    bound = 2.0 * naive_err + 1e-5
    passed = err <= bound  # inf/nan errors never pass
    return passed, {"rule": "flash_attn", "max_abs_err": err, "naive_max_abs_err": naive_err, "bound": bound}


def mere_mare(actual: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype | None = None):
    """Mean / max relative error over the elements with |golden| >= the dtype's small-value cut.

    Returns ``(mere, mare, passed)`` with passed = mere < T and mare < 10 T. With no element at or above the cut
    the means are undefined: ``(None, None, True)``.
    """
    dtype = actual.dtype if dtype is None else dtype
    a, g = _pair(actual, golden)
    keep = g.abs() >= _MERE_SMALL[dtype]
    if not bool(keep.any()):
        return None, None, True
    rel = (a[keep] - g[keep]).abs() / (g[keep].abs() + 1e-7)
    rel = torch.where(torch.isnan(rel), torch.full_like(rel, float("inf")), rel)
    mere, mare = float(rel.mean()), float(rel.max())
    t = _MERE_T[dtype]
    return mere, mare, (mere < t and mare < 10 * t)


def _fmt(details: dict) -> str:
    return ", ".join(f"{k}={v:.3e}" if isinstance(v, float) else f"{k}={v}" for k, v in details.items())


def assert_close_to_oracle(
    actual: torch.Tensor,
    golden: torch.Tensor,
    naive: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    name: str = "tensor",
) -> None:
    """Pass if the Ascend rule passes, or (when ``naive`` is given) the flash-attn rule passes.

    ``dtype`` picks the Ascend threshold (default: the actual dtype). Raises AssertionError with max abs/rel
    errors and failing counts otherwise.
    """
    if tuple(actual.shape) != tuple(golden.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(golden.shape)}")
    ok, details = ascend_rule(actual, golden, dtype)
    if ok:
        return
    message = f"{name}: Ascend rule failed ({_fmt(details)})"
    if naive is not None:
        ok2, details2 = flash_attn_rule(actual, naive, golden)
        if ok2:
            return
        message += f"; flash-attn rule failed ({_fmt(details2)})"
    raise AssertionError(message)
