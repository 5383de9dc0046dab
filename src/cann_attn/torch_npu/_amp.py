"""``torch.npu.amp`` / ``torch_npu.npu.amp`` on the device npu is mapped to (docs/guides/torch_npu.md, "The npu
device"): torch_npu's signatures and defaults, torch's autocast and gradient scaler underneath.

* ``autocast(enabled=True, dtype=torch.float16, cache_enabled=True)``: ``torch.autocast`` of the target device with
  torch_npu's default float16 (the CPU's own default would be bfloat16).
* ``GradScaler(init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, dynamic=True,
  enabled=True)``: with ``dynamic`` (the default) a step whose gradients hold an inf or NaN is skipped and the scale
  multiplied by ``backoff_factor``; ``growth_interval`` clean steps in a row multiply it by ``growth_factor``.
  ``dynamic=False`` is torch_npu's static loss scale: gradients are unscaled, every step is taken, the scale stays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import ParamInvalidError
from . import _device

__all__ = ["GradScaler", "autocast", "custom_bwd", "custom_fwd"]


def _device_type() -> str:
    return (_device.target() or _device.default_target()).type


class autocast(torch.amp.autocast_mode.autocast):
    """``torch.npu.amp.autocast()``: ``torch.autocast`` on the target device, float16 by default as torch_npu."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
        super().__init__(_device_type(), enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


def custom_fwd(fwd: Callable | None = None, *, cast_inputs: torch.dtype | None = None) -> Callable:
    """``torch.amp.custom_fwd`` for the target device (docs/guides/torch_npu.md, "Mixed precision")."""
    return torch.amp.custom_fwd(fwd, device_type=_device_type(), cast_inputs=cast_inputs)


def custom_bwd(bwd: Callable | None = None) -> Callable:
    """``torch.amp.custom_bwd`` for the target device (docs/guides/torch_npu.md, "Mixed precision")."""
    return torch.amp.custom_bwd(bwd, device_type=_device_type())


class GradScaler(torch.amp.GradScaler):
    """torch_npu's ``GradScaler`` (module docstring) as ``torch.amp.GradScaler`` of the target device."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, dynamic: bool = True, enabled: bool = True) -> None:
        if enabled and growth_factor <= 1.0:
            raise ParamInvalidError(f"GradScaler: growth_factor={growth_factor!r} must be > 1.0")
        if enabled and backoff_factor >= 1.0:
            raise ParamInvalidError(f"GradScaler: backoff_factor={backoff_factor!r} must be < 1.0")
        super().__init__(_device_type(), init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self._dynamic = dynamic

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        if self._dynamic:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # Static loss scale: unscale without looking for infs, so found_inf stays 0 and the step is taken.
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(inv_scale.to(param.grad.device))
        return {found_inf.device: found_inf}

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if self._dynamic or new_scale is not None or not self.is_enabled():
            super().update(new_scale)
            return
        super().update(new_scale=self._scale.clone())  # keeps the scale and clears the per-optimizer state

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.is_enabled():
            state["dynamic"] = self._dynamic
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self._dynamic = state_dict.pop("dynamic", self._dynamic)
        super().load_state_dict(state_dict)
