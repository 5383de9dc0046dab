"""``torch_npu.npu``'s random-number functions for the dropout generator of :mod:`cann_attn.torch_npu`.

They follow torch_npu's documented API (the ``torch.cuda`` counterparts): ``manual_seed(seed)`` and
``manual_seed_all(seed)`` set the seed and return None, ``seed()`` seeds with a random number, ``initial_seed()``
returns the current seed (int), ``get_rng_state(device="npu")`` returns the state as a uint8 CPU tensor (16 bytes:
seed and offset, int64 little-endian) and ``set_rng_state(new_state, device="npu")`` restores it. There is one
generator (one "device"): the ``device`` arguments are accepted and ignored. After
:func:`cann_attn.torch_npu.install` mapped the npu device, they also seed the target device's generator (the one
``torch.randn(..., device="npu")`` then draws from).

The device functions (``is_available``, ``device_count``, ``set_device``, ``synchronize``, the memory statistics,
``Stream``, ``Event``, ``stream``...) are those of ``torch.cuda`` or ``torch.cpu`` for the device the npu device is
mapped to (:func:`cann_attn.torch_npu.install`; before it, CUDA when available, else the CPU); this module is
``torch.npu`` once installed (docs/guides/torch_npu.md, "The npu device").
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import time
from typing import Any

import torch
from torch import Tensor

from ..errors import ParamInvalidError
from . import _device, _graphs, _rng
from ._graphs import (  # noqa: F401  (torch.npu's graph capture, docs/guides/torch_npu.md "Graph capture")
    ExternalEvent,
    NPUGraph,
    graph,
    graph_pool_handle,
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
    is_current_stream_capturing,
    make_graphed_callables,
)


def _mapped() -> torch.device:
    return _device.target() or _device.default_target()


def _on_cuda() -> bool:
    return _mapped().type == "cuda"


def _cuda_index(device: Any) -> Any:
    """An npu device argument (None, an index, "npu:i", a torch.device) as torch.cuda's device argument."""
    is_npu, index = _device.npu_index(device)
    return index if is_npu else device


def _seed_mapped_device(seed: int, all_devices: bool) -> None:
    if _device.target() is None:
        return
    if _on_cuda():
        _cuda("manual_seed_all" if all_devices else "manual_seed")(seed)
    else:
        torch.default_generator.manual_seed(seed)


def manual_seed(seed: int) -> None:
    _rng.manual_seed(seed)
    _seed_mapped_device(seed, all_devices=False)


def manual_seed_all(seed: int) -> None:
    _rng.manual_seed(seed)
    _seed_mapped_device(seed, all_devices=True)


def seed() -> None:
    """Seed the generator with a non-deterministic random number."""
    _rng.manual_seed(random.SystemRandom().getrandbits(63))


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return _rng.initial_seed()


def get_rng_state(device="npu") -> Tensor:
    return _rng.get_rng_state().view(torch.uint8).clone()


def set_rng_state(new_state: Tensor, device="npu") -> None:
    _rng.set_rng_state(new_state)


def get_rng_state_all() -> list[Tensor]:
    return [get_rng_state()]


def set_rng_state_all(new_states) -> None:
    for state in new_states:
        set_rng_state(state)


# ----------------------------------------------------------------------------------------------- device functions
def is_available() -> bool:
    """Whether the device npu is mapped to is available (the CPU always is)."""
    return _cuda("is_available")() if _on_cuda() else True


def device_count() -> int:
    return _cuda("device_count")() if _on_cuda() else 1


def current_device() -> int:
    return _cuda("current_device")() if _on_cuda() else 0


def set_device(device: Any) -> None:
    """``torch.npu.set_device(local_rank)``: torch.cuda.set_device on CUDA; accepted and ignored on the CPU."""
    if _on_cuda():
        _cuda("set_device")(_cuda_index(device))


def synchronize(device: Any = None) -> None:
    _graphs.refuse_waiting_replays("torch.npu.synchronize")
    if _on_cuda():
        _cuda("synchronize")(_cuda_index(device))


def device(device: Any):
    """``with torch.npu.device(i):`` makes device i current inside the block and restores the previous one after
    it (None or -1: no change): torch.cuda.device on CUDA; on the CPU, the one device 0."""
    index = _device_argument_index(device, "device")
    if _on_cuda():
        return _cuda("device")(index)
    return contextlib.nullcontext()


def set_compile_mode(**_: Any) -> None:
    """Ascend's operator compile switch (``jit_compile=False``): there is nothing to compile; accepted."""


