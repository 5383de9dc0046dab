"""``install()``: make unmodified torch_npu code run on cann_attn (docs/guides/torch_npu.md, "install()")."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator

import torch

from . import _device, _registry, _rng

_STATE: dict = {"libraries": {}, "defined": set(), "manual_seed": None}


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


def install(device: str | torch.device | None = None, *, release: str | None = None) -> None:
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

    Raises:
        TorchNpuPresentError: the real torch_npu is importable.
        ValueError: ``device`` is not a CPU or an available CUDA device.
    """
    package = sys.modules[__package__]
    origin = _real_torch_npu_origin(package)
    if origin is not None:
        raise TorchNpuPresentError(
            f"cann_attn.torch_npu.install(): the real torch_npu is importable ({origin}); use it on an NPU machine, "
            "or import cann_attn.torch_npu as torch_npu without install() to run these operators off the NPU")
    # Called again without a device (an example's own install() line after a test's install("cpu")): keep it.
    target = _device.target() if device is None and _device.target() is not None else _device.resolve_target(device)
    if release is not None:
        _registry.use_release(release)
    sys.modules["torch_npu"] = package
    sys.modules["torch_npu.npu"] = package.npu
    _register_ops()
    _seed_with_torch()
    _device.map_npu_device(target, package.npu)


def uninstall() -> None:
    """Undo :func:`install`: torch's functions, ``torch.manual_seed`` and ``sys.modules`` as they were, no
    ``torch.npu``. The ``torch.ops.npu`` operators stay defined (torch.library cannot drop a schema while it may be
    referenced) and ``torch.device("npu")`` keeps parsing (torch cannot rename its PrivateUse1 device twice)."""
    _device.unmap_npu_device()
    if _STATE["manual_seed"] is not None:
        torch.manual_seed = _STATE["manual_seed"]
        _STATE["manual_seed"] = None
    for name in ("torch_npu", "torch_npu.npu"):
        if sys.modules.get(name) in (sys.modules[__package__], sys.modules[__package__].npu):
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


def _seed_with_torch() -> None:
    if _STATE["manual_seed"] is not None:
        return
    original = torch.manual_seed

    def manual_seed(seed):
        generator = original(seed)
        _rng.manual_seed(seed)
        return generator

    manual_seed.__doc__ = original.__doc__
    _STATE["manual_seed"] = original
    torch.manual_seed = manual_seed
