"""A covering sample of the parametrised cases, for the second run of the operator matrix on the Triton kernels
(`make test`; `make test-full` runs every case).

`CANN_ATTN_TEST_SAMPLE=N` keeps, of each test function's parametrised cases, every case that brings a parameter
value no kept case has yet, then every N-th of the rest (in collection order). Every test function still runs, and
every value of every parameter (each dtype, layout, sparse mode, feature switch) still runs at least once on each
path; only the combinations are thinned. Unparametrised tests always run; the hypothesis tests of the matrix draw
`fuzz_examples(n)` configurations, n / N of their full count.
"""

from __future__ import annotations

import os
from collections import defaultdict

SAMPLE_VARIABLE = "CANN_ATTN_TEST_SAMPLE"


def sample_stride() -> int:
    """N of `CANN_ATTN_TEST_SAMPLE=N` (1 or unset: every case)."""
    raw = os.environ.get(SAMPLE_VARIABLE, "").strip()
    if not raw:
        return 1
    stride = int(raw)
    if stride < 1:
        raise ValueError(f"{SAMPLE_VARIABLE} must be a positive integer, got {raw!r}")
    return stride


def _value_key(value: object) -> str:
    # Parameter values may be unhashable (tensors, dicts); their repr identifies them within one collection.
    return f"{type(value).__name__}:{value!r}"


def covering_sample(items: list, stride: int) -> tuple[list, list]:
    """(kept, dropped) of pytest items: per test function, the cases covering every parameter value first, then
    every `stride`-th of the others."""
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            groups[(str(item.path), item.originalname)].append(item)
    drop: set[int] = set()
    for cases in groups.values():
        covered: set[tuple[str, str]] = set()
        rest = []
        for case in cases:
            values = {(name, _value_key(value)) for name, value in case.callspec.params.items()}
            if values - covered:
                covered |= values
            else:
                rest.append(case)
        drop.update(id(case) for index, case in enumerate(rest) if index % stride != stride - 1)
    return [item for item in items if id(item) not in drop], [item for item in items if id(item) in drop]


def fuzz_examples(full: int) -> int:
    """A hypothesis test's `max_examples` under the sample: `full` divided by N, at least 10 (or `full` itself
    where that is smaller), so the random configurations still reach every drawn feature."""
    return max(min(full, 10), full // sample_stride())