def _memory(name: str, cpu_value: Any) -> Any:
    def statistic(device: Any = None) -> Any:
        return _cuda(name)(_cuda_index(device)) if _on_cuda() else cpu_value()

    statistic.__name__ = name
    statistic.__doc__ = f"torch.cuda.{name} on CUDA; {cpu_value()!r} on the CPU (no device allocator to report)."
    return statistic


memory_allocated = _memory("memory_allocated", lambda: 0)
max_memory_allocated = _memory("max_memory_allocated", lambda: 0)
memory_reserved = _memory("memory_reserved", lambda: 0)
max_memory_reserved = _memory("max_memory_reserved", lambda: 0)
memory_stats = _memory("memory_stats", dict)
reset_peak_memory_stats = _memory("reset_peak_memory_stats", lambda: None)
reset_max_memory_allocated = _memory("reset_max_memory_allocated", lambda: None)


def empty_cache() -> None:
    if _on_cuda():
        _cuda("empty_cache")()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: torch.cuda.mem_get_info on CUDA, the host's available and physical memory on the CPU."""
    if _on_cuda():
        return _cuda("mem_get_info")(_cuda_index(device))
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class _CpuEvent:
    """An event on the CPU, where work is done when the call returns: record() notes the time, so
    ``start.elapsed_time(end)`` times the host code between them, in milliseconds as torch.cuda.Event does."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end_event: _CpuEvent) -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end_event._time - self._time) * 1e3


def _cpu_default_stream(device: Any = None) -> torch.cpu.Stream:
    return torch.cpu.current_stream()


# Streams and events are the target device's own classes (torch.cuda.Stream is then torch.npu.Stream), looked up
# when used so that install(device=...) decides.
_STREAM_API = {
    "Stream": (lambda: _cuda("Stream"), lambda: torch.cpu.Stream),
    "Event": (lambda: _cuda("Event"), lambda: _CpuEvent),
    "stream": (lambda: _cuda("stream"), lambda: torch.cpu.stream),
    "StreamContext": (lambda: _cuda("StreamContext"), lambda: torch.cpu.StreamContext),
    "current_stream": (lambda: _cuda("current_stream"), lambda: torch.cpu.current_stream),
    "default_stream": (lambda: _cuda("default_stream"), lambda: _cpu_default_stream),
}


def __getattr__(name: str) -> Any:
    if name in _STREAM_API:
        on_cuda, on_cpu = _STREAM_API[name]
        return on_cuda() if _on_cuda() else on_cpu()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (docs/guides/torch_npu.md lists what "
                         "torch.npu maps)")


# --------------------------------------------------------------------------------- runtime: properties, lazy init
# The runtime names of torch_npu.npu (docs/guides/torch_npu.md, "The npu device"). torch.cuda's functions are
# looked up as they were before transfer_to_npu pointed torch.cuda's names at this module.
DEVICE_NAME_ENV = "CANN_ATTN_NPU_DEVICE_NAME"
_RUNTIME: dict[str, Any] = {"device_name": None, "initialized": False, "queued": []}
_TORCH_DEVICE = _device._TORCH_DEVICE


def _cuda(name: str) -> Any:
    return _device.original(torch.cuda, name)


def _device_argument_index(device: Any, argument: str) -> int | None:
    """An npu device argument (None, an int, "npu:i", a torch.device) as an index checked against device_count()."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (int, str, _TORCH_DEVICE)):
        raise ParamInvalidError(f"{argument}: expected an index, 'npu:<index>' or a torch.device, got {device!r}")
    if isinstance(device, int):
        index = device
    else:
        is_npu, index = _device.npu_index(device)
        if not is_npu:  # the target's own spelling ("cuda:1", "cpu")
            try:
                own = _TORCH_DEVICE(device)
            except RuntimeError:
                own = None
            if own is None or own.type != _mapped().type:
                raise ParamInvalidError(f"{argument}: {device!r} is not the npu device")
            index = own.index
    if index is None or index == -1:
        return None
    if not 0 <= index < device_count():
        raise ParamInvalidError(f"{argument}: device index {index} out of range (device_count() is {device_count()})")
    return index


def set_device_name(name: str | None) -> None:
    """The name ``get_device_name()`` / ``get_device_properties().name`` report (None: the target's own, or the
    ``CANN_ATTN_NPU_DEVICE_NAME`` environment variable). ``install(device_name=...)`` sets it."""
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ParamInvalidError(f"device_name: expected a non-empty string, got {name!r}")
    _RUNTIME["device_name"] = name


def _target_device_name(index: int | None) -> str:
    chosen = _RUNTIME["device_name"] or os.environ.get(DEVICE_NAME_ENV, "").strip()
    if chosen:
        return chosen
    return _cuda("get_device_name")(index) if _on_cuda() else (platform.processor() or "cpu")


