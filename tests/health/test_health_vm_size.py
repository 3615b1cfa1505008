"""The health stage's VM size: read from the host identity the loop stamps on each snapshot (the
identity provider asks IMDS off the loop thread, again soon after a failure that is not "off Azure");
off Azure no size at all, and IMDS is not asked where only the InfiniBand collectors run."""

from __future__ import annotations

import pytest

from gpumon.cli import schemas
from gpumon.config import load
from gpumon.health.stage import vm_size_of
from gpumon.identity import IdentityProvider
from gpumon.model import AzureInstance, CollectorStatus, HostIdentity, Snapshot
from tests.conftest import closed_port, wait_for
from tests.fakes.imds import COMPUTE_PATH, ImdsServer


def provider_of(url: str) -> IdentityProvider:
    config = load(schemas(), None, {"GPUMON_AZURE_IMDS_URL": url, "GPUMON_AZURE_COMPUTE_REFRESH": "10"}, {})
    return IdentityProvider.from_config(config)


def test_a_5xx_at_boot_is_asked_again_and_the_size_is_learned() -> None:
    server = ImdsServer()
    provider = provider_of(server.url)
    provider.ask_again = 0.2
    try:
        server.fail(COMPUTE_PATH, 500)
        assert provider.current().vm_size() is None  # asked on a thread of its own: unknown until it answers
        provider.start()
        wait_for(lambda: server.count(COMPUTE_PATH) >= 1, timeout=5)
        assert provider.current().vm_size() is None  # a 5xx is not "off Azure": unknown, no baseline meanwhile
        server.fail(COMPUTE_PATH, None)
        wait_for(lambda: provider.current().vm_size() == "Standard_ND96isr_H100_v5", timeout=10)
    finally:
        provider.stop()
        server.close()


def test_off_azure_answers_no_size() -> None:
    provider = provider_of(f"http://127.0.0.1:{closed_port()}")  # nothing listens: unreachable, as off Azure
    provider.start()
    try:
        wait_for(lambda: provider.current().vm_size() == "", timeout=10)
        assert all(provider.look().vm_size() == "" for _ in range(5))
    finally:
        provider.stop()


def _stamped(identity: HostIdentity | None) -> Snapshot:
    return Snapshot("h", 0.0, (), (), (CollectorStatus("nvml", True, 0.1),), identity=identity)


@pytest.mark.parametrize(("identity", "size"), [
    (HostIdentity(), None),  # not asked yet: no inventory, no baseline
    (HostIdentity(asked=True), None),  # asked, failed, not "off Azure": the same
    (HostIdentity(asked=True, off_azure=True), ""),  # off Azure: the baseline
    (HostIdentity(AzureInstance("id", "Standard_ND96isr_H100_v5", "eastus2", "n", "r"), asked=True),
     "Standard_ND96isr_H100_v5"),
    (None, ""),  # a snapshot no loop stamped: the baseline, as a stage built by hand always was
])
def test_the_stage_reads_the_size_from_the_snapshot(identity, size) -> None:
    assert vm_size_of(_stamped(identity)) == size


@pytest.fixture
def imds_server():
    server = ImdsServer()
    yield server
    server.close()


def test_the_vm_size_is_not_asked_when_only_the_infiniband_collectors_run(gpumon_run, tmp_path,
                                                                          imds_server) -> None:
    from gpumon.simulate.sysfs import build_tree

    build_tree("nd-h100-v5", str(tmp_path / "sys"))
    process = gpumon_run("--collectors", "infiniband,linkflap", "--sinks", "prometheus", "--interval", "0.2",
                         "--sysfs-root", str(tmp_path / "sys"), env={"GPUMON_AZURE_IMDS_URL": imds_server.url})
    # several verdicts later (each would have asked), still no question: the baseline holds the ports
    runs = 'gpumon_collector_runs_total{collector="infiniband"}'
    wait_for(lambda: any(line.startswith(runs) and float(line.split()[-1]) >= 5
                         for line in process.metrics().splitlines()), timeout=10)
    assert "gpumon_health_state" in process.metrics() and imds_server.count(COMPUTE_PATH) == 0


def test_the_vm_size_is_asked_when_the_gpus_are_read(gpumon_run, imds_server) -> None:
    gpumon_run("--simulate", "nd-h100-v5", "--collectors", "nvml", "--sinks", "prometheus",
               env={"GPUMON_AZURE_IMDS_URL": imds_server.url})
    wait_for(lambda: imds_server.count(COMPUTE_PATH) >= 1, timeout=10)
