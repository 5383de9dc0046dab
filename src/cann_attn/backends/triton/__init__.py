"""Triton GPU kernels (docs/design.md "Layers"). Kernel modules import triton; import them only after
`cann_attn.backends.select_backend` has chosen "triton", so the package works without triton installed."""
