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

from . import _device, _rng


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
        (torch.cuda.manual_seed_all if all_devices else torch.cuda.manual_seed)(seed)
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
    return torch.cuda.is_available() if _on_cuda() else True


def device_count() -> int:
    return torch.cuda.device_count() if _on_cuda() else 1


def current_device() -> int:
    return torch.cuda.current_device() if _on_cuda() else 0


def set_device(device: Any) -> None:
    """``torch.npu.set_device(local_rank)``: torch.cuda.set_device on CUDA; accepted and ignored on the CPU."""
    if _on_cuda():
        torch.cuda.set_device(_cuda_index(device))


def synchronize(device: Any = None) -> None:
    if _on_cuda():
        torch.cuda.synchronize(_cuda_index(device))


def get_device_name(device: Any = None) -> str:
    return torch.cuda.get_device_name(_cuda_index(device)) if _on_cuda() else (platform.processor() or "cpu")


def device(device: Any):
    """``with torch.npu.device(i):``: torch.cuda.device on CUDA, a no-op context on the CPU."""
    return torch.cuda.device(_cuda_index(device)) if _on_cuda() else contextlib.nullcontext()


def set_compile_mode(**_: Any) -> None:
    """Ascend's operator compile switch (``jit_compile=False``): there is nothing to compile; accepted."""


def _memory(name: str, cpu_value: Any) -> Any:
    def statistic(device: Any = None) -> Any:
        return getattr(torch.cuda, name)(_cuda_index(device)) if _on_cuda() else cpu_value()

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
        torch.cuda.empty_cache()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: torch.cuda.mem_get_info on CUDA, the host's available and physical memory on the CPU."""
    if _on_cuda():
        return torch.cuda.mem_get_info(_cuda_index(device))
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
    "Stream": (lambda: torch.cuda.Stream, lambda: torch.cpu.Stream),
    "Event": (lambda: torch.cuda.Event, lambda: _CpuEvent),
    "stream": (lambda: torch.cuda.stream, lambda: torch.cpu.stream),
    "StreamContext": (lambda: torch.cuda.StreamContext, lambda: torch.cpu.StreamContext),
    "current_stream": (lambda: torch.cuda.current_stream, lambda: torch.cpu.current_stream),
    "default_stream": (lambda: torch.cuda.default_stream, lambda: _cpu_default_stream),
}


def __getattr__(name: str) -> Any:
    if name in _STREAM_API:
        on_cuda, on_cpu = _STREAM_API[name]
        return on_cuda() if _on_cuda() else on_cpu()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (docs/guides/torch_npu.md lists what "
                         "torch.npu maps)")
