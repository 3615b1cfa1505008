"""The Dockerfile builds with Debian's buildah (no Docker engine here) and yields a non-root image.

The public python:*-slim base cannot be pulled (only Debian's and PyPI's package archives are
reachable), so the test builds an equivalent base first: a minimal Debian bookworm root with python3
and python3-venv from debootstrap, kept in local storage for later runs. The wheels are fetched on
the host and handed to the build in ./wheels, the Dockerfile's offline route.

Needs (Debian): buildah, debootstrap. Runs as root with buildah's chroot isolation.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASE_IMAGE = "localhost/gpumon-test-python:bookworm"
PLATFORMS = ["manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def buildah(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    path = shutil.which("buildah")
    assert path, "buildah is missing: apt-get install buildah"
    out = subprocess.run([path, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check:
        assert out.returncode == 0, f"buildah {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out


def ensure_base_image(workdir: Path) -> None:
    if buildah("images", "--quiet", BASE_IMAGE, check=False).returncode == 0:
        return
    debootstrap = shutil.which("debootstrap")
    assert debootstrap, "debootstrap is missing: apt-get install debootstrap"
    rootfs = workdir / "rootfs"
    subprocess.run(
        [debootstrap, "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
         "bookworm", str(rootfs), "http://deb.debian.org/debian"],
        check=True, capture_output=True, timeout=400,
    )
    container = buildah("from", "scratch").stdout.strip()
    try:
        mount = buildah("mount", container).stdout.strip()
        subprocess.run(["cp", "-a", f"{rootfs}/.", mount], check=True, timeout=120)
        buildah("umount", container)
        buildah("commit", "--rm", container, BASE_IMAGE)
    except BaseException:
        buildah("rm", container, check=False)
        raise
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


def build_context(dest: Path, wheel: Path) -> Path:
    """The repository's build context (what .dockerignore lets through) plus ./wheels: ``wheel`` (gpumon's,
    built from this checkout) and its dependencies."""
    dest.mkdir()
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, dest / name)
    shutil.copytree(REPO / "gpumon", dest / "gpumon", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "deploy/kubernetes/base").mkdir(parents=True)
    shutil.copy(REPO / "deploy/kubernetes/base/gpumon.toml", dest / "deploy/kubernetes/base/gpumon.toml")
    (dest / "scripts").mkdir()
    shutil.copy(REPO / "scripts/sbom.sh", dest / "scripts/sbom.sh")
    wheels = dest / "wheels"
    wheels.mkdir()
    own = Path(shutil.copy(wheel, wheels / wheel.name))
    pip = [sys.executable, "-m", "pip"]
    # Binary wheels for the base's interpreter (bookworm: CPython 3.11), whatever runs the tests.
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [*pip, "download", "--quiet", "--only-binary=:all:", *platform_args, "--python-version", "3.11",
         "--implementation", "cp", "-d", str(wheels), f"{own}[all]", "cyclonedx-bom"],
        check=True, capture_output=True, timeout=300,
    )
    return dest


@pytest.fixture(scope="module")
def image(tmp_path_factory, gpumon_wheel):
    work = tmp_path_factory.mktemp("image")
    ensure_base_image(work)
    context = build_context(work / "context", gpumon_wheel)
    tag = f"localhost/gpumon-test:{uuid.uuid4().hex[:12]}"
    buildah("bud", "--format", "docker", "--isolation", "chroot", "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}",
            "--tag", tag, str(context), timeout=500)
    try:
        yield tag
    finally:
        buildah("rmi", "--force", tag, check=False)


@pytest.fixture(scope="module")
def config(image) -> dict:
    inspected = json.loads(buildah("inspect", "--type", "image", image).stdout)
    return inspected["Docker"]["config"]


@pytest.fixture(scope="module")
def container(image):
    name = buildah("from", "--pull-never", image).stdout.strip()
    try:
        yield name
    finally:
        buildah("rm", name, check=False)


def run_in(container: str, *command: str) -> subprocess.CompletedProcess[str]:
    return buildah("run", "--isolation", "chroot", container, "--", *command, check=False, timeout=120)


def test_image_runs_as_an_unprivileged_user(config, container):
    assert config["User"] == "10001:10001"
    out = run_in(container, "id", "-u")
    assert out.returncode == 0 and out.stdout.strip() == "10001"


def test_image_entrypoint_is_the_daemon_with_a_healthcheck(config):
    assert config["Entrypoint"] == ["gpumon"]
    assert config["Cmd"] == ["run"]
    assert "9470/tcp" in config["ExposedPorts"]
    probe = " ".join(config["Healthcheck"]["Test"])
    assert "/healthz" in probe
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


def test_image_runs_gpumon_and_ships_the_container_config(container):
    out = run_in(container, "gpumon", "--version")
    assert out.returncode == 0, out.stderr
    assert "0." in out.stdout
    cfg = run_in(container, "cat", "/etc/gpumon/gpumon.toml")
    assert 'sysfs_root = "/host/sys"' in cfg.stdout


def test_image_has_no_build_tooling(container):
    # pip left with the build stage; the sources and wheels never reach the final stage.
    out = run_in(container, "sh", "-c",
                 "test ! -e /opt/gpumon/bin/pip && test ! -e /src && ! command -v gcc && ! command -v cc")
    assert out.returncode == 0, out.stdout + out.stderr


def test_image_state_dir_is_owned_by_the_user(container):
    out = run_in(container, "stat", "-c", "%u %a", "/var/lib/gpumon")
    assert out.stdout.split() == ["10001", "700"], out.stderr


def test_image_carries_the_sbom_of_its_venv(container):
    """The build's last step lists the venv as installed ([all]): gpumon's dependencies with the extras',
    and not the cyclonedx-bom that wrote it, nor pip."""
    out = run_in(container, "python3", "-c", "import json; b = json.load(open('/opt/gpumon/sbom.cdx.json')); "
                 "print(json.dumps([b['metadata']['component']['name'], [c['name'].lower() for c in b['components']]]))")
    assert out.returncode == 0, out.stderr
    root, names = json.loads(out.stdout)
    assert root == "gpumon-exporter"
    assert {"prometheus-client", "nvidia-ml-py", "opentelemetry-sdk", "azure-identity", "grpcio", "cramjam"} <= {
        n.replace("_", "-") for n in names}
    assert not {"pip", "cyclonedx-bom", "cyclonedx-python-lib"} & set(names)
