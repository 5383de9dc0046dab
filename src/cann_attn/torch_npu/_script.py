"""TorchScript sees through :func:`cann_attn.torch_npu.install` (docs/guides/torch_npu.md, "TorchScript").

install() replaces some of torch's callables by Python wrappers that map the npu device (``torch.zeros``,
``torch.device``...). ``torch.jit.script`` resolves a call to ``torch.zeros`` by looking the object up in its table of
builtins (``torch.jit._builtins``, keyed by the object's id); a Python wrapper is not in it, so TorchScript would try
to compile the wrapper's ``*args, **kwargs`` body and fail. Each wrapper is therefore entered in that table under
the aten operator its original maps to: a scripted ``torch.zeros(n, device=x.device)`` compiles to ``aten::zeros``
exactly as without install(). This keeps the device mapping in one place (the Python entry points) instead of a
second, lower-level one: renaming torch's PrivateUse1 device to "npu" would make it torch's current accelerator,
which torch.compile then fails to query, and a global TorchFunctionMode would put every torch call of the program
through Python. Scripted code cannot name the npu device itself (``device="npu"`` inside a ScriptFunction is parsed
by C++); it uses the devices of its tensors, which are the target's.

Annotations: TorchScript recognises ``d: torch.device`` (and ``torch.Generator``) by identity with torch's current
attribute; a function annotated before install() (torch's own class) or while it is installed (the mapping
constructor) must both resolve, so the annotation converter sees either as the attribute torch has now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.jit._builtins as _builtins
import torch.jit.annotations as _annotations

# id(replacement) -> the replacement, kept alive while its id is in torch's table (a freed id could be reused).
_MIRRORED: dict[int, Any] = {}


def mirror_builtin(original: Any, replacement: Any) -> None:
    """Enter ``replacement`` in TorchScript's builtin table under ``original``'s operator, if it has one.

    Called before ``replacement`` is installed: the first lookup builds torch's table from torch's own functions."""
    operator = _builtins._find_builtin(original)
    if operator is not None and id(replacement) not in _MIRRORED:
        _builtins._register_builtin(replacement, operator)
        _MIRRORED[id(replacement)] = replacement


def forget_builtin(replacement: Any) -> None:
    """Take ``replacement`` out of TorchScript's builtin table again (uninstall)."""
    if _MIRRORED.pop(id(replacement), None) is not None:
        _builtins._get_builtin_table().pop(id(replacement), None)


def annotation_converter(aliases: dict[str, tuple[Any, ...]]) -> Callable:
    """``torch.jit.annotations.try_ann_to_type`` seeing each of ``aliases[name]`` as ``getattr(torch, name)``."""
    convert = _annotations.try_ann_to_type

    def try_ann_to_type(ann, loc, rcb=None):
        for name, classes in aliases.items():
            if any(ann is cls for cls in classes):
                ann = getattr(torch, name)
                break
        return convert(ann, loc, rcb)

    return try_ann_to_type
