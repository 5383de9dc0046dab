"""``torch_npu.contrib.transfer_to_npu`` onto the install target (docs/guides/torch_npu.md, "transfer_to_npu").

On an NPU, importing torch_npu's ``transfer_to_npu`` makes CUDA code run on the NPU: device strings and
``torch.device``\\ s naming cuda become npu ones, an integer ``device=`` argument (and ``.to(i)``) means npu i,
``Tensor.cuda`` / ``Module.cuda`` are ``.npu``, ``torch.cuda.*`` and ``torch.cuda.amp.*`` are ``torch.npu``'s,
``torch.Generator("cuda")`` an NPU generator, and ``"nccl"`` becomes ``"hccl"``. Here npu is itself mapped to the
install target, so the same rewrites end on the target: cuda -> npu -> target. Every replacement is recorded by
:mod:`._device` and :func:`cann_attn.torch_npu.uninstall` undoes it.

Deliberately not rewritten: ``Tensor.is_cuda`` stays torch's own (torch and libraries use it to pick CUDA kernels,
so a CPU tensor claiming to be on CUDA would send them there), and ``torch.jit.script`` keeps working (torch_npu's
version turns it off; after install() TorchScript compiles these programs).
"""

from __future__ import annotations

import sys

import torch

from . import _device
from . import npu as npu_module

# torch.cuda's names that become torch.npu's (torch_npu points torch.cuda's whole API at torch_npu.npu).
_CUDA_NAMES = (
    "is_available", "device_count", "current_device", "set_device", "synchronize", "get_device_name",
    "get_device_properties", "device", "is_bf16_supported", "manual_seed", "manual_seed_all", "seed", "seed_all",
    "initial_seed", "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats", "reset_peak_memory_stats",
    "reset_max_memory_allocated", "empty_cache", "mem_get_info", "Stream", "Event", "stream", "current_stream",
    "default_stream", "_lazy_call", "init", "is_initialized", "graph", "graph_pool_handle",
    "is_current_stream_capturing", "make_graphed_callables",
)


def enable() -> None:
    """Apply the rewrites (once; install() first with its default target when it has not been called)."""
    if _device.target() is None:
        sys.modules[__package__].install()
    if _device._STATE["cuda_is_npu"]:
        return
    _device._STATE["cuda_is_npu"] = True
    _device.replace(torch.Tensor, "cuda", _device._tensor_npu)
    _device.replace(torch.nn.Module, "cuda", _device._module_npu)
    cuda = sys.modules["torch.cuda"]
    for name in _CUDA_NAMES:
        _device.replace(cuda, name, getattr(npu_module, name))
    _device.replace(cuda, "CUDAGraph", npu_module.NPUGraph)  # as torch_npu's transfer_to_npu sets it
    # torch.cuda.amp stays torch's module (torch._dynamo reads its submodules); its classes become torch.npu.amp's.
    for name in ("autocast", "GradScaler", "custom_fwd", "custom_bwd"):
        _device.replace(torch.cuda.amp, name, getattr(npu_module.amp, name))
