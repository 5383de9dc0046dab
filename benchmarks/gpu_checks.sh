#!/usr/bin/env bash
# Every pending GPU check in one device call (METHOD.md: few, full calls). Run it on the lent GPU machine from
# the repository root, with that machine's own python3 (PyTorch with CUDA and Triton are installed there):
#
#   bash benchmarks/gpu_checks.sh            # results under $OUT (device tool) or benchmarks/results
#
# 1. the GPU tests (`pytest -m gpu`), 2. the dense and DSA GPU benchmarks (JSON + PNG named after the GPU).
# Each step's log is kept; a failing step does not stop the later ones, and the exit status is the worst one.
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

step gpu_tests python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_dense.py tests/test_gpu_dsa.py \
  tests/test_gpu_merge.py tests/test_gpu_paged.py tests/test_gpu_fia.py tests/test_gpu_torch_npu.py
step gpu_context_parallel python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_gpu_context_parallel.py
step bench_gpu_dense python3 benchmarks/bench_gpu_dense.py --out "$RESULTS" ${DENSE_ARGS:-}
step bench_gpu_dsa python3 benchmarks/bench_gpu_dsa.py --out "$RESULTS" ${DSA_ARGS:-}
exit $status
