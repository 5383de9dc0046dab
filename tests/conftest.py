"""Shared test configuration: ``import oracle`` from this folder, hypothesis profiles, a seeded RNG."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; the flag is read when a kernel module is first
# imported, so it must be set before any test imports one. backend="auto" still picks the reference backend on
# CPU unless CANN_ATTN_BACKEND=triton (the Triton matrix run of `make test`).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, settings

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# "ci" (default): no deadline (CPU timings vary a lot on busy machines), tolerant of slow generation.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
# "dev": quicker local iterations.
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The suite runs as `pytest -n 2` on 2 cores: one intra-op thread per worker avoids oversubscription, under
# which every small tile operation waits on a busy sibling thread (10x slower runs).
torch.set_num_threads(1)


@pytest.fixture
def single_thread():
    """Tiny shapes: run torch single-threaded (intra-op threads only add overhead, and on a loaded 2-core machine
    float64 GEMMs with a thread pool can take ~50 ms each); restores the previous setting. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def rng(request) -> torch.Generator:
    """A CPU torch.Generator seeded from the test's node id (stable run to run, different per test).

    Also seeds torch's global RNG with the same value.
    """
    seed = 0
    for ch in request.node.nodeid:
        seed = (seed * 131 + ord(ch)) % (2**31 - 1)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=["reference", "reference_pytorch_path", "triton"])
def every_path(request, monkeypatch) -> str:
    """The `backend=` value of each computation path: the reference backend with its native loops, the reference
    backend's PyTorch path (CANN_ATTN_NATIVE=0) and the Triton kernels (the interpreter on CPU)."""
    if request.param == "triton":
        pytest.importorskip("triton")
        return "triton"
    if request.param == "reference_pytorch_path":
        from cann_attn.backends.reference import native

        monkeypatch.setenv(native.ENV_SWITCH, "0")
    return "reference"


def pytest_collection_modifyitems(config, items) -> None:
    """`CANN_ATTN_TEST_SAMPLE=N`: a covering sample of the parametrised cases (tests/matrix_sample.py)."""
    from matrix_sample import covering_sample, sample_stride

    stride = sample_stride()
    if stride == 1:
        return
    kept, dropped = covering_sample(items, stride)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
