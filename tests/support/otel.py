"""What the OpenTelemetry sink tests share: the sink under test with fast retries (:func:`make_sink`),
a two-collector snapshot (:func:`snapshot`, :data:`POINTS` data points) and a point's attributes
as a dict (:func:`attrs`). The receivers are in :mod:`tests.fakes.otlp`."""

from __future__ import annotations

from typing import Any

from gpumon.model import CollectorStatus, Event, MetricFamily, MetricSpec, MetricType, Snapshot
from gpumon.sinks.base import SinkContext
from gpumon.sinks.otel import OtelSink
from tests.support.declared_hints import hinted


def make_sink(endpoint: str, tmp_path, environ: dict[str, str] | None = None, **options: Any) -> OtelSink:
    """An OtelSink with fast retries and no IMDS probe unless the test asks for one."""
    from gpumon.config import Section

    values = {"endpoint": endpoint, "azure_detect": False, "backoff_initial": 0.05, "backoff_max": 0.2,
              "timeout": 2.0}
    values.update(options)
    ctx = SinkContext(hostname="node-7", state_dir=str(tmp_path), version="9.9.9")
    return OtelSink(ctx, Section("otel", values), environ=environ or {})


GPU_INFO = MetricSpec("gpumon_gpu_info", MetricType.INFO, "GPU identity.",
                      labels=("gpu", "uuid", "model", "pci_bus_id", "driver_version", "vbios", "serial"))


UTIL = hinted(MetricSpec("gpumon_gpu_utilization_ratio", MetricType.GAUGE, "GPU busy.", "ratio",
                         ("gpu", "uuid", "engine")))


MEM_USED = hinted(MetricSpec("gpumon_gpu_memory_used_bytes", MetricType.GAUGE, "Used.", "bytes",
                             ("gpu", "uuid")))


ENERGY = hinted(MetricSpec("gpumon_gpu_energy_joules_total", MetricType.COUNTER, "Energy.", "joules",
                           ("gpu", "uuid")))


TEMP = hinted(MetricSpec("gpumon_gpu_temperature_celsius", MetricType.GAUGE, "Temp.", "celsius",
                         ("gpu", "uuid", "sensor")))


LOST = hinted(MetricSpec("gpumon_gpu_lost", MetricType.GAUGE, "Lost.", "", ("gpu", "uuid")))


XID = hinted(MetricSpec("gpumon_gpu_xid_errors_total", MetricType.COUNTER, "XIDs.", "",
                        ("gpu", "uuid", "xid")))


CLOCK = MetricSpec("gpumon_gpu_sm_clock_hertz", MetricType.GAUGE, "SM clock.", "hertz", ("gpu", "uuid"))


IB_INFO = MetricSpec("gpumon_ib_port_info", MetricType.INFO, "Port identity.",
                     labels=("device", "port", "link_layer", "fw_version", "hca_type"))


RX = hinted(MetricSpec("gpumon_ib_port_data_received_bytes_total", MetricType.COUNTER, "Rx.", "bytes",
                       ("device", "port")))


TX = hinted(MetricSpec("gpumon_ib_port_data_transmitted_bytes_total", MetricType.COUNTER, "Tx.", "bytes",
                       ("device", "port")))


UP = hinted(MetricSpec("gpumon_ib_port_up", MetricType.GAUGE, "Up.", "", ("device", "port")))


SYM = hinted(MetricSpec("gpumon_ib_port_symbol_errors_total", MetricType.COUNTER, "Symbol errors.", "",
                        ("device", "port")))


DOWNED = MetricSpec("gpumon_ib_port_link_downed_total", MetricType.COUNTER, "Link downed.", "", ("device", "port"))


UUID = "GPU-11111111-2222-3333-4444-555555555555"


def snapshot(t: float, energy: float, rx: float, events: tuple[Event, ...] = (), seq: int = 1) -> Snapshot:
    families = (
        MetricFamily(GPU_INFO, (GPU_INFO.sample(1, "0", UUID, "NVIDIA H100 80GB HBM3", "00000001:00:00.0",
                                                "550.54.15", "96.00.74.00.01", "1650123456789"),)),
        MetricFamily(UTIL, (UTIL.sample(0.75, "0", UUID, "gpu"), UTIL.sample(0.25, "0", UUID, "encoder"))),
        MetricFamily(MEM_USED, (MEM_USED.sample(2 ** 33, "0", UUID),)),
        MetricFamily(ENERGY, (ENERGY.sample(energy, "0", UUID),)),
        MetricFamily(TEMP, (TEMP.sample(41, "0", UUID, "gpu"), TEMP.sample(45, "0", UUID, "memory"))),
        MetricFamily(LOST, (LOST.sample(0, "0", UUID),)),
        MetricFamily(XID, (XID.sample(2, "0", UUID, "79"),)),
        MetricFamily(CLOCK, (CLOCK.sample(1.98e9, "0", UUID),)),
        MetricFamily(IB_INFO, (IB_INFO.sample(1, "mlx5_ib0", "1", "InfiniBand", "28.39.1002", "MT4129"),)),
        MetricFamily(RX, (RX.sample(rx, "mlx5_ib0", "1"),)),
        MetricFamily(TX, (TX.sample(rx / 2, "mlx5_ib0", "1"),)),
        MetricFamily(UP, (UP.sample(1, "mlx5_ib0", "1"),)),
        MetricFamily(SYM, (SYM.sample(3, "mlx5_ib0", "1"),)),
        MetricFamily(DOWNED, (DOWNED.sample(1, "mlx5_ib0", "1"),)),
    )
    status = (CollectorStatus("nvml", True, 0.01), CollectorStatus("infiniband", True, 0.002))
    return Snapshot("node-7", t, families, events, status, seq)


POINTS = 19
"""Data points of ``snapshot()``: one per series, two (ok, failed) for each hw.status (the GPU's and
the port's)."""


def attrs(point) -> dict[str, object]:
    out = {}
    for kv in point.attributes:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which)
    return out
