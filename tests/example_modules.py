"""Loading a script of examples/ as a module for its smoke tests (docs/guides/*.md run these examples)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def loaded_example(name: str) -> Iterator[ModuleType]:
    """Yields examples/<name>.py imported as the module ``<name>_example`` (registered in sys.modules while in use,
    since dataclasses look their module up by name), then unregisters it: the body of a module-scoped fixture."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
