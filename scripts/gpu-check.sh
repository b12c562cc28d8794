#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine: kernel tests (decode and
# prefill), model fixture tests (CUDA vs reference vs CPU) and the benchmark
# (decode and prefill; per decode step the per-kind profile and the
# launch-by-launch trace, where each microsecond of a step goes), with a summary.
#
#   scripts/gpu-check.sh build   # here (needs nvcc, not a GPU): builds the
#                                # standalone binaries into build-cuda/
#   scripts/gpu-check.sh run     # on the GPU machine (carry build-cuda's
#                                # lily_cuda_tests and lily_bench_device)
#   scripts/gpu-check.sh ab      # on the GPU machine: decode A/B of variants
#                                # run alternately (AB_VARIANTS, below)
#
# Environment: OUT (log folder, default /tmp/lily-gpu-check), CTX (bench
# decode contexts), PREFILL (bench prompt lengths, "none" to skip), FILTER (gtest filter), BENCH_ARGS (extra bench arguments),
# BENCH_Q8KV=0 (skip the q8 KV decode run), REUSE (preamble lengths for the
# prefix-reuse bench, e.g. 4096,32768; unset: skipped),
# SKIP_TESTS=1, SKIP_BENCH=1. When tests fail, the failing ones run again
# under compute-sanitizer (racecheck, synccheck, memcheck) where it works.
# ab: AB_VARIANTS, variants separated by '|', each environment settings
# ("LILY_CUDA_DN_IN=1"; "-" for none) optionally followed by "@BINARY" (a
# lily_bench_device of another revision), run AB_ROUNDS (2) times in turn at
# CTX (4096,131072) with AB_ARGS (--repeats 3); prints each variant's median
# tok/s per context and its ratio to the first variant.
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
      --ctx "${CTX:-256,4096,32768,131072}" --prefill "${PREFILL:-256,4096,32768,131072}" --profile --trace --json "$OUT/bench-qwen3.6-35b-a3b.json" \
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
    if [[ -n ${REUSE:-} ]]; then
      # The prefix cache: time to first token of requests sharing a preamble.
      echo "-- prefix reuse" | tee -a "$LOG"
      timeout 180 "$B/lily_bench_device" --synthetic qwen3.6-35b-a3b --backend cuda --reuse "$REUSE" \
        --json "$OUT/bench-reuse.json" 2>&1 | tee -a "$LOG"
    fi
    if [[ ${BENCH_30B:-1} == 1 ]]; then
      timeout 90 "$B/lily_bench_device" --synthetic qwen3-30b-a3b --backend cuda --ctx 4096 \
        --json "$OUT/bench-qwen3-30b-a3b.json" 2>&1 | tee -a "$LOG"
    fi
  fi
  if [[ $tests_rc != 0 ]]; then sanitize_failed; fi
  echo "== summary" | tee -a "$LOG"
  {
    echo "tests exit $tests_rc, bench exit $bench_rc"
    grep -E "^\[  (PASSED|FAILED) " "$OUT/tests.log" 2>/dev/null
    grep -E "^\[ cuda" "$OUT/tests.log" 2>/dev/null
    grep -E "^ +[0-9]+ +[0-9.]+ " "$LOG"
  } | tee -a "$LOG"
  [[ $tests_rc == 0 && $bench_rc == 0 ]]
}

# The failing tests once more under compute-sanitizer (it may refuse the
# device: KINDS.md), each tool with a time limit.
sanitize_failed() {
  local failed
  failed=$(grep -E "^\[  FAILED  \] [A-Za-z0-9_/]+\.[A-Za-z0-9_/]+" "$OUT/tests.log" | awk '{sub(/,$/, "", $4); print $4}' |
    sort -u | paste -sd: -)
  [[ -z $failed ]] && return
  command -v compute-sanitizer >/dev/null || [[ -x /usr/local/cuda/bin/compute-sanitizer ]] || return
  local cs
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in racecheck synccheck memcheck; do
    echo "== compute-sanitizer --tool $tool on $failed" | tee -a "$LOG"
    timeout 120 "$cs" --tool "$tool" --print-limit 20 "$B/lily_cuda_tests" --gtest_filter="$failed" 2>&1 |
      tee "$OUT/sanitize-$tool.log" | grep -E "ERROR SUMMARY|Error|Race|Invalid|at 0x|by thread|FAILED" | head -40 | tee -a "$LOG"
  done
}

ab() {
  local want=/work/main
  if [[ $(pwd -P) != "$want" && ! -e $want ]]; then mkdir -p /work && ln -s "$(pwd -P)" "$want"; fi
  local ctx=${CTX:-4096,131072} rounds=${AB_ROUNDS:-2}
  IFS='|' read -r -a vs <<<"${AB_VARIANTS:-"-|LILY_CUDA_DN_IN=1"}"
  : >"$OUT/ab.tsv"
  for ((r = 1; r <= rounds; ++r)); do
    for i in "${!vs[@]}"; do
      local v=${vs[$i]} envs bin=$B/lily_bench_device
      envs=${v%%@*}
      [[ $v == *@* ]] && bin=${v#*@}
      [[ $envs == "-" || -z ${envs// /} ]] && envs=""
      echo "-- round $r variant $i: ${v}" | tee -a "$LOG"
      env $envs timeout 200 "$bin" --synthetic qwen3.6-35b-a3b --backend cuda --ctx "$ctx" \
        ${AB_ARGS:---repeats 3} 2>&1 | tee -a "$LOG" | grep -E "^ +[0-9]+ +[0-9.]+ " |
        awk -v i="$i" -v r="$r" '{print i "\t" r "\t" $1 "\t" $2}' >>"$OUT/ab.tsv"
    done
  done
  echo "== ab: median tok/s over $rounds rounds (ratio to variant 0)" | tee -a "$LOG"
  for i in "${!vs[@]}"; do
    local line="  [$i] ${vs[$i]}:"
    for c in ${ctx//,/ }; do
      local med base
      med=$(awk -v i="$i" -v c="$c" '$1 == i && $3 == c {print $4}' "$OUT/ab.tsv" | sort -g |
        awk '{a[NR] = $1} END {if (NR) print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2)}')
      base=$(awk -v c="$c" '$1 == 0 && $3 == c {print $4}' "$OUT/ab.tsv" | sort -g |
        awk '{a[NR] = $1} END {if (NR) print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2)}')
      if [[ -n $med && -n $base ]]; then
        line+=$(awk -v c="$c" -v m="$med" -v b="$base" 'BEGIN {printf "  ctx %s %.1f (%.3f)", c, m, m / b}')
      else
        line+="  ctx $c -"
      fi
    done
    echo "$line" | tee -a "$LOG"
  done
}

case "${1:-run}" in
  build) build ;;
  run) run ;;
  ab) ab ;;
  all) build && run ;;
  *) echo "usage: $0 build|run|ab|all" >&2; exit 2 ;;
esac
