#!/usr/bin/env bash
# The test command: builds lily (Release) and runs every test, then builds and
# runs the tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
# Set LILY_SKIP_SANITIZE=1 to run only the first pass.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=$(nproc)

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$JOBS"
ctest --test-dir build --output-on-failure -j"$JOBS" || { bash scripts/ci-digest.sh build; exit 1; }

if [ "${LILY_SKIP_SANITIZE:-0}" != 1 ]; then
  # The CUDA code is compiled (and its tests skip without a GPU) in the first
  # pass; the sanitizer pass checks the host code only.
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLILY_SANITIZE=ON -DLILY_CUDA=OFF >/dev/null
  cmake --build build-asan -j"$JOBS"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j"$JOBS" || { bash scripts/ci-digest.sh build-asan; exit 1; }
fi
