#!/usr/bin/env bash
# After a failed ctest run: the failures' own words again, last, where a CI
# log's tail shows them (ctest prints a failing test's output in the middle,
# before its long list of skipped tests).
#
#   scripts/ci-digest.sh BUILD_DIR
#
# Prints each failing node:test subtest (TAP "not ok" with its error block)
# and each GoogleTest failure with the lines after it, from the build's
# Testing/Temporary/LastTest.log.
set -uo pipefail
LOG=${1:?build dir}/Testing/Temporary/LastTest.log
[ -f "$LOG" ] || { echo "ci-digest: no $LOG"; exit 0; }
echo "================ failures (from $LOG) ================"
{
  grep -n -E -A 24 '^[[:space:]]*not ok ' "$LOG"
  grep -n -E -A 8 ': Failure$|^\[  FAILED  \] .*\(' "$LOG"
} | head -n 200
echo "======================================================"
