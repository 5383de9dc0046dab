"""``torch_npu.contrib`` after :func:`cann_attn.torch_npu.install`: ``transfer_to_npu`` (docs/guides/torch_npu.md,
"transfer_to_npu")."""
