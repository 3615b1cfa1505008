"""A minimal Debian bookworm root (debootstrap minbase) for running installers where systemd is not PID 1.

Built once per machine and kept under ``$GPUMON_TEST_CACHE`` (default ``~/.cache/gpumon-tests``);
every test gets a throwaway overlay on it (``run_in_root``), so nothing it writes reaches the cache or
the host. The build is the only step that needs the Debian archive; it also leaves the ``.deb`` files
of ``DOWNLOAD_ONLY`` in the root's apt cache with the package lists, so apt-get installs them later
with no network at all.

A root run this way looks like a container: a new PID and mount namespace, ``/proc`` mounted inside,
no ``/run/systemd/system`` (what sd_booted(3) checks). systemctl there says "System has not been
booted with systemd as init system (PID 1). Can't operate." (systemd 252, bookworm).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# systemctl present (the user's case: it exists, systemd is not running); no procps, so no /bin/kill.
INCLUDE = ("python3", "python3-venv", "systemd")
DOWNLOAD_ONLY = ("procps",)


# The wheel tags bookworm's python3 (CPython 3.11, glibc 2.36) takes, whatever interpreter runs the tests.
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
PYTHON_VERSION = "3.11"


def wheelhouse(requirement: str, dest: Path) -> Path:
    """Binary wheels of ``requirement`` and its dependencies for the root's python3, in ``dest``."""
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", *platform_args,
                    "--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(dest), requirement],
                   check=True, capture_output=True, timeout=280)
    return dest


def cache_dir() -> Path:
    return Path(os.environ.get("GPUMON_TEST_CACHE", Path.home() / ".cache" / "gpumon-tests"))


def debian_root() -> Path:
    """The cached root, built on first use (a few minutes; atomic, so parallel runs may race safely)."""
    key = hashlib.sha256(repr((SUITE, INCLUDE, DOWNLOAD_ONLY)).encode()).hexdigest()[:12]
    root = cache_dir() / f"debian-{SUITE}-minbase-{key}"
    if (root / "etc/os-release").exists():
        return root
    debootstrap = shutil.which("debootstrap")
    assert debootstrap, "debootstrap is missing: apt-get install debootstrap"
    cache_dir().mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=cache_dir()))
    try:
        subprocess.run([debootstrap, "--variant=minbase", "--include=" + ",".join(INCLUDE), SUITE,
                        str(building), MIRROR], check=True, capture_output=True, timeout=900)
        shutil.copy("/etc/resolv.conf", building / "etc/resolv.conf")
        subprocess.run(["chroot", str(building), "apt-get", "install", "-y", "-q", "--download-only",
                        "--no-install-recommends", *DOWNLOAD_ONLY],
                       check=True, capture_output=True, timeout=300, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        (building / "etc/resolv.conf").unlink()
        try:
            building.rename(root)
        except OSError:  # another run finished first
            if not (root / "etc/os-release").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return root


def run_in_root(root: Path, work: Path, script: str, binds: dict[str, Path] | None = None,
                timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (sh) as root inside an overlay of ``root``, in new PID and mount namespaces.

    ``work`` holds the overlay's upper layer: after the run, ``work / "upper"`` is every file the
    script wrote or removed (removals as overlayfs whiteouts). ``binds`` maps a path inside the root
    to a host directory mounted read-only there (a wheelhouse, the installer).
    """
    upper, scratch, merged = work / "upper", work / "overlay-work", work / "merged"
    for d in (upper, scratch, merged):
        d.mkdir(parents=True, exist_ok=True)
    mounts = [f"mount -t overlay overlay -o lowerdir={root},upperdir={upper},workdir={scratch} {merged}"]
    for inside, host in (binds or {}).items():
        target = f"{merged}{inside}"
        mounts += [f"mkdir -p {target}", f"mount --bind {host} {target}", f"mount -o remount,bind,ro {target}"]
    inner = f"mount -t proc proc /proc && {script}"
    outer = " && ".join(mounts) + f" && exec chroot {merged} /bin/sh -c {shlex.quote(inner)}"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
    return subprocess.run(["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "sh", "-c", outer],
                          capture_output=True, text=True, timeout=timeout, check=False, env=env)






