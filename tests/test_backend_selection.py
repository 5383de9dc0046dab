"""`select_backend`: which backend computes a call, and why it falls back (docs/design.md "Public API")."""

from __future__ import annotations

import warnings

import pytest
import torch

from cann_attn.backends import BackendFallbackWarning, dispatch_counts, select_backend
from cann_attn.errors import ParamInvalidError

CPU = torch.device("cpu")
# select_backend only reads the device type, so a CUDA device object works without a GPU.
CUDA = torch.device("cuda")


def supported() -> None:
    return None


def unsupported() -> str:
    return "float64 is not a Triton dtype here"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("CANN_ATTN_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_unknown_backend_is_rejected():
    with pytest.raises(ParamInvalidError, match="backend: expected one of"):
        select_backend("cuda", CPU, "op", supported)


def test_auto_on_cpu_is_the_reference_backend():
    assert select_backend("auto", CPU, "op", supported) == "reference"


def test_reference_is_always_honoured():
    assert select_backend("reference", CUDA, "op", supported) == "reference"


def test_auto_on_cuda_picks_triton_when_supported():
    assert select_backend("auto", CUDA, "op", supported) == "triton"


def test_auto_on_cuda_warns_with_the_reason_when_it_falls_back():
    with pytest.warns(BackendFallbackWarning, match="float64 is not a Triton dtype"):
        assert select_backend("auto", CUDA, "my_op", unsupported) == "reference"


def test_auto_on_cuda_falls_back_for_an_op_without_kernels():
    with pytest.warns(BackendFallbackWarning, match="no Triton kernel implements"):
        assert select_backend("auto", CUDA, "my_op") == "reference"


def test_forced_triton_raises_with_the_reason():
    with pytest.raises(ParamInvalidError, match=r"backend: 'triton' cannot compute this my_op: float64"):
        select_backend("triton", CPU, "my_op", unsupported)


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ParamInvalidError, match="TRITON_INTERPRET=1"):
        select_backend("triton", CPU, "my_op", supported)


def test_forced_triton_on_cpu_runs_in_the_interpreter():
    assert select_backend("triton", CPU, "my_op", supported) == "triton"


def test_preference_env_makes_auto_prefer_triton_and_fall_back_quietly(monkeypatch):
    monkeypatch.setenv("CANN_ATTN_BACKEND", "triton")
    assert select_backend("auto", CPU, "op", supported) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_backend("auto", CPU, "op", unsupported) == "reference"


def test_preference_env_does_not_soften_an_explicit_request(monkeypatch):
    monkeypatch.setenv("CANN_ATTN_BACKEND", "triton")
    with pytest.raises(ParamInvalidError, match="float64"):
        select_backend("triton", CPU, "op", unsupported)


def test_preference_env_reference_pins_auto(monkeypatch):
    monkeypatch.setenv("CANN_ATTN_BACKEND", "reference")
    assert select_backend("auto", CUDA, "op", supported) == "reference"


def test_preference_env_is_validated(monkeypatch):
    monkeypatch.setenv("CANN_ATTN_BACKEND", "npu")
    with pytest.raises(ParamInvalidError, match="CANN_ATTN_BACKEND"):
        select_backend("auto", CPU, "op", supported)


def test_dispatch_counts_record_the_choice():
    before = dispatch_counts[("counted_op", "triton")]
    select_backend("auto", CUDA, "counted_op", supported)
    assert dispatch_counts[("counted_op", "triton")] == before + 1
