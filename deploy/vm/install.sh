#!/bin/sh
# Install, upgrade or remove gpumon as a systemd service on a GPU VM.
#
# Targets Ubuntu-HPC 22.04/24.04 and AlmaLinux 8/9 (any Ubuntu/Debian or RHEL-family host with
# systemd should do). Re-running it upgrades in place: the virtual environment is reused, the unit is
# rewritten, the config is never overwritten (the shipped default lands next to it as
# gpumon.toml.default), and the service is restarted.
#
# gpumon is installed from gpumon's own artefact only, never by a name another project owns (the name
# "gpumon" on PyPI belongs to an unrelated project; gpumon's distribution is "gpumon-exporter"):
#
#   install.sh                                 the one gpumon_exporter-*.whl next to this script
#   install.sh --wheel ./gpumon_exporter-0.1.0-py3-none-any.whl [--sha256 HEX] --extras azure
#   install.sh --version 0.1.0 --sha256 HEX    gpumon-exporter==0.1.0 from the index, hash-checked
#   install.sh --uninstall [--purge]           stop, disable, remove (--purge: config and state too)
#   install.sh --prefix /tmp/root --no-start   relocated install (paths in the unit point into it)
#   install.sh --no-kmsg ...                   without the kernel-log drop-in (gpumon.service.d/kmsg.conf)
#
# Where systemd is not PID 1 (a container, a chroot building an image) the files are installed and
# the unit enabled for the next boot, but nothing is started; --no-start leaves the unit alone too.
#   DESTDIR=/tmp/stage install.sh              staged install for packaging (unit keeps /opt/gpumon)
#
# Run `install.sh --help` for every option.
set -eu

VENV=/opt/gpumon
ETC=/etc/gpumon
UNIT_DIR=/etc/systemd/system
DESTDIR=${DESTDIR:-}
PREFIX=""
WHEEL=""
VERSION=""
SHA256=""
EXTRAS=""
PYTHON=""
SYSTEM_SITE=0
INSTALL_OS_DEPS=auto
START=1
KMSG=1
UNINSTALL=0
PURGE=0
PIP_ARGS=""

say() { printf 'gpumon-install: %s\n' "$*"; }
die() { printf 'gpumon-install: error: %s\n' "$*" >&2; exit 1; }

usage() {
    cat <<'USAGE'
Usage: install.sh [options]

Source of gpumon (one of them; nothing is ever installed by the bare name "gpumon", which on
PyPI is another project):
  (none)                the one gpumon_exporter-*.whl in the directory holding install.sh
  --wheel FILE          this wheel, built from gpumon's repository (`pip wheel --no-deps -w dist .`)
  --version X.Y.Z       the release gpumon-exporter==X.Y.Z from the package index (PyPI, or the
                        feed named with --pip-arg=--index-url=URL); needs --sha256
  --sha256 HEX          the wheel's SHA-256: checked before anything is installed (pip's
                        --require-hashes mode with --version)
  --extras LIST         optional extras: otel, azure, remote_write, attribution or all (comma-separated)
  --pip-arg ARG         extra argument for pip, repeatable (e.g. --pip-arg=--no-index
                        --pip-arg=--find-links=/srv/wheels for an offline mirror)

Python:
  --python PATH         interpreter for the virtual environment (>= 3.10); default: the newest
                        python3.1x found, installing one from the distribution if none is
  --system-site-packages
                        let the venv see the interpreter's packages (offline installs)
  --no-os-deps          never call apt-get/dnf

Layout:
  --prefix DIR          relocate everything under DIR (DIR/opt/gpumon, DIR/etc/gpumon,
                        DIR/etc/systemd/system); the unit refers to the relocated paths
  DESTDIR=DIR           (environment) stage under DIR for packaging; the unit keeps /opt/gpumon

Kernel log:
  --no-kmsg             leave out (or remove) the drop-in gpumon.service.d/kmsg.conf, which lets
                        the kmsg collector read /dev/kmsg (NVRM Xid, SXid, mlx5 lines) with
                        CAP_SYSLOG; installed by default

