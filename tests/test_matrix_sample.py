"""The covering sample behind `CANN_ATTN_TEST_SAMPLE` (tests/matrix_sample.py): every test function and every
value of every parameter survive the thinning."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from matrix_sample import covering_sample, sample_stride


@dataclass
class _CallSpec:
    params: dict


@dataclass
class _Item:
    originalname: str
    params: dict | None
    path: Path = field(default_factory=lambda: Path("tests/test_x.py"))

    @property
    def callspec(self):
        if self.params is None:
            raise AttributeError("callspec")
        return _CallSpec(self.params)


def _grid(name: str, **axes) -> list[_Item]:
    return [_Item(name, dict(zip(axes, values, strict=True))) for values in itertools.product(*axes.values())]


@pytest.mark.parametrize("stride", [2, 3, 5, 100])
def test_every_value_of_every_parameter_is_kept(stride):
    items = (_grid("test_a", dtype=["fp16", "bf16", "fp32"], layout=["BSND", "BNSD", "TND"], mode=[0, 2, 3, 4])
             + _grid("test_b", seed=list(range(7))) + [_Item("test_plain", None)])
    kept, dropped = covering_sample(items, stride)
    assert len(kept) + len(dropped) == len(items) and len(dropped) > 0
    assert any(item.originalname == "test_plain" for item in kept)
    for name in ("test_a", "test_b"):
        wanted = {(k, repr(v)) for item in items if item.originalname == name for k, v in item.params.items()}
        got = {(k, repr(v)) for item in kept if item.originalname == name for k, v in item.params.items()}
        assert got == wanted, name
    assert [item for item in items if item in kept] == kept  # collection order kept


def test_stride_one_keeps_everything_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv("CANN_ATTN_TEST_SAMPLE", raising=False)
    assert sample_stride() == 1
    monkeypatch.setenv("CANN_ATTN_TEST_SAMPLE", "0")
    with pytest.raises(ValueError, match="positive integer"):
        sample_stride()
    items = _grid("test_a", dtype=["fp16", "bf16"], layout=["BSND", "TND"])
    assert covering_sample(items, 1) == (items, [])


def test_fuzz_examples_shrink_with_the_stride_but_keep_a_floor(monkeypatch):
    from matrix_sample import fuzz_examples

    monkeypatch.delenv("CANN_ATTN_TEST_SAMPLE", raising=False)
    assert [fuzz_examples(n) for n in (5, 40, 200)] == [5, 40, 200]
    monkeypatch.setenv("CANN_ATTN_TEST_SAMPLE", "4")
    assert [fuzz_examples(n) for n in (5, 15, 40, 200)] == [5, 10, 10, 50]
