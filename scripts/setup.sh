#!/usr/bin/env bash
# Installs what lily needs to build and test on Debian 12 (run as root or with sudo).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
PKGS=(build-essential cmake pkg-config git
      nlohmann-json3-dev libpcre2-dev libutf8proc-dev libcpp-httplib-dev libssl-dev
      libgtest-dev libgmock-dev libbenchmark-dev
      nodejs npm)
missing=()
for p in "${PKGS[@]}"; do
  # A node/npm from elsewhere (e.g. NodeSource, which bundles npm) will do.
  if [ "$p" = nodejs ] && command -v node >/dev/null; then continue; fi
  if [ "$p" = npm ] && command -v npm >/dev/null; then continue; fi
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The OpenAI SDK for the end-to-end tests of `lily serve` (tests/e2e, pinned
# by its package-lock.json; scripts/e2e.sh also installs it when missing).
(cd "$(dirname "$0")/../tests/e2e" && npm ci --no-audit --no-fund --loglevel=error)
