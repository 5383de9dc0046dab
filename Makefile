# Set-up is idempotent: the first target that needs the virtual environment creates it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-full lint bench bench-check docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/cann-attn verify

# The operator test matrix and the hypothesis fuzzers again on the Triton kernels (the interpreter on CPU), against
# the same float64 oracle. `make test` runs a covering sample of it (tests/matrix_sample.py: every test function,
# every value of every parameter, a quarter of the other combinations and of the fuzz examples); `make test-full`
# runs every case.
TRITON_SAMPLE ?= 4
TRITON_MATRIX := tests/test_fa_forward.py tests/test_fa_backward.py tests/test_pfa.py \
	tests/test_sparse_attention.py tests/test_indexer.py tests/test_fa_hypothesis.py \
	tests/test_fa_backward_hypothesis.py tests/test_pfa_hypothesis.py tests/test_sparse_attention_hypothesis.py \
	tests/test_fia.py tests/test_atb_attention.py tests/test_kv_quant_sfa.py tests/test_fia_inference.py \
	tests/test_quant_indexer.py tests/test_dense_indexer.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 -q
	# The operators that use the native CPU loops, again with the loops switched off: the PyTorch path stays tested.
	CANN_ATTN_NATIVE=0 $(BIN)/python -m pytest -n 2 -q tests/test_sparse_attention.py tests/test_indexer.py \
		tests/test_fa_forward.py tests/test_fa_backward.py
	# ... and with the native loops on but the fused dense loops (which call PyTorch's BLAS) off.
	CANN_ATTN_NATIVE_BLAS=0 $(BIN)/python -m pytest -n 2 -q tests/test_fa_forward.py tests/test_fa_backward.py
	CANN_ATTN_TEST_SAMPLE=$(TRITON_SAMPLE) CANN_ATTN_BACKEND=triton TRITON_INTERPRET=1 \
		$(BIN)/python -m pytest -n 2 -q $(TRITON_MATRIX)

test-full:
	$(MAKE) test TRITON_SAMPLE=1

lint: $(STAMP)
	$(BIN)/ruff check .

# The documentation site into site/: the figures first (docs/figures.py draws them from the library's rules; the
# PNGs are committed, so mkdocs alone also builds the site), then the pages with every warning (broken link or anchor, page missing from the nav, docstring
# problem) an error. `make test` builds it too (tests/test_docs.py) and runs every example in README.md and docs/.
docs: $(STAMP)
	$(BIN)/python docs/figures.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/cann-attn bench --out benchmarks/results

# The performance guard (not part of `test`: timings are not tests): a quick subset of the benchmark ratios against
# benchmarks/baseline.json, failing on a drop beyond the noise margin (docs/performance.md; a few minutes on 2 cores).
# BENCH_PYTHON=/path/to/python uses another interpreter (with PYTHONPATH=src) instead of the project venv;
# BENCH_CHECK_ARGS passes options, e.g. BENCH_CHECK_ARGS=--update-baseline.
BENCH_PYTHON ?= $(BIN)/python
bench-check: $(if $(filter $(BIN)/python,$(BENCH_PYTHON)),$(STAMP))
	PYTHONPATH=src $(BENCH_PYTHON) benchmarks/perf_guard.py $(BENCH_CHECK_ARGS)

clean:
	rm -rf $(VENV) build dist site src/*.egg-info