def get_device_name(device: Any = None) -> str:
    """The device's name: the target's own (the GPU's, the CPU's processor) unless set (:func:`set_device_name`)."""
    return _target_device_name(_device_argument_index(device, "device"))


class NPUDeviceProperties:
    """``torch.npu.get_device_properties(i)``: torch_npu's fields. ``name`` as :func:`get_device_name`,
    ``total_memory`` in bytes; the core counts are the GPU's multiprocessors or the CPU's cores (there are no cube
    and vector units to count); ``L2_cache_size`` the GPU's L2 (0 on the CPU). On CUDA the GPU's other properties
    (``major``, ``multi_processor_count``...) read through, for torch code that queries them via torch.cuda after
    transfer_to_npu."""

    def __init__(self, name: str, total_memory: int, cores: int, l2_cache_size: int, cuda: Any = None) -> None:
        self.name = name
        self.total_memory = total_memory
        self.cube_core_num = cores
        self.vector_core_num = cores
        self.L2_cache_size = l2_cache_size
        self._cuda = cuda

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or self.__dict__.get("_cuda") is None:
            raise AttributeError(name)
        return getattr(self._cuda, name)

    def __repr__(self) -> str:
        return (f"_NPUDeviceProperties(name='{self.name}', total_memory={self.total_memory // 2 ** 20}MB, "
                f"cube_core_num={self.cube_core_num}, vector_core_num={self.vector_core_num}, "
                f"L2_cache_size={self.L2_cache_size // 2 ** 20}MB)")


def get_device_properties(device: Any = None) -> NPUDeviceProperties:
    """The properties of device `device` (None: the current one) with torch_npu's fields
    (docs/guides/torch_npu.md, "The npu device")."""
    index = _device_argument_index(device, "device")
    if _on_cuda():
        cuda = _cuda("get_device_properties")(current_device() if index is None else index)
        return NPUDeviceProperties(_target_device_name(index), cuda.total_memory, cuda.multi_processor_count,
                                   getattr(cuda, "L2_cache_size", 0), cuda)
    return NPUDeviceProperties(_target_device_name(index), mem_get_info()[1], os.cpu_count() or 1, 0)


def is_bf16_supported(including_emulation: bool = False) -> bool:
    """bfloat16 on the target: always on the CPU; torch.cuda.is_bf16_supported on CUDA."""
    return bool(_cuda("is_bf16_supported")(including_emulation)) if _on_cuda() else True


def is_support_inf_nan() -> bool:
    """True: the target computes with IEEE infs and NaNs (an Ascend 910B or later mode; torch_npu's GradScaler
    then checks gradients for them instead of reading an overflow flag)."""
    return True


def is_initialized() -> bool:
    """Whether the npu runtime is initialised (:func:`init`, or ``install()``), so :func:`_lazy_call` runs its
    callback at once (docs/guides/torch_npu.md, "The npu device")."""
    return _RUNTIME["initialized"]


def init() -> None:
    """Initialise the npu runtime: runs the callbacks :func:`_lazy_call` queued, once, in order."""
    _lazy_init()


def _lazy_init() -> None:
    if _RUNTIME["initialized"]:
        return
    _RUNTIME["initialized"] = True
    queued, _RUNTIME["queued"] = _RUNTIME["queued"], []
    for callback in queued:
        callback()


def _lazy_call(callback, **_: Any) -> None:
    """torch_npu's deferred initialisation: ``callback`` runs now when the runtime is initialised, else when it is
    (:func:`init`, install() mapping the device). Keyword flags torch's variant takes (``seed=True``) are
    accepted."""
    if _RUNTIME["initialized"]:
        callback()
    else:
        _RUNTIME["queued"].append(callback)


def _reset_runtime() -> None:
    """uninstall(): a later install() initialises again; the device name set by install() is forgotten."""
    _RUNTIME.update(device_name=None, initialized=False, queued=[])


class _CpuStream(torch.cpu.Stream):
    """A CPU stream with the NPU stream's ``synchronize()`` and ``query()``: the work queued on it is done when a
    call returns."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_stream(device: Any = None) -> _CpuStream:
    return _CpuStream()


_STREAM_API.update({
    "Stream": (lambda: _cuda("Stream"), lambda: _CpuStream),
    "current_stream": (lambda: _cuda("current_stream"), lambda: _cpu_stream),
    "default_stream": (lambda: _cuda("default_stream"), lambda: _cpu_stream),
})

from . import _amp as amp  # noqa: E402, F401  (torch.npu.amp: needs the functions above)
from . import _npu_utils as utils  # noqa: E402, F401  (torch_npu.npu.utils: re-exports the functions above)
