"""The resource: service.*, host.name, OTEL_RESOURCE_ATTRIBUTES, and on Azure cloud.* / host.id /
host.type from the host identity the loop stamps on each snapshot (the one provider asks IMDS, on its
own thread: the sink never does, and start-up never waits for it). The first identity fixes the
resource; the first export waits at most ``[azure] imds_timeout`` + 0.5 s for it."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gpumon.daemon.identity import identity_provider
from gpumon.identity import IdentityProvider
from gpumon.model import HostIdentity, Snapshot
from gpumon.sinks.base import SinkContext
from gpumon.sinks.otel import resource_attributes
from tests.conftest import closed_port
from tests.fakes import otlp as receivers
from tests.support.otel import attrs, make_sink, snapshot

# The receivers' fixtures, shared with this module.
http_receiver = receivers.http_receiver

COMPUTE = {
    "vmId": "2f6c5a1e-0000-4000-8000-123456789abc", "vmSize": "Standard_ND96isr_H100_v5",
    "location": "eastus2", "name": "gpu-node-7", "resourceGroupName": "rg-train", "zone": "2",
    "subscriptionId": "8d2b4e6a-1111-4222-8333-444455556666",
    "resourceId": "/subscriptions/s/resourceGroups/rg-train/providers/Microsoft.Compute/virtualMachines/gpu-node-7",
    "tagsList": [],
}


class FakeImds:
    def __init__(self, doc: dict, hold: threading.Event | None = None) -> None:
        self.seen_headers: list[dict[str, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                fake.seen_headers.append(dict(self.headers))
                if hold is not None:
                    hold.wait(10)
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metadata/instance/compute"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def provider_for(sink) -> IdentityProvider:
    """The provider ``gpumon run`` builds for this sink alone (its deprecated ``imds_url`` honoured)."""
    provider = identity_provider(sink.ctx.config, (), [sink])
    assert provider is not None
    return provider


def stamped(identity: HostIdentity) -> Snapshot:
    return dataclasses.replace(snapshot(time.time(), 1.0, 1.0), identity=identity)


def test_layers_later_wins():
    ctx = SinkContext(hostname="node-7", state_dir="/tmp", version="1.2.3")
    env = {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,host.name=from-env,team=ml%20infra",
           "OTEL_SERVICE_NAME": "gpu-telemetry"}
    got = resource_attributes(ctx, ["team=research"], env, {"cloud.provider": "azure", "host.name": "imds"})
    assert got == {"service.name": "gpu-telemetry", "service.version": "1.2.3", "host.name": "from-env",
                   "cloud.provider": "azure", "deployment.environment": "prod", "team": "research"}


def test_azure_attributes_reach_the_collector(http_receiver, tmp_path):
    imds = FakeImds(COMPUTE)
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False, azure_detect=True, imds_url=imds.url)
    try:
        sink.start()
        sink.publish(stamped(provider_for(sink).look()))
        http_receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(2)
        imds.close()
    resource = attrs(http_receiver.metrics[0].resource_metrics[0].resource)
    assert resource["cloud.provider"] == "azure" and resource["cloud.platform"] == "azure.vm"
    assert resource["cloud.region"] == "eastus2"
    assert resource["host.id"] == COMPUTE["vmId"] and resource["host.type"] == "Standard_ND96isr_H100_v5"
    assert resource["host.name"] == "node-7"
    assert resource["cloud.account.id"] == COMPUTE["subscriptionId"]
    assert resource["cloud.availability_zone"] == "2"
    assert resource["azure.resource_group.name"] == "rg-train"
    assert "k8s.node.name" not in resource  # not in a pod
    assert imds.seen_headers[0].get("Metadata") == "true"


def test_aks_node_is_azure_aks(http_receiver, tmp_path):
    imds = FakeImds({**COMPUTE, "resourceGroupName": "MC_rg_cluster_eastus2", "zone": ""})
    # what the DaemonSet gives the pod: the API server's address, and the node's name from spec.nodeName
    pod_env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "GPUMON_DAEMON_HOSTNAME": "aks-gpu-12345678-vmss000003"}
    sink = make_sink(http_receiver.endpoint, tmp_path, pod_env, logs=False, azure_detect=True, imds_url=imds.url)
    try:
        sink.start()
        sink.publish(stamped(provider_for(sink).look()))
        http_receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(2)
        imds.close()
    resource = attrs(http_receiver.metrics[0].resource_metrics[0].resource)
    assert resource["cloud.platform"] == "azure.aks"
    assert resource["k8s.node.name"] == "aks-gpu-12345678-vmss000003"
    assert resource["azure.resource_group.name"] == "MC_rg_cluster_eastus2"
    assert "cloud.availability_zone" not in resource  # a VM outside any zone


def test_node_name_variable_wins_over_the_daemon_hostname():
    ctx = SinkContext(hostname="node-7", state_dir="/tmp", version="1.2.3")
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "GPUMON_DAEMON_HOSTNAME": "a", "NODE_NAME": "b"}
    assert resource_attributes(ctx, [], env)["k8s.node.name"] == "b"
    assert "k8s.node.name" not in resource_attributes(ctx, [], {"NODE_NAME": "b"})  # not in a pod


def test_off_azure_nothing_is_added_and_start_does_not_wait(http_receiver, tmp_path):
    hold = threading.Event()
    imds = FakeImds(COMPUTE, hold=hold)  # answers only after the timeout: as good as absent
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False, azure_detect=True, imds_url=imds.url,
                     imds_timeout=0.3)
    try:
        started = time.monotonic()
        sink.start()
        assert time.monotonic() - started < 0.2
        sink.publish(stamped(provider_for(sink).look()))  # the provider's look times out: as absent
        http_receiver.wait(lambda r: r.metrics)
    finally:
        hold.set()
        sink.stop(2)
        imds.close()
    resource = attrs(http_receiver.metrics[0].resource_metrics[0].resource)
    assert not any(k.startswith("cloud.") for k in resource) and "host.id" not in resource


def test_imds_not_listening_adds_nothing(http_receiver, tmp_path):
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False, azure_detect=True,
                     imds_url=f"http://127.0.0.1:{closed_port()}/metadata")
    try:
        sink.start()
        sink.publish(stamped(provider_for(sink).look()))
        http_receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(2)
    assert "cloud.provider" not in attrs(http_receiver.metrics[0].resource_metrics[0].resource)


def test_the_first_export_waits_a_little_for_the_identity_then_goes_without(http_receiver, tmp_path):
    """The provider has not looked yet (the loop's first snapshot): the export waits ``imds_timeout``
    + 0.5 s at most, then goes with gpumon's own attributes; the identity, once it comes, fixes the
    resource, and a later change does not move it (the resource identifies the exporter)."""
    imds = FakeImds(COMPUTE)
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False, azure_detect=True, imds_url=imds.url,
                     imds_timeout=0.2, interval=0.0)
    try:
        sink.start()
        started = time.monotonic()
        sink.publish(stamped(HostIdentity()))
        http_receiver.wait(lambda r: r.metrics)
        assert 0.6 <= time.monotonic() - started < 5.0
        first = provider_for(sink).look()
        sink.publish(dataclasses.replace(stamped(first), seq=2))
        http_receiver.wait(lambda r: len(r.metrics) >= 2)
        assert first.instance is not None
        moved = HostIdentity(dataclasses.replace(first.instance, vm_id="another"), asked=True)
        sink.publish(dataclasses.replace(stamped(moved), seq=3))
        http_receiver.wait(lambda r: len(r.metrics) >= 3)
    finally:
        sink.stop(2)
        imds.close()
    resources = [attrs(m.resource_metrics[0].resource) for m in http_receiver.metrics[:3]]
    assert "host.id" not in resources[0]
    assert resources[1]["host.id"] == resources[2]["host.id"] == COMPUTE["vmId"]


def test_azure_detect_off_reads_no_identity(http_receiver, tmp_path):
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False, azure_detect=False)
    assert sink.identity_overrides() is None and identity_provider(sink.ctx.config, (), [sink]) is None
    try:
        sink.start()
        sink.publish(stamped(HostIdentity(asked=True, physical_host="PHX0123456789")))
        http_receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(2)
    assert "gpumon.azure.physical_host" not in attrs(http_receiver.metrics[0].resource_metrics[0].resource)
