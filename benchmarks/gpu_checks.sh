#!/usr/bin/env bash
# The GPU checks and the GPU benchmarks in one run of under ten minutes on a fresh machine. Run it on a CUDA machine
# from the repository root, with a python3 that has PyTorch with CUDA and Triton:
#
#   bash benchmarks/gpu_checks.sh             # results under $OUT when it is set, else benchmarks/results
#   bash benchmarks/gpu_checks.sh --dry-run   # the steps, their time limits and commands; runs nothing
#
# On a fresh machine every Triton specialisation compiles from scratch (15-20 s per test when every autotune
# candidate compiles, enough to use up ten minutes before the benchmarks start), so:
#   - the benchmarks run first, and with CANN_ATTN_TRITON_AUTOTUNE=first (each autotuner keeps only its first
#     config, the one a launch without autotuning takes): one compile per specialisation instead of up to 28;
#   - the tests follow in priority order (the newest, never-run features first), on the same first configs;
#   - TRITON_CACHE_DIR is .triton_cache in the checkout: a cache built elsewhere and copied there is
#     used when its manifest's Triton and Python versions match the machine's (benchmarks/triton_cache.py check),
#     and each step logs how many kernels it compiled (new cubins in the cache = cache misses).
#
# Timing plan (minutes of this script). Budgets are each step's timeout in seconds, overridable by the environment
# variables named; their sum stays under ten minutes:
#   0:00-0:15  gpu_info              nvidia-smi, torch/triton versions, cache status            (INFO_SECONDS 15)
#   0:15-3:15  bench_gpu_dense       dense figures, --quick, first autotune configs             (DENSE_SECONDS 180)
#   3:15-5:15  bench_gpu_dsa         DSA figures, --quick, first autotune configs               (DSA_SECONDS 120)
#   5:15-8:45  gpu_tests             pytest -m gpu, newest features first, per-test durations   (TESTS_SECONDS 210)
#   8:45-9:30  gpu_context_parallel  NCCL tests (skipped with fewer than 2 GPUs)                (CP_SECONDS 45)
# So both figures are in hand about 5.5 minutes into the script.
# Each step's output goes to one log ($RESULTS/gpu_checks.log) and its exit status, seconds and compile count to
# $RESULTS/gpu_checks_steps.json, beside the benchmarks' JSON + PNG and test_gpu_paged's paged_gpu.jsonl (7 files).
# A failing or timed-out step (exit 124) does not stop the later ones; the exit status is the worst one.
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=src PYTHONUNBUFFERED=1
export CANN_ATTN_TRITON_AUTOTUNE=${CANN_ATTN_TRITON_AUTOTUNE:-first}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
PY=${PYTHON:-python3}
RESULTS=${OUT:-benchmarks/results}
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1

TESTS=(tests/test_gpu_graphs.py tests/test_gpu_precision.py tests/test_gpu_torch_npu_runtime.py
       tests/test_gpu_npu_device.py tests/test_gpu_atb.py tests/test_gpu_sinks.py tests/test_gpu_fia.py
       tests/test_gpu_paged.py
       tests/test_gpu_torch_npu.py tests/test_gpu_merge.py tests/test_gpu_quant_dsa.py
       tests/test_gpu_dsa.py tests/test_gpu_dense.py)
STEP_NAMES=(gpu_info bench_gpu_dense bench_gpu_dsa gpu_tests gpu_context_parallel)
STEP_BUDGETS=("${INFO_SECONDS:-15}" "${DENSE_SECONDS:-180}" "${DSA_SECONDS:-120}" "${TESTS_SECONDS:-210}"
              "${CP_SECONDS:-45}")
step_command() {
  case $1 in
    gpu_info) echo "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader &&" \
                   "$PY benchmarks/triton_cache.py check" ;;
    bench_gpu_dense) echo "$PY benchmarks/bench_gpu_dense.py --out $RESULTS ${DENSE_ARGS:---quick}" ;;
    bench_gpu_dsa) echo "$PY benchmarks/bench_gpu_dsa.py --out $RESULTS ${DSA_ARGS:---quick}" ;;
    gpu_tests) echo "$PY -m pytest -m gpu -q -p no:cacheprovider --durations=0 ${TESTS[*]}" ;;
    gpu_context_parallel) echo "$PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_gpu_context_parallel.py" ;;
  esac
}

if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_checks plan (CANN_ATTN_TRITON_AUTOTUNE=$CANN_ATTN_TRITON_AUTOTUNE, TRITON_CACHE_DIR=$TRITON_CACHE_DIR," \
       "results in $RESULTS)"
  start=0
  for i in "${!STEP_NAMES[@]}"; do
    end=$((start + STEP_BUDGETS[i]))
    printf '%2d:%02d-%2d:%02d  %-21s %4ss  %s\n' $((start / 60)) $((start % 60)) $((end / 60)) $((end % 60)) \
      "${STEP_NAMES[i]}" "${STEP_BUDGETS[i]}" "$(step_command "${STEP_NAMES[i]}")"
    start=$end
  done
  echo "total budget ${start}s (limit: 600s)"
  [ "$start" -le 600 ] || { echo "over the 10-minute limit of the whole run" >&2; exit 1; }
  exit 0
fi

mkdir -p "$RESULTS" "$TRITON_CACHE_DIR"
LOG=$RESULTS/gpu_checks.log
: >"$LOG"
SUMMARY=()
status=0
cubins() { find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l; }

for i in "${!STEP_NAMES[@]}"; do
  name=${STEP_NAMES[i]}
  command=$(step_command "$name")
  before=$(cubins)
  t0=$(date +%s)
  echo "== $name (budget ${STEP_BUDGETS[i]}s): $command" | tee -a "$LOG"
  timeout "${STEP_BUDGETS[i]}" bash -c "$command" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  seconds=$(($(date +%s) - t0))
  compiled=$(($(cubins) - before))
  echo "== $name exit $rc after ${seconds}s; $compiled kernels compiled (new cubins in the Triton cache)" | tee -a "$LOG"
  SUMMARY+=("{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $seconds, \"budget\": ${STEP_BUDGETS[i]}, \"compiled\": $compiled}")
  [ "$rc" -gt "$status" ] && status=$rc
done
(IFS=,; echo "[${SUMMARY[*]}]") >"$RESULTS/gpu_checks_steps.json"
exit $status
