"""Compute backends. Each implements the same small interface over canonical problems (DESIGN.md)."""

from __future__ import annotations

import torch

from ..errors import ParamInvalidError

BACKENDS = ("auto", "reference", "triton")


def select_backend(backend: str, device: torch.device) -> str:
    """Resolve `backend`; "auto" is the reference backend until a Triton kernel supports the case."""
    if backend not in BACKENDS:
        raise ParamInvalidError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if backend == "triton":
        raise ParamInvalidError("backend: the Triton backend is not available in this build yet; use 'reference'")
    return "reference"
