"""The Prometheus -> OpenTelemetry name table: the hardware conventions where they exist, a mechanical
gpumon.* name with a UCUM unit for everything else, and every declared metric covered."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from gpumon.catalogue import units
from gpumon.catalogue.lookup import otel_hints
from gpumon.confdoc import declared_specs
from gpumon.model import MetricSpec, MetricType
from gpumon.sinks.otel import mapping as m
from tests.conftest import REPO

OTEL_NAME = re.compile(r"^[a-zA-Z][a-zA-Z0-9_.\-/]{0,254}$")
TABLE = {s.name: otel_hints(s) for s in declared_specs() if otel_hints(s)}
"""The OpenTelemetry hints on the declared metrics, by Prometheus name."""


@pytest.mark.parametrize(("prom", "otel", "unit", "kind"), [
    ("gpumon_gpu_utilization_ratio", "hw.gpu.utilization", "1", m.Kind.GAUGE),
    ("gpumon_gpu_memory_used_bytes", "hw.gpu.memory.usage", "By", m.Kind.UPDOWN),
    ("gpumon_gpu_memory_total_bytes", "hw.gpu.memory.limit", "By", m.Kind.UPDOWN),
    ("gpumon_gpu_pcie_bytes_total", "hw.gpu.io", "By", m.Kind.COUNTER),
    ("gpumon_gpu_power_watts", "hw.power", "W", m.Kind.GAUGE),
    ("gpumon_gpu_energy_joules_total", "hw.energy", "J", m.Kind.COUNTER),
    ("gpumon_gpu_temperature_celsius", "hw.temperature", "Cel", m.Kind.GAUGE),
    ("gpumon_gpu_xid_errors_total", "hw.errors", "{error}", m.Kind.COUNTER),
    ("gpumon_gpu_lost", "hw.status", "1", m.Kind.STATUS_INVERTED),
    ("gpumon_ib_port_data_received_bytes_total", "hw.network.io", "By", m.Kind.COUNTER),
    ("gpumon_ib_port_packets_transmitted_total", "hw.network.packets", "{packet}", m.Kind.COUNTER),
    ("gpumon_ib_port_up", "hw.network.up", "1", m.Kind.UPDOWN),
    ("gpumon_ib_port_rate_bytes_per_second", "hw.network.bandwidth.limit", "By/s", m.Kind.UPDOWN),
    ("gpumon_ib_port_symbol_errors_total", "hw.errors", "{error}", m.Kind.COUNTER),
    ("gpumon_gpu_fan_speed_ratio", "hw.fan.speed_ratio", "1", m.Kind.GAUGE),
    ("gpumon_gpu_temperature_threshold_celsius", "hw.temperature.limit", "Cel", m.Kind.GAUGE),
    ("gpumon_gpu_ecc_errors_total", "hw.errors", "{error}", m.Kind.COUNTER),
    ("process_cpu_seconds_total", "process.cpu.time", "s", m.Kind.COUNTER),
])
def test_semantic_convention_entries(prom, otel, unit, kind):
    metric = TABLE[prom][0]
    assert (metric.name, metric.unit, metric.kind, metric.semconv) == (otel, unit, kind, True)


@pytest.mark.parametrize(("spec", "name", "unit", "kind"), [
    (MetricSpec("gpumon_gpu_clock_hertz", MetricType.GAUGE, "h", "hertz"), "gpumon.gpu.clock", "Hz", m.Kind.GAUGE),
    (MetricSpec("gpumon_ib_port_down_seconds", MetricType.GAUGE, "h", "seconds"), "gpumon.ib.port_down", "s",
     m.Kind.GAUGE),
    (MetricSpec("gpumon_gpu_nvlink_bytes_total", MetricType.COUNTER, "h", "bytes"), "gpumon.gpu.nvlink", "By",
     m.Kind.COUNTER),
    (MetricSpec("gpumon_gpu_board_ratio", MetricType.GAUGE, "h", "ratio"), "gpumon.gpu.board", "1",
     m.Kind.GAUGE),
    (MetricSpec("gpumon_gpu_pcie_throughput_bytes_per_second", MetricType.GAUGE, "h", "bytes_per_second"),
     "gpumon.gpu.pcie_throughput", "By/s", m.Kind.GAUGE),
    (MetricSpec("gpumon_ib_port_vl15_dropped_total", MetricType.COUNTER, "h", units.PACKETS), "gpumon.ib.port_vl15_dropped",
     "{packet}", m.Kind.COUNTER),
    (MetricSpec("gpumon_gpu_nvlink_errors_total", MetricType.COUNTER, "h", units.ERRORS), "gpumon.gpu.nvlink_errors",
     "{error}", m.Kind.COUNTER),
    (MetricSpec("gpumon_gpu_info", MetricType.INFO, "h"), "gpumon.gpu.info", "{info}", m.Kind.GAUGE),
    (MetricSpec("gpumon_gpu_board_volts", MetricType.GAUGE, "h", "volts"), "gpumon.gpu.board", "V",
     m.Kind.GAUGE),
    (MetricSpec("gpumon_up", MetricType.GAUGE, "h", units.STATE), "gpumon.up", "{state}", m.Kind.GAUGE),
    (MetricSpec("gpumon_gpu_widgets_total", MetricType.COUNTER, "h"), "gpumon.gpu.widgets", "{event}",
     m.Kind.COUNTER),
    (MetricSpec("gpumon_gpu_widget_count", MetricType.GAUGE, "h"), "gpumon.gpu.widget_count", "{count}",
     m.Kind.GAUGE),
    (MetricSpec("gpumon_gpu_widgets", MetricType.GAUGE, "h", "widgets"), "gpumon.gpu.widgets", "{widgets}",
     m.Kind.GAUGE),
])
def test_a_metric_without_an_entry_maps_mechanically(spec, name, unit, kind):
    metric = m.resolve(spec)
    assert (metric.name, metric.unit, metric.kind, metric.semconv) == (name, unit, kind, False)


WIRE = {m.Kind.STATUS: m.Kind.UPDOWN, m.Kind.STATUS_INVERTED: m.Kind.UPDOWN}
"""Both status kinds are up-down counters on the wire."""


def _signature(metric: m.OtelMetric) -> tuple:
    formats = tuple(sorted((label, attr, m.VALUE_FORMATS.get((label, attr), "")) for label, attr in metric.label_map))
    return metric.domain, metric.attributes, formats, metric.select


def test_every_declared_metric_maps_to_a_valid_distinct_series():
    specs = declared_specs()
    names = {s.name for s in specs}
    assert "gpumon_collector_up" in names
    assert {"gpumon_gpu_utilization_ratio", "gpumon_ib_port_data_received_bytes_total"} <= names
    by_otel: dict[str, list[tuple[MetricSpec, m.OtelMetric]]] = {}
    for spec in specs:
        for metric in m.routes(spec):
            assert OTEL_NAME.match(metric.name), metric.name
            assert metric.unit and " " not in metric.unit, (spec.name, metric.unit)
            if spec.type is MetricType.COUNTER:
                assert metric.kind is m.Kind.COUNTER, spec.name  # counters stay monotonic sums
            by_otel.setdefault(metric.name, []).append((spec, metric))
    for otel_name, group in by_otel.items():
        assert len({g[1].unit for g in group}) == 1, f"{otel_name}: units disagree: {group}"
        assert len({WIRE.get(g[1].kind, g[1].kind) for g in group}) == 1, f"{otel_name}: instruments disagree"
        signatures = [_signature(g[1]) for g in group]
        assert len(set(signatures)) == len(signatures), f"{otel_name}: two metrics would collide: {group}"


def test_docs_table_matches_what_is_exported():
    with open(os.path.join(REPO, "docs", "metrics.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("<!-- BEGIN otel -->", 1)[1].split("<!-- END otel -->", 1)[0]
    table = m.markdown_table(declared_specs())
    missing = [row for row in table.splitlines() if row not in section]
    assert not missing, ("docs/metrics.md's otel table is out of date; regenerate it with "
                         "`python -m gpumon.confdoc --otel-table`. Missing rows:\n" + "\n".join(missing[:10]))


def test_attribute_values_follow_the_conventions():
    identity = m.Identity.from_families([("gpumon_gpu_info", [{"gpu": "3", "uuid": "GPU-x", "model": "H100",
                                                               "vbios": "96.0", "serial": "S1"}])])
    util = m.attributes(TABLE["gpumon_gpu_utilization_ratio"][0], {"gpu": "3", "uuid": "GPU-x", "engine": "gpu"},
                        identity)
    assert dict(util) == {"hw.id": "GPU-x", "hw.type": "gpu", "hw.name": "gpu3", "hw.vendor": "NVIDIA",
                          "hw.model": "H100", "hw.firmware_version": "96.0", "hw.serial_number": "S1",
                          "hw.gpu.task": "general"}
    pcie = dict(m.attributes(TABLE["gpumon_gpu_pcie_bytes_total"][0],
                             {"gpu": "3", "uuid": "GPU-x", "direction": "tx"}, identity))
    assert pcie["network.io.direction"] == "transmit"
    volatile, lifetime = TABLE["gpumon_gpu_ecc_errors_total"]
    sample = {"gpu": "3", "uuid": "GPU-x", "type": "uncorrected", "counter": "volatile"}
    assert volatile.takes(sample) and not lifetime.takes(sample)
    ecc = dict(m.attributes(volatile, sample, identity))
    assert ecc["error.type"] == "uncorrected" and "counter" not in ecc and ecc["hw.id"] == "GPU-x"
    aggregate = {**sample, "counter": "aggregate"}
    assert lifetime.takes(aggregate) and not volatile.takes(aggregate)
    life = dict(m.attributes(lifetime, aggregate, identity))
    assert (lifetime.name, life["error.type"], life["hw.id"]) == ("gpumon.gpu.ecc.errors.lifetime", "uncorrected",
                                                                   "GPU-x")
    util, memory = TABLE["gpumon_gpu_utilization_ratio"]
    busy = {"gpu": "3", "uuid": "GPU-x", "engine": "memory"}
    assert memory.takes(busy) and not util.takes(busy) and "hw.gpu.task" not in dict(m.attributes(memory, busy,
                                                                                                   identity))
    limit = dict(m.attributes(TABLE["gpumon_gpu_temperature_threshold_celsius"][0],
                              {"gpu": "3", "uuid": "GPU-x", "threshold": "memory_max"}, identity))
    assert limit == {"hw.id": "GPU-x:temperature:memory", "hw.type": "temperature", "hw.parent": "GPU-x",
                     "hw.name": "gpu3 memory temperature", "hw.sensor_location": "memory", "hw.limit_type": "max"}
    nvlink = dict(m.attributes(m.resolve(MetricSpec("gpumon_gpu_nvlink_bytes_total", MetricType.COUNTER, "h",
                                                    "bytes", ("gpu", "uuid", "direction"))),
                               {"gpu": "3", "uuid": "GPU-x", "direction": "rx"}, identity))
    assert nvlink == {"gpu": "3", "uuid": "GPU-x", "hw.id": "GPU-x", "hw.type": "gpu",
                      "network.io.direction": "receive"}


def test_no_metric_that_is_not_a_fraction_has_unit_1():
    """Unit 1 is for fractions; on a gauge the OTLP -> Prometheus translation appends ``_ratio``."""
    wrong = [(spec.name, o.name) for spec in declared_specs() for o in m.routes(spec)
             if o.unit == "1" and o.kind is m.Kind.GAUGE and not spec.name.endswith("_ratio")]
    assert not wrong
    units = {spec.name: m.resolve(spec).unit for spec in declared_specs()}
    assert units["gpumon_gpu_info"] == units["gpumon_build_info"] == "{info}"
    assert units["gpumon_collector_up"] == "{state}"
    assert units["gpumon_sink_dropped_total"] == "{item}"
    for direction in ("received", "transmitted"):
        for cast in ("unicast", "multicast"):
            name = f"gpumon_ib_port_{cast}_packets_{direction}_total"
            if name in units:
                assert units[name] == "{packet}", name


def test_module_import_does_not_load_the_sdk():
    """The registry imports sink modules to read class attributes; the SDK must wait for start()."""
    listing = "print(sorted(m for m in sys.modules if m.split('.')[0] in ('opentelemetry', 'grpc', 'google')))"

    def loaded(imports: str) -> str:
        out = subprocess.run([sys.executable, "-c", f"import {imports}; {listing}"], capture_output=True,
                             text=True, timeout=60, check=True)
        return out.stdout.strip()

    # an older googleapis-common-protos installs a *-nspkg.pth that imports the `google` namespace into
    # every interpreter: what the bare interpreter already has is not the module's doing
    assert loaded("sys, gpumon.sinks.otel") == loaded("sys")
