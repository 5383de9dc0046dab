"""The ``npu`` device mapped onto a CPU or CUDA device, for :func:`cann_attn.torch_npu.install`
(docs/guides/torch_npu.md, "The npu device").

Ascend code names its device ``"npu"``: ``x.npu()``, ``x.to("npu:0")``, ``torch.zeros(n, device="npu")``,
``torch.npu.synchronize()``. This module rewrites those device arguments to the target device at the entry points
that take them (after ``transfer_to_npu``, :mod:`._transfer`, the cuda ones too), adds ``Tensor.npu`` /
``Tensor.is_npu`` / ``Module.npu``, and exposes :mod:`cann_attn.torch_npu.npu` as ``torch.npu``. Every replaced
attribute is recorded (TorchScript resolves each replacement as its original, :mod:`._script`) and
:func:`unmap_npu_device` puts the original back.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ParamInvalidError
from . import _script

# Keyword arguments that carry a device (factories, torch.load, autocast, init_process_group's device_id).
_DEVICE_KEYWORDS = ("device", "device_type", "map_location", "device_id")
# torch's factory functions that take ``device=`` (the list torch.utils._device uses for `with torch.device(...)`),
# plus the *_like functions and torch.fft's frequency helpers.
_LIKE_FACTORIES = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like")
_TENSOR_METHODS = ("to", "new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros")

_STATE: dict[str, Any] = {"target": None, "saved": [], "modules": [], "cuda_is_npu": False}
_TORCH_DEVICE = torch.device  # torch's own class, also while install() has replaced torch.device
_TORCH_GENERATOR = torch.Generator
# torch's own, also while transfer_to_npu maps torch.cuda's names
_CUDA_IS_AVAILABLE, _CUDA_DEVICE_COUNT = torch.cuda.is_available, torch.cuda.device_count
# A device string naming the npu (or, after transfer_to_npu, cuda): torch's own grammar, "type" or "type:index".
_DEVICE_STRING = re.compile(r"(npu|cuda)(?::(0|[1-9][0-9]*))?")


def target() -> torch.device | None:
    """The device ``npu`` is mapped to, or None while the mapping is not installed."""
    return _STATE["target"]


def default_target() -> torch.device:
    """CUDA when a GPU is available, else the CPU."""
    return _TORCH_DEVICE("cuda" if _CUDA_IS_AVAILABLE() else "cpu")


def resolve_target(device: str | torch.device | None) -> torch.device:
    """``install(device=...)``'s argument as a device: None picks :func:`default_target`; cpu or cuda only."""
    names_npu = isinstance(device, str) and device.partition(":")[0].strip() == "npu"
    if names_npu or (isinstance(device, _TORCH_DEVICE) and device.type == "npu"):
        raise ParamInvalidError(f"install(): device={device!r}: the npu device is mapped onto 'cpu' or 'cuda' "
                                "(install(device='cpu')); it cannot be npu itself")
    try:
        chosen = default_target() if device is None else _TORCH_DEVICE(device)
    except (RuntimeError, TypeError) as error:
        raise ParamInvalidError(f"install(): device={device!r} is not a device ({error})") from None
    if chosen.type not in ("cpu", "cuda"):
        raise ParamInvalidError(f"install(): device={device!r}: the npu device can be mapped to 'cpu' or 'cuda' "
                                "only (it is the device npu stands for, so it cannot be npu itself)")
    if chosen.type == "cuda" and not _CUDA_IS_AVAILABLE():
        raise ParamInvalidError(f"install(): device={device!r}: CUDA is not available in this process")
    return chosen


def _mapped_types() -> tuple[str, ...]:
    return ("npu", "cuda") if _STATE["cuda_is_npu"] else ("npu",)


def npu_index(device: Any) -> tuple[bool, int | None]:
    """(is it an npu device, its index): ``"npu"``, ``"npu:1"`` or a ``torch.device`` of type npu (after
    transfer_to_npu also cuda ones). A malformed npu string (``"npu:-1"``, ``" npu"``) raises
    ParamInvalidError (a ValueError), as torch refuses ``"cuda:-1"``."""
    if isinstance(device, _TORCH_DEVICE):
        return device.type in _mapped_types(), device.index
    if isinstance(device, str):
        name = device.partition(":")[0].strip()
        if name not in _mapped_types():
            return False, None
        match = _DEVICE_STRING.fullmatch(device)
        if match is None:
            raise ParamInvalidError(f"device: invalid device string {device!r} (expected {name!r} or "
                                    f"'{name}:<index>' with an index >= 0 and no spaces)")
        return True, None if match[2] is None else int(match[2])
    return False, None


