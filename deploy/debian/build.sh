#!/bin/sh
# Build gpumon's Debian package, gpumon_<version>-<revision>_<arch>.deb, with dpkg-deb.
#
# Run it on Debian 12 (bookworm) or in a bookworm container/chroot: the package carries a virtual
# environment at /opt/gpumon made with this host's python3 (3.11), so it installs on bookworm only.
# Root is not needed (dpkg-deb --root-owner-group sets every owner to root).
#
#   build.sh                                  build gpumon's wheel from this checkout, fetch its
#                                             dependencies from the package index, build the .deb
#   build.sh --wheelhouse DIR                 offline: gpumon_exporter-*.whl and every dependency's
#                                             wheel are in DIR (pip --no-index --find-links DIR)
#   build.sh --revision 2 --out dist          Debian revision (default 1), output directory (default dist)
#   build.sh --extras azure                   optional extras in the venv (otel, azure, remote_write,
#                                             attribution or all, comma-separated)
#
# The package installs the hardened unit (systemd/gpumon.service) and the kernel-log drop-in
# (systemd/gpumon.service.d/kmsg.conf) under /lib/systemd/system, /etc/gpumon/gpumon.toml as a
# conffile, /usr/bin/gpumon, and maintainer scripts (deploy/debian/) that create the system user
# gpumon and its state directory, enable the unit (start it where systemd runs) and, on purge,
# remove the state and /etc/gpumon.
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WHEELHOUSE=""
REVISION=1
OUT=dist
EXTRAS=""
VENV=/opt/gpumon

say() { printf 'gpumon-deb: %s\n' "$*"; }
die() { printf 'gpumon-deb: error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --wheelhouse) WHEELHOUSE=${2:?--wheelhouse needs a directory}; shift 2 ;;
        --wheelhouse=*) WHEELHOUSE=${1#*=}; shift ;;
        --revision) REVISION=${2:?--revision needs a number}; shift 2 ;;
        --revision=*) REVISION=${1#*=}; shift ;;
        --out) OUT=${2:?--out needs a directory}; shift 2 ;;
        --out=*) OUT=${1#*=}; shift ;;
        --extras) EXTRAS=${2:?--extras needs a list}; shift 2 ;;
        --extras=*) EXTRAS=${1#*=}; shift ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option: $1 (see --help)" ;;
    esac
done
case "$REVISION" in ""|*[!0-9A-Za-z.+~]*) die "not a Debian revision: $REVISION" ;; esac
for extra in $(printf '%s' "$EXTRAS" | tr ',' ' '); do
    case "$extra" in otel|azure|remote_write|attribution|all) ;;
        *) die "--extras takes otel, azure, remote_write, attribution or all, comma-separated (got $EXTRAS)" ;;
    esac
done

command -v dpkg-deb >/dev/null || die "dpkg-deb is missing: build on Debian 12 (apt-get install dpkg)"
python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null ||
    die "python3 here is not 3.11: build on Debian 12 (bookworm), whose python3 the package's venv uses"
python3 -c 'import ensurepip, venv' 2>/dev/null || die "python3-venv is missing: apt-get install python3-venv"
ARCH=$(dpkg --print-architecture)

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STAGE=$WORK/root
mkdir -p "$STAGE" "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ -z "$WHEELHOUSE" ]; then
    WHEELHOUSE=$WORK/wheels
    say "building gpumon's wheel from $REPO and fetching its dependencies"
    python3 -m venv "$WORK/build-venv"
    "$WORK/build-venv/bin/python" -m pip --disable-pip-version-check wheel --quiet -w "$WHEELHOUSE" \
        "$REPO${EXTRAS:+[$EXTRAS]}"