Actions:
  --no-start            write everything but do not call systemctl: the unit is neither enabled
                        nor started (implied by --prefix/DESTDIR). Where systemd is not running
                        (a container or a chroot) the unit is enabled for the next boot and
                        nothing is started, with or without it
  --uninstall           stop and disable the service, remove the unit and the venv
  --purge               with --uninstall: also remove /etc/gpumon and the state directory
  -h, --help            this text
USAGE
}

while [ $# -gt 0 ]; do
    case "$1" in
        --wheel) WHEEL=${2:?--wheel needs a file}; shift 2 ;;
        --wheel=*) WHEEL=${1#*=}; shift ;;
        --version) VERSION=${2:?--version needs a version}; shift 2 ;;
        --version=*) VERSION=${1#*=}; shift ;;
        --sha256) SHA256=${2:?--sha256 needs a hex digest}; shift 2 ;;
        --sha256=*) SHA256=${1#*=}; shift ;;
        --extras) EXTRAS=${2:?--extras needs a list}; shift 2 ;;
        --extras=*) EXTRAS=${1#*=}; shift ;;
        --pip-arg) PIP_ARGS="$PIP_ARGS ${2:?--pip-arg needs an argument}"; shift 2 ;;
        --pip-arg=*) PIP_ARGS="$PIP_ARGS ${1#*=}"; shift ;;
        --python) PYTHON=${2:?--python needs a path}; shift 2 ;;
        --python=*) PYTHON=${1#*=}; shift ;;
        --system-site-packages) SYSTEM_SITE=1; shift ;;
        --no-os-deps) INSTALL_OS_DEPS=no; shift ;;
        --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
        --prefix=*) PREFIX=${1#*=}; shift ;;
        --no-start) START=0; shift ;;
        --no-kmsg) KMSG=0; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        --purge) PURGE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done

[ -z "$WHEEL" ] || [ -z "$VERSION" ] || die "--wheel and --version exclude each other"
if [ -n "$VERSION" ] && [ -z "$SHA256" ]; then
    die "--version needs --sha256 (the digest published with the release): without it any file the index serves would do"
fi
case "$VERSION" in *[!0-9A-Za-z.+!-]*) die "not a version: $VERSION" ;; esac
case "$SHA256" in
    "") ;;
    *[!0-9a-fA-F]*) die "--sha256 must be 64 hex digits (got $SHA256)" ;;
    *) [ ${#SHA256} -eq 64 ] || die "--sha256 must be 64 hex digits (got $SHA256)"
       SHA256=$(printf '%s' "$SHA256" | tr 'A-F' 'a-f') ;;
esac
if [ -n "$PREFIX" ] && [ -n "$DESTDIR" ]; then die "--prefix and DESTDIR exclude each other"; fi
for extra in $(printf '%s' "$EXTRAS" | tr ',' ' '); do
    case "$extra" in otel|azure|remote_write|attribution|all) ;;
        *) die "--extras takes otel, azure, remote_write, attribution or all, comma-separated (got $EXTRAS)" ;;
    esac
done

if [ -n "$PREFIX" ]; then
    mkdir -p "$PREFIX"
    PREFIX=$(cd "$PREFIX" && pwd)
    VENV=$PREFIX$VENV ETC=$PREFIX$ETC UNIT_DIR=$PREFIX$UNIT_DIR
    START=0
    INSTALL_OS_DEPS=no
fi
if [ -n "$DESTDIR" ]; then
    START=0
    INSTALL_OS_DEPS=no
fi
# What the files are called on disk now (ROOT_*) and what the unit calls them at run time.
ROOT_VENV=$DESTDIR$VENV ROOT_ETC=$DESTDIR$ETC ROOT_UNIT_DIR=$DESTDIR$UNIT_DIR
STATE_DIRS="/var/lib/gpumon /var/lib/private/gpumon"
# gpumon's distribution name, its wheels' file-name prefix, and the old name, now another project's.
DIST=gpumon-exporter
WHEEL_PREFIX=gpumon_exporter-
FOREIGN_DIST=gpumon
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=""
cleanup() { if [ -n "$WORK" ]; then rm -rf "$WORK"; fi; }
trap cleanup EXIT

have() { command -v "$1" >/dev/null 2>&1; }

# systemd is the running init when /run/systemd/system exists: the test sd_booted(3) documents. In a
# container or a chroot it does not, and systemctl there can only edit files ("offline").
systemd_running() { [ -d /run/systemd/system ]; }

