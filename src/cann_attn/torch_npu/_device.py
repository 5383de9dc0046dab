"""The ``npu`` device mapped onto a CPU or CUDA device, for :func:`cann_attn.torch_npu.install`
(docs/guides/torch_npu.md, "The npu device").

Ascend code names its device ``"npu"``: ``x.npu()``, ``x.to("npu:0")``, ``torch.zeros(n, device="npu")``,
``torch.npu.synchronize()``. This module rewrites those device arguments to the target device at the entry points
that take them (the reverse of torch_npu's own ``transfer_to_npu``, which rewrites ``cuda`` to ``npu``), adds
``Tensor.npu`` / ``Tensor.is_npu`` / ``Module.npu``, and exposes :mod:`cann_attn.torch_npu.npu` as ``torch.npu``.
Every replaced attribute is recorded and :func:`unmap_npu_device` puts the original back.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

# Keyword arguments that carry a device (factories, torch.load, autocast, init_process_group's device_id).
_DEVICE_KEYWORDS = ("device", "device_type", "map_location", "device_id")
# torch's factory functions that take ``device=`` (the list torch.utils._device uses for `with torch.device(...)`),
# plus the *_like functions and torch.fft's frequency helpers.
_LIKE_FACTORIES = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like")
_TENSOR_METHODS = ("to", "new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros")

_STATE: dict[str, Any] = {"target": None, "saved": []}
_TORCH_DEVICE = torch.device  # torch's own class, also while install() has replaced torch.device


def target() -> torch.device | None:
    """The device ``npu`` is mapped to, or None while the mapping is not installed."""
    return _STATE["target"]


def default_target() -> torch.device:
    """CUDA when a GPU is available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_target(device: str | torch.device | None) -> torch.device:
    """``install(device=...)``'s argument as a device: None picks :func:`default_target`; cpu or cuda only."""
    chosen = default_target() if device is None else _TORCH_DEVICE(device)
    if chosen.type not in ("cpu", "cuda"):
        raise ValueError(f"install(device={device!r}): the npu device can be mapped to 'cpu' or 'cuda' only")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"install(device={device!r}): CUDA is not available in this process")
    return chosen


def npu_index(device: Any) -> tuple[bool, int | None]:
    """(is it an npu device, its index): ``"npu"``, ``"npu:1"`` or a ``torch.device`` of type npu."""
    if isinstance(device, _TORCH_DEVICE):
        return device.type == "npu", device.index
    if isinstance(device, str):
        name, _, index = device.partition(":")
        if name.strip() == "npu":
            return True, int(index) if index else None
    return False, None


def to_target(device: Any) -> Any:
    """An npu device (string or ``torch.device``) as the target device; anything else unchanged."""
    is_npu, index = npu_index(device)
    mapped = _STATE["target"]
    if not is_npu or mapped is None:
        return device
    if mapped.type == "cpu":
        return _TORCH_DEVICE("cpu")
    return _TORCH_DEVICE("cuda", mapped.index if index is None else index)


def _map_argument(value: Any) -> Any:
    if isinstance(value, dict):  # torch.load(map_location={"npu:0": "npu:1"})
        return {_map_argument(key): _map_argument(item) for key, item in value.items()}
    mapped = to_target(value)
    if mapped is not value and isinstance(value, str) and not isinstance(mapped, str):
        # Strings stay strings (autocast's device_type, map_location keys) so callers comparing them keep working.
        return str(mapped)
    return mapped


def _mapping_arguments(function: Callable, positional: bool) -> Callable:
    @functools.wraps(function)
    def mapped(*args, **kwargs):
        if positional:
            args = tuple(_map_argument(arg) for arg in args)
        for key in _DEVICE_KEYWORDS:
            if key in kwargs:
                kwargs[key] = _map_argument(kwargs[key])
        return function(*args, **kwargs)

    return mapped


def _replace(owner: Any, name: str, value: Any) -> None:
    missing = object()
    _STATE["saved"].append((owner, name, owner.__dict__.get(name, missing) if isinstance(owner, type)
                            else getattr(owner, name, missing), missing))
    setattr(owner, name, value)


def _wrap(owner: Any, name: str, positional: bool = False) -> None:
    function = getattr(owner, name, None)
    if function is not None:
        _replace(owner, name, _mapping_arguments(function, positional))


