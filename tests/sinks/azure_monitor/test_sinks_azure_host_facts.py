"""The OTel and Azure Monitor sinks read the host identity the one provider learnt from the IMDS
``[azure]`` configures (stamped on each snapshot), and carry the host's placement: on the OTel resource
(decoded from a real OTLP export) and on the rows of all three Azure tables (through the real
LogsIngestionClient to the loopback ingestion endpoint). Their own IMDS keys are deprecated aliases:
honoured by the provider with a warning, and ``imds_url = ""`` still switches the sink's host facts off."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from gpumon import imds
from gpumon.collectors import host_info
from gpumon.config import DAEMON, load
from gpumon.daemon import make_context, sink_context
from gpumon.daemon.identity import identity_provider
from gpumon.identity import IdentityProvider
from gpumon.model import Event, HostIdentity, MetricFamily, MetricSpec, MetricType, Severity, Snapshot
from gpumon.simulate.azure import write_kvp_pool
from gpumon.sinks import azure_host, otel
from gpumon.sinks import azure_monitor as am
from gpumon.sinks.azure_monitor.rows import HOST_COLUMNS
from gpumon.sinks.base import SinkContext
from tests.fakes import otlp as receivers
from tests.fakes.imds import COMPUTE, ImdsServer
from tests.fakes.logs_ingestion import IngestionServer
from tests.fakes.tokens import FakeCredential
from tests.support.declared_hints import hinted
from tests.support.otel import attrs

http_receiver = receivers.http_receiver

SCHEMAS = [DAEMON, imds.OPTIONS, host_info.OPTIONS, otel.OPTIONS, am.OPTIONS]
COMPUTE_PATH = "/metadata/instance/compute"
POWER = hinted(MetricSpec("gpumon_gpu_power_watts", MetricType.GAUGE, "p", "watts", ("gpu", "uuid")))
EXPECTED = {"VmId": COMPUTE["vmId"], "VmSize": COMPUTE["vmSize"], "Region": COMPUTE["location"],
            "Zone": "2", "Vmss": "gpu-node", "PlacementGroup": COMPUTE["placementGroupId"],
            "FaultDomain": "1", "PhysicalHost": "PHX0123456789"}


def config(tmp_path, server: ImdsServer, **env: str):
    pool = tmp_path / "kvp_pool_3"
    write_kvp_pool(str(pool), {"PhysicalHostName": "PHX0123456789", "VirtualMachineName": "gpu-node-0_3"})
    base = {"GPUMON_AZURE_IMDS_URL": server.url, "GPUMON_HOST_INFO_KVP_POOL": str(pool),
            "GPUMON_DAEMON_STATE_DIR": str(tmp_path / "state")}
    return load(SCHEMAS, None, {**base, **env}, {})


def context(cfg) -> SinkContext:
    return SinkContext("node-7", str(cfg.daemon.state_dir), "9.9.9", config=cfg)


def snapshot(events=(), identity: HostIdentity | None = None) -> Snapshot:
    fam = MetricFamily(POWER, (POWER.sample(300.0, "0", "GPU-a"),))
    return Snapshot("node-7", time.time(), (fam,), tuple(events), (), identity=identity)


def wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def server():
    srv = ImdsServer()
    yield srv
    srv.close()


def test_both_sinks_share_the_configured_client_and_carry_the_placement(http_receiver, server, tmp_path):
    cfg = config(tmp_path, server)
    ctx = context(cfg)
    otel_sink = otel.OtelSink(ctx, {"endpoint": http_receiver.endpoint, "logs": False, "timeout": 2.0},
                              environ={})
    skew = [0.0]  # the interval boundary comes when the test says, not after a sleep
    with IngestionServer() as ingest:
        az_sink = am.AzureMonitorSink(ctx, {
            "endpoint": ingest.endpoint, "dcr_immutable_id": ingest.dcr_id, "ca_bundle": ingest.ca_path,
            "upload_interval": 60.0, "timeout": 2.0}, credential=FakeCredential(),
            clock=lambda: time.monotonic() + skew[0])
        try:
            otel_sink.start()
            az_sink.start()
            provider = identity_provider(cfg, (), [otel_sink, az_sink])
            assert provider is not None
            identity = provider.look()
            otel_sink.publish(snapshot(identity=identity))
            az_sink.publish(snapshot(identity=identity))
            flap = Event("ib_link_flap", Severity.WARNING, {"device": "mlx5_ib0", "port": "1"}, "flap", {})
            skew[0] = 60.0
            az_sink.publish(snapshot([flap], identity))
            http_receiver.wait(lambda r: r.metrics)
            assert ingest.wait_for(lambda s: s.rows("Custom-GpuMonGpu_CL") and s.rows("Custom-GpuMonEvents_CL"))
        finally:
            otel_sink.stop(2)
            az_sink.stop(2)
        gpu_row = ingest.rows("Custom-GpuMonGpu_CL")[0]
        event_row = ingest.rows("Custom-GpuMonEvents_CL")[0]
        assert {r.status for r in ingest.requests()} == {204}  # the DCR declares the new columns
    for row in (gpu_row, event_row):
        assert {column: row.get(column) for _, column in HOST_COLUMNS} == EXPECTED
    resource = attrs(http_receiver.metrics[0].resource_metrics[0].resource)
    assert resource["host.id"] == COMPUTE["vmId"] and resource["cloud.resource_id"] == COMPUTE["resourceId"]
    assert resource["cloud.availability_zone"] == "2"
    assert resource["cloud.account.id"] == COMPUTE["subscriptionId"]
    assert resource["azure.resource_group.name"] == "rg-train"
    assert resource["gpumon.azure.vmss"] == "gpu-node"
    assert resource["gpumon.azure.placement_group"] == COMPUTE["placementGroupId"]
    assert resource["gpumon.azure.fault_domain"] == "1"
    assert resource["gpumon.azure.physical_host"] == "PHX0123456789"
    assert server.count(COMPUTE_PATH) == 1  # one provider, one compute request for both sinks


def test_the_ib_table_declares_the_host_columns_too():
    from gpumon.sinks.azure_monitor.rows import IB, stream_columns

    names = [c for c, _ in stream_columns()[IB]]
    assert all(column in names for _, column in HOST_COLUMNS)


def test_a_deprecated_alias_is_honoured_with_a_warning(server, tmp_path, caplog):
    other = ImdsServer({**COMPUTE, "vmId": "from-the-alias"})
    try:
        cfg = config(tmp_path, server, GPUMON_OTEL_IMDS_URL=other.url + "/metadata/instance/compute",
                     GPUMON_OTEL_IMDS_TIMEOUT="2.5")
        sink = otel.OtelSink(context(cfg), cfg.sections["otel"], environ={})
        assert "deprecated" not in caplog.text  # gpumon check builds the sink too: no warning for it
        with caplog.at_level(logging.WARNING, logger="gpumon.sinks"):
            provider = identity_provider(cfg, (), [sink])  # gpumon run: the provider honours the keys
        assert provider is not None
        assert provider.client is imds.client(other.url) and provider.client.timeout == 2.5
        found = provider.look().instance
        assert found is not None and found.vm_id == "from-the-alias"
        assert "[otel] imds_url: use [azure] imds_url" in caplog.text
        assert "[otel] imds_timeout: use [azure] imds_timeout" in caplog.text
    finally:
        other.close()
    assert server.count(COMPUTE_PATH) == 0


def test_unset_aliases_follow_azure_without_a_warning(server, tmp_path, caplog):
    cfg = config(tmp_path, server)
    with caplog.at_level(logging.WARNING, logger="gpumon.sinks"):
        for name, schema, aliases in (("otel", otel.OPTIONS, otel.IMDS_ALIASES),
                                      ("azure_monitor", am.OPTIONS, am.IMDS_ALIASES)):
            assert azure_host.imds_overrides(context(cfg), name, cfg.sections[name], schema, aliases) == {}
        provider = identity_provider(cfg, (), [otel.OtelSink(context(cfg), cfg.sections["otel"], environ={})])
        assert provider is not None and provider.client is imds.configured(cfg.sections["azure"])
    assert "deprecated" not in caplog.text


@pytest.mark.parametrize("variable", ["GPUMON_OTEL_IMDS_URL", "GPUMON_AZURE_MONITOR_IMDS_URL"])
def test_an_empty_alias_switches_the_sinks_imds_off(server, tmp_path, variable):
    cfg = config(tmp_path, server, **{variable: ""})
    name = "otel" if "OTEL" in variable else "azure_monitor"
    module = otel if name == "otel" else am
    assert azure_host.imds_overrides(context(cfg), name, cfg.sections[name], module.OPTIONS,
                                     module.IMDS_ALIASES) is None


def test_an_azure_monitor_sink_with_imds_off_writes_no_host_columns(server, tmp_path):
    cfg = config(tmp_path, server, GPUMON_AZURE_MONITOR_IMDS_URL="")
    sink = am.AzureMonitorSink(context(cfg), {"endpoint": "https://127.0.0.1:1", "dcr_immutable_id": "dcr-1",
                                              "imds_url": ""}, credential=FakeCredential())
    assert sink.identity_overrides() is None and identity_provider(cfg, (), [sink]) is None
    identity = IdentityProvider.from_config(cfg).look()  # another reader's provider: this sink ignores it
    assert identity.instance is not None
    sink.publish(snapshot(identity=identity))
    assert sink._builder.vm == {}


def test_the_rows_follow_the_identity_the_loop_stamps(server, tmp_path):
    """A live migration: the next identity brings the new physical host to the rows."""
    cfg = config(tmp_path, server)
    sink = am.AzureMonitorSink(context(cfg), cfg.sections["azure_monitor"], credential=FakeCredential())
    identity = IdentityProvider.from_config(cfg).look()
    sink.publish(snapshot(identity=HostIdentity()))  # not looked yet: nothing known, nothing written
    assert sink._builder.vm == {}
    sink.publish(snapshot(identity=identity))
    assert sink._builder.vm["physical_host"] == "PHX0123456789"
    sink.publish(snapshot(identity=dataclasses.replace(identity, physical_host="PHX9")))
    assert sink._builder.vm["physical_host"] == "PHX9" and sink._builder.vm["vm_id"] == COMPUTE["vmId"]


def test_a_hand_built_section_counts_a_changed_value_as_set(server):
    """Without a Config (a sink built by hand), a value other than the default is the alias set."""
    ctx = SinkContext("node-7", "/tmp", "9.9.9")
    assert azure_host.imds_overrides(ctx, "azure_monitor", {"imds_url": ""}, am.OPTIONS, am.IMDS_ALIASES) is None
    assert azure_host.imds_overrides(ctx, "azure_monitor", {"imds_url": server.url}, am.OPTIONS,
                                     am.IMDS_ALIASES) == {"imds_url": server.url}


def test_a_simulated_host_hands_the_provider_its_own_imds_and_pool(tmp_path):
    cfg = load(SCHEMAS, None, {"GPUMON_DAEMON_SIMULATE": "nd-h100-v5",
                               "GPUMON_DAEMON_STATE_DIR": str(tmp_path / "state")}, {})
    ctx = make_context(cfg)
    try:
        sctx = sink_context(ctx.config)
        assert sctx.config.sections["azure"]["imds_url"] == ctx.simulation.azure.imds_url
        provider = IdentityProvider.from_config(ctx.config)
        assert provider.pool == ctx.simulation.azure.kvp_pool
        found = provider.look()
        assert found.instance is not None and found.instance.vm_size == "Standard_ND96isr_H100_v5"
        assert found.physical_host.startswith("SIM")
    finally:
        ctx.simulation.stop()
