"""Per-tensor precision metrics of docs/semantics/precision.md, as ``cann-attn compare`` and ``verify`` report them.

Floating-point tensors (threshold dtype = the output's dtype, or the one asked for):

- max abs error, max relative error (Ascend's rel = |a - g| / (max(|a|, |g|) + eps));
- the Ascend "double thousandth" rule (the gate): threshold t = 1e-3 fp16, 4e-3 bf16, 1e-4 fp32; FAIL only when
  BOTH more than t * numel elements have rel > t AND more than t * numel elements have |a - g| > t;
- MERE / MARE: mean / max of |a - g| / (|g| + 1e-7) over the elements with |g| at least 2^-11 (fp16), 2^-8
  (bf16), 2^-14 (fp32); they pass when MERE < T and MARE < 10 T (T = 2^-10, 2^-7, 2^-13). Reported always,
  a gate only with ``strict``. Non-finite values equal on both sides (the -inf of empty top-k slots) count as
  exact, as in the Ascend rule.

A non-finite actual value where the golden holds another value (a NaN, or an infinity the golden lacks) fails the tensor
whatever the counts: torch_npu's assertRtolEqual rejects mismatching NaN positions, and docs/semantics/invalid-rows.md
promises no NaN outputs. An actual whose dtype differs from the golden's fails too (``dtype_problem``): the rule's
thresholds are those of the golden's dtype, and a lower-precision actual would otherwise be measured against a golden
rounded to its own dtype.

Integer tensors: int8 (quantized outputs) pass when every element is within one int8 step of the golden
(docs/operators/prompt_flash_attention.md: the NPU may round an intermediate value to fp16 and land one step away); with
``strict`` at most 0.1% of the elements (at least one) may be one step off. Other integer and bool tensors (indices)
must match exactly.

The computations are those of ``cann_attn.testing.precision`` (the rules the test suite applies).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..testing.precision import _MERE_T, ascend_rule, mere_mare

__all__ = [
    "SECOND_RULE_NOTE",
    "TensorMetrics",
    "dtype_name",
    "dtype_problem",
    "judge_flash_attn",
    "measure",
    "nonfinite_mismatches",
    "second_rule",
]

INT8_STRICT_FRACTION = 1e-3


def dtype_name(dtype: torch.dtype) -> str:
    """'float16', 'bfloat16', 'int8', ... (torch's name without the ``torch.`` prefix)."""
    return str(dtype).removeprefix("torch.")


@dataclass
class TensorMetrics:
    """The metrics of one actual tensor against its golden; ``failures(strict)`` names the failing metrics."""

    name: str
    dtype: str  # the dtype whose thresholds apply
    shape: tuple[int, ...]
    kind: str  # "float" (Ascend rule), "int8" (quantized steps) or "exact"
    numel: int = 0
    max_abs: float = 0.0
    max_rel: float | None = None
    threshold: float | None = None
    n_rel_fail: int = 0
    n_abs_fail: int = 0
    allowed: float = 0.0
    ascend_pass: bool = True
    mere: float | None = None
    mare: float | None = None
    mere_limit: float | None = None
    n_mismatch: int = 0  # integer tensors: elements that differ
    n_nonfinite: int = 0  # float tensors: non-finite actual values where the golden holds another value
    problem: str = ""  # could not be compared (missing, shape mismatch): always a failure
    notes: list[str] = field(default_factory=list)
    # The secondary rule of docs/semantics/precision.md, judged only when the Ascend rule fails and the golden
    # directory holds the naive (input-dtype) reference: None when not judged.
    flash_attn_pass: bool | None = None
    flash_attn_reason: str = ""

    @property
    def mere_pass(self) -> bool:
        # None: no golden element reaches the small-value cut, so there is no mean to judge.
        return self.mere is None or self.mere < self.mere_limit

    @property
    def mare_pass(self) -> bool:
        return self.mare is None or self.mare < 10 * self.mere_limit

    def failures(self, strict: bool = False) -> list[str]:
        """One short line per failing metric (empty: the tensor passes)."""
        if self.problem:
            return [self.problem]
        out = []
        if self.kind == "float":
            if self.n_nonfinite:
                out.append(f"{self.n_nonfinite} NaN/inf values where the golden holds other values")
            if not self.ascend_pass and not self.flash_attn_pass:
                out.append(
                    f"Ascend rule: {self.n_rel_fail} elements with rel err > {self.threshold:g} and "
                    f"{self.n_abs_fail} with abs err > {self.threshold:g} (both over the {self.allowed:g} allowed "
                    f"= {self.threshold:g} x {self.numel})"
                    + (f"; {self.flash_attn_reason}" if self.flash_attn_reason else "")
                )
            if strict and not self.mere_pass:
                out.append(f"MERE {self.mere:.3e} >= {self.mere_limit:.3e}")
            if strict and not self.mare_pass:
                out.append(f"MARE {self.mare:.3e} >= {10 * self.mere_limit:.3e}")
        elif self.kind == "int8":
            if self.max_abs > 1:
                out.append(f"int8 steps: max |diff| {self.max_abs:g} > 1 step ({self.n_mismatch} elements differ)")
            elif strict and self.n_mismatch > self.int8_allowed:
                out.append(
                    f"int8 steps: {self.n_mismatch} elements one step off > {self.int8_allowed} allowed (--strict)"
                )
        elif self.n_mismatch:
            out.append(f"exact match: {self.n_mismatch} of {self.numel} elements differ (max |diff| {self.max_abs:g})")
        return out

    @property
    def by_second_rule(self) -> bool:
        """Passes only because the flash-attn rule accepts it (the Ascend rule does not)."""
        return self.kind == "float" and not self.ascend_pass and bool(self.flash_attn_pass)

    @property
    def int8_allowed(self) -> int:
        return max(1, int(INT8_STRICT_FRACTION * self.numel))

    def passed(self, strict: bool = False) -> bool:
        return not self.failures(strict)

    def to_json(self, strict: bool = False) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "notes"}
        out.update(shape=list(self.shape), notes=list(self.notes), passed=self.passed(strict))
        out["failures"] = self.failures(strict)
        if self.kind == "float":
            out.update(mere_pass=self.mere_pass, mare_pass=self.mare_pass, by_second_rule=self.by_second_rule)
        return out