class _DeviceType(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _TORCH_DEVICE)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _TORCH_DEVICE)


class _MappingDevice(metaclass=_DeviceType):
    """``torch.device`` while installed: ``torch.device("npu:1")`` is the target device; anything else is
    torch's own. Instances are real ``torch.device`` objects."""

    def __new__(cls, type: Any, index: int | None = None) -> torch.device:
        if isinstance(type, str) and index is not None and type.strip() == "npu":
            type, index = f"npu:{index}", None
        mapped = to_target(type)
        return _TORCH_DEVICE(mapped) if index is None else _TORCH_DEVICE(mapped, index)


def _npu_argument(device: Any) -> Any:
    """``.npu(device)``'s argument (None, an index, ``"npu:i"``) as the target device."""
    if isinstance(device, int):
        device = f"npu:{device}"
    return to_target("npu" if device is None else device)


def _tensor_npu(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs) -> torch.Tensor:
    """``Tensor.npu(device=None, non_blocking=False)``: the tensor on the target device."""
    return self.to(_npu_argument(device), non_blocking=non_blocking, **kwargs)


def _module_npu(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
    """``Module.npu(device=None)``: parameters and buffers moved to the target device."""
    return self.to(_npu_argument(device))


def _is_npu(self: torch.Tensor) -> bool:
    mapped = _STATE["target"]
    return mapped is not None and self.device.type == mapped.type


def _distributed_backend(function: Callable) -> Callable:
    """init_process_group(backend="hccl") -> gloo on the CPU, nccl on CUDA (also inside "cpu:gloo,npu:hccl")."""

    @functools.wraps(function)
    def mapped(*args, **kwargs):
        replacement = "nccl" if _STATE["target"].type == "cuda" else "gloo"
        if args and isinstance(args[0], str):
            args = (_backend_name(args[0], replacement), *args[1:])
        if isinstance(kwargs.get("backend"), str):
            kwargs["backend"] = _backend_name(kwargs["backend"], replacement)
        return function(*args, **kwargs)

    return mapped


def _backend_name(backend: str, replacement: str) -> str:
    return backend.replace("hccl", replacement).replace("npu:", f"{_STATE['target'].type}:")


def map_npu_device(device: torch.device, npu_module: Any) -> None:
    """Map ``npu`` onto ``device`` (see the module docstring); ``npu_module`` becomes ``torch.npu``."""
    already_mapped = _STATE["target"] is not None
    _STATE["target"] = device
    if already_mapped:  # install() again: a new target, the replaced attributes stay
        return
    # torch has no npu device type, and renaming its PrivateUse1 device to "npu" (as torch_npu does) would make it
    # torch's current accelerator, which torch.compile then fails to query. torch.device itself is replaced by a
    # constructor that maps npu devices when they are made and stays a torch.device for isinstance.
    _replace(torch, "device", _MappingDevice)
    from torch.utils._device import _device_constructors

    for factory in _device_constructors():
        owner, name = (torch.fft, factory.__name__[4:]) if factory.__name__.startswith("fft_") else \
            (torch, factory.__name__)
        if getattr(owner, name, None) is factory:
            _wrap(owner, name)
    for name in (*_LIKE_FACTORIES, "load"):
        _wrap(torch, name)
    for name in _TENSOR_METHODS:
        _wrap(torch.Tensor, name, positional=True)
    _wrap(torch.nn.Module, "to", positional=True)
    _wrap(torch.nn.Module, "to_empty")
    _wrap(torch.amp.autocast_mode.autocast, "__init__", positional=True)
    _replace(torch.Tensor, "npu", _tensor_npu)
    _replace(torch.Tensor, "is_npu", property(_is_npu))
    _replace(torch.nn.Module, "npu", _module_npu)
    if torch.distributed.is_available():
        _replace(torch.distributed, "init_process_group", _distributed_backend(torch.distributed.init_process_group))
    _replace(torch, "npu", npu_module)
    sys.modules["torch.npu"] = npu_module


def unmap_npu_device() -> None:
    """Put back every attribute :func:`map_npu_device` replaced."""
    while _STATE["saved"]:
        owner, name, original, missing = _STATE["saved"].pop()
        if original is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    sys.modules.pop("torch.npu", None)
    _STATE["target"] = None