NO_SYSTEMD="systemd is not running on this host (no /run/systemd/system: a container, or a chroot building an image)"

# ---------------------------------------------------------------------------------------------------
uninstall() {
    live=0
    if [ "$START" = 1 ] && systemd_running && have systemctl; then
        live=1
        systemctl disable --now gpumon.service 2>/dev/null || true
    elif [ "$START" = 1 ]; then
        say "$NO_SYSTEMD: nothing to stop; removing the files"
    fi
    # What `systemctl enable` made (WantedBy=multi-user.target), also where it ran offline.
    rm -f "$ROOT_UNIT_DIR/multi-user.target.wants/gpumon.service"
    rm -f "$ROOT_UNIT_DIR/gpumon.service" "$ROOT_UNIT_DIR/gpumon.service.d/kmsg.conf"
    rmdir "$ROOT_UNIT_DIR/gpumon.service.d" 2>/dev/null || true
    if [ "$live" = 1 ]; then
        systemctl daemon-reload
    fi
    rm -rf "$ROOT_VENV"
    say "removed the service and $ROOT_VENV"
    if [ "$PURGE" = 1 ]; then
        rm -rf "$ROOT_ETC"
        if [ -z "$PREFIX$DESTDIR" ]; then
            for d in $STATE_DIRS; do rm -rf "$d"; done
        fi
        say "purged $ROOT_ETC and the state directory"
    else
        say "kept $ROOT_ETC (config) and /var/lib/gpumon (state); --purge removes them"
    fi
}

python_ok() {
    "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1
}

find_python() {
    for candidate in python3.13 python3.12 python3.11 python3.10 python3; do
        if have "$candidate" && python_ok "$(command -v "$candidate")"; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

install_os_python() {
    [ -r /etc/os-release ] || die "no /etc/os-release: pass --python"
    # shellcheck disable=SC1091
    . /etc/os-release
    case "${ID:-}:${ID_LIKE:-}" in
        ubuntu:*|debian:*|*:*debian*)
            say "installing python3 and python3-venv with apt-get"
            DEBIAN_FRONTEND=noninteractive apt-get update -q
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3 python3-venv
            ;;
        almalinux:*|rocky:*|rhel:*|centos:*|ol:*|*:*rhel*|*:*fedora*)
            # EL8's python3 is 3.6 and EL9's 3.9: both too old; AppStream carries python3.11.
            say "installing python3.11 with dnf"
            dnf install -y -q python3.11
            ;;
        *) die "unsupported distribution ${PRETTY_NAME:-$ID}: pass --python /path/to/python3.10+" ;;
    esac
}

write_if_changed() {  # write_if_changed FILE MODE: stdin -> FILE, atomically, only when different
    tmp="$1.tmp.$$"
    cat > "$tmp"
    if [ -f "$1" ] && cmp -s "$tmp" "$1"; then
        rm -f "$tmp"
        return 1
    fi
    chmod "$2" "$tmp"
    mv -f "$tmp" "$1"
    return 0
}

relocate() {  # the shipped unit and config name /opt/gpumon and /etc/gpumon; point them at ours
    sed -e "s#/opt/gpumon/#$VENV/#g" -e "s#/etc/gpumon/#$ETC/#g"
}

