"""The simulated ND H100 v5 host end to end: every metric family its collectors produce arrives at a
real OTLP receiver under its mapped name, unit and instrument, with its values; an injected flap and
XID arrive as log records. In process (HTTP and gRPC), and through `gpumon run --sinks otel`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from gpumon.model import Snapshot
from gpumon.simulate import control
from gpumon.sinks.otel import mapping
from tests.conftest import clean_env
from tests.fakes import otlp as receivers
from tests.fakes.otlp import OtlpHttpReceiver, event_name
from tests.fakes.simulated_host import SimulatedHost
from tests.support.otel import attrs, make_sink

# The receivers' fixtures, shared with this module.
grpc_receiver = receivers.grpc_receiver
http_receiver = receivers.http_receiver

def taken(family, otel: mapping.OtelMetric) -> int:
    """Samples of ``family`` that go to ``otel`` (one Prometheus metric may feed several names)."""
    return sum(1 for sample in family.samples if otel.takes(dict(sample.labels)))


def expected_points(snapshot: Snapshot) -> int:
    status = (mapping.Kind.STATUS, mapping.Kind.STATUS_INVERTED)
    return sum(taken(f, otel) * (2 if otel.kind in status or otel.cpu_modes else 1)
               for f in snapshot.families for otel in mapping.routes(f.spec))


@pytest.fixture(params=["http/protobuf", "grpc"])
def receiver(request):
    return request.getfixturevalue("http_receiver" if request.param == "http/protobuf" else "grpc_receiver")


def test_every_family_of_the_host_arrives_mapped(receiver, tmp_path):
    protocol = "grpc" if type(receiver).__name__ == "OtlpGrpcReceiver" else "http/protobuf"
    host = SimulatedHost(str(tmp_path))
    sink = make_sink(receiver.endpoint, tmp_path, protocol=protocol)
    try:
        snap = host.snapshot()
        sink.start()
        sink.publish(snap)
        receiver.wait(lambda r: r.metrics)
        host.sim.apply({"action": "flap", "device": "mlx5_ib3", "port": 1})
        host.sim.apply({"action": "xid", "gpu": 3, "xid": 79})
        host.sim.step(1.0)
        deadline = time.monotonic() + 10
        kinds: set[str] = set()
        while not {"ib_link_flap", "gpu_xid"} <= kinds:
            assert time.monotonic() < deadline, f"events seen: {kinds}"
            later = host.snapshot()
            kinds |= {e.kind for e in later.events}
            sink.publish(later)
        receiver.wait(lambda r: {"gpumon.ib_link_flap", "gpumon.gpu_xid"}
                      <= {event_name(rec) for rec, _ in r.log_records()})
    finally:
        sink.stop(5)
        host.close()

    names = {f.name for f in snap.families}
    assert {"gpumon_gpu_utilization_ratio", "gpumon_gpu_energy_joules_total",
            "gpumon_ib_port_data_received_bytes_total", "gpumon_ib_port_up"} <= names
    first = receiver.metrics[0]
    received = {m.name: m for m in first.resource_metrics[0].scope_metrics[0].metrics}
    for family, otel in ((f, o) for f in snap.families for o in mapping.routes(f.spec) if taken(f, o)):
        assert otel.name in received, f"{family.name} -> {otel.name} did not arrive"
        metric = received[otel.name]
        assert metric.unit == otel.unit, family.name
        data = metric.WhichOneof("data")
        assert data == ("gauge" if otel.kind is mapping.Kind.GAUGE else "sum"), family.name
        if data == "sum":
            assert metric.sum.is_monotonic == (otel.kind is mapping.Kind.COUNTER), family.name
    points = sum(len(getattr(m, m.WhichOneof("data")).data_points) for m in received.values())
    assert points == expected_points(snap)

    # values and identity: GPU 0's energy, and the 8 H100s carry their model
    energy = snap.family("gpumon_gpu_energy_joules_total").samples[0]
    energy_points = {attrs(p)["hw.id"]: p.as_double for p in received["hw.energy"].sum.data_points}
    assert energy_points[energy.label("uuid")] == energy.value
    gpus = {attrs(p)["hw.id"]: attrs(p) for p in received["hw.gpu.utilization"].gauge.data_points}
    assert len(gpus) == 8 and all("H100" in a["hw.model"] for a in gpus.values())
    ports = {attrs(p)["hw.id"] for p in received["hw.network.io"].sum.data_points}
    assert {f"mlx5_ib{i}:1" for i in range(8)} <= ports

    records = {event_name(rec): rec for rec, _ in receiver.log_records()}
    flap, xid = records["gpumon.ib_link_flap"], records["gpumon.gpu_xid"]
    assert attrs(flap)["hw.id"] == "mlx5_ib3:1" and flap.severity_number >= 13
    assert attrs(xid)["xid"] == 79 and attrs(xid)["gpu"] == "3" and xid.severity_number >= 17


def test_gpumon_run_with_the_otel_sink_delivers_every_family(tmp_path):
    """`gpumon run --simulate nd-h100-v5 --sinks otel` against the test receiver."""
    expected_host = SimulatedHost(str(tmp_path / "reference"))
    try:
        expected = {o.name for f in expected_host.snapshot().families for o in mapping.routes(f.spec)
                    if taken(f, o)}
    finally:
        expected_host.close()
    receiver = OtlpHttpReceiver()
    state = tmp_path / "state"
    # Azure detection on: the simulated host answers as its own IMDS and KVP pool, never the link-local one
    env = clean_env(GPUMON_OTEL_ENDPOINT=receiver.endpoint, GPUMON_DAEMON_STATE_DIR=str(state))
    del env["GPUMON_AZURE_IMDS_URL"]  # unset, --simulate puts the simulated host's IMDS there
    for key in [k for k in env if k.startswith("OTEL_")]:
        del env[key]
    proc = subprocess.Popen([sys.executable, "-m", "gpumon", "run", "--simulate", "nd-h100-v5",
                             "--sinks", "otel", "--interval", "0.5"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def arrived(r) -> set[str]:
            if proc.poll() is not None:
                raise AssertionError(f"gpumon exited {proc.returncode}")
            return expected <= set(r.metric_points()) and set(r.metric_points())

        got = receiver.wait(arrived, timeout=30)
        assert "gpumon.collector.up" in got  # the daemon's self-metrics travel too
        control(str(state / "simulate" / "nd-h100-v5"), {"action": "flap", "device": "mlx5_ib2", "port": 1})
        receiver.wait(lambda r: any(event_name(rec) == "gpumon.ib_link_flap" for rec, _ in r.log_records()),
                      timeout=30)
        resource = attrs(receiver.metrics[-1].resource_metrics[0].resource)
        assert resource["service.name"] == "gpumon" and resource["service.version"]
        assert resource["cloud.provider"] == "azure" and resource["host.type"] == "Standard_ND96isr_H100_v5"
        assert resource["gpumon.azure.placement_group"] and resource["gpumon.azure.vmss"]
        assert resource["gpumon.azure.physical_host"].startswith("SIM")  # the simulated KVP pool
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        receiver.close()
    assert proc.returncode == 0, out
