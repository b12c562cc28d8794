#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine: kernel tests (decode and
# prefill), model fixture tests (CUDA vs reference vs CPU) and the benchmark
# (decode and prefill), with a summary.
#
#   scripts/gpu-check.sh build   # here (needs nvcc, not a GPU): builds the
#                                # standalone binaries into build-cuda/
#   scripts/gpu-check.sh run     # on the GPU machine (carry build-cuda's
#                                # lily_cuda_tests and lily_bench_device)
#
# Environment: OUT (log folder, default /tmp/lily-gpu-check), CTX (bench
# decode contexts), PREFILL (bench prompt lengths, "none" to skip), FILTER (gtest filter), BENCH_ARGS (extra bench arguments),
# BENCH_Q8KV=0 (skip the q8 KV decode run),
# SKIP_TESTS=1, SKIP_BENCH=1.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${LILY_CUDA_BUILD:-build-cuda}
OUT=${OUT:-/tmp/lily-gpu-check}
mkdir -p "$OUT"
LOG=$OUT/log

build() {
  cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build "$B" -j"$(nproc)" --target lily_cuda_tests lily_bench_device
}

run() {
  # The test binary names the fixture folder by its absolute path here.
  local want=/work/main
  if [[ $(pwd -P) != "$want" && ! -e $want ]]; then mkdir -p /work && ln -s "$(pwd -P)" "$want"; fi
  {
    echo "== device"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  } | tee -a "$LOG"
  local tests_rc=0 bench_rc=0
  if [[ ${SKIP_TESTS:-0} != 1 ]]; then
    echo "== tests" | tee -a "$LOG"
    timeout 200 "$B/lily_cuda_tests" --gtest_filter="${FILTER:-*Cuda*}" 2>&1 | tee "$OUT/tests.log" | tail -60
    tests_rc=${PIPESTATUS[0]}
    grep -E "^\[ cuda|FAILED|PASSED|SKIPPED" "$OUT/tests.log" >>"$LOG"
  fi
  if [[ ${SKIP_BENCH:-0} != 1 ]]; then
    echo "== bench" | tee -a "$LOG"
    nvidia-smi dmon -s pc -d 1 >"$OUT/dmon.log" 2>&1 &
    local dmon=$!
    timeout 300 "$B/lily_bench_device" --synthetic qwen3.6-35b-a3b --backend cuda \
      --ctx "${CTX:-256,4096,32768,131072}" --prefill "${PREFILL:-256,4096,32768,131072}" --profile --json "$OUT/bench-qwen3.6-35b-a3b.json" \
      ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG"
    bench_rc=${PIPESTATUS[0]}
    if [[ ${BENCH_Q8KV:-1} == 1 ]]; then
      # The same decode with the q8 KV cache (the 128K target is met there).
      echo "-- kv q8" | tee -a "$LOG"
      timeout 120 "$B/lily_bench_device" --synthetic qwen3.6-35b-a3b --backend cuda --kv q8 \
        --ctx "${CTX:-256,4096,32768,131072}" --repeats 3 --json "$OUT/bench-qwen3.6-35b-a3b-kvq8.json" 2>&1 | tee -a "$LOG"
    fi
    if [[ ${VARIANTS:-1} == 1 ]]; then
      # What the launch machinery buys: the same step without PDL, and
      # without graphs (kernels launched one by one from the host).
      # LILY_CUDA_DN_IN=1: v21's DeltaNet step in the in_proj's launch
      # (off by default until measured), with each cluster size.
      for v in ${VARIANT_LIST:-"LILY_CUDA_PDL=0" "LILY_CUDA_GRAPHS=0" "LILY_CUDA_MV_MINBLOCKS=3" "LILY_CUDA_DN_IN=1" "LILY_CUDA_DN_IN=1 LILY_CUDA_DN_CLUSTER=1"}; do
        echo "-- variant $v" | tee -a "$LOG"
        env $v timeout 60 "$B/lily_bench_device" --synthetic qwen3.6-35b-a3b --backend cuda --ctx 4096 \
          --repeats 3 2>&1 | tail -1 | sed "s/^/$v /" | tee -a "$LOG"
      done
    fi
    kill "$dmon" 2>/dev/null
    if [[ ${BENCH_30B:-1} == 1 ]]; then
      timeout 90 "$B/lily_bench_device" --synthetic qwen3-30b-a3b --backend cuda --ctx 4096 \
        --json "$OUT/bench-qwen3-30b-a3b.json" 2>&1 | tee -a "$LOG"
    fi
  fi
  echo "== summary" | tee -a "$LOG"
  {
    echo "tests exit $tests_rc, bench exit $bench_rc"
    grep -E "^\[  (PASSED|FAILED) " "$OUT/tests.log" 2>/dev/null
    grep -E "^\[ cuda" "$OUT/tests.log" 2>/dev/null
    grep -E "^ +[0-9]+ +[0-9.]+ " "$LOG"
  } | tee -a "$LOG"
  [[ $tests_rc == 0 && $bench_rc == 0 ]]
}

case "${1:-run}" in
  build) build ;;
  run) run ;;
  all) build && run ;;
  *) echo "usage: $0 build|run|all" >&2; exit 2 ;;
esac