install() {
    if [ -z "$PYTHON" ]; then
        PYTHON=$(find_python) || {
            [ "$INSTALL_OS_DEPS" != no ] || die "no python >= 3.10 with venv found: pass --python"
            install_os_python
            PYTHON=$(find_python) || die "still no python >= 3.10 with venv after installing one"
        }
    fi
    python_ok "$PYTHON" || die "$PYTHON is not python >= 3.10 with the venv module (python3-venv)"
    if [ -z "$WHEEL" ] && [ -z "$VERSION" ]; then
        WHEEL=$(wheel_next_to_script)
    fi
    if [ -n "$WHEEL" ]; then
        [ -f "$WHEEL" ] || die "no such wheel: $WHEEL"
        WHEEL=$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")
        check_wheel "$WHEEL"
    fi

    # A venv whose interpreter vanished (distribution upgrade) or changed is rebuilt from scratch.
    if [ -x "$ROOT_VENV/bin/python" ] && ! "$ROOT_VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
        say "the venv at $ROOT_VENV is broken; recreating it"
        rm -rf "$ROOT_VENV"
    fi
    if [ ! -x "$ROOT_VENV/bin/python" ]; then
        say "creating the virtual environment $ROOT_VENV with $PYTHON"
        if [ "$SYSTEM_SITE" = 1 ]; then
            "$PYTHON" -m venv --system-site-packages "$ROOT_VENV"
        else
            "$PYTHON" -m venv "$ROOT_VENV"
        fi
    fi

    if [ -n "$VERSION" ]; then
        fetch_release
    fi
    # A venv from an older guide may hold a distribution called "gpumon": gpumon under its old name,
    # or the unrelated PyPI project. Both own the files of the import package gpumon: remove it first.
    if "$ROOT_VENV/bin/python" -I -m pip --disable-pip-version-check show --quiet "$FOREIGN_DIST" >/dev/null 2>&1; then
        say "removing the distribution '$FOREIGN_DIST' from $ROOT_VENV (gpumon's is '$DIST')"
        "$ROOT_VENV/bin/python" -I -m pip --disable-pip-version-check uninstall --quiet --yes "$FOREIGN_DIST"
    fi

    suffix=""
    [ -z "$EXTRAS" ] || suffix="[$EXTRAS]"
    say "installing $WHEEL$suffix"
    # The dependencies come from the index under their own projects' names (--pip-arg to change it).
    pip_in_venv install --quiet --upgrade "$WHEEL$suffix"
    # pip keeps an installed gpumon of the same version; the wheel asked for must win.
    pip_in_venv install --quiet --force-reinstall --no-deps "$WHEEL"
    version=$("$ROOT_VENV/bin/python" -I -c 'import sys
from importlib.metadata import version
import gpumon
if gpumon.__version__ != version(sys.argv[1]):
    sys.exit(1)
print(gpumon.__version__)' "$DIST") || die "the venv's gpumon is not the distribution $DIST just installed"
    say "installed $DIST $version in $ROOT_VENV"

    mkdir -p "$ROOT_ETC" "$ROOT_UNIT_DIR"
    chmod 0755 "$ROOT_ETC"
    default_config | relocate | write_if_changed "$ROOT_ETC/gpumon.toml.default" 0644 || true
    if [ ! -e "$ROOT_ETC/gpumon.toml" ]; then
        cp "$ROOT_ETC/gpumon.toml.default" "$ROOT_ETC/gpumon.toml"
        say "wrote the default config $ROOT_ETC/gpumon.toml"
    else
        say "kept the config $ROOT_ETC/gpumon.toml (the shipped default is gpumon.toml.default)"
    fi
    if [ ! -e "$ROOT_ETC/gpumon.env" ]; then
        (umask 077; default_env > "$ROOT_ETC/gpumon.env")
    fi
    chmod 0600 "$ROOT_ETC/gpumon.env"

    if [ -n "$PREFIX" ]; then
        unit_text | relocate | write_if_changed "$ROOT_UNIT_DIR/gpumon.service" 0644 && changed=1 || changed=0
    else
        unit_text | write_if_changed "$ROOT_UNIT_DIR/gpumon.service" 0644 && changed=1 || changed=0
    fi
    if [ "$changed" = 1 ]; then say "wrote $ROOT_UNIT_DIR/gpumon.service"; fi
    install_kmsg_drop_in
    if have restorecon && [ -z "$PREFIX$DESTDIR" ]; then
        restorecon -R "$VENV" "$ETC" "$UNIT_DIR/gpumon.service" 2>/dev/null || true
    fi

    if [ ! -e "$DESTDIR/dev/nvidiactl" ] && [ -z "$PREFIX$DESTDIR" ]; then
        say "warning: /dev/nvidiactl is missing: is the NVIDIA driver loaded? the nvml collector will be unavailable"
    fi

    if [ -z "$PREFIX$DESTDIR" ]; then
        ensure_kill
    fi

    if [ "$START" = 0 ]; then
        say "not touching the service (--no-start): this run neither enabled, started nor restarted it"
    elif systemd_running; then
        have systemctl || die "systemd runs but systemctl is not on PATH"
        systemctl daemon-reload
        systemctl enable gpumon.service
        systemctl restart gpumon.service
        say "gpumon.service enabled and (re)started; check it with: systemctl status gpumon; $VENV/bin/gpumon check"
    else
        start_without_systemd
    fi
}

start_without_systemd() {  # a container or a chroot: enable for the next boot, start nothing
    if have systemctl; then
        # --root makes systemctl edit the unit files only, as it must with no systemd to talk to.
        systemctl --root=/ --quiet enable gpumon.service
        say "$NO_SYSTEMD: gpumon.service is enabled and starts at the next boot with systemd; nothing was started"
    else
        say "$NO_SYSTEMD, and systemctl is not installed: $UNIT_DIR/gpumon.service is written but neither enabled nor started"
    fi
    say "to run gpumon here without systemd: $VENV/bin/gpumon run --config $ETC/gpumon.toml"
    say "(--no-start installs the same files and leaves the unit alone: not enabled, not started)"
}

install_kmsg_drop_in() {  # the kernel-log drop-in, on unless --no-kmsg (which also removes ours)
    dir="$ROOT_UNIT_DIR/gpumon.service.d"
    if [ "$KMSG" = 0 ]; then
        if [ -e "$dir/kmsg.conf" ]; then
            rm -f "$dir/kmsg.conf"
            rmdir "$dir" 2>/dev/null || true
            say "removed $dir/kmsg.conf (--no-kmsg): the kmsg collector cannot read /dev/kmsg"
        fi
        return 0
    fi
    mkdir -p "$dir"
    if kmsg_drop_in_text | write_if_changed "$dir/kmsg.conf" 0644; then
        say "wrote $dir/kmsg.conf: the kmsg collector may read /dev/kmsg (CAP_SYSLOG; --no-kmsg to leave it out)"
    fi
}

ensure_kill() {  # the unit's ExecReload= is /bin/kill, which minimal Debian and Ubuntu images lack
    [ ! -x /bin/kill ] || return 0
    package=procps
    if [ "$INSTALL_OS_DEPS" != no ] && [ -r /etc/os-release ]; then
        # shellcheck disable=SC1091
        . /etc/os-release
        case "${ID:-}:${ID_LIKE:-}" in
            ubuntu:*|debian:*|*:*debian*)
                say "installing procps with apt-get: /bin/kill, which \`systemctl reload gpumon\` runs"
                # The package lists at hand first (no network when the package is cached), then fresh ones.
                DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends procps >/dev/null 2>&1 || {
                    DEBIAN_FRONTEND=noninteractive apt-get update -q
                    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends procps
                } || true
                ;;
            almalinux:*|rocky:*|rhel:*|centos:*|ol:*|*:*rhel*|*:*fedora*)
                package=util-linux
                say "installing /usr/bin/kill (util-linux) with dnf, which \`systemctl reload gpumon\` runs"
                dnf install -y -q /usr/bin/kill || true
                ;;
        esac
    fi
    [ -x /bin/kill ] || say "warning: /bin/kill is missing (install $package): \`systemctl reload gpumon\` will fail until it is there; the service itself runs"
}

