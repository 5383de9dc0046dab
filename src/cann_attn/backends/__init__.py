"""Compute backends. Each implements the same small interface over canonical problems (docs/design.md).

`select_backend` decides, per call, which backend computes it:

- "reference": the tiled PyTorch backend (any device, every case).
- "triton": the Triton kernels; CUDA tensors, or CPU tensors under the Triton interpreter (TRITON_INTERPRET=1,
  how CI tests the kernels). An unsupported case raises ParamInvalidError saying why.
- "auto": Triton for CUDA tensors when the kernels support the case, else the reference backend. Falling back
  on a CUDA tensor emits a `BackendFallbackWarning` that says why (a silent 100x slowdown is a bug report).

The environment variable CANN_ATTN_BACKEND=triton makes "auto" prefer Triton on every device (the interpreter
on CPU) while still falling back where the kernels do not support a case; CI runs the whole operator test
matrix that way. CANN_ATTN_BACKEND=reference pins "auto" to the reference backend.

In the "npu" precision mode (`cann_attn.precision("npu")`, docs/semantics/precision.md) the Triton kernels are no
candidate: "auto" computes on the reference backend (warning on CUDA tensors), "triton" raises ParamInvalidError.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from collections import Counter
from collections.abc import Callable
from types import ModuleType

import torch

from ..errors import ParamInvalidError
from ..problem.precision import npu_mode

BACKENDS = ("auto", "reference", "triton")
PREFERENCE_ENV = "CANN_ATTN_BACKEND"

# How many calls each (op, backend) pair served in this process; tests use it to prove that the Triton
# matrix really ran on Triton.
dispatch_counts: Counter[tuple[str, str]] = Counter()


class BackendFallbackWarning(UserWarning):
    """backend="auto" computed a CUDA call on the reference backend; the message says why."""


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why Triton cannot run on `device` at all, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'cann-attn[triton]')"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1" and device.type == "cpu":
        return None
    return f"Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got device {device}"


def _preference() -> str:
    preference = os.environ.get(PREFERENCE_ENV, "auto") or "auto"
    if preference not in BACKENDS:
        raise ParamInvalidError(f"{PREFERENCE_ENV}: expected one of {list(BACKENDS)}, got {preference!r}")
    return preference


def select_backend(
    backend: str,
    device: torch.device,
    op: str = "",
    unsupported: Callable[[], str | None] | None = None,
) -> str:
    """Resolve `backend` to "reference" or "triton" for one call of `op` on `device` (`resolve_backend`), and count
    the dispatch.

    `unsupported` returns why the Triton kernels cannot compute this particular case (None when they can);
    it is only evaluated when Triton is a candidate.
    """
    return _count(op, resolve_backend(backend, device, op, unsupported))


def resolve_backend(
    backend: str,
    device: torch.device,
    op: str = "",
    unsupported: Callable[[], str | None] | None = None,
    warn: bool = True,
) -> str:
    """"reference" or "triton" for one call of `op` on `device`, or ParamInvalidError; nothing counted. With
    `warn=False` a fallback under "auto" is silent: a caller checking ahead (before drawing a dropout mask from the
    user's generator) leaves the warning to the op's own call."""
    if backend not in BACKENDS:
        raise ParamInvalidError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if backend == "reference":
        return "reference"
    if backend == "auto":
        preference = _preference()
        if preference == "reference" or (device.type != "cuda" and preference != "triton"):
            return "reference"
    reason = _triton_reason(device, unsupported)
    if reason is None:
        return "triton"
    if backend == "triton":
        raise ParamInvalidError(f"backend: 'triton' cannot compute this {op or 'call'}: {reason}")
    if warn and device.type == "cuda":
        warnings.warn(f"cann_attn.{op or 'op'} runs on the reference backend: {reason}",
                      BackendFallbackWarning, stacklevel=4)
    return "reference"


def _triton_reason(device: torch.device, unsupported: Callable[[], str | None] | None) -> str | None:
    if npu_mode():
        return 'the "npu" precision mode (docs/semantics/precision.md) is computed by the reference backend only'
    reason = triton_unavailable_reason(device)
    if reason is not None:
        return reason
    if unsupported is None:
        return "no Triton kernel implements this operator yet"
    return unsupported()


def _count(op: str, backend: str) -> str:
    dispatch_counts[(op, backend)] += 1
    return backend


# (reference module, Triton module) under cann_attn.backends of each kernel family that both backends implement.
_KERNEL_MODULES = {
    "dense_forward": ("reference.flash_forward", "triton.dense_forward"),
    "dense_backward": ("reference.flash_backward", "triton.dense_backward"),
}


def kernels(family: str, backend: str) -> ModuleType:
    """The module computing `family` on `backend` ("reference" or "triton"), imported on demand so the package
    works without triton: dense_forward has `forward(problem, query, key, value, out, softmax_max=None,
    softmax_sum=None)`, dense_backward `backward(problem, query, key, value, dy, attention_in, softmax_max,
    softmax_sum, dq, dk, dv, dpse_source, dsink_acc=None)`."""
    reference, triton = _KERNEL_MODULES[family]
    return importlib.import_module(f"{__name__}.{triton if backend == 'triton' else reference}")