def second_rule(m: TensorMetrics, actual: torch.Tensor, naive: torch.Tensor, golden: torch.Tensor) -> None:
    """Judge `m` (Ascend rule failed) by the flash-attn rule against the naive reference; record the verdict and
    its reason on `m` (docs/semantics/precision.md)."""
    m.flash_attn_pass, m.flash_attn_reason = judge_flash_attn(actual, naive, golden)


def judge_flash_attn(actual: torch.Tensor, naive: torch.Tensor, golden: torch.Tensor) -> tuple[bool, str]:
    """The flash-attn rule's verdict on `actual` and why: its max error against the bound
    (docs/semantics/precision.md)."""
    from ..testing.precision import flash_attn_rule

    ok, details = flash_attn_rule(actual, naive, golden)
    return ok, (f"flash-attn rule: max err {details['max_abs_err']:.2e} {'<=' if ok else '>'} "
                f"2 x naive {details['naive_max_abs_err']:.2e} + 1e-5")


SECOND_RULE_NOTE = (
    "outputs marked 'flash-attn rule' fail the Ascend rule but pass the secondary rule: their max error against the "
    "float64 golden is at most twice that of the same computation done naively in the input dtype "
    "(docs/semantics/precision.md)"
)


def _same_values(actual: torch.Tensor, golden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, g, same): both on the CPU, the golden cast to the actual's dtype, and where they hold the same value
    (NaN counting as equal to NaN)."""
    a = actual.detach().to("cpu")
    g = golden.detach().to("cpu").to(a.dtype)
    return a, g, (a == g) | (torch.isnan(a) & torch.isnan(g))


def nonfinite_mismatches(actual: torch.Tensor, golden: torch.Tensor) -> int:
    """Non-finite actual values where the golden (cast to the actual's dtype) holds a different value."""
    a, _, same = _same_values(actual, golden)
    return int((~torch.isfinite(a) & ~same).sum())


def dtype_problem(actual: torch.Tensor, expected: torch.dtype) -> str:
    """'' when `actual` has the `expected` dtype, else the failure line naming both."""
    if actual.dtype == expected:
        return ""
    return f"dtype {dtype_name(actual.dtype)} != expected {dtype_name(expected)}"


def _same_non_finite_to_zero(actual: torch.Tensor, golden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Elements holding the same non-finite value on both sides (-inf score slots, ...) set to 0 on both sides, so
    that MERE/MARE skip them (|g| = 0 is below the small-value cut) as the Ascend rule counts them as exact."""
    a, g, same = _same_values(actual, golden)
    same &= ~torch.isfinite(a)
    if not bool(same.any()):
        return actual, golden
    return a.masked_fill(same, 0), g.masked_fill(same, 0)


def measure(name: str, actual: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype | None = None) -> TensorMetrics:
    """Metrics of `actual` against `golden`. `dtype` picks the thresholds (default: the actual's dtype); the
    golden is cast to the actual's dtype before comparing (docs/semantics/precision.md)."""
    dtype = actual.dtype if dtype is None else dtype
    shape = tuple(actual.shape)
    if tuple(golden.shape) != shape:
        return TensorMetrics(
            name,
            dtype_name(dtype),
            tuple(golden.shape),
            "float" if dtype.is_floating_point else "exact",
            problem=f"shape {list(actual.shape)} != golden shape {list(golden.shape)}",
        )
    if dtype.is_floating_point:
        if not actual.dtype.is_floating_point:
            actual = actual.to(dtype)
        ok, details = ascend_rule(actual, golden, dtype)
        mere, mare, _ = mere_mare(*_same_non_finite_to_zero(actual, golden), dtype)
        return TensorMetrics(
            name,
            dtype_name(dtype),
            shape,
            "float",
            numel=details["numel"],
            max_abs=details["max_abs_err"],
            max_rel=details["max_rel_err"],
            threshold=details["threshold"],
            n_rel_fail=details["n_rel_fail"],
            n_abs_fail=details["n_abs_fail"],
            allowed=details["allowed"],
            ascend_pass=ok,
            mere=mere,
            mare=mare,
            mere_limit=_MERE_T[dtype],
            n_nonfinite=nonfinite_mismatches(actual, golden),
        )
    a = actual.detach().to("cpu").to(torch.int64)
    g = golden.detach().to("cpu").to(torch.int64)
    diff = (a - g).abs()
    return TensorMetrics(
        name,
        dtype_name(dtype),
        shape,
        "int8" if dtype == torch.int8 else "exact",
        numel=a.numel(),
        max_abs=float(diff.max()) if a.numel() else 0.0,
        n_mismatch=int((diff != 0).sum()),
    )
