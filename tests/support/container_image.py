"""Build the Dockerfile with Debian's buildah (no Docker engine, no registry) for amd64 or arm64.

The public python:*-slim base cannot be pulled (only Debian's and PyPI's package archives are
reachable), so the build starts from an equivalent base made here: a minimal Debian bookworm root with
python3 and python3-venv, kept in buildah's local storage under a tag for later runs. The wheels are
fetched on the host for the image's architecture and handed to the build in ./wheels, the Dockerfile's
offline route.

amd64 uses debootstrap. arm64 runs under qemu-user emulation (binfmt_misc), where debootstrap's
maintainer scripts take minutes; the arm64 base is only unpacked instead (mmdebstrap's extract
variant, no scripts run) plus the two files a script would have written that the Dockerfile needs
(/etc/passwd and /etc/group, for groupadd/useradd). Nothing else of a configured system is used: the
build installs from local wheels with the venv's pip and never reaches the network.

The Dockerfile's build stage runs on this machine's platform and installs the target's wheels, so an
arm64 build emulates only the final stage's short RUN steps. buildah 1.28 does not set the platform
arguments itself: they are passed (``BUILDPLATFORM``, ``TARGETPLATFORM``, ``TARGETARCH``). The two
local bases have different names (python:*-slim is one multi-platform name in a registry), so the
build stage's is given as ``BUILD_IMAGE``.

Needs (Debian): buildah, debootstrap; for arm64 also mmdebstrap, qemu-user-static, binfmt-support
with binfmt_misc mounted. Runs as root with buildah's chroot isolation.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# python3-pip: python:*-slim has a pip of its own, which scripts/sbom.sh uses for its tool in the build
# stage (no throwaway venv).
INCLUDE = ("python3", "python3-venv", "ca-certificates", "python3-pip")
# The arm64 root is unpacked, not configured: the tools the Dockerfile's RUN lines and scripts/sbom.sh
# call come from their packages' files (dash's /bin/sh, passwd's groupadd/useradd, coreutils' install
# and mktemp, bash, grep, sed), all of them in the amd64 minbase root and in python:*-slim too. It is the
# final stage's base only (the build stage runs on this machine's platform): no pip.
ARM64_INCLUDE = ("python3", "python3-venv", "ca-certificates", "dash", "bash", "coreutils", "grep", "sed",
                 "findutils", "passwd", "base-passwd", "libc-bin")
# bookworm's python3: CPython 3.11 with glibc 2.36, whatever interpreter runs the tests.
PYTHON_VERSION = "3.11"
GLIBC = "2.36"
# The OCI architecture of this machine, where the Dockerfile's build stage runs.
BUILD_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}[platform.machine()]
# Builds of the base images wait on each other, also across two runs of the
# suite at once (they share buildah's storage).
LOCK = Path("/var/tmp/gpumon-test-images.lock")
# The binfmt_misc handler that runs another architecture's binaries (Debian's qemu-user-static names).
BINFMT = {"arm64": "qemu-aarch64"}
# Seconds a build may take on two busy cores: 2.5 to 3.5 minutes measured at a load of 4-6 for either
# architecture, the arm64 one emulating only `groupadd`, `useradd` and `gpumon --version`.
BUILD_TIMEOUT = {"amd64": 540, "arm64": 540}


def base_image(arch: str) -> str:
    if arch == "amd64":
        key = hashlib.sha256(repr((SUITE, INCLUDE, "minbase")).encode()).hexdigest()[:12]
        return f"localhost/gpumon-test-python:{SUITE}-{key}"  # a new list of packages, a new base
    key = hashlib.sha256(repr((SUITE, ARM64_INCLUDE, "extract", "byte-compiled")).encode()).hexdigest()[:12]
    return f"localhost/gpumon-test-python:{SUITE}-{arch}-{key}"


def buildah(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    path = shutil.which("buildah")
    assert path, "buildah is missing: apt-get install buildah"
    out = subprocess.run([path, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check:
        assert out.returncode == 0, f"buildah {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out


def require_emulation(arch: str) -> None:
    """Fail, naming what is missing, unless the kernel runs ``arch`` binaries through qemu-user."""
    if arch not in BINFMT:
        return
    handler = Path("/proc/sys/fs/binfmt_misc") / BINFMT[arch]
    assert Path("/proc/sys/fs/binfmt_misc/status").exists(), (
        "binfmt_misc is not mounted: mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc (scripts/test.sh does)")
    assert handler.exists(), (
        f"no binfmt_misc handler {handler.name}: apt-get install qemu-user-static binfmt-support, "
        f"then update-binfmts --enable {handler.name}")
    text = handler.read_text()
    assert text.startswith("enabled"), f"{handler} is disabled: update-binfmts --enable {handler.name}\n{text}"
    # F (fix-binary): the kernel opened the interpreter at registration, so it runs inside any chroot
    # without a copy of qemu there.
    assert "F" in next((ln.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("flags:")), ""), (
        f"{handler} lacks the F flag (qemu-user-static registers it with F): {text}")


def make_root(arch: str, rootfs: Path) -> None:
    if arch == "amd64":
        debootstrap = shutil.which("debootstrap")
        assert debootstrap, "debootstrap is missing: apt-get install debootstrap"
        subprocess.run([debootstrap, "--variant=minbase", "--include=" + ",".join(INCLUDE), SUITE, str(rootfs),
                        MIRROR], check=True, capture_output=True, timeout=400)
        return
    mmdebstrap = shutil.which("mmdebstrap")
    assert mmdebstrap, "mmdebstrap is missing: apt-get install mmdebstrap"
    subprocess.run([mmdebstrap, "--quiet", f"--arch={arch}", "--variant=extract", "--include=" + ",".join(
        ARM64_INCLUDE), SUITE, str(rootfs), MIRROR], check=True, capture_output=True, timeout=300)
    # base-passwd's postinst writes these on a configured system; the build's groupadd/useradd edit them.
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                      "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    (rootfs / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    # python3.11's postinst byte-compiles the standard library (py3compile); unpacked, it has no .pyc,
    # so every emulated interpreter start would compile what it imports again (the image sets
    # PYTHONDONTWRITEBYTECODE). Byte-code does not depend on the architecture: a 3.11 here writes it.
    python311 = sys.executable if sys.version_info[:2] == (3, 11) else shutil.which("python3.11")
    if python311:
        subprocess.run([python311, "-m", "compileall", "-q", "-j", "0", str(rootfs / "usr/lib/python3.11")],
                       check=False, capture_output=True, timeout=300)


def ensure_base_image(arch: str, workdir: Path) -> str:
    """The base image for ``arch`` in local storage, built on first use; returns its tag."""
    tag = base_image(arch)
    if buildah("images", "--quiet", tag, check=False).returncode == 0:
        return tag
    rootfs = workdir / f"rootfs-{arch}"
    make_root(arch, rootfs)
    container = buildah("from", "scratch").stdout.strip()
    try:
        buildah("config", "--os", "linux", "--arch", arch, container)
        mount = buildah("mount", container).stdout.strip()
        subprocess.run(["cp", "-a", f"{rootfs}/.", mount], check=True, timeout=120)
        buildah("umount", container)
        buildah("commit", "--rm", container, tag)
    except BaseException:
        buildah("rm", container, check=False)
        raise
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return tag


def build_context(dest: Path, arch: str, wheel: Path) -> Path:
    """The repository's build context (what .dockerignore lets through) plus ./wheels for ``arch``:
    ``wheel`` (gpumon's, built once per run from this checkout: the ``gpumon_wheel`` fixture) and its
    dependencies' wheels for the image's interpreter and architecture."""
    dest.mkdir()
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, dest / name)
    shutil.copytree(REPO / "gpumon", dest / "gpumon", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "deploy/kubernetes/base").mkdir(parents=True)
    shutil.copy(REPO / "deploy/kubernetes/base/gpumon.toml", dest / "deploy/kubernetes/base/gpumon.toml")
    (dest / "scripts").mkdir()
    for script in ("sbom.sh", "wheel_platforms.py"):
        shutil.copy(REPO / "scripts" / script, dest / "scripts" / script)
    wheels = dest / "wheels"
    wheels.mkdir()
    own = Path(shutil.copy(wheel, wheels / wheel.name))
    download(wheels, arch, f"{own}[all]")
    download(wheels, BUILD_ARCH, "cyclonedx-bom")  # the SBOM tool runs in the build stage, on this machine
    return dest


def download(wheels: Path, arch: str, requirement: str) -> None:
    """``requirement``'s wheels for bookworm's python3 on ``arch`` into ``wheels`` (scripts/wheel_platforms.py
    gives the tags, as in the Dockerfile)."""
    platforms = subprocess.run([sys.executable, str(REPO / "scripts/wheel_platforms.py"), arch, "--glibc", GLIBC],
                               check=True, capture_output=True, text=True, timeout=30).stdout.split()
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", *platforms, "--python-version",
         PYTHON_VERSION, "--implementation", "cp", "-d", str(wheels), requirement],
        check=True, capture_output=True, timeout=300,
    )


@contextlib.contextmanager
def images_locked() -> Iterator[None]:
    with LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def bases(arch: str, work: Path) -> tuple[str, str]:
    """The bases of a build for ``arch``: (the build stage's, on this machine's platform; the image's)."""
    with images_locked():
        return ensure_base_image(BUILD_ARCH, work), ensure_base_image(arch, work)


def build_image(work: Path, arch: str, wheel: Path) -> str:
    """Build the Dockerfile for ``arch`` (``buildah bud --arch``, the build stage on this machine's
    platform) with gpumon's ``wheel``; returns the new image's tag."""
    require_emulation(arch)
    build_base, base = bases(arch, work)
    context = build_context(work / f"context-{arch}", arch, wheel)
    tag = f"localhost/gpumon-test:{arch}-{uuid.uuid4().hex[:12]}"
    buildah("bud", "--format", "docker", "--isolation", "chroot", "--os", "linux", "--arch", arch,
            "--pull-never", "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"BUILD_IMAGE={build_base}",
            "--build-arg", f"BUILDPLATFORM=linux/{BUILD_ARCH}", "--build-arg", f"TARGETPLATFORM=linux/{arch}",
            "--build-arg", f"TARGETARCH={arch}", "--tag", tag, str(context), timeout=BUILD_TIMEOUT[arch])
    return tag


def image_config(tag: str) -> dict:
    """``buildah inspect``'s image: the Docker config (``config``) and the platform fields."""
    return json.loads(buildah("inspect", "--type", "image", tag).stdout)


def run_in(container: str, *command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return buildah("run", "--isolation", "chroot", container, "--", *command, check=False, timeout=timeout)


@contextlib.contextmanager
def built_image(work: Path, arch: str, wheel: Path) -> Iterator[str]:
    """:func:`build_image`, removed again when the block ends."""
    tag = build_image(work, arch, wheel)
    try:
        yield tag
    finally:
        buildah("rmi", "--force", tag, check=False)


@contextlib.contextmanager
def working_container(image: str) -> Iterator[str]:
    """A working container of ``image`` (``buildah from``), removed when the block ends."""
    name = buildah("from", "--pull-never", image).stdout.strip()
    try:
        yield name
    finally:
        buildah("rm", name, check=False)
