"""Shared test configuration: ``import oracle`` from this folder, hypothesis profiles, a seeded RNG."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# "ci" (default): no deadline (CPU timings vary a lot on shared 2-core machines), tolerant of slow generation.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
# "dev": quicker local iterations.
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def rng() -> torch.Generator:
    """A CPU torch.Generator seeded from the test's node id (stable run to run, different per test)."""
    seed = 0
    node = os.environ.get("PYTEST_CURRENT_TEST", "")
    for ch in node.split(" ")[0]:
        seed = (seed * 131 + ord(ch)) % (2**31 - 1)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
