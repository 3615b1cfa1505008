"""gpumon_host_info from a loopback IMDS stand-in and a real KVP pool file: labels, caching through the
shared client, and each source failing on its own."""

from __future__ import annotations

import time

import pytest

from gpumon import imds
from gpumon.collectors.base import Context
from gpumon.collectors.host_info import LABELS, OPTIONS, HostInfoCollector
from gpumon.config import DAEMON, load
from gpumon.model import Collection, Snapshot
from gpumon.report.tables import host_info_table
from tests.conftest import closed_port
from tests.fakes.imds import COMPUTE, COMPUTE_PATH, ImdsServer
from tests.fakes.kvp import record, writer_holding_the_lock


@pytest.fixture
def server():
    srv = ImdsServer()
    yield srv
    srv.close()


@pytest.fixture
def pool(tmp_path):
    path = tmp_path / ".kvp_pool_3"
    path.write_bytes(record("VirtualMachineName", "gpu-node-0_3") + record("PhysicalHostName", "CH1-R12-N07"))
    return str(path)


def collector(url: str, pool: str) -> HostInfoCollector:
    config = load([DAEMON, imds.OPTIONS, OPTIONS], None,
                  {"GPUMON_AZURE_IMDS_URL": url, "GPUMON_HOST_INFO_KVP_POOL": pool}, {})
    return HostInfoCollector(Context("test", config=config), config.sections["host_info"])


def info(coll: Collection) -> dict[str, str] | None:
    samples = [s for f in coll.families if f.name == "gpumon_host_info" for s in f.samples]
    if not samples:
        return None
    (sample,) = samples
    assert sample.value == 1.0 and [k for k, _ in sample.labels] == list(LABELS)
    return dict(sample.labels)


def test_identity_and_placement_from_imds_and_the_physical_host_from_kvp(server, pool):
    c = collector(server.url, pool)
    assert c.probe().available
    got = info(c.collect())
    assert got == {"vm_size": "Standard_ND96isr_H100_v5", "region": "eastus2", "zone": "2",
                   "vmss": "gpu-node", "vm_id": COMPUTE["vmId"], "placement_group": COMPUTE["placementGroupId"],
                   "fault_domain": "1", "physical_host": "CH1-R12-N07"}
    table = host_info_table(Snapshot("h", 0.0, tuple(c.collect().families), (), ()))
    assert table is not None and table.rows[0][-1] == "CH1-R12-N07"


def test_imds_is_asked_once_however_often_the_collector_runs(server, pool):
    c = collector(server.url, pool)
    c.probe()
    for _ in range(5):
        c.collect()
    other = collector(server.url, pool)  # another user of the same IMDS shares the cache
    other.collect()
    assert server.count(COMPUTE_PATH) == 1


def test_an_imds_error_is_counted_and_kvp_alone_still_names_the_host(server, pool):
    server.fail(COMPUTE_PATH, 500)
    c = collector(server.url, pool)
    coll = c.collect()
    assert coll.errors == {"imds_http_error": 1}
    assert info(coll) == {**{k: "" for k in LABELS}, "physical_host": "CH1-R12-N07"}
    server.fail(COMPUTE_PATH, None)
    assert info(c.collect())["vm_size"] == "Standard_ND96isr_H100_v5"


def test_a_locked_pool_is_counted_and_imds_alone_still_gives_the_series(server, pool):
    c = collector(server.url, pool)
    with writer_holding_the_lock(pool):
        coll = c.collect()
    assert coll.errors == {"kvp_read": 1}
    assert info(coll)["physical_host"] == "" and info(coll)["vm_size"]
    assert info(c.collect())["physical_host"] == "CH1-R12-N07"


def test_off_azure_without_kvp_is_unavailable_quickly(tmp_path):
    started = time.monotonic()
    availability = collector(f"http://127.0.0.1:{closed_port()}", str(tmp_path / "none")).probe()
    assert time.monotonic() - started < 1.0
    assert not availability.available and "not on Azure" in availability.reason


def test_off_azure_with_a_kvp_pool_reports_the_host_alone(pool):
    c = collector(f"http://127.0.0.1:{closed_port()}", pool)
    assert c.probe().available
    coll = c.collect()
    assert coll.errors == {"imds_unreachable": 1}
    assert info(coll)["physical_host"] == "CH1-R12-N07"
