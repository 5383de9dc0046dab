"""Calls the operator documentation marks unsupported but production callers make (docs/semantics/beyond-docs.md).

The NPU evidently accepts some calls its documentation refuses (vllm-ascend and cann-recipes-infer make them). Where
the mathematics is unambiguous we compute them, and record each one with the caller that relies on it. Operator
testers who want exactly the documented contract set `CANN_ATTN_STRICT_DOCS=1`: every such call is then refused with
the documented error. The variable is read at each call, so a test can switch it without re-importing.
"""

from __future__ import annotations

import os

from ..errors import ParamInvalidError

__all__ = ["STRICT_DOCS_ENV", "beyond_docs", "strict_docs"]

STRICT_DOCS_ENV = "CANN_ATTN_STRICT_DOCS"


def strict_docs() -> bool:
    """True when `CANN_ATTN_STRICT_DOCS` is set to a true value (1, true, yes, on; case-insensitive)."""
    return os.environ.get(STRICT_DOCS_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def beyond_docs(param: str, call: str, caller: str) -> None:
    """Admit a call the docs mark unsupported, or refuse it under strict mode.

    `param` is the parameter named in the error, `call` says what the docs refuse, and `caller` names the production
    code that makes the call (it appears in the strict-mode message so a tester knows why the default admits it).
    """
    if strict_docs():
        raise ParamInvalidError(
            f"{param}: {call} is not supported by the operator documentation "
            f"({STRICT_DOCS_ENV}=1; admitted by default because {caller} makes this call)")
