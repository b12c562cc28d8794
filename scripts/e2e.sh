#!/usr/bin/env bash
# End-to-end tests of `lily serve`: starts the real server on the bundled tiny
# model and drives it with the official OpenAI SDK (tests/e2e/*.test.mjs,
# node's built-in test runner), including a bounded load test.
#
#   scripts/e2e.sh [path/to/lily]        (default: build/lily)
#
# Installs the SDK into tests/e2e/node_modules (npm ci) when it is missing.
# ctest runs this for every build (tests/CMakeLists.txt). LILY_SKIP_E2E=1
# skips it; LILY_LOAD_CLIENTS / LILY_LOAD_REQUESTS / LILY_LOAD_MAX_TOKENS size
# the load test.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${1:-$ROOT/build/lily}
E2E=$ROOT/tests/e2e

if [ "${LILY_SKIP_E2E:-0}" = 1 ]; then
  echo "e2e: skipped (LILY_SKIP_E2E=1)"
  exit 0
fi
if [ ! -x "$BIN" ]; then
  echo "e2e: no lily binary at $BIN (build first)" >&2
  exit 1
fi
if ! command -v node >/dev/null; then
  echo "e2e: node is not installed (scripts/setup.sh installs nodejs and npm)" >&2
  exit 1
fi
if [ ! -f "$E2E/node_modules/openai/package.json" ]; then
  echo "e2e: installing the OpenAI SDK into tests/e2e/node_modules"
  (cd "$E2E" && npm ci --no-audit --no-fund --loglevel=error)
fi

export LILY_BIN=$BIN
status=0
for f in "$E2E"/*.test.mjs; do
  echo "e2e: node --test $(basename "$f")"
  start=$(date +%s)
  if ! node --test "$f"; then
    status=1
    echo "e2e: FAILED $(basename "$f")" >&2
  fi
  echo "e2e: $(basename "$f") took $(( $(date +%s) - start ))s"
done
exit $status
