#!/usr/bin/env bash
# Builds and runs the prefill kernel tests (tests/cuda_prefill_test.cpp)
# without the rest of the CMake build: nvcc for src/backend/cuda/prefill_*.cu,
# the host compiler for the test and the CPU reference sources it uses.
#   scripts/prefill-check.sh build      # compile only (works without a GPU)
#   scripts/prefill-check.sh run [args] # build if needed, then run the tests
#   LILY_PREFILL_BENCH=1 scripts/prefill-check.sh run   # also the timings
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
CXX=${CXX:-g++}
OUT=${PREFILL_BUILD:-build-prefill}
mkdir -p "$OUT"
CUFLAGS=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -lineinfo
         --expt-relaxed-constexpr -Xcompiler=-Wall,-Wextra)
CXXFLAGS=(-std=c++20 -O2 -Wall -Wextra -Isrc -I"$(dirname "$NVCC")/../include" -DLILY_HAVE_CUDA=1)

build() {
  local objs=()
  for f in src/backend/cuda/prefill_*.cu; do
    local o="$OUT/$(basename "${f%.cu}").o"
    if [[ ! -f $o || $f -nt $o || src/backend/cuda/prefill_common.cuh -nt $o || src/backend/cuda/prefill.h -nt $o ]]; then
      "$NVCC" "${CUFLAGS[@]}" -Xptxas -v -c "$f" -o "$o" 2> "$OUT/$(basename "$f").ptxas.txt" ||
        { cat "$OUT/$(basename "$f").ptxas.txt"; exit 1; }
      grep -E "warning|error" "$OUT/$(basename "$f").ptxas.txt" || true
    fi
    objs+=("$o")
  done
  for f in tests/cuda_prefill_test.cpp src/backend/cpu/deltanet.cpp src/backend/cpu/ops.cpp src/core/thread_pool.cpp; do
    local o="$OUT/$(basename "${f%.cpp}").o"
    if [[ ! -f $o || $f -nt $o || src/backend/cuda/prefill.h -nt $o ]]; then
      "$CXX" "${CXXFLAGS[@]}" -c "$f" -o "$o"
    fi
    objs+=("$o")
  done
  cc -O2 -c scripts/prefill_glibc_compat.c -o "$OUT/glibc_compat.o"
  objs+=("$OUT/glibc_compat.o")
  "$NVCC" -o "$OUT/cuda_prefill_test" "${objs[@]}" -lgtest -lgtest_main -lpthread \
    -Xcompiler=-static-libstdc++,-static-libgcc
}

case "${1:-run}" in
  build) build ;;
  run)
    shift || true
    [[ -x $OUT/cuda_prefill_test ]] || build
    "$OUT/cuda_prefill_test" "$@"
    ;;
  *) echo "usage: $0 build|run [gtest args]" >&2; exit 2 ;;
esac
