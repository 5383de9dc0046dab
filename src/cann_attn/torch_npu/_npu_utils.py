"""``torch_npu.npu.utils``: the runtime functions torch_npu keeps in that module, here the ones of
:mod:`cann_attn.torch_npu.npu` (docs/guides/torch_npu.md, "The npu device")."""

from __future__ import annotations

from .npu import __getattr__ as _stream_api
from .npu import (  # noqa: F401  (re-exported under torch_npu's module name)
    current_device,
    device,
    device_count,
    get_device_name,
    get_device_properties,
    is_bf16_supported,
    is_support_inf_nan,
    set_device,
    synchronize,
)


def __getattr__(name: str):
    return _stream_api(name)  # stream, current_stream, default_stream: the target's, looked up when used
