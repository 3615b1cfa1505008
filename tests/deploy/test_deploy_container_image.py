"""The Dockerfile builds with Debian's buildah (no Docker engine here) and yields a non-root image.

The build (a local Debian bookworm base in place of python:*-slim, the wheels fetched on the host into
./wheels) is tests/support/container_image.py's, shared with the arm64 image's test.

Needs (Debian): buildah, debootstrap. Runs as root with buildah's chroot isolation.
"""

from __future__ import annotations

import json

import pytest

from tests.support.container_image import built_image, image_config, run_in, working_container

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def image(tmp_path_factory, gpumon_wheel):
    with built_image(tmp_path_factory.mktemp("image"), "amd64", gpumon_wheel) as tag:
        yield tag


@pytest.fixture(scope="module")
def config(image) -> dict:
    return image_config(image)["Docker"]["config"]


@pytest.fixture(scope="module")
def container(image):
    with working_container(image) as name:
        yield name


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