def to_target(device: Any) -> Any:
    """An npu device (string or ``torch.device``) as the target device; anything else unchanged."""
    is_npu, index = npu_index(device)
    mapped = _STATE["target"]
    if not is_npu or mapped is None:
        return device
    key = (mapped.type, None if mapped.type == "cpu" else mapped.index if index is None else index)
    if key not in _TARGET_DEVICES:
        _TARGET_DEVICES[key] = _TORCH_DEVICE(*key) if key[1] is not None else _TORCH_DEVICE(key[0])
    return _TARGET_DEVICES[key]


# The target's devices, made when the mapping is installed: torch.compile reads an existing device as a constant,
# where it cannot trace torch.device's constructor called from a mapping function.
_TARGET_DEVICES: dict[tuple[str, int | None], torch.device] = {}


def _make_target_devices(device: torch.device) -> None:
    _TARGET_DEVICES.clear()
    if device.type == "cpu":
        _TARGET_DEVICES[("cpu", None)] = _TORCH_DEVICE("cpu")
        return
    _TARGET_DEVICES[("cuda", device.index)] = device
    for index in range(_CUDA_DEVICE_COUNT()):
        _TARGET_DEVICES[("cuda", index)] = _TORCH_DEVICE("cuda", index)


def _map_argument(value: Any, integers: bool = False) -> Any:
    """One device argument as the target's. ``integers``: an int is an npu index (after transfer_to_npu, where
    torch_npu reads ``device=0`` as ``npu:0``)."""
    if integers and _STATE["cuda_is_npu"] and isinstance(value, int) and not isinstance(value, bool):
        value = f"npu:{value}"
    if isinstance(value, dict):  # torch.load(map_location={"npu:0": "npu:1"})
        return {_map_argument(key): _map_argument(item) for key, item in value.items()}
    mapped = to_target(value)
    if mapped is not value and isinstance(value, str) and not isinstance(mapped, str):
        # Strings stay strings (autocast's device_type, map_location keys) so callers comparing them keep working.
        return str(mapped)
    return mapped


def _mapping_arguments(function: Callable, positional: bool, positional_integers: bool = False) -> Callable:
    @functools.wraps(function)
    def mapped(*args, **kwargs):
        if positional:
            args = tuple(_map_argument(arg, positional_integers) for arg in args)
        for key in _DEVICE_KEYWORDS:
            if key in kwargs:
                kwargs[key] = _map_argument(kwargs[key], integers=True)
        return function(*args, **kwargs)

    return mapped


