"""How kernels' helper functions are compiled, shared by the dense and the DSA kernels."""

from __future__ import annotations

import os

import triton

# Read once, like triton.jit itself does when the kernel modules are imported.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def device_function(fn):
    """`triton.jit` on a GPU. Under the interpreter a plain function: the interpreter re-patches triton.language
    on every call of a nested jit function (~1.5 ms each, several per tile), while a plain function called
    from a running interpreted kernel already sees the patched language."""
    return fn if INTERPRET else triton.jit(fn)

# CANN_ATTN_TRITON_AUTOTUNE=first: every autotuner gets only its first config (the one a launch without autotuning
# takes), so a specialisation costs one compile instead of one per config. benchmarks/gpu_checks.sh sets it for
# its first pass: otherwise a fresh GPU machine spends its first minutes compiling autotune candidates
# (docs/performance.md). Read once, at import, like INTERPRET.
AUTOTUNE_SWITCH = "CANN_ATTN_TRITON_AUTOTUNE"
FIRST_CONFIG_ONLY = os.environ.get(AUTOTUNE_SWITCH, "all").strip().lower() == "first"


def tuning_configs(configs: list) -> list:
    """The autotune candidates: all of `configs`, or only the first under CANN_ATTN_TRITON_AUTOTUNE=first."""
    return configs[:1] if FIRST_CONFIG_ONLY else configs