fi
WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
set -- "$WHEELHOUSE"/gpumon_exporter-*.whl
if [ $# -ne 1 ] || [ ! -f "$1" ]; then die "need exactly one gpumon_exporter-*.whl in $WHEELHOUSE"; fi
WHEEL=$1

# The venv is made at its staging path, then relocated to /opt/gpumon: nothing else of this host
# is touched. pip writes no .pyc (they would name the staging path); postinst compiles them.
say "creating the virtual environment (python3 $(python3 -c 'import platform; print(platform.python_version())'))"
python3 -m venv "$STAGE$VENV"
"$STAGE$VENV/bin/python" -I -m pip --disable-pip-version-check install --quiet --no-compile --no-index \
    --find-links "$WHEELHOUSE" "$WHEEL${EXTRAS:+[$EXTRAS]}"
"$STAGE$VENV/bin/python" -I -m pip --disable-pip-version-check uninstall --quiet --yes pip setuptools
VERSION=$("$STAGE$VENV/bin/python" -I -c 'import gpumon; print(gpumon.__version__)')
find "$STAGE$VENV" -name __pycache__ -type d -prune -exec rm -rf {} +
# Relocate: the scripts' #! lines, the activate scripts and pyvenv.cfg name the staging path.
grep -rlIF "$STAGE$VENV" "$STAGE$VENV" | while IFS= read -r file; do
    sed -i "s|$STAGE$VENV|$VENV|g" "$file"
done
rm -f "$STAGE$VENV"/bin/activate.csh "$STAGE$VENV"/bin/activate.fish "$STAGE$VENV"/bin/Activate.ps1
if grep -rqF "$STAGE" "$STAGE$VENV"; then die "the venv still names its staging path $STAGE"; fi

# The unit and the drop-in as shipped in systemd/; the default config is the script route's own.
install -D -m 0644 "$REPO/systemd/gpumon.service" "$STAGE/lib/systemd/system/gpumon.service"
install -D -m 0644 "$REPO/systemd/gpumon.service.d/kmsg.conf" "$STAGE/lib/systemd/system/gpumon.service.d/kmsg.conf"
mkdir -p "$STAGE/etc/gpumon"
sed -n "/^    cat <<'CONFIG'\$/,/^CONFIG\$/p" "$REPO/deploy/vm/install.sh" | sed '1d;$d' > "$STAGE/etc/gpumon/gpumon.toml"
[ -s "$STAGE/etc/gpumon/gpumon.toml" ] || die "could not read the default config from deploy/vm/install.sh"
install -D -m 0644 "$HERE/gpumon.sysusers" "$STAGE/usr/lib/sysusers.d/gpumon.conf"
mkdir -p "$STAGE/usr/bin"
ln -s "$VENV/bin/gpumon" "$STAGE/usr/bin/gpumon"

DOC=$STAGE/usr/share/doc/gpumon
install -D -m 0644 "$HERE/copyright" "$DOC/copyright"
{
    printf 'gpumon (%s-%s) stable; urgency=medium\n\n' "$VERSION" "$REVISION"
    printf '  * gpumon %s, packaged from its wheel (see CHANGELOG.md upstream).\n\n' "$VERSION"
    printf ' -- gpumon maintainers <gpumon@users.noreply.github.com>  %s\n' \
        "$(date -R -u -d "@${SOURCE_DATE_EPOCH:-$(date +%s)}")"
} | gzip -9n > "$DOC/changelog.Debian.gz"
install -D -m 0644 "$HERE/gpumon.1" "$STAGE/usr/share/man/man1/gpumon.1"
gzip -9n "$STAGE/usr/share/man/man1/gpumon.1"
install -D -m 0644 "$HERE/lintian-overrides" "$STAGE/usr/share/lintian/overrides/gpumon"

mkdir -p "$STAGE/DEBIAN"
for script in postinst prerm postrm; do install -m 0755 "$HERE/$script" "$STAGE/DEBIAN/$script"; done
printf '/etc/gpumon/gpumon.toml\n' > "$STAGE/DEBIAN/conffiles"
SIZE=$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)
cat > "$STAGE/DEBIAN/control" <<CONTROL
Package: gpumon
Version: $VERSION-$REVISION
Architecture: $ARCH
Maintainer: gpumon maintainers <gpumon@users.noreply.github.com>
Installed-Size: $SIZE
Depends: python3 (>= 3.11), python3 (<< 3.12), libc6 (>= 2.36), systemd, procps
Section: admin
Priority: optional
Homepage: https://github.com/gpumon/gpumon
Description: GPU (NVML) and InfiniBand telemetry exporter
 gpumon exports NVIDIA GPU metrics (NVML), InfiniBand port counters and
 link flaps, kernel-log events and health verdicts to Prometheus,
 OpenTelemetry and Azure Monitor. It runs as the hardened systemd service
 gpumon.service; configure it in /etc/gpumon/gpumon.toml.
 .
 The package carries gpumon and its Python dependencies in a virtual
 environment at /opt/gpumon, built for this release's python3.
CONTROL

DEB=$OUT/gpumon_${VERSION}-${REVISION}_${ARCH}.deb
dpkg-deb --root-owner-group -Zxz --build "$STAGE" "$DEB" >/dev/null
say "built $DEB"
