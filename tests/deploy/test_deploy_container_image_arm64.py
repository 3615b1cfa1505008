"""The same Dockerfile builds an arm64 image (Grace hosts: ND GB200 v6) and gpumon runs in it.

Built with ``buildah bud --arch arm64`` and run under qemu-user emulation (Debian's qemu-user-static,
registered with binfmt_misc); tests/support/container_image.py holds the build, shared with the amd64 test.
Its own module, so a parallel run (pytest-xdist) builds it beside the amd64 image, not after it.
"""

from __future__ import annotations

import json

import pytest

from tests.support.container_image import built_image, image_config, run_in, working_container

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]


@pytest.fixture(scope="module")
def image(tmp_path_factory, gpumon_wheel):
    with built_image(tmp_path_factory.mktemp("image-arm64"), "arm64", gpumon_wheel) as tag:
        yield tag


@pytest.fixture(scope="module")
def container(image):
    with working_container(image) as name:
        yield name


def test_arm64_image_is_linux_arm64_with_the_amd64_config(image):
    inspected = image_config(image)
    assert inspected["OCIv1"]["architecture"] == "arm64"
    assert inspected["OCIv1"]["os"] == "linux"
    assert inspected["Docker"]["architecture"] == "arm64"
    config = inspected["Docker"]["config"]
    assert config["Entrypoint"] == ["gpumon"] and config["Cmd"] == ["run"]
    assert config["User"] == "10001:10001"


def test_arm64_image_runs_aarch64_binaries_and_gpumon_version(container):
    machine = run_in(container, "python3", "-c", "import platform; print(platform.machine())")
    assert machine.returncode == 0, machine.stderr
    assert machine.stdout.strip() == "aarch64"
    out = run_in(container, "gpumon", "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("gpumon 0."), out.stdout


def test_arm64_image_runs_a_simulated_gb200_host(container):
    out = run_in(container, "gpumon", "once", "--simulate", "nd-gb200-v6", "--format", "json", timeout=180)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    failed = [c for c in report["collectors"] if not c["ok"]]
    assert not failed, failed
    metrics = {m["name"]: m["samples"] for m in report["metrics"]}
    (host,) = metrics["gpumon_host_info"]
    assert host["labels"]["vm_size"] == "Standard_ND128isr_NDR_GB200_v6"
    models = [s["labels"]["model"] for s in metrics["gpumon_gpu_info"]]
    assert models == ["NVIDIA GB200"] * 4, models
    assert [s["value"] for s in metrics["gpumon_ib_port_up"]] and all(s["value"] == 1 for s in metrics["gpumon_ib_port_up"])
