#!/usr/bin/env bash
# CycloneDX SBOMs (JSON) of gpumon's Python dependencies, made with cyclonedx-bom's cyclonedx-py:
#
#   scripts/sbom.sh wheel [OUT]       the wheel's dependency set: builds the wheel from this checkout,
#                                     installs it into a throwaway venv (runtime dependencies only;
#                                     GPUMON_SBOM_EXTRAS=all for the extras too) and lists that venv.
#                                     OUT defaults to dist/gpumon-exporter-VERSION.cdx.json.
#   scripts/sbom.sh venv VENV OUT     an installed venv, as it is: the container image's /opt/gpumon
#                                     (the Dockerfile runs this; the image carries /opt/gpumon/sbom.cdx.json).
#
# The root component is gpumon-exporter (name, version, licence and links from pyproject.toml); pip
# itself is left out of the venv so only what gpumon runs with is listed. cyclonedx-py is taken from
# $CYCLONEDX_PY, PATH or the Python running this, and otherwise installed with that Python's pip into a
# throwaway directory (a throwaway venv where it has no pip); pip honours PIP_NO_INDEX and
# PIP_FIND_LINKS, the Dockerfile's offline route.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON="${PYTHON:-python3}"
say() { printf 'sbom.sh: %s\n' "$*" >&2; }
usage() { say "usage: $0 wheel [OUT] | venv VENV OUT"; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cyclonedx() {
    if [ -n "${CYCLONEDX_PY:-}" ]; then "$CYCLONEDX_PY" "$@"
    elif command -v cyclonedx-py >/dev/null; then cyclonedx-py "$@"
    elif "$PYTHON" -c 'import cyclonedx_py' 2>/dev/null; then "$PYTHON" -m cyclonedx_py "$@"
    elif "$PYTHON" -m pip --version >/dev/null 2>&1; then
        # No venv to make (ensurepip costs seconds): the tool goes into a throwaway directory, which
        # only the tool's own interpreter sees (-I: never in the environment its probe of VENV runs in).
        say "cyclonedx-py not found: installing cyclonedx-bom into a throwaway directory"
        "$PYTHON" -m pip install --quiet --target "$work/tool" cyclonedx-bom
        "$PYTHON" -I -c 'import runpy, sys
sys.path.insert(0, sys.argv.pop(1))
sys.argv[0] = "cyclonedx-py"
runpy.run_module("cyclonedx_py", run_name="__main__")' "$work/tool" "$@"
    else
        say "cyclonedx-py not found: installing cyclonedx-bom into a throwaway venv"
        "$PYTHON" -m venv "$work/tool"
        "$work/tool/bin/pip" install --quiet cyclonedx-bom
        "$work/tool/bin/cyclonedx-py" "$@"
    fi
}

# sbom VENV OUT: the SBOM of VENV, its root component gpumon-exporter at the version installed there.
sbom() {
    local venv=$1 out=$2 version
    version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("gpumon-exporter"))')
    # pyproject.toml's version is dynamic (gpumon.__version__); cyclonedx-py reads a static one.
    sed "s/^dynamic = \[\"version\"\]\$/version = \"$version\"/" "$REPO/pyproject.toml" > "$work/pyproject.toml"
    grep -q "^version = \"$version\"\$" "$work/pyproject.toml" || { say "no dynamic version in pyproject.toml"; exit 1; }
    mkdir -p "$(dirname "$out")"
    cyclonedx environment --pyproject "$work/pyproject.toml" --mc-type application --output-reproducible \
        --of JSON -o "$out" "$venv/bin/python"
    say "wrote $out (gpumon-exporter $version)"
}

case "${1:-}" in
    wheel)
        [ $# -le 2 ] || usage
        "$PYTHON" -m pip wheel --no-deps --quiet -w "$work/dist" "$REPO"
        wheel=$(ls "$work"/dist/gpumon_exporter-*.whl)
        "$PYTHON" -m venv "$work/venv"
        "$work/venv/bin/python" -m pip install --quiet "$wheel${GPUMON_SBOM_EXTRAS:+[$GPUMON_SBOM_EXTRAS]}"
        "$work/venv/bin/python" -m pip uninstall --quiet --yes pip setuptools wheel 2>/dev/null || true
        version=$("$work/venv/bin/python" -c 'import importlib.metadata as m; print(m.version("gpumon-exporter"))')
        sbom "$work/venv" "${2:-$REPO/dist/gpumon-exporter-$version.cdx.json}"
        ;;
    venv)
        [ $# -eq 3 ] || usage
        [ -x "$2/bin/python" ] || { say "$2 is not a venv (no bin/python)"; exit 2; }
        sbom "$2" "$3"
        ;;
    *) usage ;;
esac