pip_in_venv() {  # pip_in_venv COMMAND ARGS...: pip of the venv, with the operator's --pip-arg list
    # shellcheck disable=SC2086  # PIP_ARGS is a word list on purpose
    "$ROOT_VENV/bin/python" -I -m pip --disable-pip-version-check "$@" $PIP_ARGS
}

wheel_next_to_script() {
    found=""
    for candidate in "$HERE/$WHEEL_PREFIX"*.whl; do
        [ -f "$candidate" ] || continue
        [ -z "$found" ] || die "several $WHEEL_PREFIX*.whl in $HERE: pick one with --wheel"
        found=$candidate
    done
    [ -n "$found" ] || die "no gpumon wheel given and none next to install.sh ($HERE/$WHEEL_PREFIX*.whl): pass --wheel FILE, or --version X.Y.Z --sha256 HEX"
    printf '%s\n' "$found"
}

check_wheel() {  # check_wheel FILE: gpumon's own wheel, and the one the operator's digest names
    case "$(basename "$1")" in
        "$WHEEL_PREFIX"*.whl) ;;
        *) die "$1 is not a gpumon wheel ($WHEEL_PREFIX*.whl, built from gpumon's repository)" ;;
    esac
    if [ -n "$SHA256" ]; then
        actual=$("$PYTHON" -c 'import hashlib, sys
print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1")
        [ "$actual" = "$SHA256" ] || die "$1 has SHA-256 $actual, not the expected $SHA256: refusing it"
        say "verified the SHA-256 of $(basename "$1")"
    fi
}