def replace(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name = value``, recording the original for :func:`unmap_npu_device`; TorchScript resolves
    ``value`` as it resolved the original (:mod:`._script`)."""
    missing = object()
    original = owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(owner, name, missing)
    if original is not missing:
        _script.mirror_builtin(original, value)
    _STATE["saved"].append((owner, name, original, missing))
    setattr(owner, name, value)


def replace_module(name: str, module: Any) -> None:
    """``sys.modules[name] = module``, recording what was there for :func:`unmap_npu_device`."""
    _STATE["modules"].append((name, sys.modules.get(name)))
    sys.modules[name] = module


def original(owner: Any, name: str) -> Any:
    """``owner.name`` as it was before install() replaced it (the attribute itself when it was not replaced)."""
    for saved_owner, saved_name, value, missing in _STATE["saved"]:
        if saved_owner is owner and saved_name == name and value is not missing:
            return value
    return getattr(owner, name)



def wrap(owner: Any, name: str, positional: bool = False, positional_integers: bool = False) -> None:
    """Replace ``owner.name`` by a function mapping its device arguments (:func:`replace`)."""
    function = getattr(owner, name, None)
    if function is not None:
        replace(owner, name, _mapping_arguments(function, positional, positional_integers))



class _StandIn(type):
    """The type of a constructor standing in for a torch class (``torch_class``): isinstance and issubclass answer
    for that class, so code checking ``isinstance(d, torch.device)`` keeps working while install() replaced it."""

    torch_class: type

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls.torch_class)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, cls.torch_class)


class _MappingDevice(metaclass=_StandIn):
    """``torch.device`` while installed: ``torch.device("npu:1")`` is the target device; anything else is
    torch's own. Instances are real ``torch.device`` objects."""

    torch_class = _TORCH_DEVICE

    def __new__(cls, type: Any, index: int | None = None) -> torch.device:
        if isinstance(type, str) and index is not None and type.strip() in _mapped_types():
            if not isinstance(index, int) or index < 0:
                raise ParamInvalidError(f"device: index {index!r} of torch.device({type!r}, {index!r}) must be an "
                                        "int >= 0")
            type, index = f"{type.strip()}:{index}", None
        mapped = to_target(type)
        return _TORCH_DEVICE(mapped) if index is None else _TORCH_DEVICE(mapped, index)


class _MappingGenerator(metaclass=_StandIn):
    """``torch.Generator`` while installed: ``torch.Generator(device="npu")`` is a generator of the target device
    (its own state, independent of the default generator, like an NPU generator); instances are real
    ``torch.Generator`` objects."""

    torch_class = _TORCH_GENERATOR

    def __new__(cls, device: Any = "cpu") -> torch.Generator:
        return _TORCH_GENERATOR(_map_argument(device, integers=True))


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


def _autocast_init(init: Callable) -> Callable:
    """``torch.autocast("npu")`` on the target, with the npu's default dtype float16 when none is given (torch's
    default for its PrivateUse1 device, torch_npu's; the CPU's own default would be bfloat16)."""

    @functools.wraps(init)
    def mapped(self, device_type, dtype=None, *args, **kwargs):
        if dtype is None and npu_index(device_type)[0]:
            dtype = torch.float16
        return init(self, _map_argument(device_type), dtype, *args, **kwargs)

    return mapped


def _backend_name(backend: str, replacement: str) -> str:
    """``"hccl"`` -> the target's backend; in a mixed string (``"cpu:gloo,npu:hccl"``) the npu entry becomes the
    target's, and when the target is the CPU it merges with the cpu entry (torch refuses a device named twice).
    After transfer_to_npu ``nccl`` / ``cuda:`` are the npu's, as torch_npu rewrites them to hccl / npu."""
    if _STATE["cuda_is_npu"]:
        backend = backend.replace("nccl", "hccl").replace("cuda:", "npu:")
    if ":" not in backend:
        return backend.replace("hccl", replacement)
    target_type = _STATE["target"].type
    entries: dict[str, str] = {}
    for entry in backend.split(","):
        device_type, separator, name = entry.strip().partition(":")
        if not separator:
            raise ParamInvalidError(f"backend: {backend!r} mixes plain and device:backend entries")
        device_type, name = device_type.strip(), name.strip().replace("hccl", replacement)
        if device_type == "npu":
            device_type = target_type
            if device_type in entries:  # the target's own entry wins over the npu one it stands for
                continue
        entries[device_type] = name
    return ",".join(f"{device_type}:{name}" for device_type, name in entries.items())


def map_npu_device(device: torch.device, npu_module: Any) -> None:
    """Map ``npu`` onto ``device`` (see the module docstring); ``npu_module`` becomes ``torch.npu``."""
    already_mapped = _STATE["target"] is not None
    _STATE["target"] = device
    _make_target_devices(device)
    if already_mapped:  # install() again: a new target, the replaced attributes stay
        return
    # torch has no npu device type, and renaming its PrivateUse1 device to "npu" (as torch_npu does) would make it
    # torch's current accelerator, which torch.compile then fails to query. torch.device itself is replaced by a
    # constructor that maps npu devices when they are made and stays a torch.device for isinstance.
    replace(torch, "device", _MappingDevice)
    replace(torch, "Generator", _MappingGenerator)
    replace(torch.jit.annotations, "try_ann_to_type", _script.annotation_converter(
        {"device": (_TORCH_DEVICE, _MappingDevice), "Generator": (_TORCH_GENERATOR, _MappingGenerator)}))
    from torch.utils._device import _device_constructors

    for factory in _device_constructors():
        owner, name = (torch.fft, factory.__name__[4:]) if factory.__name__.startswith("fft_") else \
            (torch, factory.__name__)
        if getattr(owner, name, None) is factory:
            wrap(owner, name)
    for name in (*_LIKE_FACTORIES, "load"):
        wrap(torch, name)
    for name in _TENSOR_METHODS:
        wrap(torch.Tensor, name, positional=True, positional_integers=name == "to")
    wrap(torch.nn.Module, "to", positional=True, positional_integers=True)
    wrap(torch.nn.Module, "to_empty")
    replace(torch.amp.autocast_mode.autocast, "__init__", _autocast_init(torch.amp.autocast_mode.autocast.__init__))
    replace(torch.Tensor, "npu", _tensor_npu)
    replace(torch.Tensor, "is_npu", property(_is_npu))
    replace(torch.nn.Module, "npu", _module_npu)
    if torch.distributed.is_available():
        replace(torch.distributed, "init_process_group", _distributed_backend(torch.distributed.init_process_group))
    wrap(torch.amp.GradScaler, "__init__", positional=True)
    replace(torch, "npu", npu_module)
    replace_module("torch.npu", npu_module)
    replace_module("torch.npu.amp", npu_module.amp)
    replace_module("torch.npu.utils", npu_module.utils)


def unmap_npu_device() -> None:
    """Put back every attribute :func:`map_npu_device` replaced."""
    while _STATE["saved"]:
        owner, name, original, missing = _STATE["saved"].pop()
        _script.forget_builtin(owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None))
        if original is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    while _STATE["modules"]:
        name, module = _STATE["modules"].pop()
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
    _STATE["target"] = None
    _STATE["cuda_is_npu"] = False
