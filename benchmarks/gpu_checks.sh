#!/usr/bin/env bash
# Every pending GPU check in one device call (METHOD.md: few, full calls). Run it on the lent GPU machine from
# the repository root, with that machine's own python3 (PyTorch with CUDA and Triton are installed there):
#
#   bash benchmarks/gpu_checks.sh            # results under $OUT (device tool) or benchmarks/results
#
# A session is lent 15 minutes of device time, start included, and a fresh machine compiles every Triton
# specialization from scratch: on an H200 (2026-11-26) the GPU tests ran at ~15-20 s per test, so the whole test
# set does not fit one call. The steps therefore run in order of what has never been recorded, each under its own
# time limit (seconds; override with the environment variables named below):
#   1. the dense and DSA GPU benchmarks in their quick form (JSON + PNG named after the GPU),
#   2. the GPU tests (`pytest -m gpu`), the newest features first, with per-test durations in the log,
#   3. the context-parallel NCCL tests (skipped with fewer than 2 GPUs).
# Each step's log is kept; a failing or timed-out step (exit 124) does not stop the later ones, and the exit
# status is the worst one.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$RESULTS"
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RESULTS/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$RESULTS/gpu.txt"

step() {
  local name=$1; shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$RESULTS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc"
  [ "$rc" -gt "$status" ] && status=$rc
}

step bench_gpu_dense timeout "${DENSE_SECONDS:-170}" python3 benchmarks/bench_gpu_dense.py --out "$RESULTS" \
  ${DENSE_ARGS:---quick}
step bench_gpu_dsa timeout "${DSA_SECONDS:-110}" python3 benchmarks/bench_gpu_dsa.py --out "$RESULTS" \
  ${DSA_ARGS:---quick}
step gpu_tests timeout "${TESTS_SECONDS:-330}" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=0 \
  tests/test_gpu_npu_device.py tests/test_gpu_atb.py tests/test_gpu_sinks.py tests/test_gpu_fia.py tests/test_gpu_paged.py tests/test_gpu_torch_npu.py \
  tests/test_gpu_merge.py tests/test_gpu_quant_dsa.py \
  tests/test_gpu_dsa.py tests/test_gpu_dense.py
step gpu_context_parallel timeout "${CP_SECONDS:-60}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs \
  tests/test_gpu_context_parallel.py
exit $status
