"""``install()``: make unmodified torch_npu code run on cann_attn (docs/guides/torch_npu.md, "install()")."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from collections.abc import Iterator

import torch

from . import _device, _metadata, _registry, _rng

_STATE: dict = {"libraries": {}, "defined": set()}
# The submodule names torch_npu code imports: the package's modules under torch_npu's names.
_ALIASES = {"torch_npu": "", "torch_npu.npu": ".npu", "torch_npu.npu.amp": "._amp",
            "torch_npu.npu.utils": "._npu_utils"}


class TorchNpuPresentError(RuntimeError):
    """install() refuses to shadow a real torch_npu: its torch.ops.npu operators and NPU device would clash."""


def _real_torch_npu_origin(package) -> str | None:
    present = sys.modules.get("torch_npu")
    if present is package:
        return None
    if present is not None:
        return getattr(present, "__file__", None) or repr(present)
    spec = importlib.util.find_spec("torch_npu")
    return None if spec is None else (spec.origin or "an importable torch_npu package")


def install(device: str | torch.device | None = None, *, release: str | None = None,
            device_name: str | None = None) -> None:
    """Opt-in, once at a program's entry point, before code that imports torch_npu runs.

    Afterwards ``import torch_npu`` (and ``torch_npu.npu``) yields :mod:`cann_attn.torch_npu`, every registered
    spelling resolves as ``torch.ops.npu.<op>`` (the ATB ones as ``torch.ops.atb.<op>``, as torch_npu registers
    them; torch.library namespaces ``npu`` / ``atb``, schema of the active release;
    ``release`` switches it first, like :func:`use_release`), ``torch.manual_seed`` also seeds the dropout
    generator (torch_npu seeds the NPU generators through the same call), and the npu device is mapped to
    ``device``: ``x.npu()``, ``x.to("npu:0")``, ``device="npu"``, ``torch.npu.*`` act on it (the list:
    docs/guides/torch_npu.md, "The npu device"). Calling it again registers operators added since and changes
    the device when one is given. :func:`uninstall` undoes it; :func:`installed` is the scoped form.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:i"``; None picks CUDA when a GPU is available, else the CPU.
        release: a torch_npu release for the ``torch.ops.npu`` schemas (``"7.2"``...), see :func:`use_release`.
        device_name: what ``torch.npu.get_device_name()`` and ``get_device_properties().name`` report
            (``"Ascend910B4"`` for code gated on an SoC name); None: ``CANN_ATTN_NPU_DEVICE_NAME`` or the target's.

    It is all or nothing: when a step fails, what the call applied is undone before the error propagates.

    Raises:
        TorchNpuPresentError: the real torch_npu is importable.
        ParamInvalidError: (a ValueError) ``device`` is not a CPU or an available CUDA device, or ``device_name``
            is not a non-empty string.
    """
    package = sys.modules[__package__]
    origin = _real_torch_npu_origin(package)
    if origin is not None:
        raise TorchNpuPresentError(
            f"cann_attn.torch_npu.install(): the real torch_npu is importable ({origin}); use it on an NPU machine, "
            "or import cann_attn.torch_npu as torch_npu without install() to run these operators off the NPU")
    previous_target = _device.target()
    # Called again without a device (an example's own install() line after a test's install("cpu")): keep it.
    target = previous_target if device is None and previous_target is not None else _device.resolve_target(device)
    if previous_target is None:
        # torch._dynamo records torch.device and its factories by identity when it is imported: imported after
        # torch.device was replaced, it cannot trace x.device (torch.compile breaks the graph there).
        import torch._dynamo
    previous_release, previous_name = _registry.active_release(), package.npu._RUNTIME["device_name"]
    if device_name is not None:
        package.npu.set_device_name(device_name)  # validates before anything else is applied
    try:
        if release is not None:
            _registry.use_release(release)
        for alias, suffix in _ALIASES.items():
            sys.modules[alias] = sys.modules[__package__ + suffix]
        _register_ops()
        _device.map_npu_device(target, package.npu)
        if previous_target is None:
            _device.replace(torch, "manual_seed", _seeding_dropout_too(torch.manual_seed))
        _metadata.add_finder()
        package.npu._lazy_init()
    except BaseException:
        if previous_target is None:
            uninstall()
        else:
            _device.map_npu_device(previous_target, package.npu)
            package.npu.set_device_name(previous_name)
        _registry.use_release(previous_release)
        raise


def uninstall() -> None:
    """Undo :func:`install`: torch's functions and classes, ``torch.cuda``'s names (after ``transfer_to_npu``),
    TorchScript's builtin table, ``sys.modules`` and ``sys.meta_path`` as they were, no ``torch.npu``. The
    ``torch.ops.npu`` operators stay defined (torch.library cannot drop a schema while it may be referenced)."""
    _device.unmap_npu_device()
    _metadata.remove_finder()
    package = sys.modules[__package__]
    package.npu._reset_runtime()
    ours = {id(module) for name, module in sys.modules.items() if name.startswith(__package__)}
    for name in [name for name in sys.modules if name == "torch_npu" or name.startswith("torch_npu.")]:
        if id(sys.modules[name]) in ours or name.startswith("torch_npu.contrib"):
            del sys.modules[name]


@contextlib.contextmanager
def installed(device: str | torch.device | None = None, *, release: str | None = None) -> Iterator[None]:
    """``with installed("cpu"):`` :func:`install` for the block, :func:`uninstall` after it."""
    install(device, release=release)
    try:
        yield
    finally:
        uninstall()


def _register_ops() -> None:
    libraries = _STATE["libraries"]
    release = _registry.active_release()
    for name, op in _registry.OPS.items():
        if name in _STATE["defined"]:
            continue
        if op.namespace not in libraries:
            libraries[op.namespace] = torch.library.Library(op.namespace, "FRAGMENT")
        library = libraries[op.namespace]
        schema = op.schema(release)
        library.define(schema.text)
        # CompositeImplicitAutograd: the call decomposes into our function, whose cann_attn custom ops carry the
        # autograd and fake (torch.compile) registrations. The schema's name carries its overload
        # ("_npu_dropout_gen_mask.Tensor").
        library.impl(schema.name, op.wrapper, "CompositeImplicitAutograd")
        _STATE["defined"].add(name)


def _seeding_dropout_too(original):
    @functools.wraps(original)
    def manual_seed(seed):
        generator = original(seed)
        _rng.manual_seed(seed)
        return generator

    return manual_seed