fetch_release() {  # WHEEL=gpumon-exporter==VERSION from the index, fetched in pip's hash-checking mode
    WORK=$(mktemp -d)
    printf '%s==%s --hash=sha256:%s\n' "$DIST" "$VERSION" "$SHA256" > "$WORK/requirements.txt"
    say "fetching $DIST==$VERSION (sha256 $SHA256)"
    # --only-binary: an sdist would run its build code before anything is installed.
    pip_in_venv download --quiet --no-deps --only-binary=:all: --require-hashes --dest "$WORK" \
        -r "$WORK/requirements.txt" || die "could not fetch $DIST==$VERSION with SHA-256 $SHA256 (see pip's message above)"
    for fetched in "$WORK/$WHEEL_PREFIX$VERSION"-*.whl; do
        [ -f "$fetched" ] || die "pip fetched no $WHEEL_PREFIX$VERSION-*.whl"
        WHEEL=$fetched
    done
}

unit_text() {
    # A copy of systemd/gpumon.service (a test keeps the two identical).
    cat <<'UNIT'
# gpumon: GPU (NVML) and InfiniBand telemetry exporter.
#
# Installed by deploy/vm/install.sh as /etc/systemd/system/gpumon.service. Local changes belong in a
# drop-in (`systemctl edit gpumon`), which survives upgrades; see docs/deployment.md.
#
# Hardening notes (why some switches are not the strictest value):
#  * PrivateDevices=no: NVML opens /dev/nvidiactl, /dev/nvidia<N> and, with MIG, /dev/nvidia-caps/*.
#    DevicePolicy=closed + DeviceAllow= grants exactly those character-device majors and nothing else
#    (the standard pseudo devices /dev/null, /dev/zero, /dev/urandom... stay available).
#  * SupplementaryGroups=video: drivers installed with NVreg_DeviceFileMode=0660 give the device nodes
#    to the video group; with the default mode 0666 the group is harmless.
#  * ProcSubset= is left at "all": NVML reads /proc/driver/nvidia.
#  * MemoryDenyWriteExecute=yes holds for NVML (no JIT); CUDA would need it off, and gpumon never
#    loads CUDA.
#  * The network cannot be fenced (IPAddressDeny=, PrivateNetwork=): Prometheus scrapes it from
#    anywhere and the OTLP / Azure sinks push out. Put a firewall or the web-config TLS/auth in front.
#  * On systemd older than the directive (AlmaLinux 8 ships 239) unknown hardening keys are logged
#    and ignored: the service still starts, with that one protection missing.

[Unit]
Description=gpumon GPU and InfiniBand telemetry exporter
Documentation=https://github.com/gpumon/gpumon/tree/main/docs
Wants=network-online.target
After=network-online.target nvidia-persistenced.service
StartLimitIntervalSec=10min
StartLimitBurst=10

[Service]
Type=notify
NotifyAccess=main
ExecStart=/opt/gpumon/bin/gpumon run --config /etc/gpumon/gpumon.toml
ExecReload=/bin/kill -HUP $MAINPID
# The loop pings WATCHDOG=1 at half this period while it is healthy; a wedged loop is restarted.
WatchdogSec=60s
TimeoutStartSec=120s
TimeoutStopSec=30s
Restart=on-failure
RestartSec=5s
# Exit status 2 is a bad config or bad usage: restarting would only fail again.
RestartPreventExitStatus=2
# Descriptors: a connection waiting at the endpoint costs one (no thread), so the limit is what
# bounds them; the endpoint keeps up to 256 for the rest (each IB attribute is one cached
# descriptor, about 60 per port; NVML holds a few per GPU). Soft and hard alike: @resources is
# filtered below, so the daemon could not raise the soft limit itself.
LimitNOFILE=65536

# Secrets. The file is read by systemd as root; keep it 0600 root:root. It may set any
# GPUMON_<SECTION>_<KEY> and the Azure identity variables (AZURE_CLIENT_ID, ...).
EnvironmentFile=-/etc/gpumon/gpumon.env
# Files the daemon must read but its user must not own (TLS key, web-config with bcrypt hashes) go
# through credentials: add in a drop-in, for example
#   LoadCredential=web-config.yml:/etc/gpumon/web-config.yml
#   Environment=GPUMON_PROMETHEUS_WEB_CONFIG_FILE=%d/web-config.yml

# Identity: a throwaway UID allocated at start; nothing on the host is owned by it.
DynamicUser=yes
SupplementaryGroups=video
StateDirectory=gpumon
StateDirectoryMode=0700
UMask=0077

# Devices: NVML's nodes only.
DevicePolicy=closed
DeviceAllow=char-nvidia-frontend rw
DeviceAllow=char-nvidia rw
DeviceAllow=char-nvidia-caps rw

# File system: read-only everywhere except the state directory; /sys readable for InfiniBand.
ProtectSystem=strict
ProtectHome=yes
PrivateMounts=yes
PrivateTmp=yes
ProtectProc=invisible
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes

# Privileges.
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
PrivateUsers=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RestrictRealtime=yes
RestrictNamespaces=yes
MemoryDenyWriteExecute=yes
RemoveIPC=yes
KeyringMode=private

# Kernel interfaces.
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged @resources
SystemCallErrorNumber=EPERM

[Install]
WantedBy=multi-user.target
UNIT
}

