"""Distribution metadata for ``torch_npu`` while :func:`cann_attn.torch_npu.install` is in effect
(docs/guides/torch_npu.md, "install(): unmodified code").

Libraries decide whether torch_npu is present from its installed distribution, not from the import system:
diffusers' ``is_torch_npu_available()`` asks ``importlib.metadata.version("torch_npu")``. A meta-path finder that
finds no modules but answers ``find_distributions`` gives them one: name ``torch_npu`` (found as ``torch-npu`` too,
as importlib.metadata normalises names), version that of the torch it runs on, since torch_npu numbers its releases
after the torch they extend (torch_npu 2.5.1 for torch 2.5.1), and ``top_level.txt`` naming the ``torch_npu``
package.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import torch

DISTRIBUTION_NAME = "torch_npu"


def torch_npu_version() -> str:
    """The version the distribution reports: torch's release, without a local part (``2.13.0+cpu`` -> ``2.13.0``)."""
    return torch.__version__.split("+")[0]


class _Distribution(importlib.metadata.Distribution):
    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: {DISTRIBUTION_NAME}\nVersion: {torch_npu_version()}\n"
                    "Summary: torch_npu's Python API on a CPU or CUDA device (cann_attn.torch_npu.install())\n"
                    f"Requires-Dist: torch=={torch_npu_version()}\n")
        if filename == "top_level.txt":
            return "torch_npu\n"
        return None

    def locate_file(self, path) -> Path:
        return Path(__file__).parent / path


class DistributionFinder(importlib.metadata.DistributionFinder):
    """On ``sys.meta_path`` while installed: finds no modules, only the torch_npu distribution."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=None):
        context = context or importlib.metadata.DistributionFinder.Context()
        name = context.name
        if name is None or _normalized(name) == DISTRIBUTION_NAME:
            yield _Distribution()


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


_FINDER = DistributionFinder()


def add_finder() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


def remove_finder() -> None:
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
