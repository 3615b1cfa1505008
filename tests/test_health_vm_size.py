"""The health stage's VM size from IMDS: asked off the loop thread, asked again after a failure that
is not "off Azure"; off Azure no size at all."""

from __future__ import annotations

from gpumon.cli import schemas
from gpumon.collectors.base import Context
from gpumon.config import load
from gpumon.daemon.health import _VmSize
from gpumon.simulate.imds import COMPUTE_PATH, ImdsServer
from tests.conftest import closed_port, wait_for


def size_of(url: str) -> _VmSize:
    config = load(schemas(), None, {"GPUMON_AZURE_IMDS_URL": url, "GPUMON_AZURE_COMPUTE_REFRESH": "10"}, {})
    return _VmSize(Context(hostname="h", config=config))


def test_a_5xx_at_boot_is_asked_again_and_the_size_is_learned() -> None:
    server = ImdsServer()
    try:
        server.fail(COMPUTE_PATH, 500)
        vm = size_of(server.url)
        vm.ASK_AGAIN = 0.2
        assert vm() is None  # asked on a thread of its own: unknown until it answers
        wait_for(lambda: server.count(COMPUTE_PATH) >= 1, timeout=5)
        assert vm() is None  # a 5xx is not "off Azure": unknown, no baseline taken meanwhile
        server.fail(COMPUTE_PATH, None)
        wait_for(lambda: vm() == "Standard_ND96isr_H100_v5", timeout=10)
    finally:
        server.close()


def test_off_azure_answers_no_size() -> None:
    vm = size_of(f"http://127.0.0.1:{closed_port()}")  # nothing listens: unreachable, as off Azure
    wait_for(lambda: vm() == "", timeout=10)
    assert all(vm() == "" for _ in range(5))
