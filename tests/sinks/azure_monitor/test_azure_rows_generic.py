"""Metrics without columns of their own (a plugin's, a new one) reach Log Analytics as generic
GpuMonMetrics_CL rows, are logged once and counted: never dropped silently."""

from __future__ import annotations

import logging

from gpumon.model import MetricFamily, MetricSpec, MetricType, Snapshot
from gpumon.sinks.azure_monitor.rows import GPU, METRICS, RowBuilder
from tests.fakes.logs_ingestion import load_declarations, validate_row
from tests.support.declared_hints import hinted

INLET = MetricSpec("acme_rack_inlet_temperature_celsius", MetricType.GAUGE, "Inlet.", "celsius", ("sensor",))
TRIPS = MetricSpec("acme_rack_breaker_trips_total", MetricType.COUNTER, "Trips.", "", ("rack",))
POWER = hinted(MetricSpec("gpumon_gpu_power_watts", MetricType.GAUGE, "p", "watts", ("gpu", "uuid")))
PROCESS_MEMORY = hinted(MetricSpec("gpumon_gpu_process_memory_bytes", MetricType.GAUGE, "m", "bytes",
                                   ("gpu", "pid")))
DECLS = load_declarations()


def snap(*families: MetricFamily) -> Snapshot:
    return Snapshot("node-1", 1_700_000_000.0, families, (), ())


def fam(spec: MetricSpec, *samples) -> MetricFamily:
    return MetricFamily(spec, tuple(spec.sample(v, *labels) for v, *labels in samples))


def test_a_plugins_gauge_and_counter_become_generic_rows_the_template_accepts():
    b = RowBuilder("node-1")
    b.vm = {"vm_id": "vm-1"}
    for t, (a, c, trips) in enumerate([(24.0, 30.0, 5), (26.0, 31.0, 7), (25.0, 32.0, 8)]):
        b.add(snap(fam(INLET, (a, "inlet-a"), (c, "inlet-c")), fam(TRIPS, (trips, "r1")),
                   fam(POWER, (100, "0", "GPU-a"))), float(t))
    rows = b.close_interval(1_700_000_060.0, 60.0)
    assert len(rows[GPU]) == 1
    generic = {(r["Name"], tuple(sorted(r["Labels"].items()))): r for r in rows[METRICS]}
    assert set(generic) == {(INLET.name, (("sensor", "inlet-a"),)), (INLET.name, (("sensor", "inlet-c"),)),
                            (TRIPS.name, (("rack", "r1"),))}
    inlet = generic[(INLET.name, (("sensor", "inlet-a"),))]
    assert (inlet["Value"], inlet["Min"], inlet["Avg"], inlet["Max"], inlet["Samples"]) == (25, 24, 25, 26, 3)
    assert (inlet["MetricType"], inlet["Unit"], inlet["Computer"], inlet["VmId"]) == ("gauge", "celsius", "node-1", "vm-1")
    assert "Increase" not in inlet
    trips = generic[(TRIPS.name, (("rack", "r1"),))]
    assert (trips["Value"], trips["Increase"], trips["MetricType"]) == (8, 3, "counter")
    assert "Min" not in trips
    for row in rows[METRICS]:
        assert validate_row(row, DECLS["Custom-GpuMonMetrics_CL"]) is None
    assert b.unmapped == {INLET.name, TRIPS.name} and b.unmapped_count == 2


def test_each_unmapped_family_is_logged_once_and_a_gone_series_stops(caplog):
    b = RowBuilder("node-1")
    with caplog.at_level(logging.INFO, logger="gpumon.sinks.azure_monitor"):
        b.add(snap(fam(INLET, (24, "inlet-a"))), 0.0)
        b.add(snap(fam(INLET, (25, "inlet-a"))), 1.0)
        b.close_interval(1_700_000_060.0, 60.0)
        b.add(snap(fam(INLET, (26, "inlet-b"))), 61.0)
    lines = [r.getMessage() for r in caplog.records if INLET.name in r.getMessage()]
    assert lines == [f"azure_monitor: {INLET.name} has no columns of its own; sent as generic GpuMonMetrics_CL rows"]
    assert b.unmapped_count == 1
    (row,) = b.close_interval(1_700_000_120.0, 60.0)[METRICS]
    assert row["Labels"] == {"sensor": "inlet-b"}  # inlet-a, not seen this interval, has no row
    assert b.close_interval(1_700_000_180.0, 60.0)[METRICS] == []


def test_deliberately_excluded_metrics_are_not_sent_and_generic_rows_can_be_turned_off():
    b = RowBuilder("node-1")
    b.add(snap(fam(PROCESS_MEMORY, (1 << 30, "0", "4242"))), 0.0)
    assert b.close_interval(1_700_000_060.0, 60.0)[METRICS] == [] and b.unmapped_count == 0
    off = RowBuilder("node-1", generic=False)
    off.add(snap(fam(INLET, (24, "inlet-a"))), 0.0)
    assert off.close_interval(1_700_000_060.0, 60.0)[METRICS] == []
    assert off.unmapped == {INLET.name} and off.unmapped_count == 1  # still logged and counted
