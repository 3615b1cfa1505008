#!/usr/bin/env bash
# Installs everything the test suite needs (Debian packages and the Python test extra), then runs
# ruff and the tests. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."

# prometheus/promtool: end-to-end scrapes and rule tests; node_exporter: the benchmarks' peer;
# systemd: systemd-analyze for the unit; buildah, debootstrap: the container image build;
# shellcheck: the VM installer; nodejs (with npm): the KQL checker; apache2-utils: ab, the
# benchmarks' load generator. kubectl (with its built-in kustomize) is expected on PATH: it is not
# in Debian, see docs/deployment.md.
DEBIAN_PACKAGES=(prometheus prometheus-node-exporter systemd buildah debootstrap shellcheck nodejs apache2-utils)
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

# Policy and schema checkers for the Kubernetes manifests live in their own venv: checkov pins
# versions of common packages that would otherwise be downgraded in the main environment.
TOOLS="${DEPLOY_TOOLS_DIR:-/opt/gpumon-tools}"
if [ ! -x "$TOOLS/bin/checkov" ] || [ ! -x "$TOOLS/bin/kubernetes-validate" ]; then
    "$PYTHON" -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q checkov==3.3.30 kubernetes-validate==1.37.0
fi
export DEPLOY_TOOLS_BIN="$TOOLS/bin"

# The Kusto language service parses the Workbook's KQL against the DCR template's table schemas.
npm ci --prefix tests/kql --no-audit --no-fund --loglevel=error
"$PYTHON" -m ruff check .
"$PYTHON" -m pytest -q "$@"