kmsg_drop_in_text() {
    # A copy of systemd/gpumon.service.d/kmsg.conf (a test keeps the two identical).
    cat <<'KMSG'
# Drop-in for the kmsg collector (the kernel log: NVRM Xid, NVSwitch SXid, mlx5 and IPoIB lines).
# deploy/vm/install.sh installs it as /etc/systemd/system/gpumon.service.d/kmsg.conf unless given
# --no-kmsg; by hand: copy it there, then `systemctl daemon-reload` and `systemctl restart gpumon`.
# The unit's exposure stays at 1.8 (<= 2.0) with it.
[Service]
# /dev/kmsg is a kernel-log interface: ProtectKernelLogs=yes hides it.
ProtectKernelLogs=no
# Read-only access to that one device node (DevicePolicy=closed refuses any other).
DeviceAllow=/dev/kmsg r
# kernel.dmesg_restrict=1 (the default on Ubuntu and Debian) asks for CAP_SYSLOG, checked in the
# initial user namespace: the dynamic user gets that one capability, and no private user namespace.
CapabilityBoundingSet=CAP_SYSLOG
AmbientCapabilities=CAP_SYSLOG
PrivateUsers=no
KMSG
}

default_config() {
    cat <<'CONFIG'
# gpumon configuration (TOML). Every key can also be set from the environment as
# GPUMON_<SECTION>_<KEY>, e.g. GPUMON_DAEMON_INTERVAL=5; secrets belong in /etc/gpumon/gpumon.env
# (mode 0600). `gpumon check` validates this file and probes every collector and sink.

[daemon]
# `auto` runs every collector whose source this host has (NVML, /sys/class/infiniband).
collectors = ["auto"]
# Add "otel" and/or "azure_monitor" (install with --extras otel / azure) to push as well.
sinks = ["prometheus"]
interval = 10.0
state_dir = "/var/lib/gpumon"
sysfs_root = "/sys"
# journald stores each line with its timestamp; use "json" when a log shipper parses them.
log_format = "text"

[prometheus]
listen = "0.0.0.0:9470"
# TLS and basic auth, in the exporter-toolkit web-config format node_exporter reads.
# web_config_file = "/etc/gpumon/web-config.yml"
CONFIG
}

default_env() {
    cat <<'ENV'
# Secrets and per-host overrides for gpumon.service, read by systemd as root (keep mode 0600).
# Any GPUMON_<SECTION>_<KEY> works here, and so do the Azure identity variables, e.g.:
# AZURE_CLIENT_ID=00000000-0000-0000-0000-000000000000
ENV
}

# ---------------------------------------------------------------------------------------------------
if [ -z "$PREFIX$DESTDIR" ] && [ "$(id -u)" != 0 ]; then
    die "run as root (or use --prefix DIR for a relocated install)"
fi

if [ "$UNINSTALL" = 1 ]; then
    uninstall
else
    install
fi
