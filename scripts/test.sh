#!/usr/bin/env bash
# Installs everything the test suite needs (Debian packages and the Python test extra), then runs
# ruff and the tests. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_PACKAGES=(prometheus prometheus-node-exporter systemd)
missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install -q -e '.[test]'
"$PYTHON" -m ruff check .
"$PYTHON" -m pytest -q "$@"
