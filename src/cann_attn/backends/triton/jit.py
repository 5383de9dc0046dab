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
